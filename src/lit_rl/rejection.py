"""Sequence masks: corrections that drop whole sequences from the policy-gradient loss.

Pure tensor functions, plus the registry the loss assembly reads (``SEQUENCE_MASKS``). Where the weight
corrections of ``corrections.py`` (TIS / MIS) weigh each token by f(π_old / μ), a sequence mask keeps or drops a
whole completion by a statistic of all its tokens (and, for OPSM, its advantage):

- **OPSM**, off-policy sequence masking (DeepSeek-AI 2025, DeepSeek-V3.2 report; TRL ``off_policy_mask_threshold``;
  slime ``--use-opsm --opsm-delta``): drop a sequence when its advantage is negative AND the mean over its tokens
  of log μ − log π_θ exceeds δ. μ is the SAMPLER (``rollout_logprobs``, TRL's ``sampling_per_token_logps``), not
  the behaviour version's trainer scores ``behaviour_logprobs`` (p_o of stale rows); π_θ is the current policy,
  detached. The whole sequence goes: masking per token (keeping the tokens whose own advantage is positive) was
  the implementation slime fixed (its PR 1917).
- **The rejection family** (``rs``; verl's rollout rejection sampling, ``rollout_rs``): with d_t = log π_old −
  log μ of each token, a divergence estimate per token (Schulman's k1 = −d, k2 = d²/2, k3 = e^d − 1 − d of
  KL(μ ‖ π_old) from μ's samples, ``divergence``), aggregated per token or per sequence (sum, mean, max) and
  compared with a threshold: ``token_k1`` (|d_t| > τ drops the token), ``seq_sum_k1`` (|Σ_t d_t| > τ drops the
  sequence), ``seq_mean_k3`` (mean_t k3 > τ), ``seq_max_k2`` (max_t k2 > τ); and SkyRL's outlier veto
  ``outlier_veto`` (a sequence with any token ratio π_old/μ outside [1e-4, 100] is dropped).
- **M2PO** (Zheng et al. 2025, "Prosperity before Collapse", arXiv 2510.01161; AReaL): a batch-level token rule.
  The tokens with the largest squared log-ratio d² (d = log π_old − log μ) are masked until the second moment
  M2 = mean d² of the tokens kept is at most τ (``m2po_bound``): a bound on |d| computed once per batch, then
  applied as a token band (mask-only MIS with the band [e^{−c}, e^c], ``loss.assemble_loss``), so score centering
  centres under it.

Conventions (as ``corrections``): N completions, T padded tokens, ``mask`` bool or 0/1 [N, T] of valid response
tokens; a dropped sequence still counts in the step's denominators (lit_rl, IcePop and TRL keep them; verl's
rejection sampling shrinks them, its modified response mask). Every function returns ``(keep, metrics)``: keep
bool [N, T], a subset of ``mask``; metrics detached 0-dim tensors, fractions of the valid tokens dropped.

In the loss assembly (``loss.assemble_loss``) a sequence mask multiplies the CORRECTED policy-gradient loss, score
centering's term included: a dropped sequence leaves no trace in the policy gradient (the entropy bonus and the
KL to the reference stay). Its drift under a constant reward is therefore not zero with score centering (the mask
depends on the whole sequence, so the centring of the kept ones no longer averages to 0): the exact numbers are
in docs/corrections.md, pinned by tests/test_corrections_expectation.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from .objectives import masked_mean

#: ``correction.rs.rule`` -> its default threshold τ (``correction.rs.threshold: null``): token_k1 keeps
#: |log w| ≤ log 2 (the band [0.5, 2] of MIS), seq_sum_k1 the same on the sequence's product ratio, seq_mean_k3
#: 0.01 nats per token, seq_max_k2 (log 2)²/2 (a token at ratio 2 or 1/2); outlier_veto uses ``veto_band``
RS_RULES: dict[str, float] = {
    "token_k1": math.log(2.0),
    "seq_sum_k1": math.log(2.0),
    "seq_mean_k3": 0.01,
    "seq_max_k2": math.log(2.0) ** 2 / 2,
    "outlier_veto": math.nan,
}
#: SkyRL's outlier-token veto band of the token ratio π_old / μ
VETO_BAND = (1e-4, 100.0)


@dataclass(frozen=True)
class MaskInputs:
    """What a sequence mask may read, for one micro-batch (all [N, T], detached):

    rollout_logprobs: log μ, the sampler's log-probs. old_logprobs: log π_old. logprobs: log π_θ (current).
    advantages: float [N] or [N, T] (per-token advantages, PPO's GAE). mask: bool [N, T] of valid tokens."""

    rollout_logprobs: Tensor
    old_logprobs: Tensor
    logprobs: Tensor
    advantages: Tensor
    mask: Tensor


#: part name -> ``fn(section, MaskInputs) -> (keep [N, T] bool, metrics)``, ``section`` the part's config section
#: (``correction.opsm``, ``correction.rs``); filled by ``sequence_mask``. A new sequence-mask correction is one
#: decorated function here, its config section (``schema.loss``) and its ``conf/correction/<name>.yaml``.
SEQUENCE_MASKS: dict[str, Callable] = {}


def sequence_mask(part: str):
    """Register the decorated ``fn(section, MaskInputs) -> (keep, metrics)`` as the sequence mask of the correction
    part ``part`` (its config section ``correction.<part>``, on when ``enabled``). Raises ValueError when ``part``
    is taken."""

    def decorate(fn):
        if part in SEQUENCE_MASKS:
            raise ValueError(f"sequence mask {part!r} is registered twice")
        SEQUENCE_MASKS[part] = fn
        return fn

    return decorate


def sequence_advantages(advantages: Tensor, mask: Tensor) -> Tensor:
    """float [N]: the advantage of each sequence, ``advantages`` [N] itself, or [N, T] per-token advantages
    averaged over the valid tokens (0 for an empty row). Raises ValueError on a shape that is neither."""
    if advantages.dim() == 1 and advantages.shape[0] == mask.shape[0]:
        return advantages
    if advantages.shape != mask.shape:
        raise ValueError(
            f"advantages must be [N] or [N, T] for a mask {tuple(mask.shape)}, got {tuple(advantages.shape)}"
        )
    return masked_mean(advantages.detach(), mask, dim=-1)


def opsm_mask(
    rollout_logprobs: Tensor, logprobs: Tensor, advantages: Tensor, mask: Tensor, delta: float
) -> tuple[Tensor, dict]:
    """Off-policy sequence masking (OPSM, DeepSeek-V3.2): drop sequence i when A_i < 0 and
    (1/T_i) Σ_t (log μ_t − log π_θ,t) > δ.

    A sequence with A ≥ 0 is always kept; a negative-advantage sequence is dropped when the current policy has
    moved away from the sampler by more than δ nats per token on average (its negative update would push down a
    sample the current policy no longer produces, the instability OPSM targets). With per-token advantages (PPO's GAE)
    A_i is their mean over the sequence's valid tokens. Same rule as TRL's ``get_off_policy_mask`` (keep when
    A ≥ 0 or the mean KL ≤ δ) and slime's ``--opsm-delta``.

    Args:
        rollout_logprobs: float [N, T], log μ of the sampled tokens (the sampler, not p_o).
        logprobs: float [N, T], log π_θ of the same tokens (detached here).
        advantages: float [N] or [N, T].
        mask: bool or 0/1 float [N, T] of valid tokens.
        delta: δ ≥ 0, nats per token.

    Returns:
        (keep bool [N, T], {"opsm_maskfrac": fraction of the valid tokens dropped}).

    Raises:
        ValueError: δ < 0 or a shape mismatch.
    """
    if not delta >= 0:
        raise ValueError(f"OPSM delta must be >= 0, got {delta}")
    if rollout_logprobs.shape != mask.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"rollout_logprobs {tuple(rollout_logprobs.shape)}, logprobs {tuple(logprobs.shape)} and mask "
            f"{tuple(mask.shape)} must have the same shape"
        )
    valid = mask.bool()
    log_ratio = torch.where(valid, rollout_logprobs.detach().double() - logprobs.detach().double(), 0.0)
    mean_kl = masked_mean(log_ratio, valid, dim=-1)
    drop = (sequence_advantages(advantages, valid) < 0) & (mean_kl > delta)
    keep = valid & ~drop[:, None]
    return keep, {"opsm_maskfrac": masked_mean((valid & ~keep).float(), valid)}


def divergence(log_ratio: Tensor, kind: str) -> Tensor:
    """Schulman's per-token estimates of KL(μ ‖ π_old) from tokens sampled by μ, elementwise in
    d = log π_old − log μ (r = e^d = π_old/μ): k1 = −d = −log r, k2 = d²/2, k3 = r − 1 − log r (≥ 0; the
    ``train/train_inference_kl`` of ``corrections.mismatch_decomposition``). verl's rejection rules compare them,
    aggregated, with a threshold (k1 by its absolute value). Raises ValueError for another ``kind``."""
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"unknown divergence {kind!r}: choose k1, k2 or k3")


def rejection_mask(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    rule: str,
    threshold: Optional[float] = None,
    veto_band: tuple[float, float] = VETO_BAND,
) -> tuple[Tensor, dict]:
    """verl's rejection rules and SkyRL's outlier veto: tokens or sequences dropped by their divergence from μ.

    With d_t = log π_old,t − log μ_t (``divergence``) and τ = ``threshold`` (None: ``RS_RULES[rule]``):
    ``token_k1`` drops the tokens with |d_t| > τ (mask-only MIS with the band [e^{−τ}, e^τ]);
    ``seq_sum_k1`` the sequences with |Σ_t d_t| > τ (their product ratio outside [e^{−τ}, e^τ]);
    ``seq_mean_k3`` those with mean_t k3_t > τ; ``seq_max_k2`` those with max_t k2_t > τ;
    ``outlier_veto`` those with any token ratio e^{d_t} outside ``veto_band`` (SkyRL: [1e-4, 100]).
    A NaN divergence drops. Mask only: kept tokens keep weight 1 (pair with ``tis`` for a weight, ``tis+rs``).

    Args:
        old_logprobs: float [N, T], log π_old. rollout_logprobs: float [N, T], log μ. mask: bool [N, T].
        rule: one of ``RS_RULES``. threshold: τ > 0, or None. veto_band: (low, high), 0 < low < 1 < high.

    Returns:
        (keep bool [N, T], {"rs_maskfrac": fraction of the valid tokens dropped}).

    Raises:
        ValueError: an unknown rule, τ ≤ 0, a bad veto band or a shape mismatch.
    """
    if rule not in RS_RULES:
        raise ValueError(f"unknown rejection rule {rule!r}: choose one of {list(RS_RULES)}")
    tau = RS_RULES[rule] if threshold is None else float(threshold)
    if rule != "outlier_veto" and not tau > 0:
        raise ValueError(f"rejection threshold must be > 0, got {tau}")
    if not 0 < veto_band[0] < 1 < veto_band[1]:
        raise ValueError(f"veto band needs 0 < low < 1 < high, got {veto_band}")
    if old_logprobs.shape != mask.shape or rollout_logprobs.shape != mask.shape:
        raise ValueError("old_logprobs, rollout_logprobs and mask must have the same shape")
    valid = mask.bool()
    d = torch.where(valid, old_logprobs.detach().double() - rollout_logprobs.detach().double(), 0.0)
    if rule == "token_k1":
        drop = ~(d.abs() <= tau)
    else:
        if rule == "seq_sum_k1":
            bad = ~(d.sum(-1).abs() <= tau)
        elif rule == "seq_mean_k3":
            bad = ~(masked_mean(divergence(d, "k3"), valid, dim=-1) <= tau)
        elif rule == "seq_max_k2":
            bad = ~(torch.where(valid, divergence(d, "k2"), 0.0).amax(-1) <= tau)
        else:
            inside = (d >= math.log(veto_band[0])) & (d <= math.log(veto_band[1]))
            bad = (valid & ~inside).any(-1)
        drop = bad[:, None].expand_as(valid)
    keep = valid & ~drop
    return keep, {"rs_maskfrac": masked_mean((valid & ~keep).float(), valid)}


@sequence_mask("opsm")
def _opsm(section, x: MaskInputs) -> tuple[Tensor, dict]:
    return opsm_mask(x.rollout_logprobs, x.logprobs, x.advantages, x.mask, float(section.delta))


@sequence_mask("rs")
def _rs(section, x: MaskInputs) -> tuple[Tensor, dict]:
    if section.rule == "token_k1":  # a token rule: the weight function applies it (``corrections.weight_function``)
        return x.mask.bool(), {}
    band = (float(section.veto_band[0]), float(section.veto_band[1]))
    return rejection_mask(x.old_logprobs, x.rollout_logprobs, x.mask, section.rule, section.threshold, band)


def sequence_masks(correction) -> tuple[tuple[str, object], ...]:
    """The ``(part, section)`` pairs of the ``correction`` group (``schema.CorrectionConfig``) whose sequence mask
    is on, in ``SEQUENCE_MASKS`` order: what ``loss.LossSettings.sequence_masks`` holds."""
    return tuple(
        (part, getattr(correction, part))
        for part in SEQUENCE_MASKS
        if getattr(getattr(correction, part, None), "enabled", False)
    )


def apply_sequence_masks(masks, inputs: MaskInputs) -> tuple[Tensor, dict]:
    """The intersection of the masks ``masks`` (``sequence_masks``) keep, bool [N, T], and their metrics."""
    keep, metrics = inputs.mask.bool(), {}
    for part, section in masks:
        part_keep, part_metrics = SEQUENCE_MASKS[part](section, inputs)
        keep = keep & part_keep
        metrics.update(part_metrics)
    return keep, metrics


def m2po_bound(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    threshold: float,
    gather: Optional[Callable[[Tensor], Tensor]] = None,
) -> Tensor:
    """M2PO's cutoff c of one batch: the tokens with |d| ≤ c are kept, d = log π_old − log μ.

    Sort the valid tokens' d² in increasing order s_1 ≤ ... ≤ s_n and keep the longest prefix whose mean is at most
    τ (the mean of the m smallest grows with m): c = √s_m, so removing the largest d² one at a time until the kept
    tokens' second moment is ≤ τ (M2PO's rule) keeps exactly these. Tokens tied with s_m are kept together. With no
    valid token, or M2 of all of them ≤ τ, c = +inf (nothing masked); when even the smallest exceeds τ, c = −1 (all
    masked). Log-ratios [0, 0, 0, 3] with τ = 1: M2 = 2.25 > 1, keep the three zeros (M2 = 0), c = 0.

    Args:
        old_logprobs: float [N, T], log π_old. rollout_logprobs: float [N, T], log μ. mask: bool [N, T].
        threshold: τ ≥ 0, in nats² (the paper's default 0.04).
        gather: under data parallelism, where each rank holds a share of the batch: a collective mapping this
            rank's float64 1-D tensor to every rank's, concatenated in rank order (``RLModule.all_gather_cat``).
            The cutoff is an order statistic of the whole batch, not a sum, so the ranks gather the valid tokens'
            d² (float64, at most N·T values) and each computes the one-device cutoff of the union: the same bits
            as one device on the whole batch, on every rank. None: this batch is the whole batch.

    Returns:
        float64 0-dim tensor c.

    Raises:
        ValueError: τ < 0 or a shape mismatch.
    """
    if not threshold >= 0:
        raise ValueError(f"M2PO threshold must be >= 0, got {threshold}")
    if old_logprobs.shape != mask.shape or rollout_logprobs.shape != mask.shape:
        raise ValueError("old_logprobs, rollout_logprobs and mask must have the same shape")
    d2 = (old_logprobs.detach().double() - rollout_logprobs.detach().double())[mask.bool()] ** 2
    if gather is not None:
        d2 = gather(d2)
    d2 = torch.where(torch.isnan(d2), torch.full_like(d2, math.inf), d2).sort().values
    prefix_means = d2.cumsum(0) / torch.arange(1, len(d2) + 1, dtype=d2.dtype, device=d2.device)
    kept = int((prefix_means <= threshold).sum())  # prefix means are non-decreasing
    if kept == len(d2):
        return torch.tensor(math.inf, dtype=torch.float64)
    return d2[kept - 1].sqrt().cpu() if kept > 0 else torch.tensor(-1.0, dtype=torch.float64)


def needs_batch_pass(correction) -> bool:
    """Whether the ``correction`` group has a batch-level rule (``correction.m2po``, TIS's ``batch_normalize``): it
    needs π_old of the whole batch before the first optimizer step (a snapshot pass, even with one update)."""
    tis = getattr(correction, "tis", None)
    normalised = bool(tis is not None and tis.enabled and getattr(tis, "batch_normalize", False))
    return normalised or bool(getattr(getattr(correction, "m2po", None), "enabled", False))


def batch_log_ratio_bound(correction, rb, gather: Optional[Callable[[Tensor], Tensor]] = None) -> Optional[Tensor]:
    """The batch-level bound of the ``correction`` group (``correction.m2po``) for the rollout batch ``rb`` (with
    ``old_logprobs`` filled), float64 [N], or None when no batch-level rule is on. What ``RLModule.start_update``
    stores in ``rb.log_ratio_bound``. Under data parallelism ``rb`` is this rank's share and ``gather`` the
    collective of ``m2po_bound``: the bound is the whole step's, the one device's on the whole batch (the
    paper's batch is the step's; a per-rank bound would mask more or less as the ranks' shares differ)."""
    m2po = getattr(correction, "m2po", None)
    if m2po is None or not m2po.enabled:
        return None
    bound = m2po_bound(rb.old_logprobs, rb.rollout_logprobs, rb.response_mask, float(m2po.threshold), gather)
    return bound.expand(len(rb)).clone()
