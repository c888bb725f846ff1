"""The probe's ``conditional`` mode: each correction's drift under a constant advantage, with no token noise.

With every advantage A = 1 the true gradient is 0, and what a correction's batch gradient keeps is drift. The
sampled token y_t ~ μ(·|h_t) is the only randomness inside a prefix, so the drift's expectation given the prefix
is a sum over the vocabulary, computable from the sampler's full distribution μ(h) and the trainer's π(h):

    E_{y~μ}[c · w_y ∇log π_y | h] = Σ_v q_v ∇log π_v,   q_v = c_v μ_v w_v,   w_v = f(π_v / μ_v),

c_v the objective's coefficient ∂ℓ/∂log π had v been sampled (−A at ratio 1 for every clipped or plain policy
gradient; ``Algorithm.score_coefficients``) and f the correction's weight (``corrections.WeightFunction``). Per
correction, in the ascent direction (−q/c; the trainer's ``.grad`` is the minimised loss's, the opposite sign):

- none: Σ_v μ_v ∇log π_v = s̄, the sampler's expected score (the drift score centering exists to remove).
- TIS (cap C): Σ_v min(π_v, C μ_v) ∇log π_v = −Σ_v (π_v − C μ_v)_+ ∇log π_v, because Σ_v π_v ∇log π_v = 0:
  zero while the cap does not bind, and otherwise the capped tokens' excess, pointing away from them.
- MIS weighted (band [l, h]): Σ_v π_v 1[l ≤ π_v/μ_v ≤ h] ∇log π_v = −Σ_{v masked} π_v ∇log π_v; mask-only
  Σ_v μ_v 1[l ≤ π_v/μ_v ≤ h] ∇log π_v.
- SC (and sc+X) with the full vocabulary as head: exactly 0 (the centring term is this very sum).
- SC with the engine's top-k head H (tail filled with the trainer, rescaled; ``corrections.centering_term``):
  the residual Σ_{v∉H} (c_v μ_v w_v − c_tail α π_v) ∇log π_v, α = ρ f(1/ρ), ρ = (1 − Σ_H μ) / (1 − Σ_H π)
  (α = 0 when the trainer's tail is below ``corrections.TAIL_EPS``, as there). Zero when k = V.

One backward of the soft-target surrogate Σ_t red_t Σ_v sg(q_{t,v}) log π_{t,v} (the step's reduction ``red_t``
of ``objectives.reduce_loss``) gives Σ_t red_t E[ĝ_t | h_t] for a whole batch; averaging over batches of sampled
prefixes then estimates E_μ[ĝ] without the token-sampling noise. Exact for reductions whose weights do not depend
on the tokens after t (``seq_mean_token_sum``, ``constant``, or fixed lengths), at the first optimizer step
(π_old = π_θ). Only token-level weights have a per-prefix form: sequence-level TIS/MIS, geometric MIS, sequence
masks (OPSM, the rejection rules' sequence rules, M2PO) and TIS's batch normalisation are refused.
Tested against ``lit_rl.expectation``'s exact expectation in tests/test_conditional_probe.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..corrections import CORRECTIONS, TAIL_EPS, WeightFunction
from ..objectives import reduce_loss

#: why the sampled tail (``correction.sc.tail=sampled``) has no conditional form here
SAMPLED_TAIL = (
    "the conditional mode computes the rescaled tail's residual; the sampled tail's conditional drift is 0 in "
    "expectation over its draws by construction, and its draws' noise is measured by lit_rl.tools.tail_noise"
)


def check_conditional(correction, corrections: list[str]) -> None:
    """ConfigError, before any model loads, for a probe whose ``corrections`` (names) under the run's
    ``correction`` group have no per-prefix conditional expectation: sequence-level weights or masks (opsm, rs,
    m2po, ``tis.level`` / ``mis.level`` not ``token``), TIS's batch normalisation, or score centering with
    ``sc.tail=sampled`` (``SAMPLED_TAIL``)."""
    from ..config import _check

    sequence_level = [c for c in corrections if CORRECTIONS[c] & {"opsm", "rs", "m2po"}]
    c = correction
    _check(
        not sequence_level and c.tis.level == c.mis.level == "token" and not c.tis.batch_normalize,
        "probe.corrections",
        corrections,
        "token-level corrections only with probe.modes=[..., conditional] (no opsm / rs / m2po, "
        "correction.tis.level=token, correction.mis.level=token, correction.tis.batch_normalize=false)",
    )
    centred = any("sc" in CORRECTIONS[name] for name in corrections)
    _check(not (centred and c.sc.tail == "sampled"), "correction.sc.tail", c.sc.tail, f"rescaled: {SAMPLED_TAIL}")


def conditional_weights(
    logpi: Tensor,
    logmu: Tensor,
    rule: WeightFunction,
    coef: Tensor,
    coef_tail: Tensor,
    head_size: int | None = None,
) -> Tensor:
    """q [..., V] with E_{y~μ}[ĝ_t | h_t] = Σ_v q_v ∇log π_v for one correction (module docstring), float64.

    Args:
        logpi: float [..., V], the trainer's log π(·|h) over the whole vocabulary (detached here); −inf outside
            the sampler's support (top-k / top-p truncation): such entries get q = 0.
        logmu: float [..., V], the sampler's log μ(·|h) of the same ids, in the engine's order (largest first,
            as it records its top-k): the head of score centering is the first ``head_size`` entries.
        rule: the correction's token-level weight function f (``corrections.weight_function``).
        coef: float [..., V], c_v (the objective's coefficient had v been sampled); coef_tail: float [..., 1],
            c at the tail's ratio.
        head_size: None: no score centering; k: centred with the first k entries as head (k >= V: all of them).

    Returns:
        float64 [..., V].

    Raises:
        ValueError: shapes differ, or a weight that is not per token (sequence / geometric level).
    """
    if logpi.shape != logmu.shape or coef.shape != logpi.shape:
        raise ValueError(f"logpi, logmu and coef must share a shape, got {logpi.shape}, {logmu.shape}, {coef.shape}")
    if rule.tis_level != "token" or (rule.mis_band is not None and rule.mis_level != "token"):
        raise ValueError(
            f"the conditional expectation needs token-level weights; got tis.level={rule.tis_level}, "
            f"mis.level={rule.mis_level}"
        )
    lp, lmu = logpi.detach().double(), logmu.detach().double()
    c, c_tail = coef.detach().double(), coef_tail.detach().double()
    valid = torch.isfinite(lp) & ~torch.isnan(lmu)
    zeros = torch.zeros_like(lp)
    log_r = lp - lmu  # +inf where μ_v = 0: f maps it to a finite weight or to −inf, and μ_v w_v = 0 either way
    log_f = rule.log_weight(log_r, log_r) if not rule.is_identity else zeros
    mu_w = torch.where(valid, (lmu + log_f).exp().nan_to_num(0.0), zeros)
    q = c * mu_w
    if head_size is None:
        return q
    k = min(int(head_size), lp.shape[-1])
    in_head = torch.zeros_like(valid)
    in_head[..., :k] = True
    pi = torch.where(valid, lp.exp(), zeros)
    tail_pi = 1.0 - (pi * in_head).sum(-1, keepdim=True)
    tail_mu = (1.0 - torch.where(valid & in_head, lmu.exp(), zeros).sum(-1, keepdim=True)).clamp(min=0.0)
    has_tail = tail_pi > TAIL_EPS
    safe_pi = torch.where(has_tail, tail_pi, torch.ones_like(tail_pi))
    rho = torch.where(has_tail, tail_mu / safe_pi, zeros[..., :1])
    if rule.is_identity:
        alpha = rho
    else:
        log_inv_rho = torch.where(rho > 0, -rho.clamp(min=1e-300).log(), torch.full_like(rho, float("inf")))
        alpha = torch.where(rho > 0, rho * rule.log_weight(log_inv_rho, log_inv_rho).exp(), zeros[..., :1])
    return torch.where(in_head | ~valid, zeros, q - c_tail * alpha * pi)


def conditional_metrics(logpi: Tensor, logmu: Tensor, mask: Tensor, rule: WeightFunction) -> dict[str, Tensor]:
    """Per-prefix expectations over y ~ μ of the trainer's token metrics (``corrections.mismatch_decomposition``,
    ``correction_weights``), summed over the valid tokens: the conditional mode's readings of the gap.

    Args:
        logpi, logmu: float [..., V], log π and log μ over the whole vocabulary (as ``conditional_weights``).
        mask: bool [...], the valid (response) tokens.
        rule: the correction's token-level weight function (its cap and band name the clip and mask fractions).

    Returns:
        float64 0-dim sums over valid tokens (divide by their count for the trainer's token means):
        ``train_inference_kl`` Σ_v μ_v log(μ_v/π_v) (KL(μ‖π), what the trainer's k3 estimates), ``..._reverse``
        Σ_v π_v log(π_v/μ_v), with TIS ``tis_clipfrac`` (μ's mass where π/μ > C), with MIS ``mis_maskfrac`` (μ's
        mass outside the band). Entries where π or μ is 0 add nothing.
    """
    lp, lmu = logpi.detach().double(), logmu.detach().double()
    valid = torch.isfinite(lp) & torch.isfinite(lmu) & mask.bool()[..., None]
    zeros = torch.zeros_like(lp)
    mu, pi, log_r = torch.where(valid, lmu.exp(), zeros), torch.where(valid, lp.exp(), zeros), lp - lmu
    out = {
        "train_inference_kl": torch.where(valid, -mu * log_r, zeros).sum(),
        "train_inference_kl_reverse": torch.where(valid, pi * log_r, zeros).sum(),
    }
    if rule.tis_cap is not None:
        out["tis_clipfrac"] = torch.where(valid & (log_r.exp() > rule.tis_cap), mu, zeros).sum()
    if rule.mis_band is not None:
        out[rule.mask_metric] = torch.where(valid & torch.isneginf(rule.log_weight(log_r, log_r)), mu, zeros).sum()
    return out


def _centring_head(module, rb, head_size: int | None) -> int | None:
    """Score centering's head size for ``conditional_backward`` (None: the module does not centre), after its
    checks: the record covers the vocabulary and the correction has a per-prefix form (ValueError otherwise)."""
    settings, correction = module.loss_settings, module.correction
    vocab = module.policy.get_output_embeddings().weight.shape[0]
    if rb.topk_ids is None or rb.topk_ids.shape[-1] < vocab:
        got = None if rb.topk_ids is None else rb.topk_ids.shape[-1]
        raise ValueError(
            f"the conditional mode needs the sampler's full distribution: top-k of {got}, vocabulary {vocab} "
            "(sampling.logprobs_top_k must be the vocabulary size)"
        )
    if settings.sequence_masks or getattr(correction.tis, "batch_normalize", False):
        raise ValueError(
            f"correction={correction.name}: sequence masks and TIS's batch normalisation have no per-prefix "
            "conditional expectation"
        )
    if not settings.score_centering:
        return None
    if getattr(correction.sc, "tail", "rescaled") == "sampled":
        raise ValueError(f"correction={correction.name} with sc.tail=sampled: {SAMPLED_TAIL}")
    k = vocab if getattr(correction.sc, "mode", "topk") == "exact" else int(correction.sc.top_k)
    return k if head_size is None else head_size


def conditional_backward(module, rb, head_size: int | None = None, metrics: dict | None = None) -> float:
    """Backward, into the policy's ``.grad``, of the batch's conditional-expectation surrogate for ``module``'s
    correction under the batch's advantages (the probe sets them to 1; they must not depend on the sampled
    tokens): Σ_t red_t Σ_v sg(q_{t,v}) log π_{t,v}, whose gradient is Σ_t red_t E_{y_t~μ}[ĝ_t | h_t] of the
    minimised loss. One pass per micro-batch of ``module.micro_batches``, normalised by the whole batch's totals.

    Args:
        module: an ``RLModule`` (its policy, sampling, correction and reduction are used).
        rb: a ``RolloutBatch`` whose engine recorded its whole distribution: ``topk_ids`` / ``topk_logprobs``
            [N, T, V] (``sampling.logprobs_top_k`` = V).
        head_size: score centering's head k (None: the module's ``correction.sc.top_k``, or V with
            ``sc.mode=exact``); ignored when the correction does not centre.
        metrics: a dict to fill with the batch's token means of ``conditional_metrics`` under the trainer's
            names (``train/train_inference_kl`` ...), or None.

    Returns:
        the surrogate's value (no meaning beyond its gradient).

    Raises:
        ValueError: the engine's record does not cover the vocabulary, or the correction has no per-prefix form
        (sequence-level weights, sequence masks, TIS's batch normalisation, score centering's sampled tail).
    """
    settings = module.loss_settings
    head_size = _centring_head(module, rb, head_size)
    sums = {}

    def weights(mb, logpi: Tensor) -> Tensor:
        zeros = torch.zeros_like(logpi.detach())
        coef = module.algorithm.score_coefficients(zeros, zeros[..., 0], mb)
        coef_tail = module.algorithm.score_coefficients(zeros[..., :1], zeros[..., 0], mb)
        for k, v in conditional_metrics(logpi, mb.topk_logprobs, mb.response_mask, settings.weight_rule).items():
            sums[k] = sums.get(k, 0.0) + float(v)
        return conditional_weights(logpi, mb.topk_logprobs, settings.weight_rule, coef, coef_tail, head_size)

    total = surrogate_backward(module, rb, weights)
    num_tokens = rb.response_mask.sum()
    if metrics is not None:
        metrics.update({f"train/{k}": v / max(float(num_tokens), 1.0) for k, v in sums.items()})
    return total


def surrogate_backward(module, rb, weights) -> float:
    """Backward, into the policy's ``.grad``, of the soft-target surrogate Σ_t red_t Σ_v sg(q_{t,v}) log π_{t,v} on
    rollout batch ``rb``, whose gradient is Σ_t red_t Σ_v q_{t,v} ∇log π_{t,v}: the one loop of the probe's
    per-prefix modes (``conditional_backward``, ``tail_noise.tail_noise_backward``).

    Args:
        module: an ``RLModule``; its policy scores through ``RLModule._score`` (the trainer's one scoring call, at
            its sampling settings), over the ids the engine recorded (``rb.topk_ids``), and its reduction
            (``loss.reduction``) gives red_t, normalised by the whole batch's token and sequence counts.
        rb: a ``RolloutBatch`` with ``topk_ids`` / ``topk_logprobs`` [N, T, V'].
        weights: ``weights(mb, logpi) -> q``, float [n, T, V'] for a micro-batch ``mb``, given its log π over the
            recorded ids (``logpi`` [n, T, V'], with gradient); only valid response tokens' rows count, and entries
            with q = 0 add nothing (so -inf log-probs there are harmless).

    Returns:
        the sum of the micro-batches' surrogate values (no meaning beyond its gradient).
    """
    settings = module.loss_settings
    mask = rb.response_mask
    num_tokens, num_seqs = mask.sum(), (mask.sum(-1) > 0).sum()
    total = 0.0
    for mb in module.micro_batches(rb):
        if not mb.response_mask.any():
            continue
        scores = module._score(module.policy, mb, mb.topk_ids, {"with_entropy": False, "shared_prefix": False})
        logpi = scores.head_logprobs  # [n, T, V'] in the engine's order, with gradient
        q = weights(mb, logpi)
        q = torch.where(mb.response_mask[..., None], q, torch.zeros_like(q)).to(logpi.dtype)
        token = (q * torch.where(q != 0, logpi, torch.zeros_like(logpi))).sum(-1)
        loss = reduce_loss(
            token,
            mb.response_mask,
            settings.reduction,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            max_response_length=settings.max_response_length,
        )
        loss.backward()
        total += float(loss.detach())
    return total
