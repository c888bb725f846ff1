"""GDPO, ``advantage.multi_reward=normalize_then_sum`` (issue 40): each reward normalised in its group, summed with
its weight, whitened over the step; refused by name for algorithms that are not group-normalised."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.config import fast_config
from helpers.scripted import script_completions

from lit_rl import objectives as obj
from lit_rl.config import ConfigError, validate
from lit_rl.run.train import run
from lit_rl.tools.compare import read_scalars

R1, R2 = [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]
GROUP = torch.zeros(4, dtype=torch.long)


def test_sum_and_normalize_then_sum_give_the_issue_values():
    """One group of 4, population std, eps 1e-6, weights [1, 1] (SPEC vector 18). Sum first: R = [2, 2, 1, 0], mean
    1.25, std sqrt(0.6875) -> [0.9045, 0.9045, -0.3015, -1.5076]. GDPO: A1 = [1, 1, -1, -1], A2 = (r2 - 0.75) /
    0.4330 = [0.5774 x 3, -1.7321]; their sum [1.5774, 1.5774, -0.4226, -2.7321] has mean 0 and std 1.7762 ->
    [0.8881, 0.8881, -0.2379, -1.5382]."""
    summed = obj.group_advantages(torch.tensor(R1) + torch.tensor(R2), GROUP)
    assert torch.allclose(summed, torch.tensor([0.9045, 0.9045, -0.3015, -1.5076]), atol=1e-4)
    adv, per_reward = obj.gdpo_advantages(torch.tensor([R1, R2]).T, [1.0, 1.0], GROUP)
    assert torch.allclose(adv, torch.tensor([0.8881, 0.8881, -0.2379, -1.5382]), atol=1e-4)
    assert torch.allclose(per_reward[0], torch.tensor([1.0, 1.0, -1.0, -1.0]), atol=1e-5)
    a2 = 0.25 / math.sqrt(0.1875)
    assert torch.allclose(per_reward[1], torch.tensor([a2, a2, a2, -3 * a2]), atol=1e-5)


def test_gdpo_weights_and_peers_conventions():
    """Weight 2 on r2 doubles its normalised part before the whitening: S = A1 + 2 A2. TRL's convention
    (``advantage.std=sample advantage.eps=1e-4``): the groups' and the whitening's std divide by n - 1."""
    parts = torch.tensor([R1, R2]).T
    a1 = torch.tensor([1.0, 1.0, -1.0, -1.0]) * 0.5 / (0.5 + 1e-6)
    a2 = (torch.tensor(R2) - 0.75) / (math.sqrt(0.1875) + 1e-6)
    s = a1 + 2 * a2
    expected = (s - s.mean()) / (s.std(unbiased=False) + 1e-6)
    assert torch.allclose(obj.gdpo_advantages(parts, [1.0, 2.0], GROUP)[0], expected, atol=1e-6)
    s1 = (torch.tensor(R1) - 0.5) / (torch.tensor(R1).std() + 1e-4)
    s2 = (torch.tensor(R2) - 0.75) / (torch.tensor(R2).std() + 1e-4)
    trl = ((s1 + s2) - (s1 + s2).mean()) / ((s1 + s2).std() + 1e-4)  # torch's std(): n - 1
    got = obj.gdpo_advantages(parts, [1.0, 1.0], GROUP, eps=1e-4, std="sample")[0]
    assert torch.allclose(got, trl, atol=1e-6)


def test_a_none_reward_is_left_out_of_its_groups_statistics():
    """r1 = [1, None, 0, 0]: its group mean is 1/3 and std sqrt(2)/3 over the three that scored, the None gets
    A1 = 0; r2 keeps all four. Invalid rows (no response) get 0 after the whitening."""
    parts = torch.tensor([[1.0, 1.0], [math.nan, 1.0], [0.0, 1.0], [0.0, 0.0]])
    _, per_reward = obj.gdpo_advantages(parts, [1.0, 1.0], GROUP)
    sd = math.sqrt(2) / 3
    expected = torch.tensor([(2 / 3) / (sd + 1e-6), 0.0, (-1 / 3) / (sd + 1e-6), (-1 / 3) / (sd + 1e-6)])
    assert torch.allclose(per_reward[0], expected, atol=1e-5)
    valid = torch.tensor([True, True, True, False])
    adv, _ = obj.gdpo_advantages(parts, [1.0, 1.0], GROUP, valid=valid)
    assert adv[3] == 0 and torch.isfinite(adv).all()
    with pytest.raises(ValueError, match=r"parts must be \[N, K\]"):
        obj.gdpo_advantages(parts, [1.0], GROUP)


@pytest.mark.parametrize("algo", ["ppo", "reinforce", "reinforce_pp"])
def test_gdpo_is_refused_by_name_for_algorithms_that_are_not_group_normalised(algo):
    with pytest.raises(ConfigError, match=rf"advantage.multi_reward='normalize_then_sum'.*algo={algo} is not"):
        validate(fast_config(f"algo={algo}", "advantage.multi_reward=normalize_then_sum"))
    with pytest.raises(ConfigError, match=r"advantage.multi_reward='mean' is not allowed: choose one of"):
        validate(fast_config("advantage.multi_reward=mean"))


def test_a_gdpo_run_logs_each_rewards_own_advantage(tmp_path, monkeypatch):
    """reward.functions=[math, format] and every group's completions "#### 100", "100", "#### 100", "100" (1-digit
    sums: never right): format [1, 0, 1, 0] gives A = ±1 (mean |A| 0.999998), math is 0 everywhere (A = 0)."""
    script_completions(monkeypatch, lambda n: ["#### 100", "100"] * (n // 2))
    cfg = fast_config(
        "trainer.max_steps=2",
        "eval.num_examples=0",
        "advantage.multi_reward=normalize_then_sum",
        "reward.functions=[math,format]",
    )
    run(cfg, tmp_path / "run")
    s = read_scalars(tmp_path / "run")
    assert [round(v, 5) for _, v in s["rollout/advantage/format"]] == [1.0, 1.0]
    assert [v for _, v in s["rollout/advantage/math"]] == [0.0, 0.0]
