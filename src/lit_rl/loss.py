"""The per-token loss of one micro-batch, assembled in one place: objective ⊗ correction weights, score centering
with the objective's coefficients, the extra (value) term, the entropy bonus, the KL to the reference, and the
reduction by the whole step's totals. Pure: tensors and settings in, ``(loss, metrics)`` out, no module state.

An algorithm supplies only its objective: the per-token loss ℓ_t of ``policy_loss`` (with its own metrics, e.g.
``train/pg_clipfrac``) and its score coefficients c = ∂ℓ_t/∂log π (``score_coefficients``), which score
centering evaluates at the engine's head ids. The learner (``RLModule.micro_batch_loss``) scores the tokens,
calls the objective, then ``assemble_loss``, and records the returned metrics once (``MetricSums.record``).

Every term and metric, in the order they are applied (SPEC.md, "Objectives" and "Train–inference corrections"):

1. corrections (``corrections.correct_policy_loss``): ℓ_t · w_t with w_t = f(π_old/μ) (TIS / MIS), and score
   centering's −E_μ[c w ∇log π] over the head; logs ``train/tis``, ``tis_abs``, ``tis_clipfrac``, ``mis_maskfrac``;
   then the sequence masks (``rejection``: OPSM, the rejection family's sequence rules) zero the whole corrected
   loss of the sequences they drop (``train/opsm_maskfrac``, ``rs_maskfrac``); and the importance weights'
   moments, which the step turns into ``train/is_ess``, ``is_chi2`` (token and ``_seq``) and ``is_extreme_frac``
   (``corrections.importance_diagnostics``);
2. ``extra_loss`` (PPO's ``vf_coef`` · value loss), added per token;
3. the entropy bonus −coef · H(π_θ(·|h_t)) (``loss.entropy_coef``);
4. the KL to the frozen reference (``kl.estimator``) added with β when ``kl.mode=loss`` (``kl.is_weighted``: times
   sg(π_old/μ), the importance-weighted KL whose value ``ref_kl_is`` logs); logs ``train/ref_kl``,
   ``ref_kl_seq`` (``kl.mode=loss``: the adaptive controller's measurement), ``ref_kl_is`` (the same KL
   importance-weighted by π_old/μ: comparable between samplers);
5. on-policy distillation as its own term (``distill.mode=loss``, ``objectives.opd_loss``): coef · sg(log π_θ −
   log π_teacher) · log π_θ per token over the step's valid tokens, whatever ``loss.reduction``; logs
   ``train/opd_kl`` (the mean log-ratio; ``distill.mode=advantage`` logs it from the batch instead);
6. diagnostics: ``train/entropy``, ``train/ppo_kl`` (π_old vs π_θ), and SPEC's mismatch decomposition
   ``r_num`` (same weights, two engines) / ``r_stale`` (same engine, two versions), logged apart; multi-turn
   episodes: ``train/logprob_abs_diff`` of the first turn and of the later ones apart;
7. ``loss.drop_older_tokens``: a token written before its sequence's newest weight update (an in-flight update
   swapped the weights mid-sequence) leaves the numerator, its whole per-token loss; logs ``train/older_dropfrac``;
8. the reduction (``objectives.reduce_loss``, ``loss.reduction``) with the step's denominators: tokens MIS or
   ``drop_older_tokens`` drop leave the numerator only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from . import corrections as corr
from . import objectives as obj
from . import rejection
from .logprobs import TokenScores


class TokenMetrics:
    """One micro-batch's metric values, each with the mask it is averaged over; what the objective and
    ``assemble_loss`` return instead of writing into shared state. ``MetricSums.record`` folds them into the
    step's token-weighted means (sum of values over the mask, and the mask's count).

    Entries keep their order: ``add`` (per-token values [any shape] and a bool mask of the same shape) and
    ``add_means`` (values already averaged over the mask's valid entries, weighted by its count).
    """

    def __init__(self) -> None:
        self.entries: list[tuple[str, Tensor | float, Tensor, bool]] = []

    def add(self, name: str, values: Tensor, mask: Tensor) -> TokenMetrics:
        """Record ``values`` to be averaged over ``mask``'s true entries. Returns self."""
        self.entries.append((name, values, mask, False))
        return self

    def add_means(self, means: dict[str, Tensor | float], mask: Tensor) -> TokenMetrics:
        """Record values already averaged over ``mask``'s valid entries (weighted by their count). Returns self."""
        for name, value in means.items():
            self.entries.append((name, value, mask, True))
        return self

    def extend(self, other: TokenMetrics) -> TokenMetrics:
        """Append ``other``'s entries after these. Returns self."""
        self.entries.extend(other.entries)
        return self

    def __iter__(self) -> Iterator[tuple[str, Tensor | float, Tensor, bool]]:
        return iter(self.entries)

    def names(self) -> list[str]:
        """The recorded names, in order."""
        return [e[0] for e in self.entries]


@dataclass(frozen=True)
class LossSettings:
    """What the assembly reads from the config, fixed for a run.

    Attributes:
        reduction: ``loss.reduction`` (``objectives.REDUCTION_MODES``).
        max_response_length: L_max, ``sampling.max_new_tokens`` (the ``constant`` reduction's denominator).
        weight_rule: the correction's weight function f (``corrections.weight_function`` of ``correction``).
        score_centering: ``correction.sc.enabled``.
        sc_tail_samples: m, the tail samples the engine records after the head (``corrections.sc_tail_samples``; 0:
            the rescaled tail).
        entropy_coef: ``loss.entropy_coef`` (0 = no bonus).
        kl_estimator: ``kl.estimator`` (k1 | k2 | k3).
        kl_in_loss: ``kl.mode == "loss"`` (False: the KL went into the rewards, only logged here).
        sequence_masks: the ``(part, section)`` pairs of the sequence masks on (``rejection.sequence_masks``:
            ``correction.opsm``, ``correction.rs``'s sequence rules).
        kl_is_weighted: ``kl.is_weighted``: the KL term weighted by sg(π_old/μ) (the IS-weighted, "unbiased" KL).
        drop_older_tokens: ``loss.drop_older_tokens`` (``older_token_mask``'s tokens leave the numerator).
    """

    reduction: str
    max_response_length: int
    weight_rule: corr.WeightFunction
    score_centering: bool = False
    sc_tail_samples: int = 0
    entropy_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_in_loss: bool = True
    sequence_masks: tuple = ()
    kl_is_weighted: bool = False
    drop_older_tokens: bool = False

    @classmethod
    def from_config(cls, loss, correction, kl, max_response_length: int) -> LossSettings:
        """The settings of the config groups ``loss``, ``correction`` and ``kl`` (``schema`` dataclasses or
        anything with their fields) and L_max (``sampling.max_new_tokens``)."""
        return cls(
            reduction=loss.reduction,
            max_response_length=max_response_length,
            weight_rule=corr.weight_function(correction),
            score_centering=correction.sc.enabled,
            sc_tail_samples=corr.sc_tail_samples(correction),
            entropy_coef=loss.entropy_coef,
            kl_estimator=kl.estimator,
            kl_in_loss=kl.mode == "loss",
            sequence_masks=rejection.sequence_masks(correction),
            kl_is_weighted=bool(getattr(kl, "is_weighted", False)),
            drop_older_tokens=bool(getattr(loss, "drop_older_tokens", False)),
        )


def older_token_mask(token_versions: Tensor, mask: Tensor) -> Tensor:
    """bool [N, T]: the valid tokens (``mask`` [N, T] bool) whose weight version (``token_versions`` [N, T] int64,
    ``Rollouts.token_versions``) is older than the newest version in their own row: the tokens a sequence got before
    an in-flight weight update. A row written by one version has none, however stale (``rollout.max_staleness``
    bounds that). The rule of partial rollouts that train only on the newest policy's tokens (slime's
    ``--mask-offpolicy-in-partial-rollout``), taken per row."""
    if token_versions.shape != mask.shape:
        raise ValueError(f"token_versions {tuple(token_versions.shape)} and mask {tuple(mask.shape)} must match")
    newest = token_versions.masked_fill(~mask, torch.iinfo(token_versions.dtype).min).amax(-1, keepdim=True)
    return mask & (token_versions < newest)


def assemble_loss(
    pg_loss: Tensor,
    scores: TokenScores,
    old_logprobs: Tensor,
    mb,
    settings: LossSettings,
    *,
    num_tokens: Tensor,
    num_seqs: Tensor,
    score_coefficients: Callable[[Tensor, Tensor], Tensor] | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    extra_loss: Tensor | None = None,
    teacher_logprobs: Tensor | None = None,
    distill_coef: float = 0.0,
) -> tuple[Tensor, TokenMetrics]:
    """The scalar loss of one micro-batch, normalised by the whole step's totals, and its metrics.

    Args:
        pg_loss: float [n, T], the objective's per-token policy-gradient loss ℓ_t (to minimise).
        scores: the trainer's ``TokenScores``: ``logprobs`` [n, T] (with gradient), ``entropy``, ``head_logprobs``.
        old_logprobs: float [n, T], log π_old (the trainer's forward itself when one update per batch).
        mb: the micro-batch (``rollout.types.RolloutBatch``): ``response_mask`` [n, T] bool,
            ``rollout_logprobs`` μ [n, T], ``behaviour_logprobs`` (stale rows' p_o, NaN for the trained
            version's rows, or None), the head ``topk_logprobs`` / ``old_head_logprobs`` for score centering.
        settings: the run's ``LossSettings``.
        num_tokens, num_seqs: 0-dim, the whole step's valid tokens and sequences (all micro-batches and ranks).
        score_coefficients: ``(log_ratio [n, T, J], sampled_log_ratio [n, T]) -> c [n, T, J]``, the objective's
            ∂ℓ_t/∂log π had each head token been sampled; needed with score centering.
        ref_logprobs: float [n, T], the frozen reference's log-probs (no gradient), or None without a reference.
        kl_coef: β, the KL coefficient of this step (used when ``settings.kl_in_loss``).
        extra_loss: float [n, T] added per token before the reduction (PPO's weighted value loss), or None.
        teacher_logprobs: float [n, T], the frozen teacher's log-probs of the sampled tokens (no gradient) for the
            distillation term (``distill.mode=loss``), or None; distill_coef: its coefficient.

    Returns:
        (loss: 0-dim float, this micro-batch's share of the step's loss; metrics: ``TokenMetrics`` of the
        corrections, the KL terms and the diagnostics listed in the module docstring).
    """
    m = mb.response_mask
    logprobs = scores.logprobs
    metrics = TokenMetrics()
    rule = batch_weight_rule(settings.weight_rule, old_logprobs, mb, metrics)
    token_loss, correction_metrics = corr.correct_policy_loss(
        pg_loss,
        logprobs,
        old_logprobs,
        mb,
        rule,
        score_centering=settings.score_centering,
        logprobs_head=scores.head_logprobs,
        score_coefficients=score_coefficients,
        tail_samples=settings.sc_tail_samples,
    )
    metrics.add_means({f"train/{k}": v for k, v in correction_metrics.items()}, m)
    if mb.weight_scale is not None:  # TIS's batch normalisation: both corrected terms divided by the batch's Z
        token_loss = token_loss * mb.weight_scale.to(token_loss.dtype)[:, None]
        metrics.add_means({"train/tis_batch_mean": 1.0 / mb.weight_scale[0]}, m)
    token_loss = sequence_masked(token_loss, logprobs, old_logprobs, mb, settings, metrics)
    if extra_loss is not None:
        token_loss = token_loss + extra_loss
    if settings.entropy_coef:  # the bonus: − coef · H(π_θ(· | h_t)), reduced like the loss below
        token_loss = obj.entropy_bonus_loss(token_loss, scores.entropy, settings.entropy_coef)
    if ref_logprobs is not None:
        kl_term = reference_kl_term(logprobs, ref_logprobs, old_logprobs, mb, settings, kl_coef, metrics)
        if kl_term is not None:
            token_loss = token_loss + kl_term
    metrics.add("train/entropy", scores.entropy, m)
    metrics.add("train/ppo_kl", old_logprobs - logprobs.detach(), m)
    mismatch_metrics(logprobs, old_logprobs, mb, metrics)
    if settings.drop_older_tokens:
        token_loss = without_older_tokens(token_loss, mb, metrics)
    # tokens MIS or drop_older_tokens drop leave the numerator only (their loss is 0): every reduction keeps the
    # step's original denominators (num_tokens, num_seqs and each sequence's T_i)
    totals = dict(num_tokens=num_tokens, num_seqs=num_seqs, max_response_length=settings.max_response_length)
    loss = obj.reduce_loss(token_loss, m, settings.reduction, **totals)
    if teacher_logprobs is not None:  # its own token count: the step's valid tokens, whatever the reduction above
        loss = loss + distill_loss_term(logprobs, teacher_logprobs, distill_coef, m, num_tokens, metrics)
    return loss, metrics


def distill_loss_term(
    logprobs: Tensor, teacher_logprobs: Tensor, coef: float, mask: Tensor, num_tokens: Tensor, metrics: TokenMetrics
) -> Tensor:
    """The distillation loss term of one micro-batch (``objectives.opd_loss`` over the step's ``num_tokens``), 0-dim;
    records ``train/opd_kl`` (the per-token log π_θ − log π_teacher) into ``metrics``."""
    term, _ = obj.opd_loss(logprobs, teacher_logprobs, coef, mask, num_tokens=num_tokens)
    metrics.add("train/opd_kl", logprobs.detach() - teacher_logprobs, mask)
    return term


def batch_weight_rule(
    rule: corr.WeightFunction, old_logprobs: Tensor, mb, metrics: TokenMetrics
) -> corr.WeightFunction:
    """``rule``, or with a batch-level bound in ``mb.log_ratio_bound`` (M2PO's c on |log π_old/μ|, the same for the
    whole batch) the token band [e^−c, e^c], mask only (``rejection.m2po_bound``; c < 0: no token kept); records
    ``train/m2``, the mean (log π_old/μ)² before masking, into ``metrics``."""
    if mb.log_ratio_bound is None:
        return rule
    m = mb.response_mask
    c = float(mb.log_ratio_bound[0]) if len(mb.log_ratio_bound) else math.inf
    band = (math.exp(-c), math.exp(c)) if c >= 0 else (1.0, 1.0)  # c < 0: no token has d = 0, none kept
    d = (old_logprobs.detach() - mb.rollout_logprobs).double()
    metrics.add_means({"train/m2": obj.masked_mean(torch.where(m.bool(), d, 0.0) ** 2, m)}, m)
    return dataclasses.replace(rule, mis_band=band, mis_weighted=False, mis_level="token", mask_metric="m2po_maskfrac")


def sequence_masked(
    token_loss: Tensor, logprobs: Tensor, old_logprobs: Tensor, mb, settings: LossSettings, metrics: TokenMetrics
) -> Tensor:
    """The corrected per-token loss [n, T] with the sequences the sequence masks drop zeroed (``rejection``: OPSM,
    the rejection family's sequence rules; their ``*_maskfrac`` recorded), and the importance weights' moments
    recorded for ``train/is_ess``, ``is_chi2`` (token and ``_seq``) and ``is_extreme_frac``."""
    m = mb.response_mask
    if settings.sequence_masks:
        inputs = rejection.MaskInputs(mb.rollout_logprobs, old_logprobs.detach(), logprobs.detach(), mb.advantages, m)
        keep, mask_metrics = rejection.apply_sequence_masks(settings.sequence_masks, inputs)
        token_loss = torch.where(keep, token_loss, torch.zeros_like(token_loss))
        metrics.add_means({f"train/{k}": v for k, v in mask_metrics.items()}, m)
    token_moments, sequence_moments = corr.importance_moments(old_logprobs, mb.rollout_logprobs, m)
    metrics.add_means({f"train/{k}": v for k, v in token_moments.items()}, m)
    metrics.add_means({f"train/{k}": v for k, v in sequence_moments.items()}, m.any(-1))
    return token_loss


def mismatch_metrics(logprobs: Tensor, old_logprobs: Tensor, mb, metrics: TokenMetrics) -> None:
    """Record SPEC's decomposition of the train-inference ratio into ``metrics``: r_num = p_o/mu (same weights, two
    engines), r_stale = pi_theta/p_o (same engine, two weight versions), logged apart, never only the product;
    p_o = pi_old unless rows are stale (then the trainer's log-probs under their generating weights). A batch of
    multi-turn episodes (``mb.env_mask``) also gets ``train/logprob_abs_diff`` of its first turn and of its later
    turns apart."""
    m = mb.response_mask
    p_o = (
        old_logprobs
        if mb.behaviour_logprobs is None
        else torch.where(torch.isnan(mb.behaviour_logprobs), old_logprobs, mb.behaviour_logprobs)
    )
    decomposition = corr.mismatch_decomposition(mb.rollout_logprobs, p_o, logprobs.detach(), m)
    metrics.add_means({f"train/{k}": v for k, v in decomposition.items()}, m)
    if mb.env_mask is not None:
        first = m & (mb.env_mask.long().cumsum(-1) == 0)
        gap = (p_o - mb.rollout_logprobs).abs()
        metrics.add("train/logprob_abs_diff_first_turn", gap, first)
        metrics.add("train/logprob_abs_diff_later_turns", gap, m & ~first)


def without_older_tokens(token_loss: Tensor, mb, metrics: TokenMetrics) -> Tensor:
    """``loss.drop_older_tokens``: ``token_loss`` [n, T] with the micro-batch's ``older_token_mask`` tokens set to 0
    (unchanged when ``mb.token_versions`` is None: one version per row); adds ``train/older_dropfrac``."""
    if mb.token_versions is None:
        return token_loss
    older = older_token_mask(mb.token_versions, mb.response_mask)
    metrics.add("train/older_dropfrac", older.float(), mb.response_mask)
    return token_loss.masked_fill(older, 0.0)


def reference_kl_term(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    old_logprobs: Tensor,
    mb,
    settings: LossSettings,
    kl_coef: float,
    metrics: TokenMetrics,
) -> Tensor | None:
    """The KL to the frozen reference as a per-token loss term: β · kl_t (``kl.estimator`` of π_θ against π_ref,
    [n, T]) when ``settings.kl_in_loss`` and β > 0, else None (``kl.mode=reward``: the KL went into the returns).
    The term is ``objectives.approx_kl``'s, k3 bounded (its tangent beyond the value 10), so one token's value and
    gradient stay finite. Records ``train/ref_kl``, ``train/ref_kl_seq`` (``kl.mode=loss``: the KL per sequence,
    what the adaptive controller reads) and ``train/ref_kl_is`` into ``metrics``: these are the estimator's exact
    value (k3 unbounded, as these metrics always were; a token whose e^r overflows float32 logs inf there, and
    no longer takes the step's loss with it)."""
    m = mb.response_mask
    kl = obj.approx_kl(logprobs, ref_logprobs, settings.kl_estimator)
    if settings.kl_estimator == "k3":  # the metrics: the unbiased estimate, not the bounded loss term
        measured = obj.approx_kl(logprobs.detach(), ref_logprobs, "k3", tangent_from=None)
    else:
        measured = kl
    metrics.add("train/ref_kl", measured, m)
    if settings.kl_in_loss:
        metrics.add("train/ref_kl_seq", obj.masked_sum(measured, m, dim=-1), m.any(-1))
    # the same KL on pi_old's own samples: the tokens came from mu, so each is weighted by pi_old / mu
    # (importance sampling, unbiased; the clamp only keeps exp finite). Equal to ref_kl on-policy, and
    # comparable between samplers, where ref_kl measures the two policies on mu's tokens
    w = torch.exp((old_logprobs.detach() - mb.rollout_logprobs).clamp(max=20.0))
    metrics.add("train/ref_kl_is", w * measured, m)
    beta = kl_coef if settings.kl_in_loss else 0.0
    if beta > 0 and settings.kl_is_weighted:  # TRL use_bias_correction_kl, slime --use-unbiased-kl: the same weight
        kl = w.to(kl.dtype) * kl
    return beta * kl if beta > 0 else None
