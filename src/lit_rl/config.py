"""Start-up validation of the composed Hydra config: every bad value fails here, before any model loads.

Each error names the field, the value given and what is allowed.

What is checked where. ``validate`` first refuses a key that no typed section has a field for (``check_keys``:
Hydra refuses ``algo.clip_ratioo=0.3`` while it composes, but ``+algo.clip_ratioo=0.3`` adds the key), then runs a
short sequence of named checks, part by part, always in the same order
(the first bad value is the one reported). A value that only its own section bounds is checked by that section's
dataclass in ``lit_rl.schema`` (``problems``: the algorithm's rules, the task option's fields, the engine's
mismatch dial, correction, rollout's stale-rollout fields, sampling, optim, checkpoint, eval, log); this module
holds the checks that cross parts or read a registry of ``lit_rl.choices``, and raises ConfigError.

What runs when. This module imports neither torch nor Lightning (the named choices it checks against are in
``lit_rl.choices``, each algorithm's flags on its config dataclass in ``lit_rl.schema.algo``), and ``validate`` checks
the values first, so ``recipes/train.py`` refuses a bad value before either loads. The checks that need torch,
vLLM or the user's code run after every value has passed (``check_environment``):

- ``engine=vllm``: vLLM is installed (``check_vllm``); ``engine=auto`` asks whether it is
  (``rollout.engines.vllm_installed``, which imports torch); for a vLLM engine, its fields that depend on CUDA
  (``check_vllm_engine``) and ``kernels=batch_invariant`` refused beside it;
- ``model.attn_implementation=flash_attention_2``: a CUDA device and the flash_attn package;
- ``reward.functions``: the user's reward files and modules are loaded (``tasks.reward_checks.check_reward``), their
  imports with them.

``train.run`` checks the rest once it has loaded them: the resolved precision with LoRA (``check_lora_kernels``),
Lightning's device count (``check_world_size``) and the model's own config (context length, attention support:
``run.model_checks.check_context``, ``run.model_checks.check_model_support``).
"""

from __future__ import annotations

import difflib
import json
import math
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .choices import (
    ALGO_CONFIGS,
    ALGORITHMS,
    ATTENTION_BACKWARD_CHOICES,
    CORRECTIONS,
    FP32_GEMM_CHOICES,
    KERNELS,
    KL_KINDS,
    KL_MODES,
    LINEAR_ATTENTION_CHOICES,
    MULTI_REWARD,
    REDUCTION_MODES,
    ROLLOUT_MODES,
    SCALES,
    STD_KINDS,
)
from .choices import ENGINE_CHOICES as ENGINES
from .schema import (
    SCHEMAS,
    AlgoConfig,
    CheckpointConfig,
    CorrectionConfig,
    DistillConfig,
    EngineConfig,
    EvalConfig,
    KlConfig,
    LogConfig,
    OptimConfig,
    RolloutConfig,
    SamplingConfig,
    TaskConfig,
    config_of,
)
from .schema.base import Problems, is_int, is_number, unknown_keys
from .tasks import TASKS

DTYPES = ("float32", "bfloat16")
#: trainer.precision: auto (lit_rl.run.hardware.resolve_precision) or one of Lightning's values
PRECISIONS = (
    "auto",
    "32-true",
    "bf16-mixed",
    "16-mixed",
    "bf16-true",
    "16-true",
    "64-true",
    "32",
    "bf16",
    "16",
    "64",
    32,
    16,
    64,
)


class ConfigError(ValueError):
    """A config field holds a value lit_rl cannot run with; the message says which and what is allowed."""


def _check(ok: bool, field: str, value, allowed: str) -> None:
    if not ok:  # true / false / null as written in YAML and on the command line, not Python's True / None
        shown = json.dumps(value) if value is None or isinstance(value, bool) else repr(value)
        raise ConfigError(f"{field}={shown} is not allowed: {allowed}")


def _check_int(value, field: str, minimum: int, meaning: str = "") -> None:
    _check(is_int(value) and value >= minimum, field, value, f"must be an integer >= {minimum}{meaning}")


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError on the first invalid field of ``cfg`` (the composed train config): the values first,
    without importing torch, part by part in this order, then the checks that need torch, vLLM or the user's
    code (``check_environment``). A section whose values only it bounds checks them on its dataclass
    (``problems``: ``check_section``, ``algo_config``, ``task_config``); the rest here crosses parts or reads
    a registry of ``lit_rl.choices``. Before any value: every key is a field (``check_keys``)."""
    check_keys(cfg)
    check_choices(cfg)
    check_section(cfg, "correction")
    check_dtypes(cfg)
    check_algo(cfg)
    check_rollout(cfg)
    check_sampling(cfg)
    check_kl(cfg)
    for key in ("optim", "checkpoint", "eval", "log", "distill"):
        check_section(cfg, key)
    check_hardware(cfg)
    check_lora(cfg)
    check_task(cfg)
    from .tasks import reward_checks  # imports this module: a cycle at import time otherwise

    reward_checks.check_answer_needed(cfg)
    check_model_path(cfg)
    check_environment(cfg)


def check_keys(cfg: DictConfig) -> None:
    """Raise ConfigError for the first key of a typed section that its dataclass has no field for, naming it,
    the closest field and the fields there are. Hydra refuses ``algo.clip_ratioo=0.3`` while it composes, but
    ``+algo.clip_ratioo=0.3`` (the form its own message suggests) adds the key to any section, where it would
    be ignored or fail later with a traceback. Sections typed by a dataclass are closed (every group but
    ``trainer``, and the root); untyped ones stay open (``trainer``: Lightning's keyword arguments, which
    Lightning checks)."""
    for field, value, section, fields in unknown_keys(cfg):
        key = field.rsplit(".", 1)[-1]
        close = difflib.get_close_matches(key, fields, n=1)
        hint = f"did you mean {section}{close[0]}? " if close else ""
        where = f"{section[:-1]} has no field {key!r}" if section else f"the config has no top-level field {key!r}"
        _check(False, field, value, f"{where} ({hint}its fields: {', '.join(sorted(fields))})")


#: the config sections whose values only their own dataclass bounds (``problems``), by key
SECTIONS: dict[str, type] = {
    "engine": EngineConfig,
    "correction": CorrectionConfig,
    "rollout": RolloutConfig,
    "sampling": SamplingConfig,
    "optim": OptimConfig,
    "checkpoint": CheckpointConfig,
    "eval": EvalConfig,
    "log": LogConfig,
    "distill": DistillConfig,
}


def check_section(cfg: DictConfig, key: str) -> None:
    """Raise ConfigError for the first value the dataclass of ``cfg.<key>`` (``SECTIONS``) refuses."""
    section = config_of(SECTIONS[key], OmegaConf.to_container(cfg[key], resolve=True), ignore_unknown=True)
    _raise_first(section.problems(cfg))


def _raise_first(problems: Problems) -> None:
    """ConfigError for the first (field, value, allowed) of a dataclass's ``problems`` (``schema.base``)."""
    for field, value, allowed in problems:
        _check(False, field, value, allowed)


def check_choices(cfg: DictConfig) -> None:
    """The groups chosen in the defaults list name registered choices (algo, engine, task, correction,
    kernels); the engine's mismatch dial comes right after the engine (``EngineConfig.problems``)."""
    _check(cfg.algo.name in ALGORITHMS, "algo", cfg.algo.name, f"choose one of {list(ALGORITHMS)}")
    _check(cfg.engine.name in ENGINES, "engine", cfg.engine.name, f"choose one of {list(ENGINES)}")
    check_section(cfg, "engine")  # the mismatch dial; before the vLLM checks: its refusal there holds without vLLM
    _check(cfg.task.name in TASKS, "task", cfg.task.name, f"choose one of {list(TASKS)}")
    _check(cfg.correction.name in CORRECTIONS, "correction", cfg.correction.name, f"choose one of {list(CORRECTIONS)}")
    check_kernels(cfg)


def check_kernels(cfg: DictConfig) -> None:
    """``kernels`` and its options, ``engine.packed_linear``, ``decode_attention``, ``fused_sampler`` beside them;
    batch-invariant kernels keep their own products, attention and sampling, CPU only (``trainer.accelerator``)."""
    kernels = cfg.kernels.name
    _check(kernels in KERNELS, "kernels", kernels, f"choose one of {list(KERNELS)}")
    fields = {"fp32_gemm": ("auto", FP32_GEMM_CHOICES), "linear_attention": ("auto", LINEAR_ATTENTION_CHOICES),
              "attention_backward": ("auto", ATTENTION_BACKWARD_CHOICES)}  # fmt: skip
    value = {name: cfg.kernels.get(name, default) for name, (default, _) in fields.items()}
    for name, (_, allowed) in fields.items():
        _check(value[name] in allowed, f"kernels.{name}", value[name], f"choose one of {list(allowed)}")
    own = "kernels=batch_invariant runs every product through its own blocked kernels: leave"
    engine = {name: cfg.engine.get(name, "auto") for name in ("packed_linear", "decode_attention", "fused_sampler")}
    attn = "kernels=batch_invariant runs its own attention, forward and backward: leave"
    samples = "kernels=batch_invariant samples with torch's calls, the bits it reproduces: leave"
    for field, got, bad, leave in (
        ("kernels.fp32_gemm", value["fp32_gemm"], value["fp32_gemm"] == "onednn", f"{own} kernels.fp32_gemm at aten"),
        *((f"engine.{name}", engine[name], engine[name] is True, f"{why} engine.{name} at auto (off there) or false")
          for name, why in (("packed_linear", own), ("decode_attention", attn), ("fused_sampler", samples))),
        ("kernels.attention_backward", value["attention_backward"], value["attention_backward"] == "explicit",
         f"{attn} it at auto (which means flash there) or flash"),
    ):  # fmt: skip
        _check(not (kernels == "batch_invariant" and bad), field, got, leave)
    accelerator = cfg.trainer.get("accelerator", "cpu")
    _check(kernels != "batch_invariant" or accelerator in ("cpu", "auto"), "kernels", kernels,
           f"batch-invariant kernels cover the CPU only (trainer.accelerator={accelerator!r}); on CUDA use Thinking "
           "Machines' batch_invariant_ops or vLLM's VLLM_BATCH_INVARIANT=1")  # fmt: skip


def check_dtypes(cfg: DictConfig) -> None:
    """``engine.dtype`` (null or one of ``DTYPES``) and ``model.dtype`` (float32: AdamW's master weights)."""
    if cfg.engine.dtype:
        _check(cfg.engine.dtype in DTYPES, "engine.dtype", cfg.engine.dtype, f"null or one of {list(DTYPES)}")
    _check(cfg.model.dtype in DTYPES, "model.dtype", cfg.model.dtype, f"choose one of {list(DTYPES)}")
    _check(
        cfg.model.dtype == "float32",
        "model.dtype",
        cfg.model.dtype,
        "training keeps float32 weights: AdamW on bfloat16 weights drops every update below bf16's "
        "resolution (at lr 2e-6 most weights never change); for bf16 compute use trainer.precision=bf16-mixed "
        "(float32 master weights and Adam state), for a bf16 sampler engine.dtype=bfloat16",
    )


def check_algo(cfg: DictConfig) -> None:
    """What the objective reads: ``algo`` (the clip, the schedule, the algorithm's own rules, the dual clip),
    ``advantage`` (against the algorithm's estimator) and ``loss``."""
    clip = cfg.algo.clip
    _check(clip.eps_low > 0, "algo.clip.eps_low", clip.eps_low, "must be > 0")
    _check(clip.eps_high > 0, "algo.clip.eps_high", clip.eps_high, "must be > 0")
    a = cfg.algo
    _check(a.ppo_epochs >= 1, "algo.ppo_epochs", a.ppo_epochs, "must be >= 1")
    _raise_first(algo_config(cfg).problems(cfg))  # the algorithm's own rules (its dataclass)
    check_dual_clip(cfg.algo)
    check_advantage(cfg)
    _check(
        cfg.loss.reduction in REDUCTION_MODES,
        "loss.reduction",
        cfg.loss.reduction,
        f"choose one of {list(REDUCTION_MODES)}",
    )
    coef = cfg.loss.get("entropy_coef", 0.0)
    _check(
        is_number(coef) and math.isfinite(coef) and coef >= 0,
        "loss.entropy_coef",
        coef,
        "must be a finite number >= 0 (0 = no entropy bonus)",
    )


def check_rollout(cfg: DictConfig) -> None:
    """``rollout``: the batch sizes, a group size the algorithm's baseline can learn from, ``update.shared_prefix``
    against the model, the stale-rollout fields, and the world size where ``trainer.devices`` names one."""
    ro = cfg.rollout
    _check(ro.prompts_per_step >= 1, "rollout.prompts_per_step", ro.prompts_per_step, "must be >= 1")
    _check_int(ro.group_size, "rollout.group_size", 1)
    algo = algo_config(cfg)
    if algo.group_baseline():
        _check(ro.group_size >= 2, "rollout.group_size", ro.group_size, algo.group_size_rule())
    _check(ro.micro_batch_size >= 1, "rollout.micro_batch_size", ro.micro_batch_size, "must be >= 1")
    check_shared_prefix(cfg)
    check_section(cfg, "rollout")  # the stale-rollout fields
    ranks = static_world_size(cfg.trainer)
    if ranks is not None:
        check_world_size(cfg, ranks)


def check_sampling(cfg: DictConfig) -> None:
    """``sampling`` (``SamplingConfig.problems``) and the evaluation's generation cap."""
    check_section(cfg, "sampling")
    _check(cfg.eval.max_new_tokens > 0, "eval.max_new_tokens", cfg.eval.max_new_tokens, "must be > 0")


def check_hardware(cfg: DictConfig) -> None:
    """How the run uses the machine: ``logprob_chunk_tokens``, ``threads``, ``trainer.precision``, and the
    algorithm's refusal of ``trainer.strategy=fsdp`` (``AlgoConfig.fsdp_refusal``)."""
    _check_int(cfg.logprob_chunk_tokens, "logprob_chunk_tokens", 1)
    threads = cfg.threads
    _check(
        threads in (None, "auto", "adaptive") or (is_int(threads) and threads >= 1),
        "threads",
        threads,
        "choose auto, adaptive or an integer >= 1",
    )
    if threads == "adaptive":
        check_adaptive_threads(cfg)
    precision = cfg.trainer.get("precision", "auto")
    _check(
        precision in PRECISIONS,
        "trainer.precision",
        precision,
        f"choose auto (bf16-mixed where the hardware multiplies bfloat16 natively, else 32-true) or one of "
        f"{[p for p in PRECISIONS if isinstance(p, str) and p != 'auto' and '-' in p]}",
    )
    refusal = ALGO_CONFIGS[cfg.algo.name].fsdp_refusal
    if str(cfg.trainer.get("strategy", "auto")) == "fsdp" and refusal:
        _check(False, "algo", cfg.algo.name, refusal)


def check_task(cfg: DictConfig) -> None:
    """``reward_timeout_s``, then the task option's own fields (``task_config``: ``constant_reward``, a dataset's
    path and options, a gsm8k folder)."""
    timeout = cfg.reward_timeout_s
    _check(is_number(timeout) and timeout > 0, "reward_timeout_s", timeout, "must be a number of seconds > 0")
    _raise_first(task_config(cfg).problems(cfg))


def task_config(cfg: DictConfig) -> TaskConfig:
    """The ``task`` group of ``cfg`` as its option's dataclass (``schema.SCHEMAS``' ``base_<name>``; a task
    registered without one: ``TaskConfig``, its other fields left out)."""
    _, cls = SCHEMAS.get(f"base_{cfg.task.name}", ("task", TaskConfig))
    return config_of(cls, OmegaConf.to_container(cfg.task, resolve=True), ignore_unknown=True)


def check_model_path(cfg: DictConfig) -> None:
    """``model.name_or_path``: ``tiny``, a hub id org/name, or a local folder that exists."""
    name = cfg.model.name_or_path
    if name != "tiny" and (name.startswith((".", "/", "~")) or name.count("/") != 1):
        _check(
            Path(name).expanduser().is_dir(),
            "model.name_or_path",
            name,
            "no such folder (give a local model folder or a hub id like org/name)",
        )


def algo_config(cfg: DictConfig) -> AlgoConfig:
    """The ``algo`` group of ``cfg`` as its algorithm's config dataclass (``choices.ALGO_CONFIGS``), which also
    answers ``validate``'s questions about the algorithm (``group_baseline``, ``ppo_clip``, ...)."""
    return config_of(ALGO_CONFIGS[cfg.algo.name], OmegaConf.to_container(cfg.algo, resolve=True))


def check_advantage(cfg: DictConfig) -> None:
    """``advantage.alpha`` in [0, 1]; ``advantage.std`` and ``advantage.scale``: known values; ``scale=none``
    means no std division, which is alpha = 0 (refused with any other alpha: one of the two would be ignored);
    non-default values only for an algorithm whose advantages are ``objectives.group_advantages``
    (``AlgoConfig.group_normalised``); the others (PPO, REINFORCE, REINFORCE++) do not read ``advantage.alpha``
    either, so a value other than its default 1.0 is refused there too instead of being ignored."""
    adv, name = cfg.advantage, cfg.algo.name
    _check(0.0 <= adv.alpha <= 1.0, "advantage.alpha", adv.alpha, "must lie in [0, 1]")
    std, scale = adv.get("std", "population"), adv.get("scale", "group")
    _check(std in STD_KINDS, "advantage.std", std, f"choose one of {list(STD_KINDS)}")
    _check(scale in SCALES, "advantage.scale", scale, f"choose one of {list(SCALES)}")
    multi = adv.get("multi_reward", "sum")
    _check(multi in MULTI_REWARD, "advantage.multi_reward", multi, f"choose one of {list(MULTI_REWARD)}")
    _check(
        scale != "none" or adv.alpha == 0,
        "advantage.scale",
        scale,
        f"none means no std division, i.e. advantage.alpha=0, but advantage.alpha={adv.alpha}: set "
        "advantage.alpha=0 too (Dr.GRPO's mean-only advantage), or choose scale=group|batch",
    )
    if not ALGO_CONFIGS[name].group_normalised:
        for key, value, default in (("std", std, "population"), ("scale", scale, "group"), ("alpha", adv.alpha, 1.0)):
            _check(
                value == default,
                f"advantage.{key}",
                value,
                f"{name} has its own advantage estimator (not the group-normalised one): leave it at {default!r}",
            )


def check_dual_clip(algo: DictConfig) -> None:
    """``algo.clip_ratio_c`` (dual clip) and ``algo.delta`` (TRL's two-sided clip): null or a number > 1, at most
    one of them, and only for an algorithm whose objective is the PPO clip (``AlgoConfig.ppo_clip``)."""
    ppo_clip = ALGO_CONFIGS.names_where(lambda algo: algo.ppo_clip)
    for key, meaning in (("clip_ratio_c", "the dual-clip bound c*|A|"), ("delta", "the cap of the unclipped ratio")):
        value = algo.get(key)
        if value is None:
            continue
        _check(
            is_number(value) and math.isfinite(value) and value > 1,
            f"algo.{key}",
            value,
            f"null (off) or a number > 1 ({meaning}; at ratio 1 no clip may bind)",
        )
        _check(
            algo.name in ppo_clip,
            f"algo.{key}",
            value,
            f"{algo.name}'s objective has no PPO clip for it to bound; it applies to {ppo_clip} (null = off)",
        )
    if algo.get("clip_ratio_c") is not None and algo.get("delta") is not None:
        raise ConfigError(
            f"algo.clip_ratio_c={algo.clip_ratio_c!r} and algo.delta={algo.delta!r} are both set: for A < 0 both bound "
            "the loss by a constant times |A| (delta > 1 + eps_high is the dual clip with c = delta); choose one"
        )


def check_kl(cfg: DictConfig) -> None:
    """``kl.beta`` >= 0, ``kl.estimator``, ``kl.mode`` (loss | reward; reward only where the algorithm has
    per-token returns to fold it into, ``AlgoConfig.kl_in_reward``), the adaptive controller (``kl.target``
    > 0 needs ``kl.beta`` > 0 to start from, ``kl.horizon`` > 0), then the section's own rules
    (``KlConfig.problems``: k1 cannot be a loss term)."""
    kl, name = cfg.kl, cfg.algo.name
    _check(kl.beta >= 0, "kl.beta", kl.beta, "must be >= 0")
    _check(kl.estimator in KL_KINDS, "kl.estimator", kl.estimator, f"choose one of {list(KL_KINDS)}")
    mode = kl.get("mode", "loss")
    _check(mode in KL_MODES, "kl.mode", mode, f"choose one of {list(KL_MODES)}")
    if mode == "reward":
        takes = ALGO_CONFIGS.names_where(lambda algo: algo.kl_in_reward)
        _check(
            ALGO_CONFIGS[name].kl_in_reward,
            "kl.mode",
            mode,
            f"{name}'s advantage is one number per sequence from the group's rewards, with no per-token reward to "
            f"fold the KL into: use kl.mode=loss, or an algorithm with per-token returns: {takes}",
        )
    target, horizon = kl.get("target"), kl.get("horizon", 10000)
    if target is not None:
        _check(
            is_number(target) and target > 0,
            "kl.target",
            target,
            "null (a fixed beta) or a KL > 0 (nats per sequence)",
        )
        _check(
            kl.beta > 0,
            "kl.beta",
            kl.beta,
            f"must be > 0 with kl.target={target}: the adaptive controller multiplies beta, so it starts from it",
        )
    _check(is_number(horizon) and horizon > 0, "kl.horizon", horizon, "must be > 0 (sequences)")
    _raise_first(config_of(KlConfig, OmegaConf.to_container(kl, resolve=True), ignore_unknown=True).problems(cfg))


def check_shared_prefix(cfg) -> None:
    """``update.shared_prefix``: auto, true or false; true is refused with ``model.gradient_checkpointing``
    (transformers drops the KV cache inside checkpointed layers, so the prompt could not be reused; auto turns
    sharing off there instead). Raises ConfigError naming the field."""
    update = cfg.get("update") or {}
    value = update.get("shared_prefix", "auto")
    _check(value in ("auto", True, False), "update.shared_prefix", value, "choose auto, true or false")
    checkpointing = bool((cfg.get("model") or {}).get("gradient_checkpointing", False))
    _check(
        not (value is True and checkpointing),
        "update.shared_prefix",
        value,
        "cannot be true with model.gradient_checkpointing=true (checkpointed layers drop the KV cache the "
        "completions would reuse); choose auto (sharing off there) or false",
    )


def check_adaptive_threads(cfg: DictConfig) -> None:
    """Raise ConfigError for ``threads: adaptive`` where something else must own the thread count (called by
    ``validate``, so a sweep's jobs are checked before the first starts): several data-parallel ranks (they
    share the cores by design, and each would count the others as load); ``kernels=batch_invariant`` (a
    matrix product's bits depend on the thread count, so the mode keeps the start-up count for the whole
    run, for the trainer and an async rollout producer alike, and raises at a product run at another);
    an out-of-process vLLM engine (its workers would count as another process's load)."""
    ranks = static_world_size(cfg.trainer) or 1
    kernels = cfg.kernels.name
    for bad, why in (
        (ranks > 1, f"{ranks} data-parallel ranks share the cores"),
        (
            kernels == "batch_invariant",
            "kernels=batch_invariant keeps its own thread count (a product's bits depend on the thread "
            "count, so the mode needs one count for the whole run)",
        ),
        (
            cfg.engine.name in ("vllm", "auto") and not cfg.engine.in_process,
            "the vLLM engine's worker processes would count as another process's load",
        ),
    ):
        if bad:
            raise ConfigError(f"threads=adaptive is not allowed here: {why}; use threads=auto or a number")


def static_world_size(trainer: DictConfig) -> int | None:
    """Data-parallel ranks that ``trainer.devices`` x ``trainer.num_nodes`` name, when they are numbers
    (``devices`` an int, a digit string or a list of device ids); None for ``auto``/-1, known only once
    Lightning has looked at the machine."""
    devices, nodes = trainer.get("devices", 1), trainer.get("num_nodes", 1)
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    elif isinstance(devices, str):  # "0,1,3" names devices; "auto" is up to Lightning
        if "," not in devices:
            return None
        devices = len([d for d in devices.split(",") if d.strip()])
    elif not isinstance(devices, int):
        try:
            devices = len(list(devices))
        except TypeError:
            return None
    if not isinstance(nodes, int) or devices < 1:
        return None
    return devices * nodes


def check_world_size(cfg: DictConfig, ranks: int) -> None:
    """Raise ConfigError unless ``cfg`` can run on ``ranks`` data-parallel ranks: every rank takes an equal
    share of the step's prompts (whole groups) and every minibatch has rows on every rank."""
    ro, devices, nodes = cfg.rollout, cfg.trainer.get("devices", 1), cfg.trainer.get("num_nodes", 1)
    named = f"trainer.devices={devices}"
    if nodes != 1 or devices != ranks:
        named = f"the {ranks} ranks ({named} x trainer.num_nodes={nodes})"
    _check(
        ro.prompts_per_step % ranks == 0,
        "rollout.prompts_per_step",
        ro.prompts_per_step,
        f"must be divisible by {named}",
    )
    strategy = str(cfg.trainer.get("strategy", "auto"))
    why = ROLLOUT_MODES[ro.mode].refusal_on_ranks(ranks, strategy, cfg.engine.name, named)
    _check(why is None, "rollout.mode", ro.mode, str(why))
    rows = ro.prompts_per_step * ro.group_size // ranks
    per_rank = "" if ranks == 1 else f" / {ranks} ranks"
    _check(
        1 <= cfg.algo.num_minibatches <= rows,
        "algo.num_minibatches",
        cfg.algo.num_minibatches,
        f"must lie in [1, prompts_per_step x group_size{per_rank} = {rows}]",
    )


def check_lora(cfg: DictConfig) -> None:
    """``model.lora``: r an int >= 0 (0: off), alpha > 0, dropout in [0, 1), target_modules a non-empty list of
    module names; LoRA with trainer=fsdp is refused (see the message). Raises ConfigError."""
    lora = cfg.model.get("lora")
    if lora is None:
        return
    r = lora.r
    _check(isinstance(r, int) and not isinstance(r, bool) and r >= 0, "model.lora.r", r, "an int >= 0 (0 = off)")
    if r == 0:
        return
    _check(is_number(lora.alpha) and lora.alpha > 0, "model.lora.alpha", lora.alpha, "a number > 0 (scale alpha/r)")
    _check(is_number(lora.dropout) and 0 <= lora.dropout < 1, "model.lora.dropout", lora.dropout, "in [0, 1)")
    targets = lora.target_modules
    _check(
        targets is not None and len(targets) > 0 and all(isinstance(t, str) and t for t in targets),
        "model.lora.target_modules",
        targets,
        "a non-empty list of module-name suffixes (e.g. [q_proj, v_proj])",
    )
    _check(
        str(cfg.trainer.get("strategy", "auto")) != "fsdp",
        "model.lora.r",
        r,
        "LoRA is not wired for trainer=fsdp: FSDP flattens each unit's frozen base and trainable adapter weights "
        "into one parameter, the reference policy is the same module with the adapter disabled (no second copy "
        "to shard), and the engine's merged-weights sync reads the unsharded module. The adapter's point is "
        "that the model fits one device: use trainer=cpu, trainer=gpu or trainer=ddp",
    )


def check_environment(cfg: DictConfig) -> None:
    """The checks of ``validate`` that need torch, vLLM or the user's code (the module's docstring lists them),
    run after every value has passed: a bad value fails before torch is imported. Raises ConfigError."""
    vllm = cfg.engine.name == "vllm"
    if vllm:
        check_vllm()
    elif cfg.engine.name == "auto":
        from .rollout.engines import vllm_installed  # imports torch

        vllm = vllm_installed()
    if vllm:
        check_vllm_engine(cfg)  # auto without vLLM is the embedded engine: nothing to check
    check_attn_implementation(cfg)
    _check(
        not (vllm and cfg.kernels.name == "batch_invariant"),
        "kernels",
        cfg.kernels.name,
        f"batch-invariant kernels are lit_rl's own, for the embedded engine and the trainer; with "
        f"engine={cfg.engine.name} the sampler runs vLLM's kernels (its batch-invariant mode, "
        f"VLLM_BATCH_INVARIANT=1, is not wired in this version): use engine=torch",
    )
    from .tasks import reward_checks

    reward_checks.check_reward(cfg)
    reward_checks.check_task_code(cfg)


def check_vllm() -> None:
    """Raise ConfigError for ``engine=vllm`` when vLLM is not installed, saying how to install it."""
    from .rollout.engines import vllm_installed
    from .rollout.vllm_engine import VLLM_INSTALL  # imports torch, not vllm: after the torch-free checks

    if not vllm_installed():
        raise ConfigError(f"engine=vllm needs vLLM, which is not installed: {VLLM_INSTALL}")


def check_vllm_engine(cfg: DictConfig) -> None:
    """The vLLM fields of ``engine`` (``engine=vllm`` or ``auto``): GPU-only features only with CUDA, tensor
    parallel only out of process; under DDP/FSDP one in-process engine per rank, tensor parallel 1."""
    import torch

    e = cfg.engine
    for key in ("sleep_mode", "cuda_graphs"):
        value = e[key]
        _check(value in ("auto", True, False), f"engine.{key}", value, "choose auto, true or false")
        _check(
            value is not True or torch.cuda.is_available(),
            f"engine.{key}",
            value,
            "needs a CUDA device (vLLM's CPU build has no sleep mode and no CUDA graphs); use auto or false",
        )
    value = e.get("prefix_caching", "auto")
    _check(value in ("auto", True, False), "engine.prefix_caching", value, "choose auto, true or false")
    _check_int(e.tensor_parallel_size, "engine.tensor_parallel_size", 1)
    _check(
        e.tensor_parallel_size == 1 or not e.in_process,
        "engine.tensor_parallel_size",
        e.tensor_parallel_size,
        "> 1 needs engine.in_process=false (tensor-parallel workers are processes)",
    )
    util = e.gpu_memory_utilization
    _check(is_number(util) and 0 < util <= 1, "engine.gpu_memory_utilization", util, "must lie in (0, 1]")
    kv = e.kv_cache_gb
    _check(kv is None or (is_number(kv) and kv > 0), "engine.kv_cache_gb", kv, "must be null or a number of GiB > 0")
    length = e.max_model_len
    _check(
        length is None or (is_int(length) and length > cfg.sampling.max_new_tokens),
        "engine.max_model_len",
        length,
        f"must be null or an integer > sampling.max_new_tokens={cfg.sampling.max_new_tokens}",
    )
    strategy = str(cfg.trainer.get("strategy", "auto"))  # a Lightning Trainer argument: absent = Lightning's auto
    _check(
        strategy in ("auto", "single_device", "ddp", "fsdp"),
        "trainer.strategy",
        strategy,
        f"engine={e.name} runs one colocated vLLM engine per training process under auto, single_device, ddp "
        f"or fsdp; with trainer.strategy={strategy} use engine=torch",
    )
    if strategy in ("ddp", "fsdp"):  # one engine per rank, inside the training world (vLLM's external launcher)
        _check(
            e.in_process and e.tensor_parallel_size == 1,
            "engine.in_process",
            e.in_process,
            f"engine=vllm with trainer.strategy={strategy} runs one in-process engine per rank (vLLM's "
            f"external_launcher over the training world): needs engine.in_process=true and "
            f"engine.tensor_parallel_size=1 (got {e.tensor_parallel_size})",
        )


#: ``model.attn_implementation`` values: transformers' attention kernels lit_rl runs
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")


def check_attn_implementation(cfg: DictConfig) -> None:
    """ConfigError for a ``model.attn_implementation`` outside ``ATTN_IMPLEMENTATIONS``, and for
    ``flash_attention_2`` where it cannot run: flash-attn's kernels are CUDA-only (refused for
    ``trainer.accelerator=cpu`` or a machine without a CUDA device) and need the ``flash_attn`` package. Whether
    the model's class supports the choice is checked when its config is read
    (``run.model_checks.check_model_support``)."""
    impl = cfg.model.attn_implementation
    _check(
        impl in ATTN_IMPLEMENTATIONS, "model.attn_implementation", impl, f"choose one of {list(ATTN_IMPLEMENTATIONS)}"
    )
    if impl != "flash_attention_2":
        return
    import importlib.util

    import torch

    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    _check(
        accelerator in ("gpu", "cuda", "auto") and torch.cuda.is_available(),
        "model.attn_implementation",
        impl,
        f"flash-attn runs on CUDA GPUs only (trainer.accelerator={accelerator}, CUDA available: "
        f"{torch.cuda.is_available()}); on the CPU use sdpa (or eager)",
    )
    _check(
        importlib.util.find_spec("flash_attn") is not None,
        "model.attn_implementation",
        impl,
        "the flash_attn package is not installed (pip install flash-attn --no-build-isolation, matching your "
        "torch and CUDA); or use sdpa",
    )


def check_lora_kernels(cfg: DictConfig) -> None:
    """LoRA with ``kernels=batch_invariant`` needs a bf16 trainer precision (``trainer.precision`` resolved,
    ``resolve_hardware``): there the engine's log-probs equal the trainer's bit for bit through the updates
    (tests/test_lora.py). At 32-true, gaps of 1e-8 to 1e-6 nats appeared (tiny model, 4 steps; also with B = 0,
    i.e. the adapter contributing exact zeros, and gone when the embedding weight is left trainable: a code path
    of the trainer's float32 forward with frozen weights that the kernels do not pin down, not isolated), so the
    mode's guarantee does not hold and the run is refused. Raises ConfigError."""
    lora = cfg.model.get("lora")
    if lora is None or not lora.r or cfg.kernels.name != "batch_invariant":
        return
    precision = str(cfg.trainer.get("precision"))
    _check(
        precision.startswith("bf16"),
        "kernels",
        cfg.kernels.name,
        f"with a LoRA adapter (model.lora.r={lora.r}) the batch-invariant kernels keep the engine's log-probs bit for "
        f"bit equal to the trainer's only under trainer.precision=bf16-mixed (at {precision}, with the base "
        "weights frozen, gaps of 1e-8 to 1e-6 nats were measured); use trainer.precision=bf16-mixed, or "
        "kernels=default",
    )
