"""Staleness exactly on tabular policies (lit_rl.tools.tabular_staleness): the curves start at the on-policy
gradient, the training trajectory is the real update's, and each cell is the exact expectation it claims to be."""

from types import SimpleNamespace

import pytest
import torch
from helpers import compose_config

from lit_rl.expectation import TabularPolicy, all_sequences, expected_gradient, sequence_logprobs
from lit_rl.run.train import build_module
from lit_rl.tools.tabular_staleness import realised_kl, staleness_curves, tolerated_lag, train_tables

CORRECTIONS = ("none", "tis", "mis", "sc", "sc+tis")


def reward(seqs):
    return (seqs[:, 0] == seqs[:, -1]).float()


def module_for(policy, correction, algo="reinforce"):
    algo_overrides = ["algo=reinforce", "algo.baseline=none"] if algo == "reinforce" else [f"algo={algo}"]
    cfg = compose_config(
        "model=tiny",
        "trainer.precision=32-true",
        f"sampling.max_new_tokens={policy.length}",
        "rollout.micro_batch_size=4096",
        "logprob_chunk_tokens=4096",
        *algo_overrides,
        f"correction={correction}",
        f"correction.sc.top_k={policy.vocab_size}",
    )
    return build_module(cfg, policy, SimpleNamespace(pad_token_id=0, eos_token_id=policy.vocab_size - 1))


@pytest.fixture(scope="module")
def trained():
    policy = TabularPolicy(3, 2, seed=3)
    modules = {c: module_for(policy, c) for c in CORRECTIONS}
    tables = train_tables(modules["none"], policy, reward, steps=4, lr=0.05)
    return policy, modules, tables


def expected_reward(table, length):
    seqs = all_sequences(table.shape[1], length)
    return float((sequence_logprobs(table, seqs).sum(-1).exp() * reward(seqs).double()).sum())


def test_training_takes_exact_adam_steps_on_the_on_policy_gradient(trained):
    policy, modules, tables = trained
    assert len(tables) == 5
    # step 1 by hand: Adam's first step moves every coordinate by lr * sign(g) (|g| >> eps)
    probe = TabularPolicy(3, 2, tables[0].clone())
    g0 = expected_gradient(module_for(probe, "none"), probe, tables[0], reward, head_size=3).mean
    torch.testing.assert_close(tables[1], tables[0] - 0.05 * g0.sign(), atol=1e-6, rtol=0)
    assert expected_reward(tables[-1], 2) > expected_reward(tables[0], 2) + 0.01  # it learns


def test_curve_at_lag_zero_is_the_on_policy_gradient_exactly(trained):
    policy, modules, tables = trained
    g, points = staleness_curves(modules, policy, tables, reward, [0, 1, 4])
    # g is the trainer's own on-policy expectation at θ_s
    direct = expected_gradient(modules["none"], policy, tables[-1], reward, head_size=3).mean
    torch.testing.assert_close(g, direct, atol=0, rtol=0)
    scale = float(g.abs().max())
    for p in points:
        if p.lag == 0:
            assert float((p.gradient - g).abs().max()) <= 1e-6 * scale, p.correction
            assert p.bias == pytest.approx(0.0, abs=1e-5) and p.progress == pytest.approx(1.0, abs=1e-5)
            assert p.kl == 0.0
        else:
            assert p.kl > 0
    by = {(p.correction, p.lag): p for p in points}
    # a stale sampler biases the uncorrected gradient, more at a larger lag
    assert 1e-3 < by["none", 1].bias < by["none", 4].bias
    # the cell at lag 4 is the exact expectation under the sampler θ_{s-4}
    sc4 = expected_gradient(modules["sc"], policy, tables[0], reward, head_size=3).mean
    torch.testing.assert_close(by["sc", 4].gradient, sc4, atol=0, rtol=0)


def test_realised_kl_is_the_visited_per_token_kl():
    # L = 1: one prefix, KL(mu || pi) itself
    mu = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    pi = torch.tensor([[0.5, -0.5]], dtype=torch.float64)
    p, q = torch.softmax(mu, -1), torch.softmax(pi, -1)
    assert realised_kl(mu, pi, 1) == pytest.approx(float((p * (p / q).log()).sum()), rel=1e-12)


def test_tolerated_lag_and_bad_lags(trained):
    policy, modules, tables = trained
    points = [SimpleNamespace(correction="c", lag=k, bias=b) for k, b in ((0, 0.0), (1, 0.05), (2, 0.2), (4, 0.01))]
    assert tolerated_lag(points, "c", 0.1) == 1  # the first failure ends it, a later pass does not count
    assert tolerated_lag(points, "c", 0.0) == 0
    with pytest.raises(ValueError, match=r"lags must lie in \[0, 4\]"):
        staleness_curves(modules, policy, tables, reward, [0, 5])
    with pytest.raises(ValueError, match="steps must be >= 1"):
        train_tables(modules["none"], policy, reward, steps=0, lr=0.1)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--algo", "grpoo"], "--algo 'grpoo': choose one of ['reinforce', 'ppo', 'grpo'"),
        (["--corrections", "tis,sc+tiss"], "--corrections: 'sc+tiss': choose among ['none', 'tis'"),
        (["--corrections", "tis/sequence"], "'tis/sequence': choose among"),
        (["--lags", "0,30"], "--lags: [30] outside [0, --steps 20]"),
        (["--lags", "0,a"], "--lags '0,a': comma-separated integers"),
        # the plausible slip: the docs' `--algo grpo --group-size 2` without the group size (default 1) trained,
        # then ended on "the on-policy expected gradient is 0" with a traceback
        (["--algo", "grpo"], "--group-size 1 --corrections none: rollout.group_size=1 is not allowed: must be >= 2"),
    ],
)
def test_the_recipe_refuses_bad_options_before_any_work(tmp_path, capsys, argv, message):
    """recipes/tabular_staleness.py: each bad option is argparse's error (exit 2) naming it, before the output
    folder is made or a step trained (a traceback after training, or at the first correction's build, before)."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stop:
        staleness_recipe()["parse_args"]([*argv, "--out", str(out)])
    assert stop.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def staleness_recipe() -> dict:
    import runpy

    from helpers import ROOT

    return runpy.run_path(f"{ROOT}/recipes/tabular_staleness.py", run_name="tabular_staleness_recipe")


def test_the_recipe_takes_the_documented_group_options(tmp_path):
    argv = ["--algo", "grpo", "--group-size", "2", "--lags", "0,2", "--out", str(tmp_path)]
    args = staleness_recipe()["parse_args"](argv)
    assert args.lag_list == [0, 2] and args.correction_names == ["none", "tis", "mis", "sc", "sc+tis", "tis/seq"]
