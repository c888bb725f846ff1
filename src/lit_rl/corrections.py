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
        Training-Inference Mismatch" (blog post), and IcePop (Ling Team 2025, "Every Step Evolves",
        arXiv 2510.18855): kept tokens keep their weight, ℓ_t · w_t · 1[low ≤ w_t ≤ high]; TRL's
        ``vllm_importance_sampling_mode="token_mask"|"sequence_mask"``. The mask-only form (no weight)
        is verl's rejection sampling (``rollout_rs``).
    Mismatch decomposition r_num · r_stale and the three KLs: "Building Intuition for RL Systems"
        (shared/seeds/002); k3 KL estimator: Schulman 2020, "Approximating KL Divergence".
    Score centering: Marek & Ryabinin 2026, as condensed in shared/SPEC.md ("Train–inference
        corrections") and the slides in shared/seeds/000: s̄ = E_μ[∇log π] and its top-k form.

Composition (SPEC "Composition"; ``correction=sc+tis|sc+mis``). A corrected per-token loss is
    L_t = w_{y_t} · ℓ_t − Σ_{v∈H} sg(c_v μ_v w_v − c_tail α π_v) · log π_v,
where ℓ_t is the objective's per-token loss, c_v = ∂ℓ_t/∂log π evaluated as if v had been sampled
(the objective's coefficient: −A for REINFORCE, −A·r_v·1[not clipped] for PPO, ...), and w_v = f(π_old,v /
μ_v) the correction's weight (TIS f(r) = min(r, C); MIS f(r) = r·1[low ≤ r ≤ high], mask-only
1[low ≤ r ≤ high]; none f ≡ 1). Its gradient is c_y w_y ∇log π_y − E_μ[c w ∇log π]: the centring is
taken under the SAME weights as the sampled term, so under a constant reward its expectation over y_t ~ μ
is 0 at every position, whether or not the cap binds or tokens are masked. Centring with the unweighted s̄
and multiplying by w_y instead (gradient A·w_y·(∇log π_y − s̄)) has expectation −A·s̄ when the cap does
not bind: exactly the drift SC exists to remove, with the sign flipped (SPEC test vector 15).
"""

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

# ``correction`` -> the parts it turns on (``tis``, ``mis``, ``sc``): the one list of corrections, torch-free there
# so that config.validate checks it before torch loads
from lit_rl.choices import CORRECTIONS  # noqa: F401  (re-exported)
from lit_rl.objectives import masked_mean, masked_sum
from lit_rl.rejection import RS_RULES

LEVELS = ("token", "sequence", "geometric")
#: the levels TIS takes (a geometric-mean weight is MIS's rejection rule, verl's ``geometric``)
TIS_LEVELS = ("token", "sequence")

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
    ``level="geometric"``: the geometric mean of its valid token ratios, exp(mean_t log r_t) (verl's
    geometric rejection sampling), broadcast over its tokens.

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
    log_w = _level_log_ratio(_valid_log_ratio(old_logprobs, rollout_logprobs, mask), level, mask)
    weights = torch.exp(log_w)
    return torch.where(mask.bool(), weights, torch.ones_like(weights))


def tis_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, cap: float = 2.0, level: str = "token"
) -> tuple[Tensor, dict]:
    """Truncated importance sampling (TIS, Yao et al. 2025): sg(min(w, cap)) per token.

    Multiply the per-token policy-gradient term by these weights (with score centering on top, use
    ``corrected_policy_loss``, which centres under the same weights). TIS's truncation is not PPO's clip: it caps
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
    kept when low ≤ w ≤ high; a NaN weight is never kept. This is the mask only; MIS as IcePop and
    TRL define it also keeps the weight on the kept tokens (``correction_weights`` with
    ``WeightFunction(mis_band=..., mis_weighted=True)``, what the trainer uses). The dropped tokens
    still count in the loss's denominators in lit_rl, as in IcePop and TRL; verl's rejection sampling
    shrinks the denominators instead (its modified response mask). The SPEC's band [1/C, C] is
    ``low=1/C, high=C``; a threshold on |log w| ≤ τ is ``low=exp(−τ), high=exp(τ)``.

    Args:
        old_logprobs: float [N, T], trainer log-probs π_train.
        rollout_logprobs: float [N, T], rollout engine log-probs π_b.
        mask: bool or 0/1 float [N, T].
        low: lower bound of the kept band, ≥ 0.
        high: upper bound of the kept band, ≥ ``low``.
        level: ``"token"``, ``"sequence"`` or ``"geometric"`` (the geometric mean of the sequence's ratios).

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
# A correction as one weight function w = f(r), for the sampled token and for the head alike
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightFunction:
    """The train–inference correction's weight w = f(r) of a token whose ratio is r = π_old / μ.

    f(r) = t(r) · 1[low ≤ r_mis ≤ high] with t(r) = clip(r_tis, L, C) when TIS is on (L = 0 unless
    ``tis_low``), r_mis when only weighted MIS is on, and 1 otherwise (none, mask-only MIS). At
    ``level="sequence"`` the ratio is the sequence's product ratio W_i = Π_t r_t (broadcast over its tokens)
    instead of the token's r_t. MIS at ``level="geometric"`` (verl's geometric rejection) keeps or drops the
    whole sequence by its geometric mean G_i = exp(mean_t log r_t), and weighted MIS then keeps each kept
    token's own r_t (not G_i).

    Fields:
        tis_cap: TIS cap C > 0 (Yao et al. 2025), or None: TIS off.
        tis_low: TIS lower bound L with 0 < L ≤ min(1, C) (TRL's ``vllm_importance_sampling_clip_min``), or
            None: no lower bound.
        tis_level: "token" | "sequence".
        mis_band: (low, high) with 0 ≤ low ≤ high, or None: MIS off.
        mis_level: "token" | "sequence" | "geometric".
        mis_weighted: True: kept tokens keep their weight r (MIS as IcePop and TRL's ``token_mask`` /
            ``sequence_mask`` define it); False: mask only (verl's rejection sampling ``rollout_rs``).

    Raises:
        ValueError (at construction): a cap ≤ 0, a bad lower bound or band, or an unknown level.
    """

    tis_cap: Optional[float] = None
    tis_level: str = "token"
    mis_band: Optional[tuple[float, float]] = None
    mis_level: str = "token"
    mis_weighted: bool = True
    tis_low: Optional[float] = None
    #: the name of the dropped fraction's metric (``rs_maskfrac`` when the band is verl's token_k1 rejection)
    mask_metric: str = "mis_maskfrac"

    def __post_init__(self):
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError(f"TIS cap must be > 0, got {self.tis_cap}")
        if self.tis_low is not None and not 0 < self.tis_low <= min(1.0, self.tis_cap or 1.0):
            raise ValueError(f"TIS lower bound must lie in (0, min(1, cap)], got {self.tis_low}")
        if self.tis_level not in TIS_LEVELS:
            raise ValueError(f"Unknown TIS level {self.tis_level!r}; expected one of {TIS_LEVELS}")
        if self.mis_band is not None and not 0 <= self.mis_band[0] <= self.mis_band[1]:
            raise ValueError(f"MIS band needs 0 <= low <= high, got {self.mis_band}")
        for name in ("tis_level", "mis_level"):
            if getattr(self, name) not in LEVELS:
                raise ValueError(f"Unknown importance-weight level {getattr(self, name)!r}; expected one of {LEVELS}")

    @property
    def is_identity(self) -> bool:
        """True when neither TIS nor MIS is on (f ≡ 1)."""
        return self.tis_cap is None and self.mis_band is None

    def log_weight(self, log_r_tis: Tensor, log_r_mis: Tensor, log_r_token: Optional[Tensor] = None) -> Tensor:
        """log f elementwise (−inf where MIS drops, NaN ratios dropped by MIS), from log-ratios at the
        TIS and MIS levels (same shape; equal at token level) and, for weighted MIS at the geometric level,
        the token's own log-ratio ``log_r_token`` (None: ``log_r_mis``). Works in the log domain, so a
        sequence ratio that would overflow exp() is still exact."""
        out = torch.zeros_like(log_r_tis)
        if self.tis_cap is not None:
            low = -math.inf if self.tis_low is None else math.log(self.tis_low)
            out = log_r_tis.clamp(min=low, max=math.log(self.tis_cap))
        elif self.mis_band is not None and self.mis_weighted:
            geometric = self.mis_level == "geometric" and log_r_token is not None
            out = log_r_token if geometric else log_r_mis
        if self.mis_band is not None:
            low, high = self.mis_band
            log_low = math.log(low) if low > 0 else -math.inf
            keep = (log_r_mis >= log_low) & (log_r_mis <= math.log(high))
            out = torch.where(keep, out, torch.full_like(out, -math.inf))
        return out


def correction_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, rule: WeightFunction
) -> tuple[Tensor, Tensor, Tensor, Tensor, dict]:
    """The sampled tokens' correction weights w_y = f(π_old / μ), without gradient, and their metrics.

    Multiply the per-token objective by ``weights`` (use ``torch.where(weights > 0, ...)`` so a dropped
    token's loss, even inf/NaN, leaves no trace); the reduction's denominators stay those of the
    unmasked step (IcePop, TRL; not verl's rejection sampling, which shrinks them).

    Args:
        old_logprobs: float [N, T], trainer log-probs π_old (detached here).
        rollout_logprobs: float [N, T], rollout engine log-probs μ (detached here).
        mask: bool or 0/1 float [N, T] of valid tokens.
        rule: the ``WeightFunction``.

    Returns:
        (weights, context_tis, context_mis, mis_scale, metrics):
            weights: float [N, T] (float32 for half inputs): f on valid tokens (0 where MIS drops), 1 on
                padding.
            context_tis / context_mis: float [N, T], the rest of the level's log-ratio once the token's own
                part is taken out: log W_i − log r_t at sequence level, log G_i − log r_t / T_i at the
                geometric level, 0 at token level (and on padding). The weight a head token v would get at
                position t is f evaluated at scale · log r_v + context (``centering_term``).
            mis_scale: float [N, T], the factor of the token's own log-ratio in the MIS level's: 1/T_i at
                the geometric level, else 1.
            metrics: detached 0-dim tensors over valid tokens: with TIS ``tis`` (mean untruncated w),
                ``tis_abs`` (mean |w − 1|), ``tis_clipfrac`` (fraction with w > C; with a lower bound also
                ``tis_clipfrac_low``, fraction with w < L); with MIS ``mis_maskfrac`` (fraction dropped).
                Sequence-level values count each token.

    Raises:
        ValueError: on shape mismatch.
    """
    log_r = _valid_log_ratio(old_logprobs, rollout_logprobs, mask)
    log_r_tis = _level_log_ratio(log_r, rule.tis_level, mask)
    log_r_mis = _level_log_ratio(log_r, rule.mis_level, mask)
    valid = mask.bool()
    log_w = rule.log_weight(log_r_tis, log_r_mis, log_r)
    weights = torch.where(valid, log_w.exp(), torch.ones_like(log_w))
    metrics = {}
    if rule.tis_cap is not None:
        w_tis = log_r_tis.exp()
        metrics["tis"] = masked_mean(w_tis, mask)
        metrics["tis_abs"] = masked_mean((w_tis - 1.0).abs(), mask)
        metrics["tis_clipfrac"] = masked_mean((w_tis > rule.tis_cap).to(w_tis.dtype), mask)
        if rule.tis_low is not None:
            metrics["tis_clipfrac_low"] = masked_mean((w_tis < rule.tis_low).to(w_tis.dtype), mask)
    if rule.mis_band is not None:
        dropped = valid & torch.isneginf(log_w)
        metrics[rule.mask_metric] = masked_mean(dropped.to(weights.dtype), valid)
    zero = torch.zeros_like(log_r)
    mis_scale = torch.ones_like(log_r)
    if rule.mis_level == "geometric":
        mis_scale = (1.0 / valid.sum(-1, keepdim=True).clamp(min=1).to(log_r.dtype)).expand_as(log_r)
    context_tis = torch.where(valid, log_r_tis - log_r, zero)
    context_mis = torch.where(valid, log_r_mis - mis_scale * log_r, zero)
    return weights, context_tis, context_mis, mis_scale, metrics


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
            ``"train_inference_kl_reverse"``: estimate of the reverse KL(π_old || μ) = E_μ[w log w] from the
                same tokens, w = exp(d) = π_old / μ: mean of w·d − (w − 1) (each term ≥ 0; unbiased when
                E_μ[w] = 1, i.e. μ covers π_old's support; the −(w − 1) term is the control variate that
                makes every term non-negative, as k3 does for the forward direction).

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
        "train_inference_kl_reverse": masked_mean(log_r_num.exp() * log_r_num - torch.expm1(log_r_num), mask),
    }


#: a token whose ratio π_old/μ lies outside [1/EXTREME_RATIO, EXTREME_RATIO] counts in ``train/is_extreme_frac``
EXTREME_RATIO = 10.0
#: a sequence's log-ratio is clamped to ±LOG_W_CLAMP in the moments, so its w² stays finite in float64
LOG_W_CLAMP = 300.0
#: the raw moments ``importance_moments`` logs, which ``importance_diagnostics`` turns into ESS and χ²
MOMENTS = {"": ("is_w:m1", "is_w:m2"), "_seq": ("is_w_seq:m1", "is_w_seq:m2")}


def importance_moments(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> tuple[dict, dict]:
    """The first two moments of the importance weights w = π_old/μ, per token and per sequence, for the step's
    effective sample size and χ² (``importance_diagnostics``), and the fraction of extreme-ratio tokens.

    Means, not ESS itself, are what a micro-batch returns: the trainer adds means weighted by their counts over
    micro-batches and ranks (``MetricSums``), so the ESS of the whole step is exact whatever the micro-batch size.

    Args:
        old_logprobs: float [N, T], log π_old. rollout_logprobs: float [N, T], log μ. mask: bool [N, T].

    Returns:
        (token means, sequence means), detached float64 0-dim tensors (0 for an empty mask):
            token (average over valid tokens): ``"is_w:m1"`` mean w_t, ``"is_w:m2"`` mean w_t²,
            ``"is_extreme_frac"`` fraction with w_t outside [1/``EXTREME_RATIO``, ``EXTREME_RATIO``];
            sequence (average over sequences with a valid token): ``"is_w_seq:m1"``, ``"is_w_seq:m2"`` of the
            product ratio W_i = Π_t w_t, its log clamped to ±``LOG_W_CLAMP``.

    Raises:
        ValueError: on shape mismatch.
    """
    log_r = _valid_log_ratio(old_logprobs, rollout_logprobs, mask).double()
    valid = mask.bool()
    rows = valid.any(-1)
    log_w_seq = log_r.sum(-1).clamp(-LOG_W_CLAMP, LOG_W_CLAMP)
    extreme = log_r.abs() > math.log(EXTREME_RATIO)
    token = {
        "is_w:m1": masked_mean(log_r.exp(), valid),
        "is_w:m2": masked_mean((2 * log_r).exp(), valid),
        "is_extreme_frac": masked_mean(extreme.double(), valid),
    }
    sequence = {
        "is_w_seq:m1": masked_mean(log_w_seq.exp(), rows),
        "is_w_seq:m2": masked_mean((2 * log_w_seq).exp(), rows),
    }
    return token, sequence


def effective_sample_size(weights: Tensor) -> float:
    """ESS / n = (Σ w)² / (n Σ w²) of importance weights [n] (Kish): 1 when all are equal, 1/n when one carries
    everything. Weights [0.5, 1, 1.5, 3] give 36 / (4 · 12.5) = 0.72. 1.0 for an empty or all-zero vector."""
    w = weights.double().flatten()
    second = float((w**2).sum())
    return float(w.sum()) ** 2 / (len(w) * second) if second > 0 else 1.0


def importance_diagnostics(means: dict[str, float], prefix: str = "train/") -> dict[str, float]:
    """``means`` with the raw moments of ``importance_moments`` (under ``prefix``) replaced by what they give:
    ``is_ess`` = m1²/m2 (ESS / n of the token weights, ``effective_sample_size``), ``is_chi2`` = m2/m1² − 1 (the
    χ² divergence of π_old from μ estimated from the weights, self-normalised: verl's ``chi2 = E[w²] − 1`` when
    mean w = 1) and ``is_ess_seq`` / ``is_chi2_seq`` of the sequence weights. Without moments, ``means``
    unchanged; with none counted (m2 = 0), ESS 1 and χ² 0. Returns a new dict."""
    out = dict(means)
    for suffix, (first, second) in MOMENTS.items():
        if prefix + first not in out:
            continue
        m1, m2 = out.pop(prefix + first), out.pop(prefix + second)
        ok = m2 > 0 and m1 > 0 and math.isfinite(m2)
        out[f"{prefix}is_ess{suffix}"] = m1 * m1 / m2 if ok else (0.0 if m2 > 0 else 1.0)
        out[f"{prefix}is_chi2{suffix}"] = m2 / (m1 * m1) - 1.0 if ok else (math.inf if m2 > 0 else 0.0)
    return out


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
    return centering_term(logprobs_head, rollout_head_logprobs, head_mask=head_mask)


CoefFn = Callable[[Tensor], Tensor]


def centering_term(
    logprobs_head: Tensor,
    rollout_head_logprobs: Tensor,
    *,
    coef: Optional[CoefFn] = None,
    old_head_logprobs: Optional[Tensor] = None,
    rule: Optional[WeightFunction] = None,
    context_tis: Optional[Tensor] = None,
    context_mis: Optional[Tensor] = None,
    head_mask: Optional[Tensor] = None,
    mis_scale: Optional[Tensor] = None,
    tail_samples: int = 0,
) -> Tensor:
    """Σ_{v∈H} sg(c_v μ_v w_v − c_tail α π_v) · log π_v, whose gradient is E_μ[c · w · ∇log π].

    The expectation, under the sampler μ, of what one token contributes to the corrected gradient:
    c_v is the objective's coefficient ∂ℓ_t/∂log π had v been sampled (``coef``), w_v the correction's
    weight f(π_old,v / μ_v) (``rule``). Subtracted from the sampled term w_y · ℓ_t it makes the estimator
    centred under the same weights (module docstring, "Composition"). With c ≡ 1 and f ≡ 1 it is plain
    score centering, Σ_H sg(μ_v − ρ π_v) log π_v (``score_centering_term``).

    The tail v ∉ H (not recorded by the engine) is filled with the trainer, rescaled: μ_v ≈ ρ_old π_old,v
    with ρ_old = (1 − Σ_H μ) / (1 − Σ_H π_old), weight f(1 / ρ_old), and a tail ratio π_θ / π_old ≈
    r_tail = (1 − Σ_H π_θ) / (1 − Σ_H π_old) for the coefficient c_tail = c(r_tail). Because
    Σ_v π_v ∇log π_v = 0 (π = π_θ), the tail's Σ_{v∉H} μ_v w_v c_v ∇log π_v becomes
    −c_tail α Σ_{v∈H} π_v ∇log π_v with α = ρ f(1/ρ_old), ρ = (1 − Σ_H μ) / (1 − Σ_H π_θ): only k
    terms. At the first optimizer step (π_θ = π_old) α = min(1, C ρ) for TIS, 1[1/high ≤ ρ ≤ 1/low]
    for weighted MIS, ρ·1[1/high ≤ ρ ≤ 1/low] for mask-only MIS and ρ for plain SC. With the full
    vocabulary as the head (k = V) the term is exact; with k < V it is exact when the engine's tail is
    proportional to the trainer's, and otherwise leaves a residual of the tail's mismatch.

    The sampled tail (``tail_samples`` = m > 0, ``correction.sc.tail=sampled``; beyond the documents, which only
    rescale): the last m entries are tail tokens u_1..u_m the engine drew i.i.d. from its own tail
    μ_tail = μ restricted to v ∉ H and renormalised, with their log μ_u (``SamplingConfig.logprobs_tail_samples``).
    The tail is then estimated without the trainer:
        Σ_{v∉H} μ_v c_v w_v ∇log π_v ≈ (1 − Σ_H μ) · (1/m) Σ_j c_{u_j} w_{u_j} ∇log π_{u_j},
    unbiased over the draws for ANY head ((1 − Σ_H μ) E_{u~μ_tail}[g(u)] = Σ_{v∉H} μ_v g(v)), so the centring is
    exact in expectation where the rescaled tail leaves the tail's mismatch; its cost is the noise the m draws add
    (docs/results/sampled_tail). w_u = f(π_old,u / μ_u) and c_u = c(π_θ,u / π_old,u) as for a head token, α = 0.

    Everything inside sg(·) is computed in float64 from detached inputs (k numbers per token): ρ, α, π_v,
    μ_v w_v in its safe form exp(log μ_v + log f) (= min(π_old,v, C μ_v) for TIS; μ_v = 0 gives 0).

    Edge cases (as ``score_centering_term``): no tail when 1 − Σ_H π_θ or 1 − Σ_H π_old ≤ ``TAIL_EPS``
    (then α = 0); 1 − Σ_H μ is clamped at 0; an entry is used only where ``head_mask`` keeps it, its
    trainer (and old) log-probs are finite and its engine log-prob is not NaN (−inf is kept: μ_v = 0).

    Args:
        logprobs_head: float [N, T, k], trainer log π_θ at the head ids (WITH gradient).
        rollout_head_logprobs: float [N, T, k], the engine's log μ_v of the same ids (detached here).
        coef: the objective's per-token coefficient as a function of log(π_θ / π_old): float [N, T, J] ->
            [N, T, J], elementwise over J (e.g. ``lambda lr: -A[:, None, None].expand_as(lr)`` for
            REINFORCE). Called once with J = k + 1 (the head ids, then the tail ratio). None: c ≡ 1.
        old_head_logprobs: float [N, T, k], log π_old at the head ids (the weights use it), or None:
            π_old = π_θ (one optimizer step per rollout batch).
        rule: the correction's ``WeightFunction``; None: f ≡ 1.
        context_tis / context_mis: float [N, T] from ``correction_weights`` (sequence level: the other
            tokens' part of the sequence ratio, so a head token's weight is f(W_i · r_v / r_y)); None = 0.
        head_mask: optional bool [N, T, k], True for the head entries to use.
        mis_scale: float [N, T] from ``correction_weights`` (geometric MIS: 1/T_i, so a head token's MIS
            ratio is exp(log G_i + (log r_v − log r_y) / T_i)); None = 1.
        tail_samples: m, the number of trailing entries that are tail samples (0: none, the rescaled tail). An
            engine with an empty tail (Σ_H μ = 1) writes them with log μ_u = −inf: they are skipped.

    Returns:
        float [N, T] (dtype of ``logprobs_head``), gradient through ``logprobs_head`` only; padding
        positions are not masked.

    Raises:
        ValueError: on shape mismatch, inputs that are not [N, T, k], or ``coef`` returning another shape, or
            ``tail_samples`` outside [0, k].
    """
    if logprobs_head.dim() != 3:
        raise ValueError(f"logprobs_head must be [N, T, k], got shape {tuple(logprobs_head.shape)}")
    _check_same_shape(logprobs_head, rollout_head_logprobs, "logprobs_head", "rollout_head_logprobs")
    lp = logprobs_head.detach().double()
    lmu = rollout_head_logprobs.detach().double()
    if old_head_logprobs is None:
        lp_old = lp
    else:
        _check_same_shape(logprobs_head, old_head_logprobs, "logprobs_head", "old_head_logprobs")
        lp_old = old_head_logprobs.detach().double()
    width = lp.shape[-1]
    if not 0 <= tail_samples <= width:
        raise ValueError(f"tail_samples must lie in [0, {width}] (the recorded entries per token), got {tail_samples}")
    valid = torch.isfinite(lp) & torch.isfinite(lp_old) & ~torch.isnan(lmu)
    if head_mask is not None:
        _check_same_shape(logprobs_head, head_mask, "logprobs_head", "head_mask")
        valid = valid & head_mask.bool()
    # the tail samples are the last ``tail_samples`` entries, used where μ_u > 0 (an engine writes −inf: no tail)
    is_sample = (torch.arange(width, device=lp.device) >= width - tail_samples).expand_as(lp)
    in_head = valid & ~is_sample
    valid = in_head | (valid & is_sample & torch.isfinite(lmu))

    zeros = torch.zeros_like(lp)
    pi = torch.where(in_head, lp.exp(), zeros)
    tail_pi = 1.0 - pi.sum(-1, keepdim=True)
    tail_old = 1.0 - torch.where(in_head, lp_old.exp(), zeros).sum(-1, keepdim=True)
    tail_mu = (1.0 - torch.where(in_head, lmu.exp(), zeros).sum(-1, keepdim=True)).clamp(min=0.0)
    has_tail = (tail_pi > TAIL_EPS) & (tail_old > TAIL_EPS)
    no_tail = torch.full_like(tail_pi, -math.inf)
    safe = lambda x: torch.where(has_tail, x, torch.ones_like(x))  # noqa: E731  (no log of a non-positive tail)
    log_rho = torch.where(has_tail, tail_mu.log() - safe(tail_pi).log(), no_tail)
    log_r_tail = torch.where(has_tail, safe(tail_pi).log() - safe(tail_old).log(), torch.zeros_like(tail_pi))

    # the μ-mass each entry stands for: μ_v on the head, (1 − Σ_H μ) / m for each of the m tail samples
    log_mass = torch.where(is_sample, (tail_mu / max(tail_samples, 1)).log().expand_as(lmu), lmu)
    if rule is None or rule.is_identity:
        mu_w = torch.where(valid, log_mass.exp(), zeros)
        log_alpha = log_rho
    else:
        ctx_t = 0.0 if context_tis is None else context_tis.detach().double().unsqueeze(-1)
        ctx_m = 0.0 if context_mis is None else context_mis.detach().double().unsqueeze(-1)
        s_m = 1.0 if mis_scale is None else mis_scale.detach().double().unsqueeze(-1)

        def f(log_r):  # log f at the ratio log_r of a head (or tail) token in place of the sampled one
            return rule.log_weight(log_r + ctx_t, s_m * log_r + ctx_m, log_r)

        log_r = lp_old - lmu  # +inf where mu_v = 0: every f maps it to a finite value or to -inf
        mu_w = torch.where(valid, (log_mass + f(log_r)).exp(), zeros)
        log_r_old_tail = torch.where(has_tail, -(tail_mu.log() - safe(tail_old).log()), no_tail)
        log_alpha = log_rho + f(log_r_old_tail)
        log_alpha = torch.where(has_tail, log_alpha, no_tail)
    alpha = log_alpha.exp() if not tail_samples else torch.zeros_like(tail_pi)  # sampled: no rescaled tail

    if coef is None:
        c_head, c_tail = 1.0, 1.0
    else:
        c = coef(torch.cat([lp - lp_old, log_r_tail], dim=-1))
        if c.shape != (*lp.shape[:2], lp.shape[2] + 1):
            raise ValueError(f"coef must map [N, T, J] to [N, T, J], got {tuple(c.shape)} for J = {lp.shape[2] + 1}")
        c = c.detach().double()
        c_head, c_tail = c[..., :-1], c[..., -1:]
    weights = torch.where(valid, c_head * mu_w - c_tail * alpha * pi, zeros).to(logprobs_head.dtype)

    # Zero the unused entries before multiplying, so no -inf / NaN reaches the forward or backward.
    safe_logprobs = torch.where(valid, logprobs_head, torch.zeros_like(logprobs_head))
    return (weights * safe_logprobs).sum(-1)


def corrected_policy_loss(
    token_loss: Tensor,
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    rule: WeightFunction,
    *,
    score_centering: bool = False,
    coef: Optional[CoefFn] = None,
    logprobs_head: Optional[Tensor] = None,
    rollout_head_logprobs: Optional[Tensor] = None,
    old_head_logprobs: Optional[Tensor] = None,
    head_mask: Optional[Tensor] = None,
    tail_samples: int = 0,
) -> tuple[Tensor, dict]:
    """The corrected per-token policy-gradient loss
    L_t = w_y · ℓ_t − [SC] Σ_{v∈H} sg(c_v μ_v w_v − c_tail α π_v) log π_v.

    The one place where TIS, MIS and score centering meet an objective (module docstring,
    "Composition"; SPEC test vector 15): the sampled token's loss ℓ_t is weighted by w_y = f(π_old / μ)
    (``correction_weights``), and with score centering the expected weighted score under μ is subtracted
    with the objective's own coefficient (``centering_term``). A token MIS drops keeps its centring term:
    the expectation over y_t includes the dropped outcomes, so the centring belongs to every position.
    Gradient: c_y w_y ∇log π_y − E_μ[c w ∇log π]; under a constant advantage its expectation over y_t ~ μ
    is 0 whatever the cap or band, and on-policy (μ = π_old) it equals the uncorrected gradient in
    expectation.

    Args:
        token_loss: float [N, T], the objective's per-token loss ℓ_t (with gradient through log π_θ(y_t)).
        old_logprobs: float [N, T], log π_old of the sampled tokens.
        rollout_logprobs: float [N, T], log μ of the sampled tokens.
        mask: bool or 0/1 float [N, T] of valid tokens.
        rule: the ``WeightFunction`` (identity for ``correction=none|sc``).
        score_centering: subtract the centring term (needs ``logprobs_head``, ``rollout_head_logprobs``).
        coef, logprobs_head, rollout_head_logprobs, old_head_logprobs, head_mask, tail_samples: see
            ``centering_term``.

    Returns:
        (loss [N, T] — 0 where MIS dropped the token and SC is off; padding not masked —, metrics of
        ``correction_weights``).

    Raises:
        ValueError: on shape mismatch, or score centering without the head's log-probs.
    """
    _check_same_shape(token_loss, mask, "token_loss", "mask")
    if rule.is_identity:
        loss, context_tis, context_mis, mis_scale, metrics = token_loss, None, None, None, {}
    else:
        weights, context_tis, context_mis, mis_scale, metrics = correction_weights(
            old_logprobs, rollout_logprobs, mask, rule
        )
        weights = weights.to(token_loss.dtype)
        loss = torch.where(weights > 0, token_loss * weights, torch.zeros_like(token_loss))
    if score_centering:
        if logprobs_head is None or rollout_head_logprobs is None:
            raise ValueError("score centering needs the trainer's and the engine's log-probs at the head ids")
        loss = loss - centering_term(
            logprobs_head,
            rollout_head_logprobs,
            coef=coef,
            old_head_logprobs=old_head_logprobs,
            rule=rule,
            context_tis=context_tis,
            context_mis=context_mis,
            head_mask=head_mask,
            mis_scale=mis_scale,
            tail_samples=tail_samples,
        )
    return loss, metrics


# ----------------------------------------------------------------------------------------------
# The proximal policy of the decoupled objective (AReaL)
# ----------------------------------------------------------------------------------------------

#: ``correction.proximal``: how π_prox, the PPO ratio's denominator, is obtained (``schema.CorrectionConfig``)
PROXIMAL_METHODS = ("trainer", "loglinear")


def loglinear_proximal_logprobs(
    rollout_logprobs: Tensor,
    logprobs: Tensor,
    token_versions: Tensor,
    proximal_version: int,
    current_version: int,
    mask: Tensor,
) -> Tensor:
    """The log-linear proximal policy (Fu et al. 2025, "AReaL", arXiv 2505.24298; AReaL's
    ``prox_logp_method=loglinear``): log π_prox of the sampled tokens interpolated in log space, by weight version,
    between the behaviour policy μ that sampled each token and the current policy π_θ, so that the trainer's π_prox
    (π_old) pass is skipped:

        α_t = (v_prox − v_b,t) / (v_θ − v_b,t) clamped to [0, 1],
        log π_prox,t ≈ log μ_t + α_t · (log π_θ,t − log μ_t),

    v_b,t the version that sampled token t, v_prox the version the update cycle started from (π_old, whose
    log-probs the ratio π_θ/π_prox wants), v_θ the version of the weights now being trained. Versions count
    optimizer steps (lit_rl's ``policy_version``), so v_θ − v_prox is the number of updates the cycle has taken.
    The two ends are exact: when v_θ = v_prox (the cycle's first update; every update with one optimizer step
    per batch) the current policy IS π_prox and its log-probs are returned as they are (α = 1 on every token,
    a fresh row's too); a token sampled by the proximal version itself (v_b = v_prox < v_θ) gets α = 0, log μ,
    which is π_old up to the numerical gap (bit for bit under ``kernels=batch_invariant``).

    AReaL's convention differs in its version count: one version per training step, v_prox = v_θ − 1 for every
    minibatch of the step (α = (v_θ − 1 − v_b)/(v_θ − v_b)), and α = 0 (log μ) for a token with v_b = v_θ. μ is
    the sampler's log-prob (``rollout_logprobs``, AReaL's ``old_logp``), not the trainer's scores under the
    behaviour weights (``behaviour_logprobs``, which need the very forward this skips).

    Args:
        rollout_logprobs: float [N, T], log μ of the sampled tokens.
        logprobs: float [N, T], log π_θ of the sampled tokens now (detached here).
        token_versions: int [N, T], v_b per token (``RolloutBatch.token_versions``).
        proximal_version: v_prox, the version the update cycle started from.
        current_version: v_θ ≥ v_prox, the version of the weights being trained.
        mask: bool or 0/1 float [N, T] of valid tokens.

    Returns:
        float [N, T] (``logprobs``' dtype), no gradient; ``logprobs`` itself (detached) on padding.

    Raises:
        ValueError: on shape mismatch, or ``current_version`` < ``proximal_version``.
    """
    _check_same_shape(rollout_logprobs, logprobs, "rollout_logprobs", "logprobs")
    _check_same_shape(token_versions, mask, "token_versions", "mask")
    _check_same_shape(logprobs, mask, "logprobs", "mask")
    if current_version < proximal_version:
        raise ValueError(
            f"current_version={current_version} is older than proximal_version={proximal_version}: the weights "
            "being trained cannot precede the update cycle's start"
        )
    current = logprobs.detach()
    if current_version == proximal_version:
        return current
    alpha = loglinear_alpha(token_versions, proximal_version, current_version).to(current.dtype)
    mu = rollout_logprobs.detach().to(current.dtype)
    approx = mu + alpha * (current - mu)
    return torch.where(mask.bool(), approx, current)


def loglinear_alpha(token_versions: Tensor, proximal_version: int, current_version: int) -> Tensor:
    """float64 [N, T]: the log-linear proximal policy's α = (v_prox − v_b) / (v_θ − v_b) clamped to [0, 1] per
    token (``loglinear_proximal_logprobs``), 1 on every token when v_θ = v_prox. ``token_versions``: int [N, T]."""
    v_b = token_versions.to(torch.float64)
    if current_version == proximal_version:
        return torch.ones_like(v_b)
    return ((proximal_version - v_b) / (current_version - v_b)).clamp(0.0, 1.0)  # v_θ > v_prox ≥ v_b: finite


def loglinear_proximal_head(rollout_head_logprobs: Tensor, head_logprobs: Tensor, alpha: Tensor) -> Tensor:
    """float [N, T, k]: the log-linear π_prox at the engine's head ids, for score centering's weights and ratios:
    (1 − α_t) log μ_v + α_t log π_θ,v with the position's α_t (``loglinear_alpha``, [N, T]), exactly log μ_v where
    α = 0 and log π_θ,v where α = 1; −inf where μ_v = 0 and α < 1. ``rollout_head_logprobs``: the engine's top-k
    log-probs [N, T, k]; ``head_logprobs``: π_θ's at the same ids [N, T, k] (detached here). Raises ValueError on
    shape mismatch."""
    _check_same_shape(rollout_head_logprobs, head_logprobs, "rollout_head_logprobs", "head_logprobs")
    current = head_logprobs.detach()
    mu = rollout_head_logprobs.detach().to(current.dtype)
    a = alpha.to(current.dtype)[..., None].expand_as(current)
    mixed = (1 - a) * mu + a * current
    return torch.where(a == 0, mu, torch.where(a == 1, current, mixed))


# ----------------------------------------------------------------------------------------------
# The ``correction`` config group: names and wiring
# ----------------------------------------------------------------------------------------------


def weight_function(correction) -> WeightFunction:
    """The ``correction`` config group's TIS / MIS settings as the weight function f of the ratio
    (``WeightFunction``); the identity for ``correction=none|sc``. The token rule of the rejection family
    (``rs.rule=token_k1``, |log w| ≤ τ) is mask-only MIS with the band [e^{−τ}, e^τ] and is applied here, so score
    centering takes it into account; the sequence rules are ``rejection.sequence_masks``. ``correction``: the group as
    ``schema.CorrectionConfig`` (or anything with its ``tis`` and ``mis`` attributes)."""
    tis, mis = correction.tis, correction.mis
    rs = getattr(correction, "rs", None)
    tis_fields = dict(
        tis_cap=float(tis.cap) if tis.enabled else None,
        tis_low=float(tis.low) if tis.enabled and getattr(tis, "low", None) is not None else None,
        tis_level=tis.level,
    )
    if rs is not None and rs.enabled and rs.rule == "token_k1":  # verl's token_k1: mask-only MIS, band e^{±τ}
        tau = RS_RULES["token_k1"] if rs.threshold is None else float(rs.threshold)
        band = (math.exp(-tau), math.exp(tau))
        return WeightFunction(**tis_fields, mis_band=band, mis_weighted=False, mask_metric="rs_maskfrac")
    return WeightFunction(
        **tis_fields,
        mis_band=(float(mis.low), float(mis.high)) if mis.enabled else None,
        mis_level=mis.level,
        mis_weighted=bool(mis.weighted),
    )


def sc_tail_samples(correction) -> int:
    """m, the tail tokens the engine must draw per generated position for score centering's sampled tail
    (``correction.sc.tail=sampled``: ``correction.sc.tail_samples``; ``centering_term``), or 0: no score centering,
    or its rescaled tail (the default). ``correction``: the group as ``schema.CorrectionConfig`` (or anything with
    its ``sc`` attribute)."""
    sc = correction.sc
    if not sc.enabled or getattr(sc, "tail", "rescaled") != "sampled" or getattr(sc, "mode", "topk") == "exact":
        return 0
    return int(sc.tail_samples)


def batch_weight_scale(correction, rb, reduce: Optional[Callable[[Tensor], Tensor]] = None) -> Optional[Tensor]:
    """1/Z for the batch normalisation of TIS's weights (``correction.tis.batch_normalize``; verl's
    ``rollout_is_batch_normalize``), float64 [N] (the same for every row), or None when it is off.

    Z is the mean of the correction's weights f(π_old/μ) (``weight_function``, truncation and masks included) over
    the valid tokens of the rollout batch ``rb`` (``old_logprobs`` filled): the normalised weights average 1 over the
    batch. The loss assembly divides the corrected per-token loss by Z, score centering's term included, so the
    centring stays under the same weights. A statistic of the batch: its expectation is reached by Monte Carlo
    (``expectation.monte_carlo_gradient``). Z = 0 (every token dropped) leaves the scale at 1.

    Under data parallelism ``rb`` is this rank's share and ``reduce`` sums a float64 tensor over the ranks
    (``RLModule.all_reduce``, a collective): Z is then the whole step's, Σ weights / Σ valid tokens over every
    rank, as one device on the whole batch (to float64 summation order), not each rank's own (verl normalises
    each worker's share). None: ``rb`` is the whole batch."""
    tis = getattr(correction, "tis", None)
    if tis is None or not tis.enabled or not getattr(tis, "batch_normalize", False):
        return None
    weights = correction_weights(rb.old_logprobs, rb.rollout_logprobs, rb.response_mask, weight_function(correction))[0]
    mask = rb.response_mask
    totals = torch.stack([masked_sum(weights.double(), mask), mask.double().sum()]).cpu()
    if reduce is not None:
        totals = reduce(totals)
    total, count = (float(x) for x in totals)
    z = total / count if count > 0 else 0.0
    return torch.full((len(rb),), 1.0 / z if z > 0 else 1.0, dtype=torch.float64)


def correct_policy_loss(
    token_loss: Tensor,
    logprobs: Tensor,
    old_logprobs: Tensor,
    batch,
    rule: WeightFunction,
    *,
    score_centering: bool = False,
    logprobs_head: Optional[Tensor] = None,
    score_coefficients: Optional[Callable[[Tensor, Tensor], Tensor]] = None,
    tail_samples: int = 0,
) -> tuple[Tensor, dict]:
    """``corrected_policy_loss`` for one micro-batch of a ``RolloutBatch``: what an algorithm's update calls.

    Args:
        token_loss: float [n, T], the objective's per-token loss ℓ_t.
        logprobs: float [n, T], log π_θ of the sampled tokens (its detached value gives the sampled ratio).
        old_logprobs: float [n, T], log π_old.
        batch: the micro-batch (``rollout.types.RolloutBatch``): ``rollout_logprobs``, ``response_mask`` and,
            for score centering, ``topk_logprobs`` [n, T, k] and ``old_head_logprobs`` (or None).
        rule: the ``WeightFunction`` (``weight_function`` of the config group).
        score_centering: subtract the weighted centring term over the engine's head.
        logprobs_head: float [n, T, k], log π_θ at the head ids (score centering).
        score_coefficients: ``(log_ratio [n, T, J], sampled_log_ratio [n, T]) -> c [n, T, J]``, the objective's
            coefficient ∂ℓ_t/∂log π had each head token been sampled (``Algorithm.score_coefficients``).
        tail_samples: m, the tail samples the engine recorded after its head (``sc_tail_samples``; 0: the rescaled
            tail).

    Returns:
        (loss [n, T], metrics of ``correction_weights``), as ``corrected_policy_loss``.
    """
    kwargs = {}
    if score_centering:
        sampled_log_ratio = logprobs.detach() - old_logprobs.detach()
        kwargs = dict(
            score_centering=True,
            logprobs_head=logprobs_head,
            rollout_head_logprobs=batch.topk_logprobs,
            old_head_logprobs=batch.old_head_logprobs,
            head_mask=torch.isfinite(batch.topk_logprobs),
            coef=lambda log_ratio: score_coefficients(log_ratio, sampled_log_ratio),
            tail_samples=tail_samples,
        )
    return corrected_policy_loss(token_loss, old_logprobs, batch.rollout_logprobs, batch.response_mask, rule, **kwargs)


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
    0, while plain REINFORCE drifts by coef · s̄). Additive, no hyperparameter. Not for composing with
    TIS / MIS: passing coef = w · A centres with the unweighted s̄ and drifts by −A·s̄ (SPEC test vector
    15); ``corrected_policy_loss`` centres under the weights. For PPO pass coef = A · r where the clip
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


def _level_log_ratio(log_r: Tensor, level: str, mask: Tensor) -> Tensor:
    """Per-token log-ratios [N, T] (0 on padding) at ``level``: themselves, each row's sum broadcast
    (sequence), or each row's mean over its valid tokens broadcast (geometric)."""
    if level == "sequence":
        return log_r.sum(-1, keepdim=True).expand_as(log_r)
    if level == "geometric":
        return masked_mean(log_r, mask, dim=-1).unsqueeze(-1).expand_as(log_r)
    if level != "token":
        raise ValueError(f"Unknown importance-weight level {level!r}; expected one of {LEVELS}")
    return log_r


def _check_same_shape(a: Tensor, b: Tensor, name_a: str, name_b: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{name_a} and {name_b} must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
