"""The loss assembly's sections (``loss.assemble_loss``): ``correction``, ``advantage``, ``loss``, ``kl`` and
``distill``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from .base import Number, Problems, int_rule, is_number, rule

#: why vLLM cannot serve ``correction.sc.tail=sampled`` (the refusal here, ``engine=auto``'s choice in run.resolve)
TAIL_DRAWS_NOT_FROM_VLLM = (
    "from the sampler's own distribution at every position, which vLLM's log-prob output (its top-k) does not give"
)


@dataclass
class TisConfig:
    """``correction.tis``: truncated importance sampling, loss_t *= sg(min(pi_old/mu, cap))."""

    enabled: bool = False
    cap: Number = 2.0
    #: lower bound L in (0, min(1, cap)] (TRL's vllm_importance_sampling_clip_min): the weight min(max(w, L), cap);
    #: null = none
    low: Optional[Number] = None
    #: token | sequence
    level: str = "token"
    #: divide the weights by their mean over the batch's valid tokens (verl's rollout_is_batch_normalize): a batch
    #: statistic, computed once per batch from pi_old (``corrections.batch_weight_scale``)
    batch_normalize: bool = False


@dataclass
class MisConfig:
    """``correction.mis``: masked importance sampling (IcePop), loss_t *= w * 1[low <= w <= high]."""

    enabled: bool = False
    low: Number = 0.5
    high: Number = 2.0
    #: token | sequence | geometric (a sequence kept or dropped by the geometric mean of its ratios, verl's
    #: geometric rejection; weighted: kept tokens keep their own w_t)
    level: str = "token"
    #: true: kept tokens keep their weight w (IcePop, TRL); false: mask only (verl's rejection sampling)
    weighted: bool = True


@dataclass
class ScConfig:
    """``correction.sc``: score centering, c w_y grad log pi(y) - E_mu[c w grad log pi]."""

    enabled: bool = False
    #: head H: the engine's top-k per token (the tail: ``tail``)
    top_k: int = 128
    #: topk | exact (the full vocabulary; small models only)
    mode: str = "topk"
    #: the tail v not in H: rescaled (the trainer's pi, rescaled to the tail's mu-mass; the documents' form) |
    #: sampled (tail_samples tokens the engine draws per position from its own tail, an estimate exact in
    #: expectation for any k; embedded engine only: ``corrections.centering_term``)
    tail: str = "rescaled"
    #: m >= 1, the tail samples per generated position with tail=sampled
    tail_samples: int = 4
    #: ``correction.sc.tail``'s values
    tails: ClassVar[tuple[str, ...]] = ("rescaled", "sampled")


@dataclass
class OpsmConfig:
    """``correction.opsm``: off-policy sequence masking (DeepSeek-V3.2), drop a sequence with A < 0 whose mean
    log(mu / pi_theta) per token exceeds delta (``rejection.opsm_mask``)."""

    enabled: bool = False
    #: delta, nats per token (TRL off_policy_mask_threshold, slime --opsm-delta)
    delta: Number = 1.0e-4


@dataclass
class RsConfig:
    """``correction.rs``: the rejection family (``rejection.rejection_mask``), mask only."""

    #: the rules (``rejection.RS_RULES`` holds their default thresholds; the tests check the two agree)
    rules: ClassVar[tuple[str, ...]] = ("token_k1", "seq_sum_k1", "seq_mean_k3", "seq_max_k2", "outlier_veto")
    enabled: bool = False
    #: token_k1 | seq_sum_k1 | seq_mean_k3 | seq_max_k2 | outlier_veto (``rejection.RS_RULES``)
    rule: str = "seq_mean_k3"
    #: tau > 0; null = the rule's default (``rejection.RS_RULES``)
    threshold: Optional[Number] = None
    #: outlier_veto: a sequence with any token ratio pi_old/mu outside [low, high] is dropped (SkyRL)
    veto_band: list = field(default_factory=lambda: [1.0e-4, 100.0])


@dataclass
class M2poConfig:
    """``correction.m2po``: M2PO (arXiv 2510.01161), mask the tokens with the largest (log pi_old/mu)^2 until the
    batch's second moment is <= threshold (``rejection.m2po_bound``)."""

    enabled: bool = False
    #: tau, nats^2 (the paper's 0.04)
    threshold: Number = 0.04


@dataclass
class GuardConfig:
    """``correction.guard``: a check of the step's numerical train-inference gap (slime's CI threshold)."""

    #: warn or stop when train/logprob_abs_diff exceeds this (nats per token); null = off
    logprob_abs_diff_max: Optional[Number] = None
    #: warn (a warning, the run goes on) | stop (LogprobGapExceeded after the step's metrics are written)
    action: str = "warn"


@dataclass
class CorrectionConfig:
    """``correction``: train-inference corrections (``corrections.CORRECTIONS``; docs/corrections.md)."""

    #: one of ``corrections.CORRECTIONS``
    name: str = "none"
    tis: TisConfig = field(default_factory=TisConfig)
    mis: MisConfig = field(default_factory=MisConfig)
    sc: ScConfig = field(default_factory=ScConfig)
    opsm: OpsmConfig = field(default_factory=OpsmConfig)
    rs: RsConfig = field(default_factory=RsConfig)
    m2po: M2poConfig = field(default_factory=M2poConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    #: true: the rollout log-probs mu are pi_old, the trainer's pi_old pass is skipped (``algorithms.old_policy``)
    bypass: bool = False
    #: the PPO ratio's denominator pi_prox (``corrections.PROXIMAL_METHODS``): trainer (pi_old, the trainer's own
    #: log-probs at the update cycle's start) | loglinear (AReaL's log-linear interpolation between mu and pi_theta
    #: by weight version, the pi_old pass skipped: ``corrections.loglinear_proximal_logprobs``)
    proximal: str = "trainer"
    #: ``correction.proximal``'s values (``corrections.PROXIMAL_METHODS``; the tests check the two agree)
    proximal_methods: ClassVar[tuple[str, ...]] = ("trainer", "loglinear")

    def problems(self, run) -> Problems:
        """The values of the correction's parts it refuses (``schema.base``: ``config.validate`` raises
        ConfigError for the first); each part is checked whether enabled or not."""
        tis, mis, sc = self.tis, self.mis, self.sc
        yield from rule(tis.cap > 0, "correction.tis.cap", tis.cap, "must be > 0")
        yield from rule(0 <= mis.low < mis.high, "correction.mis.low/high", (mis.low, mis.high), "need 0 <= low < high")
        yield from rule(
            isinstance(mis.weighted, bool),
            "correction.mis.weighted",
            mis.weighted,
            "true (kept tokens keep their weight, IcePop/TRL) or false (mask only, verl's rejection sampling)",
        )
        yield from rule(sc.top_k >= 1, "correction.sc.top_k", sc.top_k, "must be >= 1")
        yield from rule(sc.mode in ("topk", "exact"), "correction.sc.mode", sc.mode, "choose 'topk' or 'exact'")
        yield from self.tail_problems(run)
        yield from rule(
            tis.level in ("token", "sequence"), "correction.tis.level", tis.level, "choose 'token' or 'sequence'"
        )
        yield from rule(
            mis.level in ("token", "sequence", "geometric"),
            "correction.mis.level",
            mis.level,
            "choose 'token', 'sequence' or 'geometric' (the geometric mean of the sequence's ratios)",
        )
        yield from self.mask_problems()
        yield from self.bypass_problems(run)
        yield from self.proximal_problems()
        low = tis.low
        yield from rule(
            low is None or (is_number(low) and 0 < low <= min(1.0, tis.cap)),
            "correction.tis.low",
            low,
            f"null (no lower bound) or a number in (0, min(1, correction.tis.cap={tis.cap})] (an on-policy token, "
            "weight 1, must keep its weight)",
        )

    def tail_problems(self, run) -> Problems:
        """``correction.sc.tail`` and ``tail_samples``: a known tail, m an integer >= 1, and the sampled tail refused
        with engine=vllm (its log-prob output gives the top-k, not draws from the tail)."""
        sc = self.sc
        yield from rule(sc.tail in sc.tails, "correction.sc.tail", sc.tail, "choose 'rescaled' or 'sampled'")
        yield from int_rule(sc.tail_samples, "correction.sc.tail_samples", 1, " (tail tokens drawn per position)")
        engine = getattr(getattr(run, "engine", None), "name", None)
        yield from rule(
            not (sc.enabled and sc.tail == "sampled" and engine == "vllm"),
            "correction.sc.tail",
            sc.tail,
            f"rescaled with engine=vllm: the sampled tail needs tail tokens drawn {TAIL_DRAWS_NOT_FROM_VLLM}; "
            "use engine=torch",
        )

    def bypass_problems(self, run) -> Problems:
        """Where ``correction.bypass=true`` cannot be exact or safe (``algorithms.old_policy``): rows sampled by
        older weights (``correction.proximal=loglinear`` serves them), a weight correction whose pi_old/mu bypass
        makes 1, or an objective without a clipped ratio under kernels that leave a numerical gap between mu and
        pi_old."""
        if not self.bypass or run is None:
            return
        from ..choices import ALGO_CONFIGS, ROLLOUT_MODES  # choices imports this package

        mode = run.rollout.mode
        yield from rule(
            not (mode in ROLLOUT_MODES and ROLLOUT_MODES[mode].stale),
            "correction.bypass",
            True,
            f"false with rollout.mode={mode}: its rows come from older weights, so mu is not pi_old; bypass needs "
            "rollout.mode=sync. To skip the pi_old pass with stale rows use correction.proximal=loglinear (AReaL's "
            "log-linear proximal policy; correction=decoupled weighs each token by pi_prox/mu)",
        )
        weights = [part for part in ("tis", "mis", "rs", "m2po") if getattr(self, part).enabled]
        yield from rule(
            not weights,
            "correction.bypass",
            True,
            f"false with correction={self.name}: its {'/'.join(weights)} weighs each token by pi_old/mu, which "
            "bypass makes 1 (the PPO ratio pi_theta/mu is then the importance ratio); use none, sc or opsm",
        )
        exact = run.kernels.name == "batch_invariant"
        algo = run.algo.name
        yield from rule(
            exact or (algo in ALGO_CONFIGS and ALGO_CONFIGS[algo].ppo_clip),
            "correction.bypass",
            True,
            f"false with algo={algo} under kernels={run.kernels.name}: mu differs from pi_old by the numerical gap, "
            "and without a clipped ratio nothing bounds pi_theta/mu; bypass is exact under kernels=batch_invariant, "
            "and elsewhere needs a PPO-clip objective (its clip is the importance truncation, verl's bypass)",
        )

    def proximal_problems(self) -> Problems:
        """``correction.proximal`` one of ``proximal_methods``; ``loglinear`` (the pi_old pass skipped) refused with
        what needs that pass or chooses the denominator otherwise: bypass (mu as the denominator), M2PO's bound and
        TIS's batch normalisation (pi_old of the whole batch before the first update). Score centering takes
        pi_prox at the head ids interpolated the same way (``corrections.loglinear_proximal_head``)."""
        yield from rule(
            self.proximal in self.proximal_methods,
            "correction.proximal",
            self.proximal,
            f"choose one of {list(self.proximal_methods)}",
        )
        if self.proximal != "loglinear":
            return
        tis_normalised = bool(self.tis.batch_normalize)
        needs_pass = [
            name
            for name, on in (
                ("correction.bypass=true (mu is then the denominator)", self.bypass),
                ("m2po (its bound reads pi_old of the whole batch)", self.m2po.enabled),
                ("tis.batch_normalize (its Z reads pi_old of the whole batch)", self.tis.enabled and tis_normalised),
            )
            if on
        ]
        yield from rule(
            not needs_pass,
            "correction.proximal",
            self.proximal,
            f"'trainer' with {', '.join(needs_pass)}: loglinear skips the trainer's pi_old pass, which these need",
        )

    def mask_problems(self) -> Problems:
        """The sequence masks' and the guard's values ``CorrectionConfig.problems`` refuses."""
        opsm, rs, guard = self.opsm, self.rs, self.guard
        yield from rule(is_number(opsm.delta) and opsm.delta >= 0, "correction.opsm.delta", opsm.delta, "must be >= 0")
        yield from rule(rs.rule in rs.rules, "correction.rs.rule", rs.rule, f"choose one of {list(rs.rules)}")
        yield from rule(
            rs.threshold is None or (is_number(rs.threshold) and rs.threshold > 0),
            "correction.rs.threshold",
            rs.threshold,
            "null (the rule's default) or a number > 0",
        )
        band = list(rs.veto_band)
        yield from rule(
            len(band) == 2 and all(is_number(b) for b in band) and 0 < band[0] < 1 < band[1],
            "correction.rs.veto_band",
            band,
            "[low, high] with 0 < low < 1 < high (SkyRL: [1e-4, 100])",
        )
        yield from rule(
            not (rs.enabled and self.mis.enabled),
            "correction.rs.enabled",
            rs.enabled,
            "the rejection family and MIS both mask by the ratio: choose one (rs.rule=token_k1 is mask-only MIS with "
            "the band [e^-tau, e^tau])",
        )
        m2po = self.m2po
        yield from rule(
            is_number(m2po.threshold) and m2po.threshold >= 0,
            "correction.m2po.threshold",
            m2po.threshold,
            "must be >= 0",
        )
        yield from rule(
            not (m2po.enabled and (self.mis.enabled or (rs.enabled and rs.rule == "token_k1"))),
            "correction.m2po.enabled",
            m2po.enabled,
            "M2PO is a token band on the ratio, as MIS and rs.rule=token_k1 are: choose one",
        )
        gap = guard.logprob_abs_diff_max
        yield from rule(
            gap is None or (is_number(gap) and gap > 0),
            "correction.guard.logprob_abs_diff_max",
            gap,
            "null (off) or a number > 0 (nats per token)",
        )
        yield from rule(
            guard.action in ("warn", "stop"), "correction.guard.action", guard.action, "choose 'warn' or 'stop'"
        )


@dataclass
class AdvantageConfig:
    """``advantage``: A = (R - mean) / (std + eps)^alpha."""

    #: 1 = GRPO, 0 = Dr.GRPO (mean-only)
    alpha: Number = 1.0
    eps: Number = 1.0e-6
    #: population (divide by n; SPEC vector 1) | sample (n - 1: TRL, verl) (``objectives.STD_KINDS``)
    std: str = "population"
    #: group (the group's std, GRPO) | batch (the step's std, TRL scale_rewards=batch) | none (no division: alpha
    #: must be 0) (``objectives.SCALES``)
    scale: str = "group"
    #: several reward.functions: sum (the weighted total normalised, GRPO) | normalize_then_sum (GDPO: each reward
    #: normalised in its group, summed with reward.weights, whitened over the step; group-normalised algorithms
    #: only) (``objectives.multi_reward_advantages``)
    multi_reward: str = "sum"


@dataclass
class LossConfig:
    """``loss``: how per-token losses become one number (``objectives.REDUCTION_MODES``)."""

    reduction: str = "seq_mean_token_mean"
    #: entropy bonus: loss_t - entropy_coef * H(pi_theta(. | h_t)) under the sampler's temperature and
    #: truncation, reduced like the loss (``objectives.entropy_bonus_loss``); 0 = off
    entropy_coef: Number = 0.0
    #: drop from the loss's numerator the tokens written before their sequence's newest weight update (in-flight
    #: updates: ``loss.older_token_mask``); denominators unchanged (num_tokens, num_seqs, each T_i); a no-op when no
    #: sequence spans versions
    drop_older_tokens: bool = False


@dataclass
class KlConfig:
    """``kl``: penalty to the frozen initial policy."""

    #: 0 = off (no reference copy kept)
    beta: Number = 0.0
    #: k1 | k2 | k3 (``objectives.KL_KINDS``); as a loss term k3's gradient descends KL(pi_ref || pi), k2's
    #: KL(pi || pi_ref), k1's nothing (refused) (docs/configuration.md, "The KL to the reference")
    estimator: str = "k3"
    #: log train/ref_kl even with beta = 0 (keeps a reference copy)
    track: bool = False
    #: kl.mode=loss: weight the term by sg(pi_old/mu), the importance-weighted ("unbiased") KL that
    #: train/ref_kl_is logs (TRL use_bias_correction_kl, slime --use-unbiased-kl)
    is_weighted: bool = False
    #: loss (beta * KL per token in the loss, GRPO) | reward (-beta * KL folded into the per-token reward, classic
    #: RLHF PPO and REINFORCE++; ppo and reinforce_pp only) (``objectives.KL_MODES``)
    mode: str = "loss"
    #: the adaptive controller's KL_target in nats per sequence (Ziegler et al. 2019); null = a fixed beta
    target: Optional[Number] = None
    #: the controller's horizon, in sequences (each RL step moves beta by a fraction n_steps / horizon of the error)
    horizon: Number = 10000

    def problems(self, run) -> Problems:
        """The estimator a KL-as-loss term cannot regularise with (docs/configuration.md, "The KL to the
        reference"): k1's loss β·(log π − log π_ref) has the gradient β·∇log π(y), which does not depend on π_ref
        at all (on-policy its expectation is 0; off-policy it pushes away from π_old). As a reward (kl.mode=reward)
        k1 is the classic per-token penalty, and logging it (kl.beta=0, kl.track=true) is fine."""
        yield from rule(
            not (self.estimator == "k1" and self.mode == "loss" and is_number(self.beta) and self.beta > 0),
            "kl.estimator",
            self.estimator,
            f"with kl.mode=loss and kl.beta={self.beta} the term's gradient beta * grad log pi(y) does not depend on "
            "the reference (0 in expectation on-policy): it cannot pull toward it. Use k2 (its gradient descends "
            "KL(pi || pi_ref)) or k3 (KL(pi_ref || pi)), kl.mode=reward (ppo, reinforce_pp), or kl.beta=0 "
            "kl.track=true to only log k1",
        )


#: distill.mode's values: the reverse KL to the teacher in the advantages, or as a loss term of its own
DISTILL_MODES = ("advantage", "loss")


@dataclass
class DistillConfig:
    """``distill``: on-policy distillation from a frozen teacher that scores the student's own sampled tokens
    (docs/configuration.md, "On-policy distillation"; ``objectives.opd_advantages`` / ``opd_loss``)."""

    #: the teacher's model folder or hub id, loaded like model.name_or_path (same tokenizer and vocabulary as the
    #: student, refused at start-up otherwise); null = off
    teacher: Optional[str] = None
    #: the coefficient of the per-token reverse KL log pi_student - log pi_teacher (>= 0)
    coef: Number = 1.0
    #: advantage (A_t = A - coef * the log-ratio, slime's --use-opd) | loss (its own term over its own token
    #: count, prime-rl's form) (``DISTILL_MODES``)
    mode: str = "advantage"

    def problems(self, run) -> Problems:
        """``distill.mode`` one of ``DISTILL_MODES``, ``distill.coef`` a number >= 0, ``distill.teacher`` null or a
        non-empty string."""
        yield from rule(self.mode in DISTILL_MODES, "distill.mode", self.mode, f"choose one of {DISTILL_MODES}")
        yield from rule(is_number(self.coef) and self.coef >= 0, "distill.coef", self.coef, "must be a number >= 0")
        yield from rule(
            self.teacher is None or (isinstance(self.teacher, str) and self.teacher.strip() != ""),
            "distill.teacher",
            self.teacher,
            "null (off) or a model folder or hub id, like model.name_or_path",
        )
