"""Value tests for lit_rl.objectives (SPEC.md test vectors 1-9 and 13, plus regression cases)."""

import math

import pytest
import torch

from lit_rl.objectives import (
    approx_kl,
    baseline_advantages,
    cispo_coef,
    cispo_loss,
    clipped_value_loss,
    entropy_from_logits,
    gae,
    group_advantages,
    gspo_coef,
    gspo_loss,
    k3_knee,
    masked_mean,
    masked_sum,
    overlong_penalty,
    ppo_clip_coef,
    ppo_clip_loss,
    reduce_loss,
    reinforce_coef,
    sequence_loss_mean,
    useful_group_probability,
    useful_groups,
)


def bernoulli_group(num_correct, group_size=8):
    rewards = torch.tensor([1.0] * num_correct + [0.0] * (group_size - num_correct))
    return rewards, torch.zeros(group_size, dtype=torch.long)


def ratio_leaf(ratios):
    """Token log-probs (leaf with grad) and zero old log-probs such that exp(lp - old) = ratios."""
    logprobs = torch.tensor(ratios, dtype=torch.float64).log().reshape(1, -1).requires_grad_()
    return logprobs, torch.zeros_like(logprobs)


# ----------------------------------------------------------------------------------------------
# Masked reductions
# ----------------------------------------------------------------------------------------------


def test_masked_mean_and_sum():
    x = torch.tensor([[1.0, 1.0, 0.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    assert masked_mean(x, mask).item() == pytest.approx(5 / 3)
    assert masked_sum(x, mask).item() == pytest.approx(5.0)
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), torch.tensor([1.0, 3.0]))
    torch.testing.assert_close(masked_sum(x, mask.float(), dim=0), torch.tensor([4.0, 1.0, 0.0]))


def test_masked_mean_empty_mask_is_zero_not_nan():
    x = torch.tensor([[1.0, 2.0], [float("nan"), float("inf")]], requires_grad=True)
    mask = torch.tensor([[True, True], [False, False]])
    row_means = masked_mean(x, mask, dim=-1)
    torch.testing.assert_close(row_means, torch.tensor([1.5, 0.0]))
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0
    row_means.sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([[0.5, 0.5], [0.0, 0.0]]))


def test_masked_mean_ignores_padding_values_of_entropy():
    logits = torch.randn(2, 4, 11, generator=torch.Generator().manual_seed(0))
    entropy = entropy_from_logits(logits)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    expected = masked_mean(entropy, mask)
    garbage = torch.where(mask, entropy, torch.full_like(entropy, 1e6))
    assert masked_mean(garbage, mask).item() == expected.item()
    assert masked_mean(garbage, mask).item() == pytest.approx(entropy[mask].mean().item())


def test_masked_shape_mismatch_raises():
    with pytest.raises(ValueError):
        masked_mean(torch.ones(2, 3), torch.ones(2, 4, dtype=torch.bool))


# ----------------------------------------------------------------------------------------------
# Group advantages (vectors 1-4, 13)
# ----------------------------------------------------------------------------------------------


def test_vector_1_grpo_two_correct_of_eight():
    rewards, group_ids = bernoulli_group(2)
    assert rewards.mean().item() == pytest.approx(0.25)
    assert rewards.std(unbiased=False).item() == pytest.approx(0.433, abs=1e-3)
    advantages = group_advantages(rewards, group_ids)
    torch.testing.assert_close(advantages[:2], torch.full((2,), 1.732), atol=1e-3, rtol=0)
    torch.testing.assert_close(advantages[2:], torch.full((6,), -0.577), atol=1e-3, rtol=0)


def test_vector_2_grpo_one_and_four_correct():
    advantages = group_advantages(*bernoulli_group(1))
    assert advantages[0].item() == pytest.approx(math.sqrt(7), abs=1e-4)
    assert advantages[0].item() == pytest.approx(2.646, abs=1e-3)
    torch.testing.assert_close(advantages[1:], torch.full((7,), -1 / math.sqrt(7)), atol=1e-4, rtol=0)
    assert advantages[1].item() == pytest.approx(-0.378, abs=1e-3)

    advantages = group_advantages(*bernoulli_group(4))
    torch.testing.assert_close(advantages, torch.tensor([1.0] * 4 + [-1.0] * 4), atol=1e-4, rtol=0)


@pytest.mark.parametrize("num_correct", [1, 2, 3, 4, 5, 6, 7])
def test_vector_3_sum_of_squared_advantages(num_correct):
    rewards, group_ids = bernoulli_group(num_correct)
    p = num_correct / 8
    with_std = group_advantages(rewards, group_ids, alpha=1.0)
    assert (with_std**2).sum().item() == pytest.approx(8.0, abs=1e-4)
    without_std = group_advantages(rewards, group_ids, alpha=0.0)
    assert (without_std**2).sum().item() == pytest.approx(8 * p * (1 - p), abs=1e-6)


def test_vector_3_dr_grpo_named_values():
    assert (group_advantages(*bernoulli_group(1), alpha=0.0) ** 2).sum().item() == pytest.approx(0.875)
    assert (group_advantages(*bernoulli_group(4), alpha=0.0) ** 2).sum().item() == pytest.approx(2.0)


@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, 7.3])
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_vector_4_all_equal_group_is_zero_and_carries_no_gradient(value, alpha):
    rewards = torch.full((8,), value)
    advantages = group_advantages(rewards, torch.zeros(8, dtype=torch.long), alpha=alpha, eps=0.0)
    assert not torch.isnan(advantages).any()
    assert torch.equal(advantages, torch.zeros(8))

    logprobs = torch.randn(8, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    logprobs.requires_grad_()
    old_logprobs = logprobs.detach() + 0.1
    loss, _, _ = ppo_clip_loss(logprobs, old_logprobs, advantages.double(), 0.2, 0.2)
    reduce_loss(loss, torch.ones(8, 5, dtype=torch.bool), "seq_mean_token_mean").backward()
    assert torch.equal(logprobs.grad, torch.zeros_like(logprobs))


@pytest.mark.parametrize("p", [0.1, 0.25, 0.5, 0.75])
def test_vector_13_toy_policy_std_normalisation(p):
    z = torch.tensor(math.log(p / (1 - p)), dtype=torch.float64, requires_grad=True)
    torch.sigmoid(z).backward()
    assert z.grad.item() == pytest.approx(p * (1 - p))

    # Exact expectation over a group holding each outcome with its probability: G = 20.
    group_size = 20
    num_correct = round(p * group_size)
    rewards = torch.tensor([1.0] * num_correct + [0.0] * (group_size - num_correct), dtype=torch.float64)
    group_ids = torch.zeros(group_size, dtype=torch.long)
    for alpha, expected in [(0.0, p * (1 - p)), (1.0, math.sqrt(p * (1 - p)))]:
        advantages = group_advantages(rewards, group_ids, alpha=alpha, eps=0.0)
        z = torch.tensor(math.log(p / (1 - p)), dtype=torch.float64, requires_grad=True)
        prob = torch.sigmoid(z)
        logprobs = torch.where(rewards > 0, prob.log(), (1 - prob).log())
        (advantages * logprobs).mean().backward()
        assert z.grad.item() == pytest.approx(expected, rel=1e-9)


def test_group_advantages_interleaved_layout():
    group_ids = torch.tensor([1, 2, 1, 2])
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])  # p1: [1, 1], p2: [0, 0]
    assert torch.equal(group_advantages(rewards, group_ids), torch.zeros(4))

    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])  # p1: [1, 0], p2: [0, 1]
    advantages = group_advantages(rewards, group_ids)
    torch.testing.assert_close(advantages, torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5, rtol=0)
    torch.testing.assert_close(group_advantages(rewards, group_ids, alpha=0.0), torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_group_advantages_excludes_empty_completion():
    rewards = torch.tensor([100.0, 1.0])
    lengths = torch.tensor([0, 2])
    advantages = group_advantages(rewards, torch.zeros(2, dtype=torch.long), alpha=0.0, valid=lengths > 0)
    assert torch.equal(advantages, torch.zeros(2))

    # A third, valid member: the invalid one is outside the mean and std.
    rewards = torch.tensor([100.0, 1.0, 0.0])
    valid = torch.tensor([False, True, True])
    advantages = group_advantages(rewards, torch.zeros(3, dtype=torch.long), alpha=0.0, valid=valid)
    torch.testing.assert_close(advantages, torch.tensor([0.0, 0.5, -0.5]))
    advantages = group_advantages(rewards, torch.zeros(3, dtype=torch.long), alpha=1.0, valid=valid)
    torch.testing.assert_close(advantages, torch.tensor([0.0, 1.0, -1.0]), atol=1e-5, rtol=0)


def test_group_advantages_errors():
    rewards, group_ids = bernoulli_group(2)
    with pytest.raises(ValueError, match="alpha"):
        group_advantages(rewards, group_ids, alpha=1.5)
    with pytest.raises(ValueError, match="alpha"):
        group_advantages(rewards, group_ids, alpha=-0.1)
    with pytest.raises(ValueError):
        group_advantages(rewards, group_ids[:4])
    with pytest.raises(ValueError):
        group_advantages(rewards, group_ids, valid=torch.ones(3, dtype=torch.bool))


def test_useful_groups():
    group_ids = torch.tensor([0, 1, 0, 1, 2, 2])
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    assert useful_groups(rewards, group_ids).tolist() == [False, True, False, True, False, False]


def test_vector_9_useful_group_probability():
    assert useful_group_probability(0.5, 8) == pytest.approx(0.9921875, abs=1e-12)
    assert useful_group_probability(0.0, 8) == 0.0
    assert useful_group_probability(1.0, 8) == 0.0
    with pytest.raises(ValueError):
        useful_group_probability(1.5, 8)


# ----------------------------------------------------------------------------------------------
# REINFORCE baselines
# ----------------------------------------------------------------------------------------------


def test_baseline_advantages():
    rewards = torch.tensor([1.0, 0.0, 2.0, 3.0, 5.0])
    group_ids = torch.tensor([7, 7, 7, 9, 9])
    torch.testing.assert_close(baseline_advantages(rewards, group_ids, "none"), rewards)
    torch.testing.assert_close(baseline_advantages(rewards, group_ids, "batch_mean"), rewards - 2.2)
    # Leave-one-out: 1 - mean(0, 2) = 0; 0 - mean(1, 2) = -1.5; 2 - mean(1, 0) = 1.5; 3 - 5; 5 - 3.
    torch.testing.assert_close(
        baseline_advantages(rewards, group_ids, "rloo"), torch.tensor([0.0, -1.5, 1.5, -2.0, 2.0])
    )


def test_baseline_advantages_errors():
    with pytest.raises(ValueError, match="rloo"):
        baseline_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]), "rloo")
    with pytest.raises(ValueError, match="none"):
        baseline_advantages(torch.tensor([1.0]), torch.tensor([0]), "mean")


# ----------------------------------------------------------------------------------------------
# PPO / DAPO clipped surrogate (vectors 5, 6)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ratio, advantage, objective, grad_kept",
    [
        (1.5, +1.0, 1.2, False),
        (2 / 3, -1.0, -0.8, False),
        (0.5, +1.0, 0.5, True),
        (1.5, -1.0, -1.5, True),
    ],
)
def test_vector_5_ppo_clip(ratio, advantage, objective, grad_kept):
    logprobs, old_logprobs = ratio_leaf([ratio])
    loss, _, _ = ppo_clip_loss(logprobs, old_logprobs, torch.tensor([advantage], dtype=torch.float64), 0.2, 0.2)
    assert -loss.item() == pytest.approx(objective, abs=1e-3)
    loss.sum().backward()
    # d loss / d logπ = -r·A when the unclipped branch is active, else 0.
    expected_grad = -ratio * advantage if grad_kept else 0.0
    assert logprobs.grad.item() == pytest.approx(expected_grad, abs=1e-9)


def test_vector_5_on_policy_gradient_is_a_grad_log_pi():
    # Toy softmax policy; at r = 1 the PPO gradient equals A ∇log π.
    theta = torch.tensor([0.3, -1.0, 0.5], dtype=torch.float64, requires_grad=True)
    tokens = torch.tensor([0, 2, 1])
    advantages = torch.tensor([[1.5, -0.7, 0.4]], dtype=torch.float64)
    logprobs = torch.log_softmax(theta, -1)[tokens].unsqueeze(0)
    loss, low, high = ppo_clip_loss(logprobs, logprobs.detach(), advantages, 0.2, 0.2)
    assert not (low | high).any()
    (-loss).sum().backward()
    ppo_grad = theta.grad.clone()

    theta.grad = None
    (advantages * torch.log_softmax(theta, -1)[tokens]).sum().backward()
    torch.testing.assert_close(ppo_grad, theta.grad)


@pytest.mark.parametrize(
    "ratio, advantage, objective, grad_kept",
    [
        (1.25, +1.0, 1.25, True),
        (0.5, -1.0, -0.8, False),
        (1.3, +1.0, 1.28, False),
    ],
)
def test_vector_6_dapo_clip_higher(ratio, advantage, objective, grad_kept):
    logprobs, old_logprobs = ratio_leaf([ratio])
    loss, _, _ = ppo_clip_loss(logprobs, old_logprobs, torch.tensor([advantage], dtype=torch.float64), 0.2, 0.28)
    assert -loss.item() == pytest.approx(objective, abs=1e-3)
    loss.sum().backward()
    expected_grad = -ratio * advantage if grad_kept else 0.0
    assert logprobs.grad.item() == pytest.approx(expected_grad, abs=1e-9)

    # Plain PPO clips the first case at 1.2.
    if ratio == 1.25:
        loss, _, high = ppo_clip_loss(logprobs, old_logprobs, torch.tensor([advantage], dtype=torch.float64), 0.2, 0.2)
        assert -loss.item() == pytest.approx(1.2)
        assert high.item()


def test_ppo_clip_fraction():
    logprobs, old_logprobs = ratio_leaf([1.5, 0.5, 0.5, 1.5])
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    _, low, high = ppo_clip_loss(logprobs, old_logprobs, advantages, 0.2, 0.2)
    assert high.tolist() == [[True, False, False, False]]
    assert low.tolist() == [[False, False, True, False]]
    clipped = low | high
    assert clipped.long().tolist() == [[1, 0, 1, 0]]
    assert masked_mean(clipped.float(), torch.ones_like(clipped)).item() == 0.5


def test_ppo_advantages_broadcast_and_shape_errors():
    logprobs = torch.zeros(2, 3)
    loss, _, _ = ppo_clip_loss(logprobs, logprobs, torch.tensor([1.0, -2.0]), 0.2, 0.2)
    torch.testing.assert_close(loss, torch.tensor([[-1.0] * 3, [2.0] * 3]))
    with pytest.raises(ValueError):
        ppo_clip_loss(logprobs, logprobs, torch.ones(3), 0.2, 0.2)
    with pytest.raises(ValueError):
        ppo_clip_loss(logprobs, torch.zeros(2, 4), torch.ones(2), 0.2, 0.2)


# ----------------------------------------------------------------------------------------------
# GSPO, CISPO
# ----------------------------------------------------------------------------------------------


def test_gspo_sequence_ratio_uses_valid_tokens_only():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    old_logprobs = torch.tensor([[-1.0, -2.0, 55.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    # Token log-ratios: row 0 [0.1, -0.3] (+ padding garbage), row 1 [0.3, 0.3, 0.3].
    logprobs = old_logprobs + torch.tensor([[0.1, -0.3, 1e6], [0.3, 0.3, 0.3]], dtype=torch.float64)
    logprobs[0, 2] = float("inf")
    logprobs.requires_grad_()
    advantages = torch.tensor([1.0, 1.0], dtype=torch.float64)
    loss, low, high = gspo_loss(logprobs, old_logprobs, advantages, mask, 0.2, 0.2)

    seq_ratio_0 = math.exp(-0.1)  # geometric mean of exp(0.1), exp(-0.3)
    torch.testing.assert_close(loss[0], torch.tensor([-seq_ratio_0, -seq_ratio_0, 0.0], dtype=torch.float64))
    # Row 1: s = exp(0.3) = 1.35 > 1.2 with A > 0: clipped at 1.2 on every token.
    torch.testing.assert_close(loss[1], torch.full((3,), -1.2, dtype=torch.float64))
    assert high.tolist() == [False, True]
    assert low.tolist() == [False, False]

    reduce_loss(loss, mask, "seq_mean_token_mean").backward()
    assert torch.isfinite(logprobs.grad).all()
    # Clipped sequence: zero gradient; padding: zero gradient.
    assert torch.equal(logprobs.grad[1], torch.zeros(3, dtype=torch.float64))
    assert logprobs.grad[0, 2].item() == 0.0
    # Unclipped sequence: -(1/N) s_i A_i (1/T_i) per token.
    torch.testing.assert_close(logprobs.grad[0, :2], torch.full((2,), -seq_ratio_0 / 4, dtype=torch.float64))


def test_gspo_token_form_matches_sequence_objective_gradient():
    gen = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    old_logprobs = -torch.rand(3, 4, generator=gen, dtype=torch.float64)
    logprobs = (old_logprobs + 0.05 * torch.randn(3, 4, generator=gen, dtype=torch.float64)).requires_grad_()
    advantages = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    eps_low, eps_high = 0.02, 0.03

    loss, _, _ = gspo_loss(logprobs, old_logprobs, advantages, mask, eps_low, eps_high)
    reduce_loss(loss, mask, "seq_mean_token_mean").backward()
    token_grad = logprobs.grad.clone()

    logprobs.grad = None
    seq_ratio = torch.exp(masked_mean(logprobs - old_logprobs, mask, dim=-1))
    objective = torch.minimum(seq_ratio * advantages, seq_ratio.clamp(1 - eps_low, 1 + eps_high) * advantages)
    (-objective.mean()).backward()
    torch.testing.assert_close(token_grad, logprobs.grad)


def test_gspo_requires_sequence_advantages():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError):
        gspo_loss(x, x, torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool), 0.2, 0.2)


def test_cispo_keeps_gradient_outside_clip_range():
    ratios = [5.0, 0.01, 1.1]
    logprobs, old_logprobs = ratio_leaf(ratios)
    advantages = torch.tensor([[1.0, -1.0, 2.0]], dtype=torch.float64)
    loss = cispo_loss(logprobs, old_logprobs, advantages, 0.2, 0.28)
    clipped = torch.tensor([[1.28, 0.8, 1.1]], dtype=torch.float64)
    torch.testing.assert_close(loss, -clipped * advantages * logprobs.detach())
    loss.sum().backward()
    torch.testing.assert_close(logprobs.grad, -clipped * advantages)
    assert (logprobs.grad != 0).all()


# ----------------------------------------------------------------------------------------------
# Reductions (vector 7 and micro-batching)
# ----------------------------------------------------------------------------------------------


def two_sequence_batch(length_a=100, length_b=10_000):
    mask = torch.zeros(2, length_b, dtype=torch.bool)
    mask[0, :length_a] = True
    mask[1, :length_b] = True
    token_loss = torch.randn(2, length_b, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return token_loss.requires_grad_(), mask


@pytest.mark.parametrize(
    "mode, weight_a, weight_b",
    [
        ("seq_mean_token_mean", 1 / 200, 1 / 20_000),
        ("token_mean", 1 / 10_100, 1 / 10_100),
        ("seq_mean_token_sum", 1 / 2, 1 / 2),
        ("constant", 1 / (2 * 20_480), 1 / (2 * 20_480)),
    ],
)
def test_vector_7_reduction_weights(mode, weight_a, weight_b):
    token_loss, mask = two_sequence_batch()
    reduce_loss(token_loss, mask, mode, max_response_length=20_480).backward()
    grad = token_loss.grad
    torch.testing.assert_close(grad[0, :100], torch.full((100,), weight_a, dtype=torch.float64))
    torch.testing.assert_close(grad[1], torch.full((10_000,), weight_b, dtype=torch.float64))
    assert torch.equal(grad[0, 100:], torch.zeros(9_900, dtype=torch.float64))


def test_token_mean_excludes_masked_completion():
    # 30 tokens: rows of 10, 15 and 5 tokens; the 5-token completion (truncated) is masked out.
    token_loss = torch.randn(3, 15, generator=torch.Generator().manual_seed(2))
    lengths = torch.tensor([10, 15, 5])
    mask = torch.arange(15) < lengths.unsqueeze(-1)
    assert mask.sum().item() == 30
    mask[2] = False
    expected = (token_loss[0, :10].sum() + token_loss[1].sum()) / 25
    torch.testing.assert_close(reduce_loss(token_loss, mask, "token_mean"), expected)
    token_loss[2] = 1e6
    torch.testing.assert_close(reduce_loss(token_loss, mask, "token_mean"), expected)


def test_token_mean_across_micro_batches_equals_whole_batch():
    leaf_1 = torch.tensor([[1.0]], requires_grad=True)
    leaf_2 = torch.tensor([[0.0, 0.0, 0.0]], requires_grad=True)
    total = reduce_loss(leaf_1, torch.ones(1, 1, dtype=torch.bool), "token_mean", num_tokens=4)
    total = total + reduce_loss(leaf_2, torch.ones(1, 3, dtype=torch.bool), "token_mean", num_tokens=4)
    assert total.item() == pytest.approx(0.25)
    total.backward()

    whole = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], requires_grad=True)
    whole_mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    whole_loss = reduce_loss(whole, whole_mask, "token_mean")
    assert whole_loss.item() == pytest.approx(total.item())
    whole_loss.backward()
    assert leaf_1.grad.tolist() == [[0.25]]
    assert leaf_2.grad.tolist() == [[0.25, 0.25, 0.25]]
    assert whole.grad.tolist() == [[0.25, 0.0, 0.0], [0.25, 0.25, 0.25]]


def test_seq_mean_across_micro_batches_equals_whole_batch():
    token_loss = torch.randn(4, 6, generator=torch.Generator().manual_seed(4))
    mask = torch.arange(6) < torch.tensor([[2], [6], [3], [1]])
    whole = reduce_loss(token_loss, mask, "seq_mean_token_mean")
    parts = sum(reduce_loss(token_loss[i : i + 2], mask[i : i + 2], "seq_mean_token_mean", num_seqs=4) for i in (0, 2))
    torch.testing.assert_close(parts, whole)


def test_reduce_loss_empty_rows_and_errors():
    token_loss = torch.tensor([[2.0, 4.0], [float("nan"), 1.0]])
    mask = torch.tensor([[True, True], [False, False]])
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        assert not torch.isnan(reduce_loss(token_loss, mask, mode))
    assert reduce_loss(token_loss, mask, "seq_mean_token_mean").item() == pytest.approx(3.0)
    assert reduce_loss(token_loss, mask, "seq_mean_token_sum").item() == pytest.approx(6.0)
    assert reduce_loss(token_loss, mask, "constant", max_response_length=4).item() == pytest.approx(1.5)
    assert reduce_loss(token_loss, torch.zeros_like(mask), "token_mean").item() == 0.0
    with pytest.raises(ValueError, match="token_mean"):
        reduce_loss(token_loss, mask, "sum")
    with pytest.raises(ValueError, match="max_response_length"):
        reduce_loss(token_loss, mask, "constant")


def test_sequence_loss_mean_is_not_length_weighted():
    seq_loss = torch.tensor([1.0, 0.0])
    token_mask = torch.arange(4) < torch.tensor([[2], [4]])
    assert sequence_loss_mean(seq_loss, token_mask).item() == pytest.approx(0.5)
    assert sequence_loss_mean(seq_loss, torch.tensor([True, True])).item() == pytest.approx(0.5)
    assert sequence_loss_mean(seq_loss, torch.tensor([True, False])).item() == pytest.approx(1.0)


# ----------------------------------------------------------------------------------------------
# DAPO overlong shaping (vector 8)
# ----------------------------------------------------------------------------------------------


def test_vector_8_overlong_penalty():
    lengths = torch.tensor([100, 16_384, 18_432, 20_480, 25_000])
    penalty = overlong_penalty(lengths, max_response_length=20_480, buffer_length=4_096)
    assert penalty.dtype == torch.float32
    torch.testing.assert_close(penalty, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))
    with pytest.raises(ValueError):
        overlong_penalty(lengths, max_response_length=100, buffer_length=200)


# ----------------------------------------------------------------------------------------------
# Critic: GAE and value loss
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "gamma, lam, expected_advantages",
    [
        (1.0, 1.0, [0.5, 0.4, 0.3]),
        # δ2 = 1 - 0.7 = 0.3; δ1 = 0.9·0.7 - 0.6 = 0.03; δ0 = 0.9·0.6 - 0.5 = 0.04;
        # A1 = 0.03 + 0.72·0.3 = 0.246; A0 = 0.04 + 0.72·0.246 = 0.21712.
        (0.9, 0.8, [0.21712, 0.246, 0.3]),
    ],
)
def test_gae_hand_computed(gamma, lam, expected_advantages):
    # 3 valid tokens, reward on the last one, then one padding position holding garbage.
    rewards = torch.tensor([[0.0, 0.0, 1.0, 50.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False]])
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    expected = torch.tensor([expected_advantages + [0.0]], dtype=torch.float64)
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, torch.where(mask, expected + values, torch.zeros_like(values)))


def test_clipped_value_loss():
    values = torch.tensor([[1.5, 0.9, 0.0]], requires_grad=True)
    old_values = torch.tensor([[1.0, 1.0, 0.0]])
    returns = torch.tensor([[2.0, 0.0, 1.0]])
    loss = clipped_value_loss(values, old_values, returns, clip=0.2)
    # Token 0: unclipped (1.5-2)^2 = 0.25, clipped (1.2-2)^2 = 0.64 -> max 0.64, no grad.
    # Token 1: unclipped 0.81, clipped (0.9-0)^2 = 0.81 -> 0.81. Token 2: 1.
    torch.testing.assert_close(loss, torch.tensor([[0.32, 0.405, 0.5]]))
    loss.sum().backward()
    assert values.grad[0, 0].item() == 0.0
    assert values.grad[0, 2].item() == pytest.approx(-1.0)


# ----------------------------------------------------------------------------------------------
# Entropy and KL
# ----------------------------------------------------------------------------------------------


def test_entropy_from_logits():
    uniform = torch.zeros(2, 3, 16)
    torch.testing.assert_close(entropy_from_logits(uniform), torch.full((2, 3), math.log(16)))
    # Large logits do not overflow; -inf entries contribute nothing.
    logits = torch.tensor([[1000.0, 1000.0, float("-inf")], [5.0, -3.0, 0.5]])
    entropy = entropy_from_logits(logits)
    probs = torch.softmax(logits[1].double(), -1)
    assert entropy[0].item() == pytest.approx(math.log(2), abs=1e-6)
    assert entropy[1].item() == pytest.approx(-(probs * probs.log()).sum().item(), abs=1e-6)
    assert entropy_from_logits(logits.bfloat16()).dtype == torch.float32


def test_approx_kl():
    logprobs = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    ref_logprobs = torch.tensor([-1.0, -1.0, -2.5, -3.2])
    k3 = approx_kl(logprobs, ref_logprobs, "k3")
    assert (k3 >= 0).all()
    assert k3[0].item() == 0.0
    d = logprobs - ref_logprobs
    torch.testing.assert_close(k3, torch.exp(-d) + d - 1)
    torch.testing.assert_close(approx_kl(logprobs, ref_logprobs, "k1"), d)
    torch.testing.assert_close(approx_kl(logprobs, ref_logprobs, "k2"), 0.5 * d**2)
    assert torch.equal(approx_kl(logprobs, logprobs), torch.zeros(4))
    with pytest.raises(ValueError, match="k3"):
        approx_kl(logprobs, ref_logprobs, "k4")


def test_k3_knee_is_where_k3_reaches_the_peers_clamp_value():
    # e^r - r - 1 = 10  <=>  e^r = 11 + r; r0 = 2.610868638 (pi_ref / pi = 13.6109), by Newton's method by hand
    r0 = k3_knee(10.0)
    assert r0 == pytest.approx(2.610868638149876, rel=1e-14)
    assert math.exp(r0) == pytest.approx(11.0 + r0, rel=1e-14)
    assert k3_knee(1.0) == pytest.approx(1.1461932206, rel=1e-9)  # e^r = 2 + r
    with pytest.raises(ValueError, match="> 0"):
        k3_knee(0.0)


def test_k3_far_below_the_reference_has_a_finite_value_and_a_bounded_gradient():
    # TRL #3015 / OpenRLHF #1160, #1335: log pi = -100 against pi_ref = 0.5, r = log pi_ref - log pi = 99.307;
    # unbounded, e^r = inf in float32 and the step's loss with it. The tangent at r0 (value 10, slope e^r0 - 1 =
    # 10 + r0 = 12.6109): value 10 + 12.6109 * (99.307 - 2.6109) = 1229.42, d/dlog pi = -(10 + r0) = -12.6109
    r0 = 2.610868638149876
    logprobs = torch.tensor([-100.0, -20.0, -5.0], requires_grad=True)
    ref_logprobs = torch.tensor([math.log(0.5), 0.0, -5.0 + r0 - 1e-3])
    value = approx_kl(logprobs, ref_logprobs, "k3")
    value.sum().backward()
    r = math.log(0.5) + 100.0
    assert value[0].item() == pytest.approx(10.0 + (10.0 + r0) * (r - r0), rel=1e-6)  # 1229.42
    assert value[1].item() == pytest.approx(10.0 + (10.0 + r0) * (20.0 - r0), rel=1e-6)  # 239.29, not 4.85e8
    assert logprobs.grad[0].item() == pytest.approx(-(10.0 + r0), rel=1e-6)
    assert logprobs.grad[1].item() == pytest.approx(-(10.0 + r0), rel=1e-6)
    # just inside the bound k3 is exact: value e^(r0 - 1e-3) - (r0 - 1e-3) - 1 = 9.98739, gradient 1 - e^(r0 - 1e-3)
    inside = r0 - 1e-3
    assert value[2].item() == pytest.approx(math.exp(inside) - inside - 1.0, rel=1e-5)
    assert logprobs.grad[2].item() == pytest.approx(1.0 - math.exp(inside), rel=1e-5)
    # the bound is continuous at r0 (value 10, slope 12.6109 from both sides)
    at = approx_kl(torch.tensor([-r0 - 1e-6, -r0 + 1e-6], dtype=torch.float64), torch.zeros(2, dtype=torch.float64))
    torch.testing.assert_close(at, torch.full((2,), 10.0, dtype=torch.float64), atol=2e-5, rtol=0)
    # unbounded (tangent_from=None, what the metrics log) it overflows as before
    assert approx_kl(logprobs.detach(), ref_logprobs, "k3", tangent_from=None)[0].item() == math.inf


def test_k3_is_unchanged_bit_for_bit_where_the_bound_does_not_bind():
    # every log-ratio with pi_ref / pi <= 13.61 (and every one with pi > pi_ref): the value and the gradient are
    # e^r - r - 1 and 1 - e^r exactly as before the bound
    logprobs = torch.linspace(-2.6, 30.0, 1001, requires_grad=True)
    ref_logprobs = torch.zeros(1001)
    bounded = approx_kl(logprobs, ref_logprobs, "k3")
    (grad_bounded,) = torch.autograd.grad(bounded.sum(), logprobs)
    d = logprobs - ref_logprobs
    exact = torch.exp(-d) + d - 1.0
    (grad_exact,) = torch.autograd.grad(exact.sum(), logprobs)
    assert torch.equal(bounded, exact) and torch.equal(grad_bounded, grad_exact)
    # k1 and k2 have no exponential and no bound
    far = torch.tensor([-100.0])
    assert approx_kl(far, torch.zeros(1), "k2").item() == 5000.0
    assert approx_kl(far, torch.zeros(1), "k1").item() == -100.0


# ----------------------------------------------------------------------------------------------
# Per-token coefficients ∂ℓ/∂log π: equal to autograd's gradient of each loss at the sampled token
# ----------------------------------------------------------------------------------------------


def _autograd_coef(loss_fn, logprobs):
    logprobs = logprobs.clone().requires_grad_()
    (grad,) = torch.autograd.grad(loss_fn(logprobs).sum(), logprobs)
    return grad


def test_coefficients_equal_the_losses_gradients_clipped_or_not():
    g = torch.Generator().manual_seed(0)
    n, t = 6, 5
    old = torch.randn(n, t, generator=g, dtype=torch.float64)
    # ratios spread over [0.5, 1.6]: every clip branch of PPO / DAPO / CISPO is hit
    logprobs = old + torch.empty(n, t, dtype=torch.float64).uniform_(math.log(0.5), math.log(1.6), generator=g)
    mask = torch.ones(n, t, dtype=torch.bool)
    mask[0, 3:] = False
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0, 0.0, 1.5], dtype=torch.float64)
    adv_tok = torch.randn(n, t, generator=g, dtype=torch.float64)
    log_ratio = (logprobs - old).unsqueeze(-1)
    for a in (adv, adv_tok):
        got = ppo_clip_coef(log_ratio, a, 0.2, 0.28).squeeze(-1)
        want = _autograd_coef(lambda lp: ppo_clip_loss(lp, old, a, 0.2, 0.28)[0], logprobs)
        torch.testing.assert_close(got, want)
        assert (got == 0).any() and (got != 0).any()  # both branches
        got = cispo_coef(log_ratio, a, 0.2, 0.28).squeeze(-1)
        torch.testing.assert_close(got, _autograd_coef(lambda lp: cispo_loss(lp, old, a, 0.2, 0.28), logprobs))
        torch.testing.assert_close(
            reinforce_coef(log_ratio, a).squeeze(-1),
            _autograd_coef(lambda lp: -(a if a.dim() == 2 else a[:, None]) * lp, logprobs),
        )
    # GSPO: the sequence ratio; eps small enough that some sequences clip
    for eps in (0.05, 10.0):
        got = gspo_coef(log_ratio, logprobs - old, adv, mask, eps, eps).squeeze(-1)
        want = _autograd_coef(lambda lp: gspo_loss(lp, old, adv, mask, eps, eps)[0], logprobs)
        torch.testing.assert_close(got[mask], want[mask])


def test_gspo_coefficient_of_another_token_substitutes_its_ratio():
    # one sequence of 2 tokens with log-ratios (0.1, 0.3): s = exp(0.2). Token v at position 0 with log-ratio
    # -0.1 gives s(v) = exp((−0.1 + 0.3) / 2) = exp(0.1); A = 2, no clip: coefficient −2·exp(0.1).
    sampled = torch.tensor([[0.1, 0.3]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    alt = torch.tensor([[[-0.1], [0.3]]], dtype=torch.float64)
    got = gspo_coef(alt, sampled, torch.tensor([2.0], dtype=torch.float64), mask, 10.0, 10.0)
    torch.testing.assert_close(got, torch.tensor([[[-2 * math.exp(0.1)], [-2 * math.exp(0.2)]]], dtype=torch.float64))
    # with eps_high = 0.15 the sampled sequence (s = e^0.2 > 1.15) is clipped, the substituted one (e^0.1) not
    got = gspo_coef(alt, sampled, torch.tensor([2.0], dtype=torch.float64), mask, 0.15, 0.15)
    torch.testing.assert_close(got, torch.tensor([[[-2 * math.exp(0.1)], [0.0]]], dtype=torch.float64))
