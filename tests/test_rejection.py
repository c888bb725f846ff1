"""Sequence masks and the importance-weight diagnostics on hand vectors (issue 38): OPSM drops the whole sequence
(not the tokens whose own advantage is negative, the bug slime fixed), verl's rejection rules and SkyRL's veto,
M2PO's batch bound, the ESS / χ² of the weights exact over micro-batches, the IS-weighted KL term and the logprob
gap guard."""

import math
from types import SimpleNamespace

import pytest
import torch
from helpers import compose_config

from lit_rl.algorithms.parallel import MetricSums
from lit_rl.algorithms.step_logging import logprob_gap_problem
from lit_rl.config import ConfigError, validate
from lit_rl.corrections import (
    WeightFunction,
    batch_weight_scale,
    effective_sample_size,
    importance_moments,
    weight_function,
)
from lit_rl.logprobs import TokenScores
from lit_rl.loss import LossSettings, assemble_loss
from lit_rl.rejection import RS_RULES, divergence, m2po_bound, opsm_mask, rejection_mask, sequence_masks
from lit_rl.rollout.types import RolloutBatch
from lit_rl.schema.loss import RsConfig


def one_row(rollout, current, advantages):
    """A micro-batch of one row: log mu = ``rollout``, log pi_theta = log pi_old = ``current`` (with gradient)."""
    n = len(rollout)
    logprobs = torch.tensor([current], dtype=torch.float32, requires_grad=True)
    mb = RolloutBatch(
        prompt_ids=torch.zeros(1, 1, dtype=torch.long),
        prompt_mask=torch.ones(1, 1, dtype=torch.bool),
        response_ids=torch.zeros(1, n, dtype=torch.long),
        response_mask=torch.ones(1, n, dtype=torch.bool),
        rollout_logprobs=torch.tensor([rollout]),
        rewards=torch.zeros(1),
        advantages=torch.tensor([advantages]),
        group_ids=torch.zeros(1, dtype=torch.long),
        policy_version=torch.zeros(1, dtype=torch.long),
    )
    return logprobs, mb


def opsm_loss(advantages, delta=0.1):
    """The assembled REINFORCE loss (-A log pi per token, token mean) of the issue's OPSM vector, and its metrics."""
    logprobs, mb = one_row([-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0], advantages)
    pg = -mb.advantages * logprobs
    opsm = SimpleNamespace(enabled=True, delta=delta)
    s = LossSettings("token_mean", 8, WeightFunction(), sequence_masks=(("opsm", opsm),))
    scores = TokenScores(logprobs=logprobs, entropy=torch.zeros(1, 3))
    loss, metrics = assemble_loss(
        pg, scores, logprobs.detach(), mb, s, num_tokens=torch.tensor(3), num_seqs=torch.tensor(1)
    )
    stats = MetricSums()
    stats.record(metrics)
    return loss, logprobs, stats.means()


def test_opsm_drops_the_whole_sequence_when_its_mean_advantage_is_negative():
    # per-token log mu - log pi = 1.0, sequence mean 1.0 > delta 0.1; token advantages mean -1/6 < 0
    loss, logprobs, means = opsm_loss([-0.5, 0.25, -0.25])
    assert float(loss.detach()) == 0.0
    loss.backward()
    assert torch.equal(logprobs.grad, torch.zeros(1, 3))  # all three tokens masked, the middle one too
    assert means["train/opsm_maskfrac"] == 1.0
    # masking per token (the bug slime fixed) would have kept the middle token (A = +0.25): loss -0.25 * -2 / 3
    assert -0.25 * -2.0 / 3 != 0.0


def test_opsm_keeps_a_sequence_with_positive_advantage_and_one_close_to_the_sampler():
    loss, _, means = opsm_loss([0.5, 0.25, 0.25])
    assert float(loss.detach()) == pytest.approx(-(0.5 + 0.25 + 0.25) * -2.0 / 3)  # nothing masked
    assert means["train/opsm_maskfrac"] == 0.0
    loss, _, means = opsm_loss([-0.5, 0.25, -0.25], delta=1.0)  # mean log-ratio 1.0 is not > 1.0
    assert means["train/opsm_maskfrac"] == 0.0 and float(loss.detach()) != 0.0


def test_opsm_reads_the_sampler_and_the_current_policy_per_row_and_sequence_advantages():
    rollout = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, -1.0, -1.0]])
    current = torch.tensor([[-1.5, -1.5, 0.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])  # padding holds anything
    keep, m = opsm_mask(rollout, current, torch.tensor([-1.0, -1.0]), mask, delta=0.4)
    assert keep.tolist() == [[False, False, False], [True, True, True]]  # row 0: mean 0.5 > 0.4; row 1: 0
    assert float(m["opsm_maskfrac"]) == pytest.approx(2 / 5)
    with pytest.raises(ValueError, match="OPSM delta must be >= 0"):
        opsm_mask(rollout, current, torch.tensor([-1.0, -1.0]), mask, delta=-1)


def test_the_effective_sample_size_and_chi2_of_the_weights():
    assert effective_sample_size(torch.tensor([0.5, 1.0, 1.5, 3.0])) == pytest.approx(0.72)
    # the same weights as pi_old / mu of four tokens, cut into two micro-batches: the step's ESS is exact
    stats = MetricSums()
    for pair in ([0.5, 1.0], [1.5, 3.0]):
        old = torch.log(torch.tensor([pair]))
        token, sequence = importance_moments(old, torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool))
        stats.add_means({f"train/{k}": v for k, v in token.items()}, torch.ones(1, 2))
        stats.add_means({f"train/{k}": v for k, v in sequence.items()}, torch.ones(1))
    means = stats.means()
    assert means["train/is_ess"] == pytest.approx(0.72)
    assert means["train/is_chi2"] == pytest.approx(1 / 0.72 - 1)  # m2/m1^2 - 1 = 3.125/2.25 - 1
    # sequence weights W = 0.5 and 4.5: ESS (5)^2 / (2 * 20.5)
    assert means["train/is_ess_seq"] == pytest.approx(25 / 41)
    assert means["train/is_chi2_seq"] == pytest.approx(41 / 25 - 1)
    assert means["train/is_extreme_frac"] == 0.0 and "train/is_w:m1" not in means
    token, _ = importance_moments(torch.log(torch.tensor([[11.0, 1.0]])), torch.zeros(1, 2), torch.ones(1, 2))
    assert float(token["is_extreme_frac"]) == 0.5  # w = 11 outside [0.1, 10]


def test_the_rejection_rules_on_hand_vectors():
    # d = log pi_old - log mu per token; row 0: [0.1, -0.1, 0.8], row 1: [0.3, 0.3, 0.3]
    d = torch.tensor([[0.1, -0.1, 0.8], [0.3, 0.3, 0.3]])
    mask = torch.ones(2, 3, dtype=torch.bool)

    def kept(rule, threshold=None, band=(1e-4, 100.0), ratios=d):
        keep, m = rejection_mask(ratios, torch.zeros_like(ratios), mask, rule, threshold, band)
        return keep.tolist(), round(float(m["rs_maskfrac"]), 6)

    assert kept("token_k1") == ([[True, True, False], [True, True, True]], round(1 / 6, 6))  # |0.8| > log 2
    assert kept("seq_sum_k1") == ([[False] * 3, [False] * 3], 1.0)  # |0.8| and |0.9| > log 2 = 0.693
    assert kept("seq_sum_k1", 0.85) == ([[True] * 3, [False] * 3], 0.5)
    # k3 = e^d - 1 - d: row 0 mean (0.00517 + 0.00484 + 0.42554) / 3 = 0.1452; row 1 0.04986
    k3 = divergence(d.double(), "k3")
    assert float(k3[1, 0]) == pytest.approx(math.exp(0.3) - 1.3)
    assert kept("seq_mean_k3", 0.1) == ([[False] * 3, [True] * 3], 0.5)
    assert kept("seq_mean_k3", 0.01) == ([[False] * 3, [False] * 3], 1.0)
    # k2 = d^2 / 2: row maxima 0.32 and 0.045; the default (log 2)^2 / 2 = 0.240
    assert kept("seq_max_k2") == ([[False] * 3, [True] * 3], 0.5)
    # SkyRL's veto: any token ratio outside [1e-4, 100] drops its sequence
    veto = torch.tensor([[0.0, math.log(150.0), 0.0], [0.0, math.log(90.0), math.log(2e-4)]])
    assert kept("outlier_veto", ratios=veto) == ([[False] * 3, [True] * 3], 0.5)
    with pytest.raises(ValueError, match="unknown rejection rule"):
        rejection_mask(d, d, mask, "seq_mean_k4")
    assert set(RS_RULES) == set(RsConfig.rules)


def test_token_k1_is_the_weight_functions_mask_and_sequence_rules_are_sequence_masks():
    cfg = compose_config("correction=tis+rs", "correction.rs.rule=token_k1").correction
    rule = weight_function(cfg)
    assert rule.mis_band == pytest.approx((0.5, 2.0)) and not rule.mis_weighted and rule.tis_cap == 2.0
    assert rule.mask_metric == "rs_maskfrac" and sequence_masks(cfg)[0][0] == "rs"
    cfg = compose_config("correction=sc+opsm").correction
    assert [part for part, _ in sequence_masks(cfg)] == ["opsm"] and weight_function(cfg).is_identity


def test_the_is_weighted_reference_kl_term():
    # pi_old = 0.5 and 0.25, mu = 0.25 and 0.5: weights 2 and 0.5; k2 KL to a reference at 0.5 and 0.5
    logprobs, mb = one_row([math.log(0.25), math.log(0.5)], [math.log(0.5), math.log(0.25)], [0.0, 0.0])
    ref = torch.log(torch.tensor([[0.5, 0.5]]))
    scores = TokenScores(logprobs=logprobs, entropy=torch.zeros(1, 2))
    kw = dict(num_tokens=torch.tensor(2), num_seqs=torch.tensor(1), ref_logprobs=ref, kl_coef=1.0)
    pg = torch.zeros(1, 2)
    k2 = torch.tensor([0.0, 0.5 * math.log(2) ** 2])
    for weighted, w in ((False, torch.ones(2)), (True, torch.tensor([2.0, 0.5]))):
        s = LossSettings("token_mean", 8, WeightFunction(), kl_estimator="k2", kl_is_weighted=weighted)
        loss, _ = assemble_loss(pg, scores, logprobs.detach(), mb, s, **kw)
        assert float(loss.detach()) == pytest.approx(float((w * k2).mean()))


def test_the_logprob_gap_guard_and_its_config():
    assert logprob_gap_problem({"train/logprob_abs_diff": 0.02}, None) is None
    assert logprob_gap_problem({"train/logprob_abs_diff": 0.02}, 0.05) is None
    message = logprob_gap_problem({"train/logprob_abs_diff": 0.07}, 0.05)
    assert "0.07 nats per token exceeds correction.guard.logprob_abs_diff_max = 0.05" in message
    assert logprob_gap_problem({"train/logprob_abs_diff": math.nan}, 0.05) is not None
    for override, field in (
        ("correction.guard.action=halt", "correction.guard.action"),
        ("correction.guard.logprob_abs_diff_max=0", "correction.guard.logprob_abs_diff_max"),
        ("correction.opsm.delta=-0.1", "correction.opsm.delta"),
        ("correction.rs.rule=seq_mean_k4", "correction.rs.rule"),
        ("correction.rs.veto_band=[2,100]", "correction.rs.veto_band"),
        ("correction.mis.enabled=true", "correction.rs.enabled"),
    ):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            validate(compose_config("model=tiny", "correction=rs", override))


def test_m2po_masks_the_largest_squared_log_ratio_until_the_second_moment_is_below_the_threshold():
    # log pi_old - log mu = [0, 0, 0, 3], threshold 1: M2 = 9/4 > 1; masking the last leaves M2 = 0
    rollout = [0.0, 0.0, 0.0, -3.0]
    old = torch.zeros(1, 4)
    assert float(m2po_bound(old, torch.tensor([rollout]), torch.ones(1, 4, dtype=torch.bool), 1.0)) == 0.0
    logprobs, mb = one_row([-1.0, -1.0, -1.0, -4.0], [-1.0, -1.0, -1.0, -1.0], [1.0])
    mb.advantages = torch.ones(1)
    mb.log_ratio_bound = m2po_bound(logprobs.detach(), mb.rollout_logprobs, mb.response_mask, 1.0).expand(1)
    scores = TokenScores(logprobs=logprobs, entropy=torch.zeros(1, 4))
    s = LossSettings("token_mean", 8, WeightFunction())
    loss, metrics = assemble_loss(
        -logprobs, scores, logprobs.detach(), mb, s, num_tokens=torch.tensor(4), num_seqs=torch.tensor(1)
    )
    loss.backward()
    assert logprobs.grad.tolist() == [[-0.25, -0.25, -0.25, 0.0]]  # only the last token masked, denominators kept
    stats = MetricSums()
    stats.record(metrics)
    means = stats.means()
    assert means["train/m2po_maskfrac"] == 0.25 and means["train/m2"] == pytest.approx(9 / 4)  # M2 before masking
    # nothing to mask: +inf; every token above the threshold: -1 (all masked)
    assert math.isinf(float(m2po_bound(old, torch.zeros(1, 4), torch.ones(1, 4), 0.04)))
    assert float(m2po_bound(old, torch.full((1, 4), -1.0), torch.ones(1, 4), 0.5)) == -1.0


def test_tis_batch_normalisation_divides_the_corrected_loss_by_the_batch_mean_weight():
    # pi_old / mu = [0.5, 1, 1.5, 3] under cap 10: Z = 1.5, the normalised weights average 1
    cfg = compose_config("correction=tis", "correction.tis.cap=10", "correction.tis.batch_normalize=true").correction
    logprobs, mb = one_row([0.0] * 4, [math.log(w) for w in (0.5, 1.0, 1.5, 3.0)], [1.0])
    mb.advantages = torch.ones(1)
    mb.old_logprobs = logprobs.detach()
    mb.weight_scale = batch_weight_scale(cfg, mb)
    assert mb.weight_scale.tolist() == pytest.approx([1 / 1.5])
    scores = TokenScores(logprobs=logprobs, entropy=torch.zeros(1, 4))
    s = LossSettings("token_mean", 8, weight_function(cfg))
    pg = -mb.advantages * torch.exp(logprobs - logprobs.detach())  # -A r, r = 1
    loss, metrics = assemble_loss(
        pg, scores, logprobs.detach(), mb, s, num_tokens=torch.tensor(4), num_seqs=torch.tensor(1)
    )
    assert float(loss.detach()) == pytest.approx(-(0.5 + 1 + 1.5 + 3) / 1.5 / 4)  # -mean of w / Z = -1
    stats = MetricSums()
    stats.record(metrics)
    assert stats.means()["train/tis_batch_mean"] == pytest.approx(1.5)
    assert batch_weight_scale(compose_config("correction=tis").correction, mb) is None


@pytest.mark.slow
def test_the_gap_guard_stops_the_recipe_with_its_message_and_no_traceback(tmp_path):
    """correction.guard.action=stop on the tiny model with a bound no real gap meets (1e-12 nats; bf16-mixed
    training against the engine's float32 gives ~1e-7): the recipe ends as its other stops do, exit 1 and
    ``lit_rl: stopped: step 1: train/logprob_abs_diff = ...``, no traceback; step 1's metrics are written."""
    import os
    import subprocess
    import sys

    from lit_rl.tools.compare import read_scalars

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run_dir = tmp_path / "run"
    args = ["model=tiny", "threads=1", "trainer.max_steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2"]
    args += ["sampling.max_new_tokens=4", "eval.num_examples=0", f"hydra.run.dir={run_dir}"]
    args += ["correction.guard.action=stop", "correction.guard.logprob_abs_diff_max=1e-12"]
    cmd = [sys.executable, os.path.join(root, "recipes", "train.py"), *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root)
    assert res.returncode == 1, res.stderr[-3000:]
    assert "lit_rl: stopped: step 1: train/logprob_abs_diff = " in res.stderr
    assert "exceeds correction.guard.logprob_abs_diff_max = 1e-12" in res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    assert not (run_dir / "finished.json").exists()
    assert [step for step, _ in read_scalars(run_dir)["train/logprob_abs_diff"]] == [1]
