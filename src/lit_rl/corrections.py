"""Train–inference corrections: importance weights (TIS / MIS), mismatch diagnostics, score centering.

Pure tensor functions: no module state, no config objects.

Conventions:
    N: number of completions in the batch.
    T: padded response length.
    k: number of head tokens the rollout engine logged per position (its top-k).
    V: vocabulary size.
    ``mask``: bool (or 0/1 float) tensor [N, T] of valid response tokens (no prompt, no padding).
        Any nonzero entry counts as valid; masked positions may hold any value (even inf/NaN), they
        never reach a result or a metric.
    Log-probs (SPEC "Notation"):
        ``rollout_logprobs``: log μ = log π_b, what the rollout engine assigned to the sampled token.
        ``old_logprobs``: log π_old, the trainer's recomputation with the rollout's weights.
        ``logprobs``: log π_θ, the current trainer log-prob (with gradient).
    Every per-token "loss" returned here is the quantity to MINIMISE.
    Metrics dicts hold detached 0-dim float tensors (no host sync; call ``float()`` to log them).

Sources:
    TIS: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
        (fengyao.notion.site blog post).
    MIS: Liu et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the
        Training-Inference Mismatch" (blog post); verl's rollout correction (token / sequence masking).
    Mismatch decomposition r_num · r_stale and the three KLs: "Building Intuition for RL Systems"
        (shared/seeds/002); k3 KL estimator: Schulman 2020, "Approximating KL Divergence".
    Score centering: Marek & Ryabinin 2026, as condensed in shared/SPEC.md ("Train–inference
        corrections") and the slides in shared/seeds/000: s̄ = E_μ[∇log π] and its top-k form.
"""

from typing import Optional

import torch
from torch import Tensor

from lit_rl.objectives import masked_mean

LEVELS = ("token", "sequence")

# Below this trainer tail mass 1 − Σ_H π, the tail is treated as empty (ρ term = 0): a float32 π
# cannot resolve a smaller tail, and dividing by it would only amplify rounding noise.
TAIL_EPS = 1e-6


# ----------------------------------------------------------------------------------------------
# Importance weights: TIS and MIS
# ----------------------------------------------------------------------------------------------


def importance_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, level: str = "token") -> Tensor:
    """Train–inference importance weights w = π_train / π_b of the sampled tokens, without gradient.

    ``level="token"``: w_t = exp(old_logprobs_t − rollout_logprobs_t).
    ``level="sequence"``: one weight per sequence, the product of its valid token ratios
    w_i = exp(Σ_t valid (old_logprobs_t − rollout_logprobs_t)), broadcast over its tokens. (It can
    overflow to inf on long or very off-policy sequences; ``tis_weights`` caps it, ``mis_mask``
    drops it.)

    Args:
        old_logprobs: float [N, T], trainer log-probs (π_train; usually π_old). Detached here.
        rollout_logprobs: float [N, T], the rollout engine's log-probs (π_b). Detached here.
        mask: bool or 0/1 float [N, T].
        level: one of ``LEVELS``.

    Returns:
        float [N, T] (the inputs' promoted dtype, float32 for half precision), exactly 1 on padding,
        no gradient.

    Raises:
        ValueError: unknown ``level`` or shape mismatch.
    """
    log_w = _valid_log_ratio(old_logprobs, rollout_logprobs, mask)
    if level == "sequence":
        log_w = log_w.sum(-1, keepdim=True).expand_as(log_w)
    elif level != "token":
        raise ValueError(f"Unknown importance-weight level {level!r}; expected one of {LEVELS}")
    weights = torch.exp(log_w)
    return torch.where(mask.bool(), weights, torch.ones_like(weights))


def tis_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, cap: float = 2.0, level: str = "token"
) -> tuple[Tensor, dict]:
    """Truncated importance sampling (TIS, Yao et al. 2025): sg(min(w, cap)) per token.

    Multiply the per-token policy-gradient term by these weights (e.g. the advantage, or the
    ``coef`` of ``score_centered_loss`` for ``sc+tis``). TIS's truncation is not PPO's clip: it caps
    the weight, it never zeroes a token's gradient, and ``tis_clipfrac`` is not ``pg_clipfrac``.

    Args:
        old_logprobs: float [N, T], trainer log-probs π_train.
        rollout_logprobs: float [N, T], rollout engine log-probs π_b.
        mask: bool or 0/1 float [N, T].
        cap: truncation cap C > 0 (the fengyao post uses 2; large values such as 2048 only guard
            against outliers).
        level: ``"token"`` or ``"sequence"`` (see ``importance_weights``).

    Returns:
        (weights, metrics):
            weights: float [N, T], min(w, cap) on valid tokens, 1 on padding, no gradient.
            metrics (detached 0-dim tensors, means over valid tokens; at sequence level every token
            carries its sequence's weight, i.e. sequences count by length):
                ``"tis"``: mean w (untruncated); ``"tis_abs"``: mean |w − 1|;
                ``"tis_clipfrac"``: fraction of valid tokens with w > cap.
            All three are 0 when the mask is empty.

    Raises:
        ValueError: ``cap`` ≤ 0, unknown ``level`` or shape mismatch.
    """
    if not cap > 0:
        raise ValueError(f"TIS cap must be > 0, got {cap}")
    weights = importance_weights(old_logprobs, rollout_logprobs, mask, level)
    truncated = torch.where(mask.bool(), weights.clamp(max=cap), torch.ones_like(weights))
    metrics = {
        "tis": masked_mean(weights, mask),
        "tis_abs": masked_mean((weights - 1.0).abs(), mask),
        "tis_clipfrac": masked_mean((weights > cap).to(weights.dtype), mask),
    }
    return truncated, metrics


def mis_mask(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, low: float, high: float, level: str = "token"
) -> tuple[Tensor, dict]:
    """Masked importance sampling (MIS, Liu et al. 2025): drop tokens or sequences whose w leaves [low, high].

    A token (``level="token"``) or a whole sequence (``level="sequence"``, its product weight) is
    kept when low ≤ w ≤ high; a NaN weight is never kept. Use the returned mask in place of ``mask``
    in the loss reduction (keep the ORIGINAL mask for the reduction's denominators if the dropped
    tokens should still count, as verl does). The SPEC's band [1/C, C] is ``low=1/C, high=C``; a
    threshold on |log w| ≤ τ is ``low=exp(−τ), high=exp(τ)``.

    Args:
        old_logprobs: float [N, T], trainer log-probs π_train.
        rollout_logprobs: float [N, T], rollout engine log-probs π_b.
        mask: bool or 0/1 float [N, T].
        low: lower bound of the kept band, ≥ 0.
        high: upper bound of the kept band, ≥ ``low``.
        level: ``"token"`` or ``"sequence"``.

    Returns:
        (new_mask, metrics):
            new_mask: bool [N, T], a subset of ``mask``.
            metrics: {``"mis_maskfrac"``: detached 0-dim tensor, fraction of the valid tokens that
            were masked out (0 when the mask is empty)}.

    Raises:
        ValueError: ``low`` < 0 or ``high`` < ``low``, unknown ``level`` or shape mismatch.
    """
    if low < 0 or high < low:
        raise ValueError(f"MIS band needs 0 <= low <= high, got low={low}, high={high}")
    weights = importance_weights(old_logprobs, rollout_logprobs, mask, level)
    valid = mask.bool()
    keep = valid & (weights >= low) & (weights <= high)
    metrics = {"mis_maskfrac": masked_mean((valid & ~keep).to(weights.dtype), valid)}
    return keep, metrics


# ----------------------------------------------------------------------------------------------
# Diagnostics
# ----------------------------------------------------------------------------------------------


def mismatch_decomposition(rollout_logprobs: Tensor, old_logprobs: Tensor, logprobs: Tensor, mask: Tensor) -> dict:
    """Split the train–inference ratio p_c / p_b into numerical mismatch and staleness (SPEC "Notation").

    For one sampled token: p_b = π^rollout_{θ_b} (``rollout_logprobs``), p_o = π^train_{θ_b}
    (``old_logprobs``), p_c = π^train_{θ_c} (``logprobs``).
    r_num = p_o / p_b (same weights, two engines), r_stale = p_c / p_o (same engine, two weight
    versions), r_total = r_num · r_stale. Log r_num and r_stale separately: their product can sit
    near 1 while both are far from it (1.5 · 0.7 = 1.05).

    Args:
        rollout_logprobs: float [N, T], log p_b.
        old_logprobs: float [N, T], log p_o.
        logprobs: float [N, T], log p_c (detached here).
        mask: bool or 0/1 float [N, T].

    Returns:
        dict of detached 0-dim tensors, means over valid tokens (0 for an empty mask):
            ``"r_num_abs"``: mean |log r_num|.
            ``"r_stale_abs"``: mean |log r_stale|.
            ``"r_total_abs"``: mean |log r_total|.
            ``"logprob_abs_diff"``: mean |rollout_logprobs − old_logprobs| (equal to r_num_abs; kept
                under the SPEC's metric name).
            ``"train_inference_kl"``: k3 estimate of KL(μ || π_old) from tokens sampled by μ:
                mean of exp(d) − d − 1 with d = log p_o − log p_b (≥ 0, unbiased).

    Raises:
        ValueError: on shape mismatch.
    """
    log_r_num = _valid_log_ratio(old_logprobs, rollout_logprobs, mask)
    log_r_stale = _valid_log_ratio(logprobs, old_logprobs, mask)
    return {
        "r_num_abs": masked_mean(log_r_num.abs(), mask),
        "r_stale_abs": masked_mean(log_r_stale.abs(), mask),
        "r_total_abs": masked_mean((log_r_num + log_r_stale).abs(), mask),
        "logprob_abs_diff": masked_mean(log_r_num.abs(), mask),
        "train_inference_kl": masked_mean(torch.expm1(log_r_num) - log_r_num, mask),
    }


# ----------------------------------------------------------------------------------------------
# Score centering
# ----------------------------------------------------------------------------------------------


def score_centering_term(
    logprobs_head: Tensor, rollout_head_logprobs: Tensor, head_mask: Optional[Tensor] = None
) -> Tensor:
    """Top-k score-centering term Σ_{v∈H} sg(μ_v − ρ π_v) · log π_v, whose gradient is s̄ = E_μ[∇log π].

    Under mismatch the token is sampled from μ but scored through π, so s̄ = Σ_v μ_v ∇log π_v ≠ 0.
    With only the engine's head H (its top-k) logged, the tail is filled with the trainer, rescaled:
    μ_v ≈ ρ π_v for v ∉ H, ρ = (1 − Σ_H μ) / (1 − Σ_H π). Since Σ_v π_v ∇log π_v = 0,
    s̄ = Σ_{v∈H} (μ_v − ρ π_v) ∇log π_v: only k terms. ρ and π_v sit inside the stop-gradient, so
    the gradient of this term is exactly that estimate of s̄.

    Only the gradient is meaningful: the value is a surrogate (with the full vocabulary as head it
    differs from ``exact_score_centering_term``'s value by Σ_v π_v log π_v, which has no gradient
    under sg(π)).

    Edge cases:
        * Trainer tail 1 − Σ_H π ≤ ``TAIL_EPS`` (the head covers the whole support, e.g. k = V):
          the ρ term is 0 and the result is Σ_H μ_v log π_v, the exact s̄ when H is everything.
        * ρ uses max(1 − Σ_H μ, 0), so an engine head that sums past 1 by rounding gives ρ = 0.
        * An entry is used only if ``head_mask`` keeps it, its trainer log-prob is finite and its
          engine log-prob is not NaN. An engine log-prob of −inf is kept (μ_v = 0 is exact);
          a trainer log-prob of −inf (outside the trainer's support) is dropped, as are padding
          entries: mask out duplicate padding ids, or Σ_H π double-counts them.
        * ρ and the head sums are computed in float64 (k numbers per token).

    Args:
        logprobs_head: float [N, T, k], trainer log π_v at the head ids (WITH gradient), at the
            sampler's temperature.
        rollout_head_logprobs: float [N, T, k], the engine's log μ_v of the same ids (its recorded
            top-k). Detached here.
        head_mask: optional bool [N, T, k], True for the head entries to USE (same convention as
            ``mask``); None uses every entry with finite logprobs.

    Returns:
        float [N, T] (dtype of ``logprobs_head``), with gradient through ``logprobs_head`` only.
        Padding positions are not masked: reduce with the token mask.

    Raises:
        ValueError: on shape mismatch or if the inputs are not 3-D.
    """
    if logprobs_head.dim() != 3:
        raise ValueError(f"logprobs_head must be [N, T, k], got shape {tuple(logprobs_head.shape)}")
    _check_same_shape(logprobs_head, rollout_head_logprobs, "logprobs_head", "rollout_head_logprobs")
    rollout_head_logprobs = rollout_head_logprobs.detach()
    valid = torch.isfinite(logprobs_head.detach()) & ~torch.isnan(rollout_head_logprobs)
    if head_mask is not None:
        _check_same_shape(logprobs_head, head_mask, "logprobs_head", "head_mask")
        valid = valid & head_mask.bool()

    zeros = torch.zeros_like(logprobs_head, dtype=torch.float64)
    pi = torch.where(valid, logprobs_head.detach().double().exp(), zeros)
    mu = torch.where(valid, rollout_head_logprobs.double().exp(), zeros)
    tail_pi = 1.0 - pi.sum(-1, keepdim=True)
    tail_mu = (1.0 - mu.sum(-1, keepdim=True)).clamp(min=0.0)
    has_tail = tail_pi > TAIL_EPS
    rho = torch.where(has_tail, tail_mu / torch.where(has_tail, tail_pi, torch.ones_like(tail_pi)), 0.0)
    weights = (mu - rho * pi).to(logprobs_head.dtype)

    # Zero the unused entries before multiplying, so no -inf / NaN reaches the forward or backward.
    safe_logprobs = torch.where(valid, logprobs_head, torch.zeros_like(logprobs_head))
    return (weights * safe_logprobs).sum(-1)


def score_centered_loss(
    logprobs: Tensor,
    logprobs_head: Tensor,
    rollout_head_logprobs: Tensor,
    coef: Tensor,
    head_mask: Optional[Tensor] = None,
) -> Tensor:
    """Per-token score-centred loss L_t = −coef · [log π(y_t) − Σ_H sg(μ_v − ρ π_v) log π_v].

    Its gradient is −coef · (∇log π(y_t) − s̄): the plain REINFORCE gradient minus the drift a
    sampler/trainer mismatch adds (SPEC vector 14: with a constant reward its expectation under μ is
    0, while plain REINFORCE drifts by coef · s̄). Additive, no hyperparameter; composes with TIS
    (coef = w_TIS · A) and MIS (reduce with the MIS mask). For PPO pass coef = A · r where the clip
    does not bind and 0 where it does (the clipped surrogate's gradient is A · r · ∇log π).

    Args:
        logprobs: float [N, T], trainer log π(y_t) of the sampled tokens (with gradient), computed
            like ``logprobs_head`` (same temperature).
        logprobs_head: float [N, T, k], trainer log-probs at the engine's head ids (with gradient).
        rollout_head_logprobs: float [N, T, k], engine log-probs of the head ids.
        coef: float [N] (broadcast over tokens) or [N, T]; treated as a constant (detached).
        head_mask: optional bool [N, T, k], True for head entries to use (see
            ``score_centering_term``).

    Returns:
        float [N, T] loss to minimise; padding is not masked, reduce with the token mask.

    Raises:
        ValueError: on shape mismatch.
    """
    if logprobs_head.shape[:2] != logprobs.shape:
        raise ValueError(
            f"logprobs_head must be [N, T, k] for logprobs of shape {tuple(logprobs.shape)},"
            f" got {tuple(logprobs_head.shape)}"
        )
    coef = coef.detach()
    if coef.dim() == 1 and coef.shape[0] == logprobs.shape[0]:
        coef = coef.unsqueeze(-1)
    elif coef.shape != logprobs.shape:
        raise ValueError(
            f"coef must be [N] or [N, T] for logprobs of shape {tuple(logprobs.shape)}, got {tuple(coef.shape)}"
        )
    centering = score_centering_term(logprobs_head, rollout_head_logprobs, head_mask)
    return -coef * (logprobs - centering)


def exact_score_centering_term(logits_train: Tensor, rollout_logprobs_full: Tensor) -> Tensor:
    """Exact score-centering term over the FULL vocabulary: Σ_v sg(μ_v − π_v) · log π_v.

    π = softmax(logits_train) (gradient flows through log π), μ = exp(rollout_logprobs_full).
    Since Σ_v π_v ∇log π_v = 0, its gradient is s̄ = Σ_v μ_v ∇log π_v; wrt the logits it is μ − π
    (for a μ that sums to 1). With μ = π it is 0 (SPEC vector 14). The reference for the top-k
    estimator ``score_centering_term``; too big to log in production (V floats per token).

    Vocabulary entries with π_v = 0 (logits of −inf, e.g. ``process_logits`` output, which may be
    passed directly: log_softmax of log-probs is the identity) are left out, whatever μ_v is.

    Args:
        logits_train: float [N, T, V], trainer logits (or log-probs) of the distribution the
            sampler draws from, i.e. already divided by the temperature (with gradient).
        rollout_logprobs_full: float [N, T, V], the engine's full log-probs (detached here).

    Returns:
        float [N, T] (float32 for half-precision logits), with gradient through ``logits_train``.

    Raises:
        ValueError: on shape mismatch.
    """
    _check_same_shape(logits_train, rollout_logprobs_full, "logits_train", "rollout_logprobs_full")
    if logits_train.dtype in (torch.float16, torch.bfloat16):
        logits_train = logits_train.float()
    log_pi = torch.log_softmax(logits_train, dim=-1)
    valid = torch.isfinite(log_pi.detach())
    weights = rollout_logprobs_full.detach().to(log_pi.dtype).exp() - log_pi.detach().exp()
    safe_log_pi = torch.where(valid, log_pi, torch.zeros_like(log_pi))
    return torch.where(valid, weights, torch.zeros_like(weights)).mul(safe_log_pi).sum(-1)


# ----------------------------------------------------------------------------------------------
# Internal helpers
# ----------------------------------------------------------------------------------------------


def _valid_log_ratio(numerator: Tensor, denominator: Tensor, mask: Tensor) -> Tensor:
    """Detached numerator − denominator on valid tokens, 0 on padding (whatever it holds); float32 for half."""
    _check_same_shape(numerator, denominator, "numerator", "denominator")
    _check_same_shape(numerator, mask, "logprobs", "mask")
    log_ratio = numerator.detach() - denominator.detach()
    if log_ratio.dtype in (torch.float16, torch.bfloat16):
        log_ratio = log_ratio.float()
    return torch.where(mask.bool(), log_ratio, torch.zeros_like(log_ratio))


def _check_same_shape(a: Tensor, b: Tensor, name_a: str, name_b: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{name_a} and {name_b} must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
