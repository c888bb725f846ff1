"""The typed config: one dataclass per config group, with each field's type, default and meaning in one place.

``conf/train.yaml`` starts from ``TrainConfig`` (stored in Hydra's ConfigStore as ``schema: train``), so every
key a config file or preset sets must be a field here: a typo (``algo: {ppo_epoch: 4}``) fails at compose
time, naming the key and the file, as it does on the command line. The task group's options start from their
own schema (``base_arithmetic``, ``base_gsm8k``). The YAML files stay the user-facing defaults with their
comments; the defaults here are the same values (a test composes the default config and compares), so a
module built from Python (tests, benchmarks, ``lit_rl.expectation``) runs as the recipe does.

Adding a field: add it to its dataclass here (type, default, ``#:`` doc), to the group's YAML file with a
comment, and read it as an attribute (``cfg.algo.ppo_epochs``); a range check that involves only this field
goes to ``config.validate`` with the others.

``config_of(cls, mapping)`` turns a plain dict (what ``OmegaConf.to_container`` gives, or what a test
writes) into the dataclass, filling what the mapping leaves out with the defaults and refusing unknown keys.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, TypeVar, Union

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

C = TypeVar("C")

#: a number field: an int stays an int (``optim.grad_clip=1`` is logged and reported as written), a float a float
Number = Union[int, float]


# -- groups chosen in the defaults list ------------------------------------------------------------------
@dataclass
class LoraConfig:
    """``model.lora``: a LoRA adapter trained with PEFT on the frozen base (``models.LoraSpec`` mirrors it)."""

    #: the adapter's rank; 0 = off (full fine-tuning)
    r: int = 0
    #: the scale is alpha / r (Hu et al. 2021, eq. 3)
    alpha: float = 16.0
    #: dropout on the adapter's input (PEFT's lora_dropout), in [0, 1)
    dropout: float = 0.0
    #: module-name suffixes that get an adapter: the attention and MLP projections (Phi-3's fused ones too)
    target_modules: list[str] = field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "qkv_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
            "gate_up_proj",
        ]
    )
    #: policy/ at the end holds the adapter (false) or the merged full model (true)
    merge_on_export: bool = False


@dataclass
class ModelConfig:
    """``model``: what to load (``models.ModelSpec`` mirrors it)."""

    #: ``tiny`` (random-init 2-layer Llama), a hub id (org/name) or a local folder
    name_or_path: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    #: weights' dtype: float32 (training keeps float32 master weights) | bfloat16
    dtype: str = "float32"
    #: sdpa | eager | flash_attention_2 (CUDA with the flash_attn package; refused on the CPU)
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    #: recompute layer activations in backward (less memory, ~15% more time)
    gradient_checkpointing: bool = False
    #: seed of the random initialisation (``tiny`` only)
    init_seed: int = 0
    #: LoRA adapter (r = 0: off)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class TaskConfig:
    """``task``: the prompt source and its verifier (``tasks.build_task``); each task adds its own fields."""

    #: one of ``tasks.TASKS``
    name: str = MISSING
    #: flexible: '#### N', '\\boxed{N}', else the last number | strict: '#### N' only
    answer_format: str = "flexible"
    #: a number: every completion gets it (experiment=constant_reward_drift); null = the verifier's reward.
    #: Untyped here so that ``config.validate`` names a bad value
    constant_reward: Any = None


@dataclass
class ArithmeticConfig(TaskConfig):
    """``task=arithmetic``: problems generated from a seed (``tasks.ArithmeticTask``)."""

    name: str = "arithmetic"
    seed: int = 0
    #: digits per operand
    digits: int = 1
    operators: list[str] = field(default_factory=lambda: ["+"])
    num_train: int = 10000
    num_eval: int = 200


@dataclass
class Gsm8kConfig(TaskConfig):
    """``task=gsm8k``: GSM8K from the hub or a folder (``tasks.Gsm8kTask``)."""

    name: str = "gsm8k"
    #: a folder with train.jsonl and test.jsonl; null = the hub dataset
    path: Optional[str] = None
    hub_id: str = "openai/gsm8k"
    hub_config: str = "main"
    max_train: Optional[int] = None
    max_eval: Optional[int] = None


@dataclass
class DatasetConfig(TaskConfig):
    """``task=dataset``: any dataset ``datasets`` reads, with a column mapping (``tasks.DatasetTask``)."""

    name: str = "dataset"
    #: a data file (.jsonl .json .parquet .csv .tsv .arrow), a saved-dataset folder, a folder of files or a hub id
    path: Optional[str] = None
    #: instead of path: a file, a list of files or {split: file(s)}
    data_files: Any = None
    #: the hub dataset's configuration
    config: Optional[str] = None
    split: str = "train"
    #: null: eval_fraction of split held out
    eval_split: Optional[str] = None
    #: the held-out share of split when eval_split is null (0 = no eval split)
    eval_fraction: Number = 0.0
    #: seeds the held-out draw
    seed: int = 0
    #: the prompt column: text, or a list of chat messages {role, content}
    prompt_field: str = "prompt"
    #: the gold-answer column; null = none (reward functions that need no answer)
    answer_field: Optional[str] = "answer"
    system_prompt: Optional[str] = None
    #: a str.format template over the row's columns for text prompts, e.g. "{question} Answer after ####."
    prompt_template: Optional[str] = None
    #: the first rows of each split only; null = all
    max_examples: Optional[int] = None
    #: a prompt longer than the context leaves for max_new_tokens: drop (counted) | error
    overlong_prompts: str = "drop"


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

    def problems(self, run) -> Iterator[tuple[str, object, str]]:
        """The values this algorithm refuses, each as (field, value, what is allowed); ``config.validate``
        raises ConfigError for the first. ``run``: the whole config (for the fields an option is bounded by).
        The base: ``algo.clip.eps_low`` < 1 where the clip has a lower bound, and ``algo.clip`` at the preset's
        values where the objective reads no clip. Each algorithm adds its own options' rules."""
        clip = self.clip
        if self.clip_has_lower_bound:
            yield from _rule(
                clip.eps_low < 1, "algo.clip.eps_low", clip.eps_low, "must be < 1 (the lower bound is 1 - eps_low)"
            )
        if not self.uses_clip:  # accepted and ignored before (a new user's finding)
            preset = type(self)().clip  # the schema's defaults, as its YAML preset
            for key in ("eps_low", "eps_high"):
                value = getattr(clip, key)
                yield from _rule(
                    value == getattr(preset, key),
                    f"algo.clip.{key}",
                    value,
                    f"algo={self.name} does not read algo.clip ({self.no_clip_reason}): leave it at "
                    f"{getattr(preset, key)}",
                )


def _rule(ok: bool, field: str, value, allowed: str) -> Iterator[tuple[str, object, str]]:
    """(field, value, allowed) once unless ``ok``: one problem of ``AlgoConfig.problems``."""
    if not ok:
        yield field, value, allowed


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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

    def problems(self, run) -> Iterator[tuple[str, object, str]]:
        yield from super().problems(run)
        yield from _rule(
            self.baseline in self.baselines, "algo.baseline", self.baseline, f"choose one of {list(self.baselines)}"
        )
        yield from _rule(
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

    def problems(self, run) -> Iterator[tuple[str, object, str]]:
        yield from super().problems(run)
        yield from _rule(
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

    def problems(self, run) -> Iterator[tuple[str, object, str]]:
        yield from super().problems(run)
        model = self.value.model
        yield from _rule(model in ("shared", "separate"), "algo.value.model", model, "choose 'shared' or 'separate'")
        for key in ("gamma", "lam"):
            value = getattr(self.gae, key)
            yield from _rule(_is_number(value) and 0 <= value <= 1, f"algo.gae.{key}", value, "must lie in [0, 1]")


@dataclass
class DapoConfig(AlgoConfig):
    name: str = "dapo"
    clip: ClipConfig = field(default_factory=lambda: ClipConfig(eps_low=0.2, eps_high=0.28))
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=lambda: DynamicSamplingConfig(enabled=True))
    overlong: OverlongConfig = field(default_factory=lambda: OverlongConfig(enabled=True))

    def problems(self, run) -> Iterator[tuple[str, object, str]]:
        if self.overlong.enabled:  # the buffer lies inside the generation cap
            cap, buffer = run.sampling.max_new_tokens, self.overlong.buffer_length
            yield from _rule(
                0 <= buffer <= cap,
                "algo.overlong.buffer_length",
                buffer,
                f"must lie in [0, sampling.max_new_tokens={cap}]",
            )
        yield from super().problems(run)
        rounds = self.dynamic_sampling.max_rounds
        yield from _rule(rounds >= 1, "algo.dynamic_sampling.max_rounds", rounds, "must be >= 1")


@dataclass
class DrGrpoConfig(AlgoConfig):
    name: str = "dr_grpo"


@dataclass
class GspoConfig(AlgoConfig):
    name: str = "gspo"
    clip: ClipConfig = field(default_factory=lambda: ClipConfig(eps_low=3.0e-4, eps_high=4.0e-4))

    ppo_clip = False  # a sequence-level ratio clip


@dataclass
class SapoConfig(AlgoConfig):
    name: str = "sapo"

    ppo_clip = False
    uses_clip = False  # the soft gate's temperatures algo.sapo.tau_pos / tau_neg take its place
    no_clip_reason = "its soft gate replaces the clip: tune algo.sapo.tau_pos / tau_neg"

    def problems(self, run) -> Iterator[tuple[str, object, str]]:
        yield from super().problems(run)
        for key in ("tau_pos", "tau_neg"):
            tau = getattr(self.sapo, key)
            yield from _rule(
                _is_number(tau) and math.isfinite(tau) and tau > 0, f"algo.sapo.{key}", tau, "must be a number > 0"
            )


@dataclass
class CispoConfig(AlgoConfig):
    name: str = "cispo"
    #: eps_low >= 1: no lower bound on the weight, as in the paper
    clip: ClipConfig = field(default_factory=lambda: ClipConfig(eps_low=1.0, eps_high=0.28))

    ppo_clip = False  # a clipped importance weight, not the PPO surrogate
    clip_has_lower_bound = False  # CISPO's paper turns the lower bound off with eps_low >= 1


@dataclass
class EngineConfig:
    """``engine=torch``: the embedded engine (``rollout.engines.ENGINES``); the base of every engine's fields."""

    #: torch | vllm | auto (``rollout.engines.ENGINE_CHOICES``)
    name: str = "torch"
    #: torch: null = share the trainer's module, else sample with an own copy in this dtype (float32 |
    #: bfloat16); vllm: null = bfloat16 under a bf16 trainer precision, else model.dtype
    dtype: Optional[str] = None
    #: mismatch injection: matrices through an int8 round trip at each sync
    int8_roundtrip: bool = False
    #: the engine's sampling seed; set to ``seed`` at start-up
    seed: int = 0
    #: mismatch dial sigma >= 0 (0 = off): the embedded engine samples from softmax((logits + sigma*eps)/T'),
    #: eps ~ N(0, I) seeded per (seed, step, sequence, position); rollout log-probs and top-k are the noisy
    #: distribution's. Embedded engine only (vLLM: > 0 is refused at start-up)
    logit_noise: Number = 0.0
    #: mismatch dial delta: the sampler samples (and reports log-probs) at T' = T + delta (> 0), the trainer
    #: scores at T; both engines
    temperature_offset: Number = 0.0


@dataclass
class VLLMEngineConfig(EngineConfig):
    """``engine=vllm`` (and ``auto``, which may become it): the colocated vLLM engine."""

    name: str = "vllm"
    #: GPU memory fraction for weights + KV cache (on CPU vLLM reads it as a RAM fraction)
    gpu_memory_utilization: Number = 0.3
    #: KV-cache GiB; null = 1 on CPU, from gpu_memory_utilization on GPUs
    kv_cache_gb: Optional[Number] = None
    #: > 1 needs in_process=false (weights then travel through a file)
    tensor_parallel_size: int = 1
    #: prompt + response tokens per sequence; null = the model's context length
    max_model_len: Optional[int] = None
    #: free the engine's GPU memory during the update: auto (on with CUDA) | true | false
    sleep_mode: Any = "auto"
    #: CUDA-graph capture for decoding: auto (on with CUDA) | true | false
    cuda_graphs: Any = "auto"
    #: engine core in the training process: weights handed over by reference
    in_process: bool = True


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


@dataclass
class KernelsConfig:
    """``kernels``: default | batch_invariant (``kernels.KERNELS``)."""

    name: str = "default"
    #: float32 matrix products on the CPU: auto (oneDNN where measured faster than torch's BLAS on the model's
    #: shapes, ``kernels.fp32_gemm.resolve``) | aten (torch's own) | onednn; kernels=batch_invariant: aten
    fp32_gemm: str = "auto"


# -- sections of train.yaml ----------------------------------------------------------------------------
@dataclass
class UpdateConfig:
    """``update``: how the trainer's forward/backward is organised (none of it changes the result)."""

    #: each prompt's forward once per group (its KV cache reused by the G completions; Prefix Grouper):
    #: auto (on when rollout.group_size >= 2 and the model family is supported) | true | false
    shared_prefix: Any = "auto"


@dataclass
class RolloutConfig:
    """``rollout``: how many rollouts a step takes and with which weights (``rollout.staleness``)."""

    #: P prompts per RL step
    prompts_per_step: int = 8
    #: G completions per prompt
    group_size: int = 8
    #: sequences per forward/backward of the update (does not change the result)
    micro_batch_size: int = 16
    #: sync | lagged | async (``rollout.staleness.ROLLOUT_MODES``)
    mode: str = "sync"
    #: lagged: RL steps between the sampling weights and the trained ones
    lag: int = 0
    #: async: no consumed rollout is more than this many RL steps old
    max_staleness: int = 1
    #: async: block | drop (``rollout.staleness.ON_STALE``)
    on_stale: str = "block"
    #: async: RL steps of rollouts buffered; null = max(1, max_staleness)
    buffer_size: Optional[int] = None
    #: lagged/async: score stale rows with their own weights, so r_num and r_stale split exactly
    behaviour_logprobs: bool = True
    #: lagged: keep the lag's weight history in checkpoints (exact resume)
    save_history: bool = True


@dataclass
class SamplingConfig:
    """``sampling``: the training rollouts (``rollout.types.SamplingParams``); the trainer scores at the same
    temperature."""

    temperature: Number = 1.0
    #: 0 = off
    top_k: int = 0
    #: 1.0 = off
    top_p: Number = 1.0
    #: L_max, the generation cap (max_response_length)
    max_new_tokens: int = 64
    #: top-k log-probs the engine records per token (score centering raises it to its head)
    logprobs_top_k: int = 0


@dataclass
class EvalConfig:
    """``eval``: held-out accuracy: greedy pass@1, or mean@n and pass@k from n samples per problem."""

    every_n_steps: int = 10
    #: 0 = no evaluation
    num_examples: int = 64
    batch_size: int = 64
    max_new_tokens: int = 64
    #: samples per problem; > 1 logs eval/mean@n and eval/pass@k (needs temperature > 0)
    n: int = 1
    #: pass@k's k (1 <= k <= n), the unbiased estimator of Chen et al. 2021
    k: int = 1
    #: 0 = greedy
    temperature: Number = 0.0


@dataclass
class LogConfig:
    """``log``: what a person watching the run sees besides the scalars."""

    #: every N RL steps a few (prompt, completion, reward, advantage) rows to TensorBoard's text tab and
    #: <run>/samples.jsonl; 0 = never
    samples_every_n_steps: int = 10
    #: rows each time
    num_samples: int = 4
    #: one plain line per step (step, reward, response length, s/step, tokens/s): auto (when stdout is not a
    #: terminal, which also turns the progress bar off) | true | false
    plain_lines: Any = "auto"


@dataclass
class RewardConfig:
    """``reward``: what scores a completion (``tasks.reward_functions``; docs/data.md)."""

    #: null: the task's own verifier; or a list of built-ins (math, exact, format, length_penalty),
    #: 'module:function' or 'path/to/file.py:function'
    functions: Optional[list[str]] = None
    #: one weight per function; null = all 1. The reward is the weighted sum (a None counts 0)
    weights: Optional[list[Number]] = None
    #: verifier processes (persistent, one thread each); a call past reward_timeout_s kills and replaces one
    num_workers: int = 2


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


@dataclass
class KlConfig:
    """``kl``: penalty to the frozen initial policy."""

    #: 0 = off (no reference copy kept)
    beta: Number = 0.0
    #: k1 | k2 | k3 (``objectives.KL_KINDS``)
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


@dataclass
class OptimConfig:
    """``optim``: AdamW and the non-finite guard."""

    lr: Number = 2.0e-6
    weight_decay: Number = 0.0
    betas: list[Number] = field(default_factory=lambda: [0.9, 0.999])
    #: max gradient norm; 0 or null = no clipping
    grad_clip: Optional[Number] = 1.0
    #: linear warm-up over this many optimizer steps
    warmup_steps: int = 0
    #: a non-finite loss/gradient skips the update; this many in a row stop the run (0 = never). Untyped here so
    #: that ``config.validate`` names a bad value
    max_nonfinite_updates: Any = 3


@dataclass
class CheckpointConfig:
    """``checkpoint``: Lightning checkpoints (weights, optimizer, step) in <run>/checkpoints."""

    every_n_steps: int = 10


def _trainer_defaults() -> dict[str, Any]:
    return {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 30,
        "log_every_n_steps": 1,
        "enable_progress_bar": True,
        "precision": "auto",
    }


@dataclass
class TensorBoardLoggerConfig:
    """``logger.tensorboard``: Lightning's TensorBoardLogger, event files in ``<run>/tensorboard``."""

    #: sub-folder of the run folder
    name: str = "tensorboard"


@dataclass
class CSVLoggerConfig:
    """``logger.csv``: Lightning's CSVLogger, ``<run>/csv/metrics.csv`` (one row per step, one column per tag)."""

    #: sub-folder of the run folder
    name: str = "csv"


@dataclass
class WandbLoggerConfig:
    """``logger.wandb``: Lightning's WandbLogger (``pip install wandb``), files under ``<run>/wandb``."""

    project: str = "lit_rl"
    #: a W&B team or user; null = the account's default
    entity: Optional[str] = None
    #: online | offline | disabled; null = the WANDB_MODE environment variable, else online
    mode: Optional[str] = None


@dataclass
class MLflowLoggerConfig:
    """``logger.mlflow``: Lightning's MLFlowLogger (``pip install mlflow-skinny``)."""

    experiment_name: str = "lit_rl"
    #: a tracking server (http://...) or store URI; null = a local file store in ``<run>/mlruns``
    tracking_uri: Optional[str] = None


@dataclass
class LoggerConfig:
    """``logger``: where metrics go; each logger set here (not null) is used, several at once with
    ``logger=[tensorboard,wandb]``; ``logger=none``: none (``train.build_loggers``)."""

    tensorboard: Optional[TensorBoardLoggerConfig] = None
    csv: Optional[CSVLoggerConfig] = None
    wandb: Optional[WandbLoggerConfig] = None
    mlflow: Optional[MLflowLoggerConfig] = None
    #: the run's name in W&B and MLflow; null = the run folder's name (in a sweep: what the sweep varies)
    run_name: Optional[str] = None


@dataclass
class TrainConfig:
    """The whole run (``conf/train.yaml``): the groups chosen in its defaults list and its own sections.

    ``trainer`` is the Lightning Trainer's keyword arguments, left open (Lightning checks them). ``task`` and
    ``engine`` are typed by their option's own schema (``SCHEMAS``); everything else by the fields below.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    task: Any = field(default_factory=lambda: {"name": "arithmetic"})
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    engine: Any = field(default_factory=lambda: {"name": "torch"})
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    trainer: dict[str, Any] = field(default_factory=_trainer_defaults)
    seed: int = 0
    #: a verifier that raises or runs longer scores 0, counted in rollout/reward_errors
    reward_timeout_s: Number = 10.0
    #: torch intra-op threads: auto (the physical cores this process may run on, ``hardware.auto_threads``) |
    #: adaptive (auto's count, then per step the cores other processes leave free) | an integer
    threads: Any = "auto"
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    kl: KlConfig = field(default_factory=KlConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    #: resume: a .ckpt path, or "last" (with hydra.run.dir=<the run>)
    ckpt_path: Optional[str] = None
    #: a run folder to continue (``train.resumed_config``): its saved config.yaml, its last checkpoint, its folder
    resume: Optional[str] = None
    #: rows of float32 logits alive at once when the trainer scores tokens (100 MB at V=49152)
    logprob_chunk_tokens: int = 512


# -- the gradient-bias probe (recipes/probe_gradients.py, conf/probe.yaml) ---------------------------------
@dataclass
class ProbeEngineOverrides:
    """``probe.settings[i].engine``: the ``engine`` fields a mismatch setting overrides (null = the run's own)."""

    logit_noise: Optional[Number] = None
    temperature_offset: Optional[Number] = None
    dtype: Optional[str] = None
    int8_roundtrip: Optional[bool] = None


@dataclass
class ProbeSetting:
    """One mismatch setting of the probe: a name (its row label) and the engine fields it sets."""

    name: str = MISSING
    engine: ProbeEngineOverrides = field(default_factory=ProbeEngineOverrides)


@dataclass
class ProbeConfig:
    """``probe``: the gradient-bias probe's own fields (``lit_rl.tools.probe``; ranges in ``probe.check_probe``)."""

    #: the corrections whose batch gradients are measured (names of ``corrections.CORRECTIONS``)
    corrections: list[str] = field(default_factory=lambda: ["none", "tis", "mis", "sc", "sc+tis", "sc+mis"])
    #: the mismatched samplers; each correction sees the same rollouts of each
    settings: list[ProbeSetting] = field(default_factory=list)
    #: rollout batches per mismatch setting (>= 3: the jackknife leaves one out)
    batches: int = 5
    #: on-policy batches for the reference gradient (correction none; >= 3)
    reference_batches: int = 5
    #: constant (every advantage 1: the drift, true value 0) and/or reward (the batch's own advantages)
    modes: list[str] = field(default_factory=lambda: ["constant"])
    #: D of the gradients' CountSketch (relative error of a squared norm ~ sqrt(2/D))
    sketch_dim: int = 131072
    sketch_seed: int = 0
    #: output folder; null = the Hydra run folder
    out: Optional[str] = None


@dataclass
class ProbeRunConfig(TrainConfig):
    """The probe's whole config (``conf/probe.yaml``): every field of a training run, plus ``probe``."""

    probe: ProbeConfig = field(default_factory=ProbeConfig)


#: the schemas stored in Hydra's ConfigStore (``register_configs``): name -> (group, dataclass). The primary
#: configs' bases (group ``schema``, merged at the root: ``conf/train.yaml`` lists ``schema: train`` first,
#: ``conf/probe.yaml`` overrides it with ``probe``), and the per-option bases of the groups whose options have
#: different fields (task, engine)
SCHEMAS: dict[str, tuple[str | None, type]] = {
    "train": ("schema", TrainConfig),
    "probe": ("schema", ProbeRunConfig),
    "base_arithmetic": ("task", ArithmeticConfig),
    "base_gsm8k": ("task", Gsm8kConfig),
    "base_dataset": ("task", DatasetConfig),
    "base_torch": ("engine", EngineConfig),
    "base_vllm": ("engine", VLLMEngineConfig),
}


def register_configs() -> None:
    """Store the schemas in Hydra's ConfigStore (idempotent). ``conf/train.yaml`` lists ``schema: train`` first in
    its defaults, ``conf/task/<name>.yaml`` its ``base_<name>``. Called when this module is imported."""
    store = ConfigStore.instance()
    for name, (group, node) in SCHEMAS.items():
        store.store(name=name, group=group, node=node, package="_global_" if group == "schema" else None)


def config_of(cls: type[C], values: Mapping | C | None, ignore_unknown: bool = False) -> C:
    """``values`` (a mapping, e.g. one group of the composed config as a plain dict, or a dataclass instance)
    as the dataclass ``cls``: what it leaves out takes the field's default, nested mappings become their
    dataclasses. An instance of ``cls`` is returned as is. Raises TypeError naming a key ``cls`` has no field
    for, unless ``ignore_unknown`` (then such keys are dropped)."""
    if isinstance(values, cls):
        return values
    if dataclasses.is_dataclass(values):
        values = dataclasses.asdict(values)
    values = dict(values or {})
    kinds = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(kinds))
    if ignore_unknown:
        values = {k: v for k, v in values.items() if k in kinds}
    elif unknown:
        raise TypeError(f"{cls.__name__} has no field {unknown[0]!r} (fields: {sorted(kinds)})")
    out = {}
    for name, value in values.items():
        default = kinds[name].default_factory() if kinds[name].default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default) and isinstance(value, Mapping):
            value = config_of(type(default), value)
        out[name] = value
    return cls(**out)


register_configs()
