"""``algo``: each algorithm's options and its start-up rules, torch-free.

``AlgoConfig`` is the one schema of the ``algo`` group (every algorithm's fields; the ones an algorithm does not
read keep their defaults). Each algorithm's subclass holds its own defaults (what its ``conf/algo/<name>.yaml``
sets) and answers what ``config.validate`` asks of it before torch loads: ClassVar facts (``ppo_clip``,
``kl_in_reward``, ...), ``group_baseline`` / ``group_size_rule`` and ``problems``, the values it refuses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from .base import Number, Problems, is_number, rule


@dataclass
class ClipConfig:
    """``algo.clip``: the ratio's clip range [1 - eps_low, 1 + eps_high]."""

    eps_low: Number = 0.2
    eps_high: Number = 0.2


@dataclass
class DynamicSamplingConfig:
    """``algo.dynamic_sampling`` (DAPO): resample until the step holds groups with a nonzero advantage."""

    enabled: bool = False
    #: generation rounds per step at most (each round draws prompts_per_step prompts)
    max_rounds: int = 3


@dataclass
class OverlongConfig:
    """``algo.overlong`` (DAPO): reward penalty ramping from 0 to -penalty_factor over the last
    ``buffer_length`` tokens before L_max."""

    enabled: bool = False
    buffer_length: int = 16
    penalty_factor: Number = 1.0


@dataclass
class GaeConfig:
    """``algo.gae`` (PPO): generalised advantage estimation."""

    gamma: Number = 1.0
    lam: Number = 0.95


@dataclass
class ValueConfig:
    """``algo.value`` (PPO): the critic."""

    #: shared: a Linear head on the policy backbone | separate: its own copy of the backbone
    model: str = "shared"
    #: vf_coef, the value loss's weight
    coef: Number = 0.1
    #: value clip range around old_values
    clip: Number = 0.2


@dataclass
class SapoGateConfig:
    """``algo.sapo`` (SAPO, arXiv 2511.20347): the soft gate's temperatures, sigma(tau (r - 1)) * 4 / tau."""

    #: tau for A > 0
    tau_pos: Number = 1.0
    #: tau for A < 0 (>= tau_pos: negative advantages' off-policy tokens decay faster)
    tau_neg: Number = 1.05


@dataclass
class AlgoConfig:
    """``algo``: the algorithm (``algorithms.ALGORITHMS``) and its options. One schema for all: the fields an
    algorithm does not read keep their defaults (each ``conf/algo/<name>.yaml`` sets its own)."""

    #: one of ``algorithms.ALGORITHMS``
    name: str = "grpo"
    clip: ClipConfig = field(default_factory=ClipConfig)
    #: dual-clip PPO (Ye et al. 2020; verl's clip_ratio_c, which defaults to 3): for A < 0 the loss is bounded by
    #: c * |A|; null = off. The PPO-clip objectives only (ppo, grpo, dapo, dr_grpo, reinforce_pp)
    clip_ratio_c: Optional[Number] = None
    #: TRL's two-sided clip ``delta`` (INTELLECT-2): the unclipped ratio capped at delta (> 1); null = off
    delta: Optional[Number] = None
    #: passes over each rollout batch (the PPO schedule); 1 x 1 keeps the update on-policy
    ppo_epochs: int = 1
    #: optimizer steps per pass
    num_minibatches: int = 1
    #: reinforce: none | batch_mean | rloo (``objectives.BASELINES``); reinforce_pp: none | group
    baseline: str = "rloo"
    #: dapo
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    #: dapo
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    #: dapo: completions cut at L_max leave the loss (numerator and denominator)
    mask_truncated: bool = False
    #: ppo: whiten the GAE advantages over the batch
    whiten_advantages: bool = True
    #: ppo
    gae: GaeConfig = field(default_factory=GaeConfig)
    #: ppo
    value: ValueConfig = field(default_factory=ValueConfig)
    #: sapo
    sapo: SapoGateConfig = field(default_factory=SapoGateConfig)

    # What ``config.validate`` asks of the algorithm, here (not fields: no config key) so that it is known before
    # torch loads. The algorithm classes (``algorithms.base.Algorithm``) read them from here (``algo_config``) and
    # ``group_baseline``; tests/test_registries.py checks that each class agrees with its ``algo_config``.
    #: the objective is the PPO clipped surrogate, so ``algo.clip_ratio_c`` (dual clip) and ``algo.delta`` apply
    ppo_clip: ClassVar[bool] = True
    #: the objective reads ``algo.clip.eps_low`` / ``eps_high``; False: values other than the preset's are refused
    uses_clip: ClassVar[bool] = True
    #: the advantages are ``objectives.group_advantages`` of the ``advantage`` group; False: a non-default
    #: ``advantage.std`` / ``scale`` / ``alpha`` is refused
    group_normalised: ClassVar[bool] = True
    #: per-token returns that ``kl.mode=reward`` folds the KL into; False: kl.mode=reward is refused
    kl_in_reward: ClassVar[bool] = False
    #: the objective takes per-token advantages [N, T]; False (one per sequence): distill.mode=advantage is refused
    token_advantages: ClassVar[bool] = True

    #: the objective's ratio clip has a lower bound 1 - eps_low, so eps_low < 1 (CISPO: eps_low >= 1 turns it off)
    clip_has_lower_bound: ClassVar[bool] = True
    #: why ``algo.clip`` is not read, for an algorithm with ``uses_clip = False``
    no_clip_reason: ClassVar[str] = "it has no ratio to clip"
    #: why ``trainer=fsdp`` cannot run this algorithm, or None when it can
    fsdp_refusal: ClassVar[Optional[str]] = None

    def group_baseline(self) -> bool:
        """True when the advantage's baseline is a statistic of the prompt's group, so ``rollout.group_size``
        must be >= 2 (a group of one has zero advantage). Default: True (``objectives.group_advantages``)."""
        return True

    def group_size_rule(self) -> str:
        """What ``config.validate`` says of ``rollout.group_size`` < 2 when ``group_baseline()`` holds."""
        return f"must be >= 2 for {self.name} (a group of one has zero advantage, so nothing is learned)"

    def problems(self, run) -> Problems:
        """The values this algorithm refuses, each as (field, value, what is allowed); ``config.validate``
        raises ConfigError for the first. ``run``: the whole config (for the fields an option is bounded by).
        The base: ``algo.clip.eps_low`` < 1 where the clip has a lower bound, and ``algo.clip`` at the preset's
        values where the objective reads no clip. Each algorithm adds its own options' rules."""
        clip = self.clip
        multi = run.get("advantage", {}).get("multi_reward", "sum") if hasattr(run, "get") else "sum"
        yield from rule(
            self.group_normalised or multi == "sum",
            "advantage.multi_reward",
            multi,
            f"normalize_then_sum (GDPO) normalises each reward in its group, and algo={self.name} is not "
            "group-normalised (it has its own advantage estimator): leave it at sum, or choose an algorithm of GRPO's "
            "family",
        )
        distill = run.get("distill", {}) if hasattr(run, "get") else {}
        yield from rule(
            self.token_advantages or not distill.get("teacher") or distill.get("mode") != "advantage",
            "distill.mode",
            "advantage",
            f"algo={self.name}'s objective takes one advantage per sequence, and the teacher's log-ratio is per "
            "token: choose distill.mode=loss (its own loss term) or another algorithm",
        )
        if self.clip_has_lower_bound:
            yield from rule(
                clip.eps_low < 1, "algo.clip.eps_low", clip.eps_low, "must be < 1 (the lower bound is 1 - eps_low)"
            )
        if not self.uses_clip:  # accepted and ignored before (a new user's finding)
            preset = type(self)().clip  # the schema's defaults, as its YAML preset
            for key in ("eps_low", "eps_high"):
                value = getattr(clip, key)
                yield from rule(
                    value == getattr(preset, key),
                    f"algo.clip.{key}",
                    value,
                    f"algo={self.name} does not read algo.clip ({self.no_clip_reason}): leave it at "
                    f"{getattr(preset, key)}",
                )


# Each algorithm's own defaults for ``algo`` (``Algorithm.algo_config``): what its conf/algo/<name>.yaml sets,
# for modules built from Python (a test checks that the two agree); and its answers to ``config.validate``.
@dataclass
class ReinforceConfig(AlgoConfig):
    name: str = "reinforce"

    group_normalised = False  # its own baselines (algo.baseline)
    ppo_clip = False
    uses_clip = False  # no ratio to clip
    #: ``algo.baseline`` of reinforce (``objectives.baseline_advantages``)
    baselines: ClassVar[tuple[str, ...]] = ("none", "batch_mean", "rloo")

    def group_baseline(self) -> bool:
        """Only the leave-one-out baseline (``algo.baseline=rloo``) reads the group."""
        return self.baseline == "rloo"

    def group_size_rule(self) -> str:
        return (
            "must be >= 2 for reinforce with algo.baseline=rloo (the leave-one-out mean of the other "
            "completions of a prompt; a group of one has none); for groups of one choose "
            "algo.baseline=none or algo.baseline=batch_mean"
        )

    def problems(self, run) -> Problems:
        yield from super().problems(run)
        yield from rule(
            self.baseline in self.baselines, "algo.baseline", self.baseline, f"choose one of {list(self.baselines)}"
        )
        yield from rule(
            self.ppo_epochs == 1 and self.num_minibatches == 1,
            "algo.ppo_epochs x algo.num_minibatches",
            (self.ppo_epochs, self.num_minibatches),
            "must be 1 x 1 for reinforce: it has no importance ratio or clip, so every update after the "
            "first would be an uncorrected off-policy step (use ppo, grpo or cispo for several updates)",
        )


@dataclass
class ReinforcePpConfig(AlgoConfig):
    name: str = "reinforce_pp"
    #: reinforce_pp: none (REINFORCE++) | group (REINFORCE++-baseline: minus the group's mean reward)
    baseline: str = "none"

    group_normalised = False  # the batch whitening replaces advantage.std / scale
    kl_in_reward = True

    def group_baseline(self) -> bool:
        """Only REINFORCE++-baseline (``algo.baseline=group``) reads the group."""
        return self.baseline == "group"

    def group_size_rule(self) -> str:
        return (
            "must be >= 2 for reinforce_pp with algo.baseline=group (the group's mean reward of one completion is "
            "its own reward: zero advantage); for groups of one choose algo.baseline=none"
        )

    def problems(self, run) -> Problems:
        yield from super().problems(run)
        yield from rule(
            self.baseline in ("none", "group"),
            "algo.baseline",
            self.baseline,
            "choose none (REINFORCE++) or group (REINFORCE++-baseline) for reinforce_pp",
        )


@dataclass
class PpoConfig(AlgoConfig):
    name: str = "ppo"
    ppo_epochs: int = 2
    num_minibatches: int = 2

    group_normalised = False  # GAE
    kl_in_reward = True  # -beta * KL in the per-token reward before GAE
    fsdp_refusal = (
        "cannot run with trainer=fsdp: PPO's critic reads the policy's backbone outside the policy's sharded "
        "forward; use trainer=ddp for PPO"
    )

    def group_baseline(self) -> bool:
        """False: the critic's value is the baseline (GAE), not the group."""
        return False

    def problems(self, run) -> Problems:
        yield from super().problems(run)
        model = self.value.model
        yield from rule(model in ("shared", "separate"), "algo.value.model", model, "choose 'shared' or 'separate'")
        for key in ("gamma", "lam"):
            value = getattr(self.gae, key)
            yield from rule(is_number(value) and 0 <= value <= 1, f"algo.gae.{key}", value, "must lie in [0, 1]")


@dataclass
class DapoConfig(AlgoConfig):
    name: str = "dapo"
    clip: ClipConfig = field(default_factory=lambda: ClipConfig(eps_low=0.2, eps_high=0.28))
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=lambda: DynamicSamplingConfig(enabled=True))
    overlong: OverlongConfig = field(default_factory=lambda: OverlongConfig(enabled=True))

    def problems(self, run) -> Problems:
        if self.overlong.enabled:  # the buffer lies inside the generation cap
            cap, buffer = run.sampling.max_new_tokens, self.overlong.buffer_length
            yield from rule(
                0 <= buffer <= cap,
                "algo.overlong.buffer_length",
                buffer,
                f"must lie in [0, sampling.max_new_tokens={cap}]",
            )
        yield from super().problems(run)
        rounds = self.dynamic_sampling.max_rounds
        yield from rule(rounds >= 1, "algo.dynamic_sampling.max_rounds", rounds, "must be >= 1")


@dataclass
class DrGrpoConfig(AlgoConfig):
    name: str = "dr_grpo"


@dataclass
class GspoConfig(AlgoConfig):
    name: str = "gspo"
    token_advantages = False  # the sequence-level ratio takes one advantage per sequence
    clip: ClipConfig = field(default_factory=lambda: ClipConfig(eps_low=3.0e-4, eps_high=4.0e-4))

    ppo_clip = False  # a sequence-level ratio clip


@dataclass
class SapoConfig(AlgoConfig):
    name: str = "sapo"

    ppo_clip = False
    uses_clip = False  # the soft gate's temperatures algo.sapo.tau_pos / tau_neg take its place
    no_clip_reason = "its soft gate replaces the clip: tune algo.sapo.tau_pos / tau_neg"

    def problems(self, run) -> Problems:
        yield from super().problems(run)
        for key in ("tau_pos", "tau_neg"):
            tau = getattr(self.sapo, key)
            yield from rule(
                is_number(tau) and math.isfinite(tau) and tau > 0, f"algo.sapo.{key}", tau, "must be a number > 0"
            )


@dataclass
class CispoConfig(AlgoConfig):
    name: str = "cispo"
    #: eps_low >= 1: no lower bound on the weight, as in the paper
    clip: ClipConfig = field(default_factory=lambda: ClipConfig(eps_low=1.0, eps_high=0.28))

    ppo_clip = False  # a clipped importance weight, not the PPO surrogate
    clip_has_lower_bound = False  # CISPO's paper turns the lower bound off with eps_low >= 1
