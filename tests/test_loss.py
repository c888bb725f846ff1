"""The loss assembly (``lit_rl.loss.assemble_loss``) on values derived by hand: SPEC test vector 16 (MIS keeps a
token's weight inside the band, drops it outside, and the dropped token still counts in the step's
denominator), the KL term with beta, the entropy bonus, the extra (value) term, and the metrics it returns
recorded once into the step's sums."""

import math

import pytest
import torch

from lit_rl.algorithms.parallel import MetricSums
from lit_rl.corrections import WeightFunction
from lit_rl.logprobs import TokenScores
from lit_rl.loss import LossSettings, TokenMetrics, assemble_loss
from lit_rl.rollout.types import RolloutBatch


def batch(train_probs, rollout_probs, advantages):
    """One row of len(train_probs) tokens; pi_old = the trainer's (one update per batch: ratio 1)."""
    n = len(train_probs)
    logprobs = torch.tensor([[math.log(p) for p in train_probs]], requires_grad=True)
    mb = RolloutBatch(
        prompt_ids=torch.zeros(1, 1, dtype=torch.long),
        prompt_mask=torch.ones(1, 1, dtype=torch.bool),
        response_ids=torch.zeros(1, n, dtype=torch.long),
        response_mask=torch.ones(1, n, dtype=torch.bool),
        rollout_logprobs=torch.tensor([[math.log(p) for p in rollout_probs]]),
        rewards=torch.ones(1),
        advantages=torch.tensor(advantages),
        group_ids=torch.zeros(1, dtype=torch.long),
        policy_version=torch.zeros(1, dtype=torch.long),
    )
    return logprobs, mb


def reinforce_ratio_loss(logprobs, old_logprobs, advantages):
    """-A r per token (the PPO surrogate where the clip does not bind)."""
    return -advantages[:, None] * torch.exp(logprobs - old_logprobs)


def settings(**kw):
    return LossSettings(reduction="token_mean", max_response_length=8, **kw)


def test_mis_keeps_the_weight_inside_the_band_and_drops_the_token_outside_but_counts_it():
    # w = pi_old / mu: 0.6 / 0.4 = 1.5 (inside [0.5, 2]) and 0.5 / 0.2 = 2.5 (outside)
    logprobs, mb = batch([0.6, 0.5], [0.4, 0.2], [1.0])
    old = logprobs.detach()
    scores = TokenScores(logprobs=logprobs, entropy=torch.zeros(1, 2))
    pg = reinforce_ratio_loss(logprobs, old, mb.advantages)
    rule = WeightFunction(mis_band=(0.5, 2.0))
    loss, metrics = assemble_loss(
        pg, scores, old, mb, settings(weight_rule=rule), num_tokens=torch.tensor(2), num_seqs=torch.tensor(1)
    )
    assert float(loss.detach()) == pytest.approx((-1.5 + 0.0) / 2)  # SPEC 16: -1.5 kept, 0 dropped, denominator 2
    stats = MetricSums()
    stats.record(metrics)
    assert stats.means()["train/mis_maskfrac"] == pytest.approx(0.5)
    # mask-only (verl's rejection sampling): the kept token's loss is -1
    rule = WeightFunction(mis_band=(0.5, 2.0), mis_weighted=False)
    loss, _ = assemble_loss(
        pg, scores, old, mb, settings(weight_rule=rule), num_tokens=torch.tensor(2), num_seqs=torch.tensor(1)
    )
    assert float(loss.detach()) == pytest.approx(-1.0 / 2)


def test_kl_entropy_and_extra_terms_are_added_per_token_before_the_reduction():
    logprobs, mb = batch([0.5, 0.25], [0.5, 0.25], [1.0])
    old = logprobs.detach()
    entropy = torch.tensor([[0.3, 0.7]])
    scores = TokenScores(logprobs=logprobs, entropy=entropy)
    pg = reinforce_ratio_loss(logprobs, old, mb.advantages)  # -1 per token
    ref = torch.log(torch.tensor([[0.25, 0.25]]))
    # k1 KL per token: log pi - log pi_ref = [log 2, 0]
    kw = dict(num_tokens=torch.tensor(2), num_seqs=torch.tensor(1), ref_logprobs=ref)
    s = settings(weight_rule=WeightFunction(), kl_estimator="k1", entropy_coef=0.1)
    extra = torch.tensor([[0.5, 0.5]])
    loss, metrics = assemble_loss(pg, scores, old, mb, s, kl_coef=0.2, extra_loss=extra, **kw)
    per_token = torch.tensor([-1.0, -1.0]) + 0.5 - 0.1 * entropy[0] + 0.2 * torch.tensor([math.log(2), 0.0])
    assert float(loss.detach()) == pytest.approx(float(per_token.mean()))
    stats = MetricSums()
    stats.record(metrics)
    means = stats.means()
    assert means["train/ref_kl"] == pytest.approx(math.log(2) / 2)
    assert means["train/ref_kl_seq"] == pytest.approx(math.log(2))  # one sequence: its KL sum
    assert means["train/entropy"] == pytest.approx(0.5)
    assert means["train/ppo_kl"] == 0.0 and means["train/logprob_abs_diff"] == 0.0
    # kl.mode=reward: the KL is only logged, beta does not enter the loss, ref_kl_seq is not measured here
    loss, metrics = assemble_loss(
        pg, scores, old, mb, LossSettings("token_mean", 8, WeightFunction(), kl_in_loss=False), kl_coef=0.2, **kw
    )
    assert float(loss.detach()) == pytest.approx(-1.0)
    assert "train/ref_kl" in metrics.names() and "train/ref_kl_seq" not in metrics.names()


K3_KNEE = 2.610868638149876  # r0: e^r0 - r0 - 1 = 10 (objectives.k3_knee), the slope beyond it 10 + r0


def test_a_token_far_below_the_reference_keeps_the_step_finite_and_its_gradient_bounded():
    # TRL #3015 / OpenRLHF #1160, #1335: token 0 at log pi = -100 against pi_ref = 0.5 (k3 = e^99.3 = inf before the
    # bound: loss inf, the whole update dropped with its policy-gradient part); token 1 equals the reference
    logprobs, mb = batch([math.exp(-100.0), 0.5], [math.exp(-100.0), 0.5], [1.0])
    old = logprobs.detach()
    scores = TokenScores(logprobs=logprobs, entropy=torch.zeros(1, 2))
    pg = reinforce_ratio_loss(logprobs, old, mb.advantages)  # -1 per token, gradient -1 per token
    ref = torch.log(torch.tensor([[0.5, 0.5]]))
    kw = dict(num_tokens=torch.tensor(2), num_seqs=torch.tensor(1), ref_logprobs=ref, kl_coef=0.1)
    loss, metrics = assemble_loss(pg, scores, old, mb, settings(weight_rule=WeightFunction()), **kw)
    loss.backward()
    # k3 beyond the bound: 10 + (10 + r0)(r - r0), r = 100 + log 0.5 = 99.307 -> 1229.42; d/dlog pi = -(10 + r0)
    r = 100.0 + math.log(0.5)
    k3 = 10.0 + (10.0 + K3_KNEE) * (r - K3_KNEE)
    assert float(loss.detach()) == pytest.approx((-1.0 - 1.0 + 0.1 * k3) / 2, rel=1e-6)  # 60.471
    expected_grad = torch.tensor([[(-1.0 - 0.1 * (10.0 + K3_KNEE)) / 2, -1.0 / 2]])  # [-1.13054, -0.5]
    torch.testing.assert_close(logprobs.grad, expected_grad)
    # the metric is the estimator's exact value: it overflows for this token (logged as inf, as it always was)
    stats = MetricSums()
    stats.record(metrics)
    assert stats.means()["train/ref_kl"] == math.inf


def test_the_logged_ref_kl_is_the_exact_k3_where_the_loss_term_is_bounded():
    # pi = 0.01 against pi_ref = 0.5: r = log 50 = 3.912 > r0, so the loss takes the tangent
    # 10 + (10 + r0)(r - r0) = 26.41 while train/ref_kl keeps the exact (unbiased) k3 = 50 - log 50 - 1 = 45.088
    logprobs, mb = batch([0.01], [0.01], [0.0])
    old = logprobs.detach()
    scores = TokenScores(logprobs=logprobs, entropy=torch.zeros(1, 1))
    pg = reinforce_ratio_loss(logprobs, old, mb.advantages)  # A = 0: no policy-gradient term
    ref = torch.log(torch.tensor([[0.5]]))
    kw = dict(num_tokens=torch.tensor(1), num_seqs=torch.tensor(1), ref_logprobs=ref, kl_coef=1.0)
    loss, metrics = assemble_loss(pg, scores, old, mb, settings(weight_rule=WeightFunction()), **kw)
    r = math.log(50.0)
    assert float(loss.detach()) == pytest.approx(10.0 + (10.0 + K3_KNEE) * (r - K3_KNEE), rel=1e-6)
    stats = MetricSums()
    stats.record(metrics)
    means = stats.means()
    assert means["train/ref_kl"] == pytest.approx(50.0 - r - 1.0, rel=1e-6)
    assert means["train/ref_kl_seq"] == pytest.approx(50.0 - r - 1.0, rel=1e-6)
    assert means["train/ref_kl_is"] == pytest.approx(50.0 - r - 1.0, rel=1e-6)  # on-policy: weight 1


def test_token_metrics_are_recorded_as_the_step_sums_add_them():
    mask = torch.tensor([[True, True, False]])
    values = torch.tensor([[1.0, 3.0, 100.0]])
    direct = MetricSums()
    direct.add("a", values, mask)
    direct.add_means({"b": 0.25}, mask)
    recorded = MetricSums()
    recorded.record(TokenMetrics().add("a", values, mask).add_means({"b": 0.25}, mask))
    assert recorded.sums == direct.sums and recorded.counts == direct.counts
    assert recorded.means() == {"a": 2.0, "b": 0.25}


@pytest.mark.parametrize(
    "reduction, expected",
    [
        ("token_mean", (-2.0 - 2.0) / 5),  # 4 kept tokens of loss -1 over the step's 5
        ("seq_mean_token_mean", (-2.0 / 3 - 2.0 / 2) / 2),  # each row over its own T_i: 3 and 2
    ],
)
def test_drop_older_tokens_leaves_the_numerator_only(reduction, expected):
    """Row 0: version 0 wrote its first token, an in-flight update then version 1 the other two: the first leaves the
    numerator. Row 1, version 0's alone (stale but one version): kept whole. Denominators unchanged."""
    probs = torch.tensor([[0.5, 0.25, 0.5], [0.5, 0.5, 1.0]])
    logprobs = probs.log().requires_grad_(True)
    mb = RolloutBatch(
        prompt_ids=torch.zeros(2, 1, dtype=torch.long),
        prompt_mask=torch.ones(2, 1, dtype=torch.bool),
        response_ids=torch.zeros(2, 3, dtype=torch.long),
        response_mask=torch.tensor([[True, True, True], [True, True, False]]),
        rollout_logprobs=logprobs.detach().clone(),
        rewards=torch.ones(2),
        advantages=torch.ones(2),
        group_ids=torch.zeros(2, dtype=torch.long),
        policy_version=torch.zeros(2, dtype=torch.long),
        token_versions=torch.tensor([[0, 1, 1], [0, 0, 0]]),
    )
    old = logprobs.detach()
    scores = TokenScores(logprobs=logprobs, entropy=torch.zeros(2, 3))
    pg = reinforce_ratio_loss(logprobs, old, mb.advantages).masked_fill(~mb.response_mask, 0.0)  # -1 per token
    kw = dict(num_tokens=torch.tensor(5), num_seqs=torch.tensor(2))
    s = LossSettings(reduction, 8, WeightFunction(), drop_older_tokens=True)
    loss, metrics = assemble_loss(pg, scores, old, mb, s, **kw)
    assert float(loss.detach()) == pytest.approx(expected)
    loss.backward()
    assert logprobs.grad[0, 0] == 0.0 and (logprobs.grad[0, 1:] != 0).all() and (logprobs.grad[1, :2] != 0).all()
    stats = MetricSums()
    stats.record(metrics)
    assert stats.means()["train/older_dropfrac"] == pytest.approx(1 / 5)
    off, metrics = assemble_loss(pg, scores, old, mb, LossSettings(reduction, 8, WeightFunction()), **kw)
    assert float(off.detach()) == pytest.approx(-1.0) and "train/older_dropfrac" not in metrics.names()


def test_older_token_mask_is_taken_per_row_over_valid_tokens():
    from lit_rl.loss import older_token_mask

    versions = torch.tensor([[3, 3, 4, 5], [2, 2, 2, 9], [7, 7, 7, 7]])  # row 1's 9 is padding
    mask = torch.tensor([[True] * 4, [True, True, True, False], [True] * 4])
    expected = [[True, True, True, False], [False] * 4, [False] * 4]
    assert older_token_mask(versions, mask).tolist() == expected
    with pytest.raises(ValueError, match=r"token_versions \(3, 4\) and mask \(3, 3\) must match"):
        older_token_mask(versions, mask[:, :3])
