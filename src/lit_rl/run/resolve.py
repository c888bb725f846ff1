"""What the config leaves to the run, filled in at start-up: ``auto`` precision and threads from the machine
(``resolve_hardware``, with ``hardware``'s facts) and ``engine=auto`` / vLLM's unset fields from the model and
the precision (``resolve_engine``); ``resolve_settings`` does both, as a run, the gradient probe and the
benchmarks do.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf, open_dict

from ..config import ConfigError, check_lora_kernels, static_world_size
from ..corrections import sc_tail_samples
from ..rollout.engines import on_cuda, resolve_auto
from ..schema.loss import TAIL_DRAWS_NOT_FROM_VLLM
from .callbacks import AdaptiveThreads, adaptive_threads
from .hardware import (
    auto_threads,
    configure_threads,
    keep_freed_memory,
    omp_summary,
    oversubscribed,
    resolve_precision,
    uses_cuda,
)
from .model_checks import vllm_refusal


def resolve_engine(cfg: DictConfig) -> None:
    """Fill what ``engine`` leaves to the run, in place: ``name=auto`` becomes vllm (installed, and the model's
    head_dim as vLLM builds it fits, ``model_checks.vllm_refusal``: >= 32 on CPU, and equal to the config's for
    the architectures vLLM derives it for, and no correction needs what only the embedded engine records:
    ``correction.sc.tail=sampled``'s tail draws) or torch (printed, with the reason); vLLM's ``dtype: null``
    becomes bfloat16 under a bf16 trainer precision (``auto`` resolved as ``resolve_hardware`` does), else
    ``model.dtype``, its ``kv_cache_gb: null`` 1 GiB on CPU, and its ``prefix_caching: auto`` on for a
    multi-turn task, else off; ``engine.seed`` = ``seed``. Raises ConfigError for ``engine=vllm`` with a model
    vLLM cannot run (``vllm_refusal``), before any weight loads."""
    with open_dict(cfg):
        refusal = vllm_refusal(cfg.model, on_cuda()) if cfg.engine.name in ("auto", "vllm") else None
        if refusal is None and cfg.engine.name in ("auto", "vllm") and sc_tail_samples(cfg.correction):
            refusal = f"correction.sc.tail=sampled draws tail tokens {TAIL_DRAWS_NOT_FROM_VLLM}"
        if cfg.engine.name == "auto":
            cfg.engine.name = resolve_auto(OmegaConf.to_container(cfg.engine), refusal)
            why = f" ({refusal})" if refusal and cfg.engine.name == "torch" else ""
            print(f"lit_rl: engine=auto -> {cfg.engine.name}{why}", flush=True)
        if cfg.engine.name == "vllm" and refusal:
            raise ConfigError(f"engine=vllm: {refusal}; use engine=torch (or engine=auto)")
        if cfg.engine.name == "vllm" and not cfg.engine.dtype:
            precision, _ = resolve_precision(cfg.trainer.get("precision", "auto"), cfg.trainer.get("accelerator"))
            cfg.engine.dtype = "bfloat16" if str(precision).startswith("bf16") else cfg.model.dtype
        if cfg.engine.name == "vllm" and cfg.engine.kv_cache_gb is None and not on_cuda():
            cfg.engine.kv_cache_gb = 1.0  # on CPU vLLM would otherwise reserve a fraction of all RAM
        if cfg.engine.name == "vllm" and cfg.engine.get("prefix_caching", "auto") in (None, "auto"):
            # a multi-turn episode's later turns are requests that repeat its whole ids: cached, they are not
            # prefilled again (docs/environments.md); a single-turn run gains little and keeps it off
            cfg.engine.prefix_caching = OmegaConf.to_object(cfg.task).multi_turn  # the task schema's own rule
        cfg.engine.seed = cfg.seed


def resolve_hardware(cfg: DictConfig) -> list[str]:
    """Fill the settings ``auto`` leaves to the machine, in place, and set the thread count; returns one line
    per choice with its reason (printed at start, written at the top of config.yaml).

    ``trainer.precision: auto`` -> ``hardware.resolve_precision`` (bf16-mixed where the hardware multiplies
    bfloat16 natively, else 32-true). ``threads: auto`` -> ``hardware.auto_threads``: an exported
    ``OMP_NUM_THREADS``, else the physical cores this process may run on (affinity mask, cgroup quota),
    shared out among the ranks of a CPU ``trainer.devices`` > 1 run and, with ``rollout.mode=async`` on the
    CPU, between the rollout producer and the trainer (measured: 1 + 1 threads on 2 cores overlap best,
    benchmarks/README.md, "Sync versus async rollouts"); ``threads: adaptive`` starts from the
    same count (``AdaptiveThreads`` then adapts it per step). An explicit value is always honoured."""
    lines = []
    with open_dict(cfg):
        accelerator = cfg.trainer.get("accelerator", "auto")
        requested = cfg.trainer.get("precision", "auto")
        precision, why = resolve_precision(requested, accelerator)
        cfg.trainer.precision = precision
        if requested in (None, "auto"):
            lines.append(f"trainer.precision={precision} (auto: {why})")
        else:  # honoured; the reason carries a warning where bf16 would be emulated on this CPU
            lines.append(f"trainer.precision={precision}" + (f" ({why})" if why != "set explicitly" else ""))
        requested = cfg.threads
        if requested in (None, "auto", "adaptive"):
            ranks = static_world_size(cfg.trainer) or 1
            ranks_here = ranks // int(cfg.trainer.get("num_nodes", 1) or 1) if not uses_cuda(accelerator) else 1
            if cfg.rollout.mode == "async" and not uses_cuda(accelerator):
                ranks_here *= 2  # the rollout producer thread and the trainer each get their half of the cores
            cfg.threads, why = auto_threads(ranks_here)
            why = f"{requested or 'auto'}: {why}" + (
                ", adapted per step to the cores other processes leave free" if requested == "adaptive" else ""
            )
        else:
            why = "set explicitly"
        cfg.threads = configure_threads(cfg.threads)
        lines.append(f"threads={cfg.threads} ({why}; {omp_summary()}); {keep_freed_memory()}")
        if requested not in (None, "auto", "adaptive"):
            lines += oversubscribed(cfg.threads)
    return lines


def resolve_settings(cfg: DictConfig) -> tuple[list[str], AdaptiveThreads | None]:
    """Fill the auto settings of a validated config, in place, and print what they became: the hardware
    (``resolve_hardware``; precision first: the vLLM engine's dtype follows it), then the engine
    (``resolve_engine``). Returns (one line per hardware choice, the ``threads=adaptive`` callback or None).
    Raises ConfigError for LoRA with the batch-invariant kernels at the resolved precision
    (``config.check_lora_kernels``) or an engine the model cannot run."""
    requested_threads = cfg.threads
    hardware = resolve_hardware(cfg)  # precision first: the vLLM engine's dtype follows it
    check_lora_kernels(cfg)  # needs the resolved precision
    governor = adaptive_threads(cfg, requested_threads)  # None unless threads=adaptive
    for line in hardware:
        print(f"lit_rl: {line}", flush=True)
    resolve_engine(cfg)
    return hardware, governor
