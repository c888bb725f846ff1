"""Build everything a config names and run Lightning's fit loop; ``recipes/train.py`` is its Hydra front.

    run(cfg, out_dir) -> dict of the last logged metrics

Order matters for users: the config is validated first (a bad value fails in a second, before any model
loads), then the output folder is checked (a finished run is never overwritten), then the model loads.

Several ranks (``trainer=ddp``, ``trainer=fsdp``): every rank runs this function (Lightning's launcher
starts the other local ranks by running the same command again; torchrun and SLURM start them all), and
only global rank 0 writes files: config.yaml, the TensorBoard run, checkpoints, policy/ and finished.json.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import FSDPStrategy
from omegaconf import DictConfig, OmegaConf, open_dict

from .algorithms import ALGORITHMS
from .algorithms.base import updates_per_step
from .checkpoints import AtomicCheckpointIO, find_last
from .config import ConfigError, check_world_size, static_world_size, validate
from .hardware import (
    ThreadGovernor,
    auto_threads,
    configure_threads,
    omp_summary,
    peak_flops,
    resolve_precision,
    uses_cuda,
)
from .kernels import kernel_mode
from .models import ModelSpec, load_policy, resolve_model_path, tiny_config
from .rollout.datamodule import RolloutDataModule
from .rollout.engines import on_cuda, resolve_auto
from .rollout.staleness import StaleRolloutsShutdown
from .tasks import build_task

log = logging.getLogger(__name__)

FINISHED_MARKER = "finished.json"


def swept_keys(args) -> set[str]:
    """Keys that the override strings ``args`` sweep, as Hydra's own override parser reads them: choices
    (``algo=grpo,dapo``, ``optim.betas=[0.9,0.99],[0.8,0.9]``), ``range(...)``, ``glob(...)``. Flags and
    strings Hydra cannot parse are skipped."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    keys = set()
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            (override,) = parser.parse_overrides([arg])
        except Exception:  # noqa: BLE001 - not ours to judge: Hydra reports bad overrides itself
            continue
        if override.is_sweep_override():
            keys.add(override.key_or_group.lstrip("+~"))
    return keys


def run_name(task_overrides, sweeper_params=None, argv=None) -> str:
    """Name of a multirun job from the overrides the sweep varies, e.g. ``algo=dapo,seed=1``.

    A key is swept when the command line sweeps it (``swept_keys``) or an experiment preset lists it under
    ``hydra.sweeper.params``; fixed overrides stay out of the name (they are in each run's config.yaml),
    which keeps folder and TensorBoard run names short and telling. Falls back to ``run`` when nothing is
    swept.
    """
    swept = set(dict(sweeper_params or {}).keys())
    swept |= swept_keys(sys.argv[1:] if argv is None else argv)
    parts = [o for o in task_overrides if o.split("=", 1)[0].lstrip("+~") in swept]
    return ",".join(parts) or "run"


def register_resolvers() -> None:
    """Register ``lit_rl_run_name`` (used by ``hydra.sweep.subdir``) once."""
    if not OmegaConf.has_resolver("lit_rl_run_name"):
        OmegaConf.register_new_resolver("lit_rl_run_name", run_name)


def model_head_dim(model_cfg: DictConfig) -> int | None:
    """Attention head size of the configured model, read from its config (no weights loaded); None if unknown."""
    try:
        if model_cfg.name_or_path == "tiny":
            config = tiny_config(1)
        else:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(resolve_model_path(model_cfg.name_or_path),
                                                trust_remote_code=bool(model_cfg.trust_remote_code))
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    except Exception:  # noqa: BLE001 - a bad name is reported where the model loads
        return None


def resolve_engine(cfg: DictConfig) -> None:
    """Fill what ``engine`` leaves to the run, in place: ``name=auto`` becomes vllm (installed and, on CPU,
    the model's head_dim >= 32, which vLLM's CPU attention needs) or torch (printed); vLLM's ``dtype: null``
    becomes bfloat16 under a bf16 trainer precision (``auto`` resolved as ``resolve_hardware`` does), else
    ``model.dtype``, and its ``kv_cache_gb: null``
    1 GiB on CPU; ``engine.seed`` = ``seed``. Raises ConfigError for ``engine=vllm`` with a model vLLM's CPU
    build cannot run."""
    with open_dict(cfg):
        head_dim = model_head_dim(cfg.model) if cfg.engine.name in ("auto", "vllm") and not on_cuda() else None
        if cfg.engine.name == "auto":
            cfg.engine.name = resolve_auto(OmegaConf.to_container(cfg.engine), head_dim)
            print(f"lit_rl: engine=auto -> {cfg.engine.name}", flush=True)
        if cfg.engine.name == "vllm" and head_dim is not None and head_dim < 32:
            raise ConfigError(f"engine=vllm: vLLM's CPU attention needs head_dim >= 32 and model.name_or_path="
                              f"{cfg.model.name_or_path!r} has {head_dim}; use engine=torch (or engine=auto)")
        if cfg.engine.name == "vllm" and not cfg.engine.dtype:
            precision, _ = resolve_precision(cfg.trainer.get("precision", "auto"), cfg.trainer.get("accelerator"))
            cfg.engine.dtype = "bfloat16" if str(precision).startswith("bf16") else cfg.model.dtype
        if cfg.engine.name == "vllm" and cfg.engine.kv_cache_gb is None and not on_cuda():
            cfg.engine.kv_cache_gb = 1.0  # on CPU vLLM would otherwise reserve a fraction of all RAM
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
        lines.append(f"trainer.precision={precision}" + (f" (auto: {why})" if requested in (None, "auto") else ""))
        requested = cfg.threads
        if requested in (None, "auto", "adaptive"):
            ranks = static_world_size(cfg.trainer) or 1
            ranks_here = ranks // int(cfg.trainer.get("num_nodes", 1) or 1) if not uses_cuda(accelerator) else 1
            if cfg.rollout.mode == "async" and not uses_cuda(accelerator):
                ranks_here *= 2  # the rollout producer thread and the trainer each get their half of the cores
            cfg.threads, why = auto_threads(ranks_here)
            why = f"{requested or 'auto'}: {why}" + (", adapted per step to the cores other processes leave free"
                                                     if requested == "adaptive" else "")
        else:
            why = "set explicitly"
        cfg.threads = configure_threads(cfg.threads)
        lines.append(f"threads={cfg.threads} ({why}; {omp_summary()})")
    return lines


class AdaptiveThreads(L.Callback):
    """``threads: adaptive``: before every RL step ``hardware.ThreadGovernor`` sets as many torch threads as
    the cores other processes left free during the previous step (at most the start-up count, ``auto``'s).
    The thread count then depends on the machine's load, and with it the floating-point summation order:
    two runs (or a run and its resumption) are no longer equal bit for bit."""

    def __init__(self, max_threads: int):
        self.governor = ThreadGovernor(max_threads)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.governor.update()


def adaptive_threads(cfg: DictConfig, requested) -> AdaptiveThreads | None:
    """The ``AdaptiveThreads`` callback for ``threads: adaptive`` (``requested``), else None. Raises
    ConfigError where something else must own the thread count: several data-parallel ranks (they share the
    cores by design, and each would count the others as load), ``kernels=batch_invariant`` (it keeps its
    thread count), an out-of-process vLLM engine (its workers would count as another process's load)."""
    if requested != "adaptive":
        return None
    ranks = static_world_size(cfg.trainer) or 1
    kernels = cfg.kernels.name
    for bad, why in ((ranks > 1, f"{ranks} data-parallel ranks share the cores"),
                     (kernels != "default", f"kernels={kernels} keeps its own thread count"),
                     (cfg.engine.name in ("vllm", "auto") and not cfg.engine.in_process,
                      "the vLLM engine's worker processes would count as another process's load")):
        if bad:
            raise ConfigError(f"threads=adaptive is not allowed here: {why}; use threads=auto or a number")
    return AdaptiveThreads(int(cfg.threads))


def precision_plugins(trainer_kwargs: dict) -> list:
    """Lightning precision plugins ``trainer_kwargs`` needs, removing ``precision`` from it when a plugin
    takes its place. ``16-mixed`` on the CPU is float16 autocast with a ``torch.amp.GradScaler("cpu")``
    (Lightning would silently run bf16-mixed instead; an explicit precision is honoured)."""
    if str(trainer_kwargs.get("precision")) in ("16-mixed", "16") and not uses_cuda(trainer_kwargs.get("accelerator")):
        from lightning.pytorch.plugins.precision import MixedPrecision

        trainer_kwargs.pop("precision")
        return [MixedPrecision("16-mixed", "cpu")]
    return []


def build_module(cfg: DictConfig, policy, tokenizer):
    """The algorithm's LightningModule for ``cfg`` around an already loaded policy."""
    sampling = OmegaConf.to_container(cfg.sampling, resolve=True)
    correction = OmegaConf.to_container(cfg.correction, resolve=True)
    sc = cfg.correction.sc
    if sc.enabled:  # the engine must record the head H that score centering sums over
        vocab = policy.get_output_embeddings().weight.shape[0]
        top_k = vocab if sc.mode == "exact" else int(sc.top_k)
        if top_k > vocab:
            raise ConfigError(f"correction.sc.top_k={top_k} is larger than the vocabulary ({vocab} tokens)")
        sampling["logprobs_top_k"] = max(int(sampling["logprobs_top_k"]), top_k)
    eval_sampling = dict(sampling, temperature=0.0, top_k=0, top_p=1.0, logprobs_top_k=0,
                         max_new_tokens=cfg.eval.max_new_tokens)
    cls = ALGORITHMS[cfg.algo.name]
    return cls(
        policy=policy, tokenizer=tokenizer, sampling=sampling, eval_sampling=eval_sampling,
        group_size=cfg.rollout.group_size, micro_batch_size=cfg.rollout.micro_batch_size,
        advantage=OmegaConf.to_container(cfg.advantage, resolve=True),
        loss=OmegaConf.to_container(cfg.loss, resolve=True),
        algo=OmegaConf.to_container(cfg.algo, resolve=True),
        kl=OmegaConf.to_container(cfg.kl, resolve=True),
        optim=OmegaConf.to_container(cfg.optim, resolve=True),
        logprob_chunk_tokens=cfg.logprob_chunk_tokens,
        correction=correction,
        engine=OmegaConf.to_container(cfg.engine, resolve=True),
        rollout_mode=OmegaConf.to_container(cfg.rollout, resolve=True),
    )


def build_task_from_cfg(cfg: DictConfig):
    task_cfg = OmegaConf.to_container(cfg.task, resolve=True)
    return build_task(task_cfg)


def resolve_ckpt_path(ckpt_path: str | None, out_dir: Path) -> str | None:
    """``"last"`` -> the newest complete checkpoint in <out_dir>/checkpoints (``checkpoints.find_last``);
    a path must exist; None stays None. Raises ConfigError naming the folder or file otherwise."""
    if ckpt_path in (None, "", "null"):
        return None
    if ckpt_path == "last":
        path = find_last(out_dir / "checkpoints")
        if path is None:
            raise ConfigError(f"ckpt_path=last: no checkpoint in {out_dir / 'checkpoints'} "
                              f"(continue a run with hydra.run.dir=<its folder> ckpt_path=last)")
        return str(path)
    path = Path(ckpt_path).expanduser()
    if not path.is_file():
        raise ConfigError(f"ckpt_path={ckpt_path!r}: no checkpoint at {path}")
    return str(path)


def build_strategy(name):
    """The Lightning strategy for ``trainer.strategy``: ``fsdp`` becomes an ``FSDPStrategy`` that shards
    each transformer block (every transformers decoder layer is a ``GradientCheckpointingLayer``) as one
    unit, with full (unsharded) checkpoints; any other value is handed to Lightning as is."""
    if name != "fsdp":
        return name
    from transformers.modeling_layers import GradientCheckpointingLayer

    return FSDPStrategy(auto_wrap_policy={GradientCheckpointingLayer}, sharding_strategy="FULL_SHARD",
                        state_dict_type="full")


def check_checkpoint_fits(ckpt_path: str, module: L.LightningModule) -> None:
    """ConfigError when the checkpoint's weights do not fit ``module`` (another algorithm, value model or
    model), naming what it was written with; read memory-mapped, before any state is touched."""
    saved = torch.load(ckpt_path, map_location="cpu", mmap=True, weights_only=False)
    expected = module.state_dict()
    got = saved.get("state_dict", {})
    missing = [k for k in expected if k not in got]
    unexpected = [k for k in got if k not in expected]
    reshaped = [k for k in expected if k in got and tuple(got[k].shape) != tuple(expected[k].shape)]
    if missing or unexpected or reshaped:
        hp = saved.get("hyper_parameters", {})
        algo = (hp.get("algo") or {}).get("name", "?")
        raise ConfigError(
            f"ckpt_path={ckpt_path}: the checkpoint does not fit this config (it was written by algo={algo}"
            f"{', value model ' + str(hp['algo'].get('value', {}).get('model')) if algo == 'ppo' else ''}): "
            f"missing {missing[:3]}, unexpected {unexpected[:3]}, other shapes {reshaped[:3]}; "
            f"continue a run with the algorithm and model it was started with")


def save_final_checkpoint(trainer: L.Trainer, checkpoints: ModelCheckpoint) -> None:
    """Checkpoint the last step when ``checkpoint.every_n_steps`` did not land on it, so ``ckpt_path=last``
    of a finished run continues from its end: written atomically, ``last.ckpt`` re-pointed at it, then the
    previous one removed (``save_top_k=1``). A collective under DDP (every rank calls it)."""
    previous = checkpoints.best_model_path
    match = re.search(r"step=(\d+)", os.path.basename(previous or ""))
    if match and int(match.group(1)) == trainer.global_step:
        return
    folder = Path(checkpoints.dirpath)
    final = folder / f"step={trainer.global_step}.ckpt"
    trainer.save_checkpoint(final)
    if trainer.is_global_zero:
        link = folder / "last.ckpt"
        tmp = folder / f"last.ckpt.partial-{os.getpid()}"
        os.symlink(final.name, tmp)
        os.replace(tmp, link)
        if previous and Path(previous).is_file() and Path(previous) != final:
            Path(previous).unlink()
    trainer.strategy.barrier()


def run(cfg: DictConfig, out_dir: str | os.PathLike) -> dict[str, float]:
    """Train with ``cfg`` writing TensorBoard logs, checkpoints and the final policy under ``out_dir``.

    Raises ConfigError for a bad config or an ``out_dir`` that already holds a finished run.
    """
    validate(cfg)
    requested_threads = cfg.threads
    hardware = resolve_hardware(cfg)  # precision first: the vLLM engine's dtype follows it
    governor = adaptive_threads(cfg, requested_threads)  # None unless threads=adaptive
    for line in hardware:
        print(f"lit_rl: {line}", flush=True)
    resolve_engine(cfg)
    # Lightning warns that with manual optimisation a step's checkpoint holds the weights after its update;
    # that is exactly what resuming needs here (the next step starts from them), so the warning is noise
    warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
    out = Path(out_dir)
    ckpt_path = resolve_ckpt_path(cfg.ckpt_path, out)
    if (out / FINISHED_MARKER).exists() and ckpt_path is None:
        raise ConfigError(f"output folder {out} already holds a finished run; choose another "
                          f"(hydra.run.dir=...), or continue it with ckpt_path=last — lit_rl never overwrites one")
    if ckpt_path is None:
        started = sorted((out / "checkpoints").glob("*.ckpt")) + sorted((out / "tensorboard").glob("events.*"))
        if started and not started[0].name.endswith(".ckpt"):  # logs but no checkpoint: nothing to continue
            raise ConfigError(f"output folder {out} holds a run that stopped before its first checkpoint "
                              f"({started[0].name}); choose another folder (hydra.run.dir=...), or delete that one "
                              f"— lit_rl never mixes two runs in one folder")
        if started:
            raise ConfigError(f"output folder {out} holds an unfinished run ({started[0].name}); continue it with "
                              f"ckpt_path=last, or choose another folder (hydra.run.dir=...) — lit_rl never mixes "
                              f"two runs in one folder")
    L.seed_everything(cfg.seed, workers=True, verbose=False)

    k = updates_per_step(OmegaConf.to_container(cfg.algo, resolve=True))
    logger = TensorBoardLogger(save_dir=str(out), name="tensorboard", version="", default_hp_metric=False)
    checkpoints = ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=cfg.checkpoint.every_n_steps * k,
                                  save_last="link", save_top_k=1)
    trainer_kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    # trainer.max_steps counts RL steps; Lightning counts optimizer steps (several per RL step for PPO)
    if trainer_kwargs.get("max_steps", -1) > 0:
        trainer_kwargs["max_steps"] *= k
    if "strategy" in trainer_kwargs:
        trainer_kwargs["strategy"] = build_strategy(trainer_kwargs["strategy"])
    precision = trainer_kwargs.get("precision")
    plugins = precision_plugins(trainer_kwargs)
    eval_every = cfg.eval.every_n_steps if cfg.eval.num_examples > 0 else None
    callbacks = [checkpoints, StaleRolloutsShutdown()]  # the latter stops an async rollout producer
    if governor is not None:
        callbacks.append(governor)
    try:
        trainer = L.Trainer(
            logger=logger,
            callbacks=callbacks,
            plugins=[AtomicCheckpointIO(), *plugins],  # a kill mid-write leaves the previous checkpoint whole
            val_check_interval=eval_every,
            check_val_every_n_epoch=None,
            limit_val_batches=1.0 if eval_every else 0,
            num_sanity_val_steps=0,
            use_distributed_sampler=False,  # RolloutDataModule gives each rank its share itself
            **trainer_kwargs,
        )
    except MisconfigurationException as err:  # e.g. trainer=gpu on a machine without one
        raise ConfigError(f"trainer: {err}") from err
    check_world_size(cfg, trainer.world_size)  # devices=auto is known only now

    if trainer.is_global_zero:
        out.mkdir(parents=True, exist_ok=True)
        config_file = out / "config.yaml"
        if ckpt_path is not None and config_file.exists():  # continuing: keep the original, add this one
            config_file = out / f"config.resume-{time.strftime('%Y%m%d-%H%M%S')}.yaml"
        header = "".join(f"# {line}\n" for line in hardware)  # what the auto settings chose here, and why
        config_file.write_text(header + OmegaConf.to_yaml(cfg, resolve=True))

    try:  # data and model problems are the user's input too: report them like config errors
        task = build_task_from_cfg(cfg)
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(f"task={cfg.task.name}: {err}") from err
    try:
        policy, tokenizer = load_policy(ModelSpec(**OmegaConf.to_container(cfg.model, resolve=True)))
    except FileNotFoundError as err:
        raise ConfigError(str(err)) from err
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(f"model.name_or_path={cfg.model.name_or_path!r}: the tokenizer has no chat template, "
                          f"and task={cfg.task.name} formats prompts with it")
    datamodule = RolloutDataModule(task, tokenizer, cfg.rollout.prompts_per_step, cfg.rollout.group_size,
                                   seed=cfg.seed, eval_examples=cfg.eval.num_examples,
                                   eval_batch_size=cfg.eval.batch_size,
                                   reward_timeout_s=cfg.reward_timeout_s)
    # the kernel mode wraps the whole fit (rollouts, update, eval); copies of the policy made by the module
    # (engine.dtype, the KL reference) inherit it
    with kernel_mode(cfg.kernels.name, policy):
        module = build_module(cfg, policy, tokenizer)
        assert module.updates_per_step == k
        module.peak_flops, source = peak_flops(precision, trainer_kwargs.get("accelerator", "auto"))
        if trainer.is_global_zero:
            print(f"lit_rl: peak {module.peak_flops / 1e12:.3g} TFLOP/s per device at {precision} ({source}): "
                  f"perf/mfu divides the update's FLOP rate by it", flush=True)
        if ckpt_path is not None:
            check_checkpoint_fits(ckpt_path, module)
        try:
            trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        finally:  # a failed or interrupted run stops its producer and engine too (Lightning's hooks do it normally)
            if module.stale is not None:
                module.stale.close()  # idempotent; first, so no producer thread still uses the engine
            module.engine.close()
        save_final_checkpoint(trainer, checkpoints)

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}  # reduced over ranks: the same on each
    weights = None
    if isinstance(trainer.strategy, FSDPStrategy):
        # FSDP: each rank holds a shard; gather the full weights (a collective; full tensors on rank 0)
        full = trainer.strategy.lightning_module_state_dict()
        weights = {name[len("policy."):]: v for name, v in full.items() if name.startswith("policy.")}
    if trainer.is_global_zero:
        export = out / "policy"
        policy.save_pretrained(export, state_dict=weights, safe_serialization=True)
        tokenizer.save_pretrained(export)
        (out / FINISHED_MARKER).write_text(json.dumps({"global_step": trainer.global_step, "metrics": metrics},
                                                      indent=2))
    return metrics
