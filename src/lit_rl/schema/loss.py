"""The loss assembly's sections (``loss.assemble_loss``): ``correction``, ``advantage``, ``loss`` and ``kl``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .base import Number, Problems, is_number, rule


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
    #: head H: the engine's top-k per token; the tail is filled with the trainer, rescaled
    top_k: int = 128
    #: topk | exact (the full vocabulary; small models only)
    mode: str = "topk"


@dataclass
class CorrectionConfig:
    """``correction``: train-inference corrections (``corrections.CORRECTIONS``; docs/corrections.md)."""

    #: one of ``corrections.CORRECTIONS``
    name: str = "none"
    tis: TisConfig = field(default_factory=TisConfig)
    mis: MisConfig = field(default_factory=MisConfig)
    sc: ScConfig = field(default_factory=ScConfig)

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
        yield from rule(
            tis.level in ("token", "sequence"), "correction.tis.level", tis.level, "choose 'token' or 'sequence'"
        )
        yield from rule(
            mis.level in ("token", "sequence", "geometric"),
            "correction.mis.level",
            mis.level,
            "choose 'token', 'sequence' or 'geometric' (the geometric mean of the sequence's ratios)",
        )
        low = tis.low
        yield from rule(
            low is None or (is_number(low) and 0 < low <= min(1.0, tis.cap)),
            "correction.tis.low",
            low,
            f"null (no lower bound) or a number in (0, min(1, correction.tis.cap={tis.cap})] (an on-policy token, "
            "weight 1, must keep its weight)",
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
