"""Value tests for lit_rl.corrections (SPEC.md test vectors 10, 11, 14; TIS, MIS, score centering)."""

import math

import pytest
import torch

from lit_rl.corrections import (
    centering_term,
    exact_score_centering_term,
    importance_weights,
    mis_mask,
    mismatch_decomposition,
    score_centered_loss,
    score_centering_term,
    tis_weights,
)
from lit_rl.objectives import ppo_clip_loss

NAN, INF = float("nan"), float("inf")


def log(values, dtype=torch.float64):
    return torch.tensor(values, dtype=dtype).log()


def padded(values, pad, dtype=torch.float64):
    """Rows of log(values) right-padded with ``pad`` log-values, and the matching bool mask."""
    width = max(len(row) for row in values)
    rows = [list(map(math.log, row)) + [pad] * (width - len(row)) for row in values]
    mask = torch.tensor([[True] * len(row) + [False] * (width - len(row)) for row in values])
    return torch.tensor(rows, dtype=dtype), mask


# ----------------------------------------------------------------------------------------------
# SPEC vector 10: mismatch decomposition
# ----------------------------------------------------------------------------------------------


def test_mismatch_decomposition_vector_10():
    mask = torch.tensor([[True, False]])
    # p_b = 0.40, p_o = 0.60, p_c = 0.66; the padding column holds garbage.
    rollout = torch.tensor([[math.log(0.40), NAN]], dtype=torch.float64)
    old = torch.tensor([[math.log(0.60), INF]], dtype=torch.float64)
    current = torch.tensor([[math.log(0.66), -INF]], dtype=torch.float64, requires_grad=True)
    out = mismatch_decomposition(rollout, old, current, mask)

    assert out["r_num_abs"].item() == pytest.approx(math.log(1.5))  # r_num = 1.5
    assert out["r_stale_abs"].item() == pytest.approx(math.log(1.1))  # r_stale = 1.1
    assert out["r_total_abs"].item() == pytest.approx(math.log(1.65))  # r_total = 1.65
    assert out["logprob_abs_diff"].item() == pytest.approx(math.log(1.5))
    # k3 of KL(mu || pi_old) with d = log(p_o / p_b): exp(d) - d - 1.
    assert out["train_inference_kl"].item() == pytest.approx(1.5 - math.log(1.5) - 1.0)
    # KL(pi_old || mu) = E_mu[w log w] with w = 1.5, written w log w - (w - 1) per token
    assert out["train_inference_kl_reverse"].item() == pytest.approx(1.5 * math.log(1.5) - 0.5)
    assert all(v.grad_fn is None and v.dim() == 0 for v in out.values())


def test_mismatch_decomposition_cancellation():
    # r_num = 1.5 and r_stale = 0.7 give r_total = 1.05: the product hides two large deviations.
    mask = torch.ones(1, 1, dtype=torch.bool)
    p_b, p_o = 0.40, 0.60
    p_c = p_o * 0.7
    out = mismatch_decomposition(log([[p_b]]), log([[p_o]]), log([[p_c]]), mask)
    assert math.exp(out["r_num_abs"].item()) == pytest.approx(1.5)
    assert math.exp(-out["r_stale_abs"].item()) == pytest.approx(0.7)
    assert math.exp(out["r_total_abs"].item()) == pytest.approx(1.05)
    assert out["r_num_abs"].item() > 0.4 and out["r_stale_abs"].item() > 0.35
    assert out["r_total_abs"].item() < 0.05


def test_mismatch_decomposition_means_and_empty_mask():
    rollout = log([[0.5, 0.5], [0.5, 0.5]])
    old = log([[0.5, 0.25], [1.0, 0.5]])  # |log r_num| = 0, log 2, log 2, 0
    mask = torch.tensor([[True, True], [True, False]])
    out = mismatch_decomposition(rollout, old, old, mask)
    assert out["r_num_abs"].item() == pytest.approx(2 * math.log(2) / 3)
    assert out["r_stale_abs"].item() == 0.0
    empty = mismatch_decomposition(rollout, old, old, torch.zeros_like(mask))
    assert all(v.item() == 0.0 for v in empty.values())


# ----------------------------------------------------------------------------------------------
# SPEC vector 11: the rollout log-probs as PPO denominator clip tokens before any update
# ----------------------------------------------------------------------------------------------


def test_rollout_denominator_clips_before_any_update_vector_11():
    # Correct token: p_b 0.4, p_train 0.6, A = +1. Wrong token: p_b 0.6, p_train 0.4, A = -1.
    logprobs = log([[0.6, 0.4]]).requires_grad_()
    rollout_logprobs = log([[0.4, 0.6]])
    advantages = torch.tensor([[1.0, -1.0]], dtype=torch.float64)

    loss, clipped_low, clipped_high = ppo_clip_loss(logprobs, rollout_logprobs, advantages, 0.2, 0.2)
    ratio = torch.exp(logprobs - rollout_logprobs).detach()
    torch.testing.assert_close(ratio, torch.tensor([[1.5, 2 / 3]], dtype=torch.float64))
    # The loss is -ℓ: ℓ = 1.2 for the correct token, -0.8 for the wrong one.
    torch.testing.assert_close(loss.detach(), torch.tensor([[-1.2, 0.8]], dtype=torch.float64))
    assert clipped_high.tolist() == [[True, False]] and clipped_low.tolist() == [[False, True]]
    loss.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.zeros_like(logprobs))  # both lost their gradient

    # lit_rl's choice: pi_old (the trainer's own forward) is the PPO denominator, so r = 1 and both
    # tokens keep their gradient; the gap to the engine enters only as a TIS weight.
    logprobs.grad = None
    mask = torch.ones_like(logprobs, dtype=torch.bool)
    weights, _ = tis_weights(logprobs.detach(), rollout_logprobs, mask, cap=2.0)
    torch.testing.assert_close(weights, torch.tensor([[1.5, 2 / 3]], dtype=torch.float64))
    loss, _, _ = ppo_clip_loss(logprobs, logprobs.detach(), advantages, 0.2, 0.2)
    (weights * loss).sum().backward()
    torch.testing.assert_close(logprobs.grad, -weights * advantages)


# ----------------------------------------------------------------------------------------------
# TIS
# ----------------------------------------------------------------------------------------------


def test_tis_token_level_values_truncation_and_metrics():
    old, mask = padded([[0.5, 1.0, 3.0]], pad=INF)
    old = torch.cat([old, torch.tensor([[NAN]], dtype=torch.float64)], dim=1)
    mask = torch.cat([mask, torch.tensor([[False]])], dim=1)
    rollout = torch.zeros_like(old)
    weights, metrics = tis_weights(old, rollout, mask, cap=2.0)

    torch.testing.assert_close(weights, torch.tensor([[0.5, 1.0, 2.0, 1.0]], dtype=torch.float64))
    assert metrics["tis"].item() == pytest.approx(1.5)  # untruncated mean
    assert metrics["tis_abs"].item() == pytest.approx((0.5 + 0.0 + 2.0) / 3)
    assert metrics["tis_clipfrac"].item() == pytest.approx(1 / 3)
    torch.testing.assert_close(
        importance_weights(old, rollout, mask), torch.tensor([[0.5, 1.0, 3.0, 1.0]], dtype=torch.float64)
    )


def test_tis_is_stop_gradient_and_ignores_padding():
    old = log([[0.5, 1.0, 3.0, 7.0]]).requires_grad_()
    rollout = torch.zeros(1, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, True, True, False]])
    weights, metrics = tis_weights(old, rollout, mask, cap=2.0)
    assert weights.grad_fn is None and not weights.requires_grad
    assert all(v.grad_fn is None for v in metrics.values())

    for garbage in (NAN, INF, -INF, 123.0):
        other = old.detach().clone()
        other[0, 3] = garbage
        w2, m2 = tis_weights(other, rollout, mask, cap=2.0)
        torch.testing.assert_close(w2, weights)
        assert {k: v.item() for k, v in m2.items()} == {k: v.item() for k, v in metrics.items()}


def test_tis_sequence_level():
    # Row 0: token ratios 2 and 1.5 -> sequence weight 3 (capped at 2). Row 1: 0.5 and 1 -> 0.5.
    old, mask = padded([[2.0, 1.5], [0.5, 1.0]], pad=0.0)
    old = torch.cat([old, torch.full((2, 1), 50.0, dtype=torch.float64)], dim=1)  # padding column
    mask = torch.cat([mask, torch.zeros(2, 1, dtype=torch.bool)], dim=1)
    rollout = torch.zeros_like(old)

    raw = importance_weights(old, rollout, mask, level="sequence")
    torch.testing.assert_close(raw, torch.tensor([[3.0, 3.0, 1.0], [0.5, 0.5, 1.0]], dtype=torch.float64))
    weights, metrics = tis_weights(old, rollout, mask, cap=2.0, level="sequence")
    torch.testing.assert_close(weights, torch.tensor([[2.0, 2.0, 1.0], [0.5, 0.5, 1.0]], dtype=torch.float64))
    # Means over valid tokens: each token carries its sequence's weight.
    assert metrics["tis"].item() == pytest.approx((3 + 3 + 0.5 + 0.5) / 4)
    assert metrics["tis_abs"].item() == pytest.approx((2 + 2 + 0.5 + 0.5) / 4)
    assert metrics["tis_clipfrac"].item() == pytest.approx(0.5)


def test_tis_empty_mask_and_errors():
    old = torch.zeros(2, 3)
    weights, metrics = tis_weights(old, old, torch.zeros(2, 3, dtype=torch.bool))
    torch.testing.assert_close(weights, torch.ones(2, 3))
    assert all(v.item() == 0.0 for v in metrics.values())
    with pytest.raises(ValueError, match="cap"):
        tis_weights(old, old, torch.ones(2, 3, dtype=torch.bool), cap=0.0)
    with pytest.raises(ValueError, match="level"):
        importance_weights(old, old, torch.ones(2, 3, dtype=torch.bool), level="trajectory")
    with pytest.raises(ValueError, match="shape"):
        importance_weights(old, torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool))


def test_importance_weights_half_precision_is_float32():
    old = torch.tensor([[0.1, 0.2]], dtype=torch.bfloat16)
    weights = importance_weights(old, torch.zeros_like(old), torch.ones(1, 2, dtype=torch.bool))
    assert weights.dtype == torch.float32


# ----------------------------------------------------------------------------------------------
# MIS
# ----------------------------------------------------------------------------------------------


def test_mis_token_level_band():
    old, mask = padded([[0.4, 0.5, 1.0, 2.0, 2.5]], pad=0.0)
    old = torch.cat([old, torch.tensor([[NAN, 0.0]], dtype=torch.float64)], dim=1)
    mask = torch.cat([mask, torch.tensor([[True, False]])], dim=1)  # a NaN weight is never kept
    keep, metrics = mis_mask(old, torch.zeros_like(old), mask, low=0.5, high=2.0)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [[False, True, True, True, False, False, False]]
    assert metrics["mis_maskfrac"].item() == pytest.approx(3 / 6)
    assert metrics["mis_maskfrac"].grad_fn is None


def test_mis_sequence_level():
    # Sequence weights: 2 * 1.5 = 3 (out), 0.5 * 1 = 0.5 (in), 0.9 * 0.9 * 0.9 = 0.729 (in).
    old, mask = padded([[2.0, 1.5], [0.5, 1.0], [0.9, 0.9, 0.9]], pad=-INF)
    rollout = torch.zeros_like(old)
    keep, metrics = mis_mask(old, rollout, mask, low=0.5, high=2.0, level="sequence")
    assert keep.tolist() == [[False, False, False], [True, True, False], [True, True, True]]
    assert metrics["mis_maskfrac"].item() == pytest.approx(2 / 7)

    # The SPEC's |log w| threshold is the band [exp(-tau), exp(tau)].
    tau = math.log(1.2)
    keep, metrics = mis_mask(old, rollout, mask, low=math.exp(-tau), high=math.exp(tau), level="sequence")
    assert keep.tolist() == [[False, False, False], [False, False, False], [False, False, False]]
    assert metrics["mis_maskfrac"].item() == pytest.approx(1.0)


def test_mis_empty_mask_and_errors():
    old = torch.zeros(2, 3)
    keep, metrics = mis_mask(old, old, torch.zeros(2, 3, dtype=torch.bool), 0.5, 2.0)
    assert not keep.any() and metrics["mis_maskfrac"].item() == 0.0
    with pytest.raises(ValueError, match="low"):
        mis_mask(old, old, torch.ones(2, 3, dtype=torch.bool), 2.0, 0.5)


# ----------------------------------------------------------------------------------------------
# Score centering (SPEC vector 14)
# ----------------------------------------------------------------------------------------------


def logits_grad(term, logits):
    (grad,) = torch.autograd.grad(term.sum(), logits, retain_graph=True)
    return grad


def head_of(logits, rollout_logprobs_full, head_ids):
    """(trainer log-probs at head ids, with gradient; engine log-probs at the same ids)."""
    logprobs_full = torch.log_softmax(logits, dim=-1)
    return logprobs_full.gather(-1, head_ids), rollout_logprobs_full.gather(-1, head_ids)


def test_exact_term_on_policy_is_zero_vector_14():
    g = torch.Generator().manual_seed(0)
    logits = (2.0 * torch.randn(2, 3, 50, generator=g)).requires_grad_()
    mu_logprobs = torch.log_softmax(logits.detach(), dim=-1)
    term = exact_score_centering_term(logits, mu_logprobs)
    torch.testing.assert_close(term.detach(), torch.zeros(2, 3), atol=1e-6, rtol=0)
    torch.testing.assert_close(logits_grad(term, logits), torch.zeros_like(logits), atol=1e-6, rtol=0)


def test_exact_term_gradient_is_mu_minus_pi():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 50, generator=g, dtype=torch.float64).requires_grad_()
    mu_logprobs = torch.log_softmax(logits.detach() + 0.5 * torch.randn(2, 3, 50, generator=g, dtype=torch.float64), -1)
    grad = logits_grad(exact_score_centering_term(logits, mu_logprobs), logits)
    torch.testing.assert_close(grad, mu_logprobs.exp() - torch.softmax(logits.detach(), -1))


def test_topk_with_full_vocabulary_equals_exact():
    g = torch.Generator().manual_seed(2)
    vocab = 50
    logits = (2.0 * torch.randn(2, 3, vocab, generator=g, dtype=torch.float64)).requires_grad_()
    noise = 0.3 * torch.randn(2, 3, vocab, generator=g, dtype=torch.float64)
    mu_logprobs = torch.log_softmax(logits.detach() + noise, dim=-1)
    # Head = the whole vocabulary, in a shuffled order per position.
    head_ids = torch.stack([torch.randperm(vocab, generator=g) for _ in range(6)]).view(2, 3, vocab)

    exact = exact_score_centering_term(logits, mu_logprobs)
    topk = score_centering_term(*head_of(logits, mu_logprobs, head_ids))
    # The values differ by sum_v pi_v log pi_v (a constant under sg(pi), zero gradient); the gradients agree.
    torch.testing.assert_close(logits_grad(topk, logits), logits_grad(exact, logits), rtol=1e-10, atol=1e-12)


def test_topk_head_with_float32_full_support_has_no_nan():
    # Head covers everything in float32: 1 - sum_H pi is rounding noise, the rho term must be 0.
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 5, 20, generator=g).requires_grad_()
    mu_logprobs = torch.log_softmax(logits.detach() + 0.1 * torch.randn(4, 5, 20, generator=g), dim=-1)
    head_ids = torch.arange(20).expand(4, 5, 20)
    term = score_centering_term(*head_of(logits, mu_logprobs, head_ids))
    grad = logits_grad(term, logits)
    assert torch.isfinite(term).all() and torch.isfinite(grad).all()
    torch.testing.assert_close(grad, mu_logprobs.exp() - torch.softmax(logits.detach(), -1), atol=1e-6, rtol=0)


def test_topk_ignores_masked_and_infinite_entries():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(1, 2, 10, generator=g, dtype=torch.float64).requires_grad_()
    mu_logprobs = torch.log_softmax(logits.detach() + 0.5 * torch.randn(1, 2, 10, generator=g, dtype=torch.float64), -1)
    head_ids = torch.tensor([[[0, 1, 2, 0, 0], [3, 4, 5, 3, 3]]])  # last two entries: duplicate padding ids
    head_mask = torch.tensor([[[True, True, True, False, False]] * 2]).view(1, 2, 5)
    lp_head, mu_head = head_of(logits, mu_logprobs, head_ids)
    mu_head = mu_head.clone()
    mu_head[..., 3] = -INF  # padding with -inf logprobs
    mu_head[..., 4] = NAN
    reference = score_centering_term(lp_head[..., :3], mu_head[..., :3])
    term = score_centering_term(lp_head, mu_head, head_mask)
    torch.testing.assert_close(term, reference)
    torch.testing.assert_close(logits_grad(term, logits), logits_grad(reference, logits))

    # A trainer log-prob of -inf (outside its support) is dropped, without NaN in value or gradient.
    lp_inf = torch.cat([lp_head[..., :3], torch.full_like(lp_head[..., :1], -INF)], dim=-1)
    mu_4 = torch.cat([mu_head[..., :3], torch.full_like(mu_head[..., :1], math.log(0.01))], dim=-1)
    term = score_centering_term(lp_inf, mu_4)
    assert torch.isfinite(term).all() and torch.isfinite(logits_grad(term, logits)).all()


def test_topk_gradient_matches_the_formula():
    # s_hat wrt logits = sum_{v in H} (mu_v - rho pi_v)(onehot(v) - pi), rho = (1 - sum_H mu) / (1 - sum_H pi).
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 3, 30, generator=g, dtype=torch.float64).requires_grad_()
    mu_logprobs = torch.log_softmax(logits.detach() + 0.5 * torch.randn(2, 3, 30, generator=g, dtype=torch.float64), -1)
    head_ids = mu_logprobs.topk(6, dim=-1).indices
    grad = logits_grad(score_centering_term(*head_of(logits, mu_logprobs, head_ids)), logits)

    pi, mu = torch.softmax(logits.detach(), -1), mu_logprobs.exp()
    pi_h, mu_h = pi.gather(-1, head_ids), mu.gather(-1, head_ids)
    rho = (1 - mu_h.sum(-1, keepdim=True)) / (1 - pi_h.sum(-1, keepdim=True))
    coef = mu_h - rho * pi_h
    expected = torch.zeros_like(pi).scatter(-1, head_ids, coef) - coef.sum(-1, keepdim=True) * pi
    torch.testing.assert_close(grad, expected)


def test_topk_32_on_tiny_model_matches_exact(tiny):
    model, tokenizer = tiny
    ids = torch.tensor([tokenizer("The answer is 42 because")["input_ids"]])
    with torch.no_grad():
        raw = model(input_ids=ids).logits.float()
    # The random-init tiny model is nearly uniform over 49152 tokens; a sharp sampling temperature
    # gives it the peaked shape of a trained LM (top-32 holds > 99% of the mass here).
    logits = (raw / 0.02).requires_grad_()
    g = torch.Generator().manual_seed(0)
    mu_logprobs = torch.log_softmax(logits.detach() + 0.05 * torch.randn(logits.shape, generator=g), dim=-1)
    head_ids = mu_logprobs.topk(32, dim=-1).indices  # the engine's top-k

    exact = logits_grad(exact_score_centering_term(logits, mu_logprobs), logits)
    topk = logits_grad(score_centering_term(*head_of(logits, mu_logprobs, head_ids)), logits)
    assert exact.norm() > 1e-3  # there is a mismatch to correct
    assert ((topk - exact).norm() / exact.norm()).item() < 0.01


def test_score_centered_loss_gradient_is_coef_times_centred_score():
    g = torch.Generator().manual_seed(6)
    n, t, vocab = 2, 3, 50
    logits = torch.randn(n, t, vocab, generator=g, dtype=torch.float64).requires_grad_()
    noise = 0.5 * torch.randn(n, t, vocab, generator=g, dtype=torch.float64)
    mu_logprobs = torch.log_softmax(logits.detach() + noise, -1)
    y = torch.multinomial(mu_logprobs.exp().view(-1, vocab), 1, generator=g).view(n, t)
    pi, mu = torch.softmax(logits.detach(), -1), mu_logprobs.exp()
    onehot = torch.nn.functional.one_hot(y, vocab).to(pi.dtype)

    for coef in (torch.tensor([1.5, -0.5], dtype=torch.float64), torch.randn(n, t, generator=g, dtype=torch.float64)):
        coef = coef.requires_grad_()
        head_ids = torch.arange(vocab).expand(n, t, vocab)  # full head: s_bar = mu - pi exactly
        logprobs = torch.log_softmax(logits, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
        loss = score_centered_loss(logprobs, *head_of(logits, mu_logprobs, head_ids), coef)
        assert loss.shape == (n, t)
        grad = logits_grad(loss, logits)
        c = coef.detach() if coef.dim() == 2 else coef.detach().unsqueeze(-1)
        # -coef * ((onehot(y) - pi) - (mu - pi))
        expected = -c.unsqueeze(-1) * ((onehot - pi) - (mu - pi))
        torch.testing.assert_close(grad, expected)
        assert coef.grad is None  # coef is a constant


def test_score_centered_loss_rejects_bad_coef():
    logprobs = torch.zeros(2, 3)
    head = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="coef"):
        score_centered_loss(logprobs, head, head, torch.zeros(3))


def monte_carlo_gradients(logits, mu_probs, num_samples, generator, centred):
    """Per-sample gradients wrt the logits (ascent direction) of A * score, A = 1, y ~ mu."""
    vocab = logits.shape[-1]
    y = torch.multinomial(mu_probs, num_samples, replacement=True, generator=generator).view(num_samples, 1)
    z = logits.detach().expand(num_samples, 1, vocab).clone().requires_grad_()
    logprobs = torch.log_softmax(z, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)  # [S, 1]
    coef = torch.ones(num_samples, dtype=logits.dtype)
    if centred:
        head_ids = torch.arange(vocab).expand(num_samples, 1, vocab)
        rollout_full = mu_probs.log().expand(num_samples, 1, vocab)
        loss = score_centered_loss(logprobs, *head_of(z, rollout_full, head_ids), coef)
    else:
        loss = -coef.unsqueeze(-1) * logprobs
    (grad,) = torch.autograd.grad(loss.sum(), z)
    return -grad.view(num_samples, vocab)


def mean_and_standard_error_norm(samples):
    mean = samples.mean(0)
    standard_error = samples.std(0) / math.sqrt(samples.shape[0])
    return mean.norm().item(), standard_error.norm().item()


def test_constant_reward_drift_plain_vs_score_centred_vector_14():
    # Toy categorical over V = 20 with logits z as the parameter; the sampler mu != pi.
    g = torch.Generator().manual_seed(7)
    vocab, num_samples = 20, 20000
    logits = torch.randn(vocab, generator=g, dtype=torch.float64)
    mu_probs = torch.softmax(logits + 0.5 * torch.randn(vocab, generator=g, dtype=torch.float64), -1)
    pi = torch.softmax(logits, -1)

    plain = monte_carlo_gradients(logits, mu_probs, num_samples, g, centred=False)
    mean, se = mean_and_standard_error_norm(plain)
    assert mean > 10 * se  # plain REINFORCE drifts by s_bar under a constant reward ...
    torch.testing.assert_close(plain.mean(0), mu_probs - pi, atol=5 * se, rtol=0)

    centred = monte_carlo_gradients(logits, mu_probs, num_samples, g, centred=True)
    mean, se = mean_and_standard_error_norm(centred)
    assert mean < 3 * se  # ... score centering does not

    # On-policy (mu = pi) the plain estimator has zero mean too.
    on_policy = monte_carlo_gradients(logits, pi, num_samples, g, centred=False)
    mean, se = mean_and_standard_error_norm(on_policy)
    assert mean < 3 * se


def test_sampled_tail_averaged_over_its_draws_is_the_exact_centring_and_the_rescaled_tail_is_not():
    # V = 6, a head of k = 2, one tail sample: (1 − Σ_H μ) ∇log π_u averaged over u ~ μ_tail is the tail's part of
    # E_μ[∇log π] exactly, so the head plus the sampled tail is the full centring vector in expectation
    g = torch.Generator().manual_seed(3)
    vocab, k = 6, 2
    logits = torch.randn(1, 1, vocab, generator=g, dtype=torch.float64).requires_grad_()
    mu = torch.log_softmax(logits.detach() + 0.8 * torch.randn(1, 1, vocab, generator=g, dtype=torch.float64), -1)
    logpi = torch.log_softmax(logits, -1)
    head = mu.topk(k, -1).indices
    tail = [v for v in range(vocab) if v not in head.flatten().tolist()]
    mu_tail = mu.exp()[0, 0, tail] / mu.exp()[0, 0, tail].sum()
    (exact,) = torch.autograd.grad(exact_score_centering_term(logits, mu).sum(), logits)
    average = torch.zeros_like(exact)
    for u, p in zip(tail, mu_tail.tolist()):
        ids = torch.cat([head, torch.tensor([[[u]]])], -1)
        logpi = torch.log_softmax(logits, -1)  # a fresh graph per draw
        term = centering_term(logpi.gather(-1, ids), mu.gather(-1, ids), tail_samples=1)
        average += p * torch.autograd.grad(term.sum(), logits)[0]
    torch.testing.assert_close(average, exact, rtol=0, atol=1e-12)
    logpi = torch.log_softmax(logits, -1)
    rescaled = score_centering_term(logpi.gather(-1, head), mu.gather(-1, head))
    (rescaled,) = torch.autograd.grad(rescaled.sum(), logits)
    assert float((rescaled - exact).abs().max()) > 1e-3  # μ's tail is not proportional to π's here
    with pytest.raises(ValueError, match=r"tail_samples must lie in \[0, 3\]"):
        centering_term(logpi.gather(-1, ids), mu.gather(-1, ids), tail_samples=4)
