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
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf, open_dict

from .algorithms import RLModule
from .algorithms.base import updates_per_step
from .config import ConfigError, check_lora_kernels, check_world_size, static_world_size, validate
from .kernels import kernel_mode
from .logprobs import check_head_parity
from .models import (
    ModelSpec,
    check_lora_targets,
    context_length,
    load_model_config,
    load_policy,
    load_tokenizer,
    merged_weights,
    peft_model,
)
from .rollout.datamodule import RolloutDataModule
from .rollout.engines import on_cuda, resolve_auto
from .rollout.sources import RolloutSourceShutdown
from .run.checkpoints import AtomicCheckpointIO, OutputWriteError, find_last
from .run.hardware import (
    ThreadGovernor,
    auto_threads,
    configure_threads,
    omp_summary,
    peak_flops,
    precision_dtype,
    resolve_precision,
    uses_cuda,
)
from .run.preemption import RunCheckpoint, preempted, slurm_requeued
from .run.runfolder import (  # noqa: F401  (re-exported: the resolvers of conf/train.yaml live there, torch-free)
    RunFolderClaim,
    claim_run_folder,
    hydra_subdir,
    lightning_rank,
    register_resolvers,
    run_dir,
    run_name,
    run_tag,
    swept_keys,
)
from .tasks import build_task
from .tasks.reward_functions import RewardFunctions

log = logging.getLogger(__name__)

FINISHED_MARKER = "finished.json"


def export_policy(policy, folder: Path, weights: dict | None = None, merge: bool = False) -> None:
    """Write the trained policy to ``folder`` in save_pretrained format (safetensors): the full model, or with
    LoRA the adapter (PEFT's ``adapter_config.json`` + ``adapter_model.safetensors``, loadable with
    ``PeftModel.from_pretrained`` on the base model) -- or, with ``merge``, the merged full model
    (W0 + (alpha / r) B A, the base model's names: loadable without PEFT). ``weights``: the full state dict
    (FSDP's gathered one), None for the module's own."""
    wrapper = peft_model(policy)
    if wrapper is None:
        policy.save_pretrained(folder, state_dict=weights, safe_serialization=True)
    elif merge:
        policy.save_pretrained(folder, state_dict=merged_weights(policy), safe_serialization=True)
    else:
        wrapper.save_pretrained(folder, safe_serialization=True)


def model_config(model_cfg: DictConfig):
    """The configured model's transformers config, read without its weights; None if it cannot be read (a bad
    name is reported where the model loads)."""
    try:
        return load_model_config(model_cfg.name_or_path, bool(model_cfg.trust_remote_code))
    except Exception:  # noqa: BLE001
        return None


def model_head_dim(model_cfg: DictConfig) -> int | None:
    """Attention head size of the configured model, read from its config (no weights loaded); None if unknown."""
    config = model_config(model_cfg)
    try:
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    except Exception:  # noqa: BLE001 - no config (a bad name is reported where the model loads)
        return None


def check_context(cfg: DictConfig, datamodule: RolloutDataModule, config) -> None:
    """ConfigError unless every prompt of the run plus its ``max_new_tokens`` fits the context: the engine's
    ``engine.max_model_len`` when set (vLLM), else the model's context length (``max_position_embeddings`` of
    its config; vLLM takes it for ``max_model_len: null``, and the embedded engine would generate past it
    into positions the model never saw). Training prompts count with ``sampling.max_new_tokens``, the
    evaluated ones with ``eval.max_new_tokens``. Runs at start-up, after the tokenizer and before the weights
    load; the message names the prompt, both numbers and the fields to change."""
    context = context_length(config) if config is not None else None
    model = f"model.name_or_path={cfg.model.name_or_path!r}"
    max_len = cfg.engine.max_model_len if cfg.engine.name == "vllm" else None
    if max_len is not None and context is not None and max_len > context:
        raise ConfigError(
            f"engine.max_model_len={max_len} is more than the context length of {model} "
            f"({context} tokens, max_position_embeddings in its config): at most {context}"
        )
    if max_len is not None:
        limit, where = max_len, f"engine.max_model_len={max_len}"
    elif context is not None:
        limit = context
        where = f"the context length of {model} ({context} tokens, max_position_embeddings in its config)"
    else:
        return
    checks = [("train", "sampling.max_new_tokens", cfg.sampling.max_new_tokens)]
    if cfg.eval.num_examples > 0:
        checks.append(("eval", "eval.max_new_tokens", cfg.eval.max_new_tokens))
    task = getattr(datamodule.task, "task", datamodule.task)  # ConstantReward wraps the task
    for split, field, new_tokens in checks:
        tokens, example = datamodule.longest_prompt(split)
        if example is None or tokens + new_tokens <= limit:
            continue
        if getattr(task, "overlong_prompts", "error") == "drop":
            total = len(datamodule._train if split == "train" else datamodule._eval)
            dropped = datamodule.drop_overlong(limit - new_tokens, split)
            print(
                f"lit_rl: task={cfg.task.name}: dropped {dropped} of {total} {split} prompts longer than "
                f"{limit - new_tokens} tokens ({where} minus {field}={new_tokens}; task.overlong_prompts=drop)",
                flush=True,
            )
            datamodule.dropped_prompts[split] = dropped
            if dropped < total:
                continue
        fix = (
            f"lower {field} to at most {limit - tokens}"
            if tokens < limit
            else "use shorter prompts (the prompt alone fills the context)"
        )
        if max_len is not None and context is not None and tokens + new_tokens <= context:
            fix += f", or raise engine.max_model_len to {tokens + new_tokens} or more (at most {context})"
        raise ConfigError(
            f"task={cfg.task.name}: the longest {split} prompt ({split} example {example.id}) has "
            f"{tokens} tokens; with {field}={new_tokens} it needs {tokens + new_tokens}, more than "
            f"{where}: {fix}"
        )


def check_model_support(cfg: DictConfig, datamodule: RolloutDataModule, config) -> None:
    """ConfigError, before the weights load, for a model the run cannot serve: its class does not implement
    ``model.attn_implementation`` (Gemma-2 has no sdpa path: its attention soft-capping needs eager), or, with
    ``kernels=batch_invariant``, a sliding-window layer shorter than the run's longest sequence
    (``batch_invariant.check_sliding_window``). Norm layers the kernels do not cover are refused when the mode
    is enabled (``batch_invariant.norm_kernels``), still before the first rollout."""
    if config is None:
        return
    model = f"model.name_or_path={cfg.model.name_or_path!r}"
    impl = cfg.model.attn_implementation
    cls = causal_lm_class(config)
    flag = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn"}.get(impl)
    if cls is not None and flag is not None and getattr(cls, flag, True) is False:
        import transformers

        raise ConfigError(
            f"model.attn_implementation={impl}: {cls.__name__} ({model}) has no {impl} attention in transformers "
            f"{transformers.__version__}; use model.attn_implementation=eager"
        )
    if cfg.kernels.name == "batch_invariant":
        from .kernels.batch_invariant import check_sliding_window

        tokens = datamodule.longest_prompt("train")[0] + cfg.sampling.max_new_tokens
        if cfg.eval.num_examples > 0:
            tokens = max(tokens, datamodule.longest_prompt("eval")[0] + cfg.eval.max_new_tokens)
        try:
            check_sliding_window(config, tokens)
        except ValueError as err:
            raise ConfigError(f"{model}: {err}") from err


def causal_lm_class(config):
    """The transformers causal-LM class ``AutoModelForCausalLM`` builds for ``config``; None if unknown (e.g.
    remote code)."""
    try:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM._model_mapping[type(config)]
    except Exception:  # noqa: BLE001
        return None


#: ``logger`` options -> the package each needs (None: installed with lit_rl)
LOGGER_PACKAGES = {"tensorboard": None, "csv": None, "wandb": "wandb", "mlflow": "mlflow"}


def check_wandb_login(mode: str | None) -> None:
    """Refuse, before the model loads, an online W&B run that would stop at its first log for want of a login.

    Online (``logger.wandb.mode``, else ``$WANDB_MODE``, else online) in a process without a terminal (a batch
    job: wandb cannot prompt) needs ``WANDB_API_KEY`` or a netrc entry for the W&B host (``wandb login`` writes
    it; ``$WANDB_BASE_URL`` names another host). Without either, wandb used to raise ``UsageError: No API key
    configured`` inside fit, after the model loaded, as a traceback. Raises ConfigError saying what to set."""
    import netrc
    import sys
    from urllib.parse import urlparse

    effective = mode or os.environ.get("WANDB_MODE") or "online"
    if effective != "online" or os.environ.get("WANDB_API_KEY") or sys.stdin.isatty():
        return
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        found = netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        found = False
    if not found:
        raise ConfigError(
            f"logger=wandb runs online but has no login for {host} (no WANDB_API_KEY, no netrc entry): run "
            "`wandb login` or set WANDB_API_KEY, or log without an account: WANDB_MODE=offline (or "
            "logger.wandb.mode=offline; `wandb sync` uploads it later)"
        )


def build_loggers(cfg: DictConfig, out: Path) -> list:
    """Lightning loggers for every ``logger.<name>`` that is set (``schema.LoggerConfig``), in the order
    tensorboard, csv, wandb, mlflow; [] for ``logger=none``. Each logs the same scalars (Lightning's
    ``log_metrics``). The run name (``logger.run_name``, else the run folder's name: a sweep job's folder is the
    sweep's run name, e.g. ``algo=dapo,seed=1``) names the W&B and MLflow runs; TensorBoard and CSV write into
    ``<run>/<name>``. Raises ConfigError naming the install command when a logger's package is missing, and
    for ``logger.wandb.mode`` outside online | offline | disabled."""
    import importlib.util

    from lightning.pytorch.loggers import CSVLogger

    chosen = cfg.get("logger") or {}
    name = chosen.get("run_name") or out.resolve().name
    loggers = []
    for key, package in LOGGER_PACKAGES.items():
        options = chosen.get(key)
        if options is None:
            continue
        if package is not None and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"logger={key}: the {package} package is not installed; pip install 'lit_rl[loggers]' "
                f"(or {'mlflow-skinny' if key == 'mlflow' else package})"
            )
        if key == "tensorboard":
            loggers.append(TensorBoardLogger(save_dir=str(out), name=options.name, version="", default_hp_metric=False))
        elif key == "csv":
            loggers.append(CSVLogger(save_dir=str(out), name=options.name, version=""))
        elif key == "wandb":
            from lightning.pytorch.loggers import WandbLogger

            mode = options.mode
            if mode not in (None, "online", "offline", "disabled"):
                raise ConfigError(f"logger.wandb.mode={mode!r}: choose online, offline, disabled or null")
            kwargs = {"mode": mode} if mode else {}
            check_wandb_login(mode)
            loggers.append(
                WandbLogger(name=name, save_dir=str(out), project=options.project, entity=options.entity, **kwargs)
            )
        elif key == "mlflow":
            from lightning.pytorch.loggers import MLFlowLogger

            uri = options.tracking_uri or (out / "mlruns").resolve().as_uri()
            if uri.startswith("file:"):  # MLflow 3 refuses its file store (maintenance mode) unless told to allow it;
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # a database store needs sqlalchemy
            loggers.append(MLFlowLogger(experiment_name=options.experiment_name, run_name=name, tracking_uri=uri))
    return loggers


def finish_loggers(trainer: L.Trainer) -> None:
    """End the W&B run of a ``WandbLogger`` (its history is complete on disk, in offline mode too, only once
    ``wandb.finish`` returns; Lightning leaves the run open)."""
    from lightning.pytorch.loggers import WandbLogger

    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger) and logger._experiment is not None:
            logger._experiment.finish()


def check_output_folders(out: Path) -> None:
    """ConfigError unless the run folder can be written, and with it the ``checkpoints/``, ``tensorboard/``
    and ``policy/`` folders the run writes into later: each that exists already must be a writable folder.
    A probe file is written, flushed and removed in each, so a read-only mount, a missing permission or a
    file in a folder's place fails here, before the model loads, and not at the first checkpoint."""
    for folder in (out, out / "checkpoints", out / "tensorboard", out / "policy"):
        if folder != out and not os.path.lexists(folder):
            continue  # created later inside ``out``, which is checked
        probe = folder / f".lit_rl-write-probe-{os.getpid()}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with open(probe, "wb") as f:
                f.write(b"lit_rl")
                f.flush()
                os.fsync(f.fileno())
            probe.unlink()
        except OSError as err:
            raise ConfigError(
                f"output folder {folder} cannot be written ({err.strerror or err}); the run would "
                f"fail at its first checkpoint or at the end: choose another folder "
                f"(hydra.run.dir=...) or make it writable"
            ) from err


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
            raise ConfigError(
                f"engine=vllm: vLLM's CPU attention needs head_dim >= 32 and model.name_or_path="
                f"{cfg.model.name_or_path!r} has {head_dim}; use engine=torch (or engine=auto)"
            )
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
    """The ``AdaptiveThreads`` callback for ``threads: adaptive`` (``requested``: the value before
    ``resolve_hardware`` made it a count), else None. Where ``threads: adaptive`` is refused (several ranks,
    ``kernels=batch_invariant``, an out-of-process vLLM engine) ``config.validate`` has already raised
    (``config.check_adaptive_threads``)."""
    if requested != "adaptive":
        return None
    return AdaptiveThreads(int(cfg.threads))


def _cell(text) -> str:
    """``text`` as one Markdown table cell: pipes escaped, line breaks as <br>."""
    return str(text).replace("|", "\\|").replace("\n", "<br>")


class SampleLogger(L.Callback):
    """Every ``every`` RL steps, ``count`` rows of the step (prompt, completion, reward, advantage), spread over
    its prompts, to TensorBoard's text tab (tag ``samples``) and one JSON line each to ``<run>/samples.jsonl``.
    Global rank 0 writes its own rows."""

    def __init__(self, every: int, count: int, out: Path):
        self.every, self.count, self.file = int(every), int(count), out / "samples.jsonl"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        last = getattr(pl_module, "last_step", None)
        if last is None or not trainer.is_global_zero:
            return
        step, scored, advantages = last
        pl_module.last_step = None
        if self.every <= 0 or step % self.every:
            return
        n = len(scored.texts)
        rows = sorted({i * n // self.count for i in range(min(self.count, n))})
        tok = pl_module.tokenizer
        samples = [
            {
                "step": step,
                "prompt": tok.decode(scored.rollouts.prompt_ids[i], skip_special_tokens=True),
                "completion": scored.texts[i],
                "reward": float(scored.rewards[i]),
                "advantage": float(advantages[i]),
            }
            for i in rows
        ]
        with open(self.file, "a") as f:
            f.writelines(json.dumps(s) + "\n" for s in samples)
        tensorboard = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        experiment = tensorboard[0].experiment if tensorboard else None
        if hasattr(experiment, "add_text"):
            table = "| prompt | completion | reward | advantage |\n|---|---|---|---|\n" + "".join(
                f"| {_cell(s['prompt'])} | {_cell(s['completion'])} | {s['reward']:.4g} | {s['advantage']:.4g} |\n"
                for s in samples
            )
            experiment.add_text("samples", table, global_step=step)
            experiment.flush()


class PlainLines(L.Callback):
    """One plain line per RL step on stdout (step, reward, response length, s/step, rollout tokens/s): what a
    log file or a cluster job's output shows, where a progress bar never prints."""

    def __init__(self, max_steps: int):
        self.max_steps = max_steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not trainer.is_global_zero:
            return
        m = {k: float(v) for k, v in trainer.callback_metrics.items()}
        step = trainer.global_step // pl_module.updates_per_step
        total = f"/{self.max_steps}" if self.max_steps > 0 else ""
        print(
            f"lit_rl: step {step}{total} reward {m.get('rollout/reward_mean', float('nan')):.4f} "
            f"length {m.get('rollout/response_length_mean', float('nan')):.1f} "
            f"s/step {m.get('time/step_s', float('nan')):.2f} "
            f"tokens/s {m.get('perf/rollout_tokens_per_s', float('nan')):.1f}",
            flush=True,
        )


def plain_lines_on(setting) -> bool:
    """``log.plain_lines``: true, false, or auto (on when stdout is not a terminal)."""
    if setting == "auto":
        return not sys.stdout.isatty()
    return bool(setting)


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
    """The ``RLModule`` of ``cfg`` (its algorithm: ``algo.name``; its rollout source: ``rollout.mode``) around an
    already loaded policy."""
    sampling = OmegaConf.to_container(cfg.sampling, resolve=True)
    correction = OmegaConf.to_container(cfg.correction, resolve=True)
    sc = cfg.correction.sc
    if sc.enabled:  # the engine must record the head H that score centering sums over
        vocab = policy.get_output_embeddings().weight.shape[0]
        top_k = vocab if sc.mode == "exact" else int(sc.top_k)
        if top_k > vocab:
            raise ConfigError(f"correction.sc.top_k={top_k} is larger than the vocabulary ({vocab} tokens)")
        sampling["logprobs_top_k"] = max(int(sampling["logprobs_top_k"]), top_k)
    eval_sampling = dict(
        sampling,
        temperature=float(cfg.eval.temperature),
        top_k=0,
        top_p=1.0,
        logprobs_top_k=0,
        max_new_tokens=cfg.eval.max_new_tokens,
    )
    module = RLModule(
        policy=policy,
        tokenizer=tokenizer,
        sampling=sampling,
        eval_sampling=eval_sampling,
        group_size=cfg.rollout.group_size,
        micro_batch_size=cfg.rollout.micro_batch_size,
        advantage=OmegaConf.to_container(cfg.advantage, resolve=True),
        loss=OmegaConf.to_container(cfg.loss, resolve=True),
        algo=OmegaConf.to_container(cfg.algo, resolve=True),
        kl=OmegaConf.to_container(cfg.kl, resolve=True),
        optim=OmegaConf.to_container(cfg.optim, resolve=True),
        logprob_chunk_tokens=cfg.logprob_chunk_tokens,
        correction=correction,
        engine=OmegaConf.to_container(cfg.engine, resolve=True),
        rollout_mode=OmegaConf.to_container(cfg.rollout, resolve=True),
        update=OmegaConf.to_container(cfg["update"], resolve=True),  # cfg.update is DictConfig.update
    )
    module.eval_n, module.eval_k = int(cfg.eval.n), int(cfg.eval.k)
    return module


def build_task_from_cfg(cfg: DictConfig):
    task_cfg = OmegaConf.to_container(cfg.task, resolve=True)
    return build_task(task_cfg)


def build_rewards(cfg: DictConfig, task) -> RewardFunctions:
    """The run's ``RewardFunctions``: ``reward.functions`` (or the task's verifier) in the verifier pool."""
    r = OmegaConf.to_container(cfg.reward, resolve=True)
    try:
        return RewardFunctions(
            task,
            functions=r["functions"],
            weights=r["weights"],
            num_workers=r["num_workers"],
            timeout_s=cfg.reward_timeout_s,
            max_completion_length=cfg.sampling.max_new_tokens,
        )
    except (ValueError, FileNotFoundError, ImportError) as err:
        raise ConfigError(str(err)) from err


def resolve_ckpt_path(ckpt_path: str | None, out_dir: Path) -> str | None:
    """``"last"`` -> the newest complete checkpoint in <out_dir>/checkpoints (``checkpoints.find_last``);
    a path must exist; None stays None. Raises ConfigError naming the folder or file otherwise."""
    if ckpt_path in (None, "", "null"):
        return None
    if ckpt_path == "last":
        path = find_last(out_dir / "checkpoints")
        if path is None:
            raise ConfigError(
                f"ckpt_path=last: no checkpoint in {out_dir / 'checkpoints'} "
                f"(continue a run with hydra.run.dir=<its folder> ckpt_path=last)"
            )
        return str(path)
    path = Path(ckpt_path).expanduser()
    if not path.is_file():
        raise ConfigError(f"ckpt_path={ckpt_path!r}: no checkpoint at {path}")
    return str(path)


#: fields a continued run may change (applied from the command line, named when they differ from the run's)
SAFE_ON_RESUME = (
    "trainer.max_steps",
    "trainer.enable_progress_bar",
    "threads",
    "checkpoint.every_n_steps",
    "eval.every_n_steps",
    "eval.batch_size",
    "reward.num_workers",
    "log.samples_every_n_steps",
    "log.num_samples",
    "log.plain_lines",
)
#: values the run resolves itself (``resolve_engine``, ``resolve_hardware``): they agree with the value it resolved to
AUTO_VALUES = {"engine.name": ("auto",), "trainer.precision": ("auto",), "threads": ("auto", "adaptive")}
#: fields that say how to continue, not what the run is
RESUME_KEYS = ("ckpt_path", "resume")


def _leaves(node, prefix: str = "") -> dict[str, object]:
    """{dotted key: value} of every leaf of a plain (resolved) config container; lists are leaves."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            out.update(_leaves(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def overridden_keys(overrides) -> list[str] | None:
    """The config keys (or group names) that the command-line ``overrides`` set, as Hydra parses them, without
    ``hydra.*`` and ``ckpt_path``/``resume``; None when ``overrides`` is None (a library call: the whole config
    given counts)."""
    if overrides is None:
        return None
    from hydra.core.override_parser.overrides_parser import OverridesParser

    keys = []
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        key = override.key_or_group.lstrip("+~")
        if not key.startswith("hydra.") and key not in RESUME_KEYS:
            keys.append(key)
    return keys


def resumed_config(cfg: DictConfig, out: Path, overrides=None) -> DictConfig:
    """The config of a run continued in ``out``: its saved ``config.yaml`` (the run's config; a resumed DAPO run
    stays DAPO, with its learning rate), the fields of ``SAFE_ON_RESUME`` taken from ``cfg`` where the command
    line set them, and ``ckpt_path``/``resume`` from ``cfg``.

    ``overrides``: the command line's override strings (``recipes/train.py``); only the fields they name are
    compared (a group override, ``algo=dapo``, compares the group's fields). None (a library call): every field
    of ``cfg`` is compared. A compared field whose value differs from the run's is refused: ConfigError naming
    each field with both values. Fields ``cfg`` leaves null (filled in by the run, e.g. ``engine.dtype``) and
    ``engine=auto`` agree with any value; fields the saved config predates are taken from ``cfg``.
    """
    saved_file = out / "config.yaml"
    try:
        saved = OmegaConf.load(saved_file)
    except Exception as err:  # noqa: BLE001 - a truncated or hand-edited file: the user's to fix
        raise ConfigError(f"{saved_file}: cannot read the run's config ({err})") from err
    new = _leaves(OmegaConf.to_container(cfg, resolve=True))
    old = _leaves(OmegaConf.to_container(saved, resolve=True))
    keys = overridden_keys(overrides)
    if keys is None:
        compared = list(new)
    else:
        compared = []
        for key in keys:
            inside = [k for k in new if k == key or k.startswith(key + ".")]
            if not inside:
                raise ConfigError(
                    f"{key}: cannot be given when a run is continued (its config is {saved_file}; "
                    f"a preset or a new field would change it): drop it, or start a new run"
                )
            compared += inside
    differ, applied = [], []
    for key in dict.fromkeys(compared):
        if key in RESUME_KEYS or key not in old or new[key] is None or new[key] in AUTO_VALUES.get(key, ()):
            continue
        if new[key] == old[key]:
            continue
        if key in SAFE_ON_RESUME:
            applied.append(key)
        else:
            differ.append(f"{key} (the run: {old[key]!r}, now: {new[key]!r})")
    if differ:
        raise ConfigError(
            f"ckpt_path={cfg.ckpt_path or 'last'} continues the run in {out} with its saved "
            f"config.yaml, and {len(differ)} field{'s differ' if len(differ) > 1 else ' differs'} "
            f"from it: {'; '.join(differ)}. A continued run may change only "
            f"{', '.join(SAFE_ON_RESUME)}: drop the other overrides, or start a new run in another "
            f"folder"
        )
    result = OmegaConf.create(OmegaConf.to_container(saved, resolve=True))
    for key in applied:
        OmegaConf.update(result, key, new[key], force_add=True)
    for key, value in new.items():  # fields this version has and the saved config predates
        if key not in old and OmegaConf.select(result, key, default="__missing__") == "__missing__":
            OmegaConf.update(result, key, value, force_add=True)
    for key in RESUME_KEYS:
        OmegaConf.update(result, key, cfg[key], force_add=True)
    if applied:
        print(
            f"lit_rl: continuing {out} with its config.yaml; changed: " + ", ".join(f"{k}={new[k]}" for k in applied),
            flush=True,
        )
    return result


def build_strategy(name):
    """The Lightning strategy for ``trainer.strategy``: ``fsdp`` becomes an ``FSDPStrategy`` that shards
    each transformer block (every transformers decoder layer is a ``GradientCheckpointingLayer``) as one
    unit, with full (unsharded) checkpoints; any other value is handed to Lightning as is."""
    if name != "fsdp":
        return name
    from transformers import GenerationMixin
    from transformers.modeling_layers import GradientCheckpointingLayer

    from .algorithms.parallel import FSDPStrategy as AnyDeviceFSDPStrategy  # also on CPU processes (gloo)

    return AnyDeviceFSDPStrategy(
        auto_wrap_policy={GradientCheckpointingLayer, GenerationMixin},
        sharding_strategy="FULL_SHARD",
        state_dict_type="full",
    )


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
            f"continue a run with the algorithm and model it was started with"
        )


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


def run(cfg: DictConfig, out_dir: str | os.PathLike, overrides: list[str] | None = None) -> dict[str, float]:
    """Train with ``cfg`` writing TensorBoard logs, checkpoints and the final policy under ``out_dir``.

    Continuing a run (``ckpt_path`` set, or ``resume=<run folder>``, which replaces ``out_dir`` and means
    ``ckpt_path=last``): the run folder's saved config.yaml is the config (``resumed_config``; ``overrides``,
    the command line's override strings, say which fields the user set).

    Raises ConfigError for a bad config, an ``out_dir`` that already holds a finished run, is in use by a
    running one (``runfolder.claim_run_folder``: global rank 0 claims it before the checks, until the run
    ends) or cannot be written, or prompts that do not fit the context; OutputWriteError when a checkpoint or
    the policy export cannot be written during the run (the checkpoints written before stay whole).
    """
    claims: list[RunFolderClaim] = []  # the run folder's claim, held until the run ends however it ends
    try:
        return _run(cfg, out_dir, overrides, claims)
    finally:
        for claim in claims:
            claim.release()


def _finished_rl_step(marker: Path, updates_per_rl_step: int) -> int | None:
    """The RL step a finished run stopped at, from its ``finished.json`` (``global_step`` counts optimizer
    steps: ``updates_per_rl_step`` per RL step); None when the file cannot be read."""
    try:
        return int(json.loads(marker.read_text())["global_step"]) // max(1, updates_per_rl_step)
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass
class Prepared:
    """A run's config and folder once ``prepare_output`` has checked them.

    cfg: the config (a continued run's: its saved one, with the command line's changes), validated and with its
    auto settings resolved; out: the run folder (claimed); ckpt_path: the checkpoint it continues from, or None;
    hardware: what the auto settings chose, one line each (printed, and written at the top of config.yaml);
    governor: the ``threads=adaptive`` callback or None; updates_per_rl_step: optimizer steps per RL step.
    """

    cfg: DictConfig
    out: Path
    ckpt_path: str | None
    hardware: list[str]
    governor: AdaptiveThreads | None
    updates_per_rl_step: int


@dataclass
class RunParts:
    """What ``build`` makes of a prepared run: everything ``fit`` runs.

    trainer: Lightning's Trainer (loggers, callbacks, strategy, precision); checkpoints: its ``RunCheckpoint``;
    datamodule: the prompts, the verifier pool; spec / policy / tokenizer: the model; module: the ``RLModule``;
    kernels: the kernel mode's context manager, entered by ``build`` (the module's copies of the policy inherit
    it) and left by ``fit`` at the end of the training.
    """

    prepared: Prepared
    trainer: L.Trainer
    checkpoints: RunCheckpoint
    datamodule: RolloutDataModule
    spec: ModelSpec
    policy: torch.nn.Module
    tokenizer: object
    module: RLModule
    kernels: object


def _run(cfg: DictConfig, out_dir, overrides, claims: list) -> dict[str, float]:
    prepared = prepare_output(cfg, out_dir, overrides, claims)
    parts = build(prepared)
    metrics = fit(parts)
    export(parts, metrics)
    return metrics


def continued_run(cfg: DictConfig, out: Path, overrides) -> tuple[DictConfig, Path]:
    """(cfg, run folder) of a run that continues another: ``resume=<folder>`` (that folder, ``ckpt_path=last``),
    a SLURM requeue of a job whose folder holds a checkpoint (``ckpt_path=last``), or an explicit ``ckpt_path``;
    the config is then the folder's saved one with the command line's changes (``resumed_config``). Other runs
    come back as they are. Raises ConfigError for a ``resume`` folder without a run."""
    if cfg.resume:
        out = Path(str(cfg.resume)).expanduser()
        if not (out / "config.yaml").is_file():
            raise ConfigError(
                f"resume={cfg.resume!r}: no lit_rl run there (no config.yaml); give the folder of a "
                f"run (outputs/<date>/<time>-<pid>, or a sweep job's folder, quoted: see docs/reliability.md)"
            )
        with open_dict(cfg):
            cfg.ckpt_path = cfg.ckpt_path or "last"
    elif cfg.ckpt_path in (None, "", "null") and slurm_requeued():
        if find_last(out / "checkpoints"):  # the requeued job runs the same command: continue where it stopped
            print(f"lit_rl: SLURM started this job again: continuing {out} from its last checkpoint", flush=True)
            with open_dict(cfg):
                cfg.ckpt_path = "last"
        else:
            print(
                f"lit_rl: SLURM started this job again, and {out} holds no checkpoint: a new run starts; name "
                f"the run folder by the job (hydra.run.dir=outputs/$SLURM_JOB_ID) to continue after a requeue",
                flush=True,
            )
    if cfg.ckpt_path not in (None, "", "null") and (out / "config.yaml").is_file():
        cfg = resumed_config(cfg, out, overrides)
    return cfg, out


def check_run_folder(out: Path, ckpt_path: str | None) -> None:
    """ConfigError unless ``out`` may take this run: no finished run unless it continues one (``ckpt_path``),
    and no logs of another run that it does not continue."""
    if (out / FINISHED_MARKER).exists() and ckpt_path is None:
        raise ConfigError(
            f"output folder {out} already holds a finished run; choose another "
            f"(hydra.run.dir=...), or continue it with ckpt_path=last — lit_rl never overwrites one"
        )
    if ckpt_path is None:
        started = sorted((out / "checkpoints").glob("*.ckpt")) + sorted((out / "tensorboard").glob("events.*"))
        if started and not started[0].name.endswith(".ckpt"):  # logs but no checkpoint: nothing to continue
            raise ConfigError(
                f"output folder {out} holds a run that stopped before its first checkpoint "
                f"({started[0].name}); choose another folder (hydra.run.dir=...), or delete that one "
                f"— lit_rl never mixes two runs in one folder"
            )
        if started:
            raise ConfigError(
                f"output folder {out} holds an unfinished run ({started[0].name}); continue it with "
                f"ckpt_path=last, or choose another folder (hydra.run.dir=...) — lit_rl never mixes "
                f"two runs in one folder"
            )


def prepare_output(cfg: DictConfig, out_dir, overrides, claims: list) -> Prepared:
    """Check the config and claim the run folder, before anything heavy: the continued run's config
    (``continued_run``), ``config.validate``, the hardware and engine settings resolved (``resolve_hardware``,
    ``resolve_engine``), the folder claimed by global rank 0 (appended to ``claims``, released by ``run``) and
    checked (``check_run_folder``), the seed set. Raises ConfigError."""
    cfg, out = continued_run(cfg, Path(out_dir), overrides)
    validate(cfg)
    requested_threads = cfg.threads
    hardware = resolve_hardware(cfg)  # precision first: the vLLM engine's dtype follows it
    check_lora_kernels(cfg)  # needs the resolved precision
    governor = adaptive_threads(cfg, requested_threads)  # None unless threads=adaptive
    for line in hardware:
        print(f"lit_rl: {line}", flush=True)
    resolve_engine(cfg)
    # Lightning warns that with manual optimisation a step's checkpoint holds the weights after its update;
    # that is exactly what resuming needs here (the next step starts from them), so the warning is noise
    warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
    ckpt_path = resolve_ckpt_path(cfg.ckpt_path, out)
    if lightning_rank() == 0:  # first, so two runs cannot both pass the checks below before either writes
        claims.append(claim_run_folder(out, resume=ckpt_path is not None))
    check_run_folder(out, ckpt_path)
    L.seed_everything(cfg.seed, workers=True, verbose=False)

    k = updates_per_step(OmegaConf.to_container(cfg.algo, resolve=True))
    if ckpt_path is not None and (out / FINISHED_MARKER).exists():
        finished_at = _finished_rl_step(out / FINISHED_MARKER, k)
        if finished_at is not None and 0 < int(cfg.trainer.max_steps) <= finished_at:
            raise ConfigError(  # continuing it would run no step and rewrite its exported policy
                f"output folder {out} holds a run that finished at RL step {finished_at} "
                f"(trainer.max_steps={cfg.trainer.max_steps}): nothing to continue; to train it further, give a "
                f"larger trainer.max_steps (e.g. --resume {out} trainer.max_steps={finished_at + 10})"
            )
    return Prepared(cfg, out, ckpt_path, hardware, governor, k)


def build_trainer(prepared: Prepared) -> tuple[L.Trainer, RunCheckpoint]:
    """Lightning's Trainer of a prepared run (loggers, checkpoints every ``checkpoint.every_n_steps`` RL steps,
    the rollout source's shutdown, the sample logger, plain lines, the strategy and precision plugins) and its
    ``RunCheckpoint``. ``trainer.max_steps`` counts RL steps; Lightning counts optimizer steps. Raises
    ConfigError for a trainer Lightning refuses (e.g. trainer=gpu without a GPU) or a world size the run
    cannot use."""
    cfg, out, k = prepared.cfg, prepared.out, prepared.updates_per_rl_step
    logger = build_loggers(cfg, out)
    checkpoints = RunCheckpoint(  # a ModelCheckpoint that also checkpoints on SIGTERM/SIGUSR1 (preemption.py)
        dirpath=out / "checkpoints",
        every_n_train_steps=cfg.checkpoint.every_n_steps * k,
        save_last="link",
        save_top_k=1,
    )
    trainer_kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    # trainer.max_steps counts RL steps; Lightning counts optimizer steps (several per RL step for PPO)
    if trainer_kwargs.get("max_steps", -1) > 0:
        trainer_kwargs["max_steps"] *= k
    if "strategy" in trainer_kwargs:
        trainer_kwargs["strategy"] = build_strategy(trainer_kwargs["strategy"])
    plugins = precision_plugins(trainer_kwargs)
    eval_every = cfg.eval.every_n_steps if cfg.eval.num_examples > 0 else None
    callbacks = [checkpoints, RolloutSourceShutdown()]  # the latter stops an async rollout producer
    if prepared.governor is not None:
        callbacks.append(prepared.governor)
    callbacks.append(SampleLogger(cfg.log.samples_every_n_steps, cfg.log.num_samples, out))
    if plain_lines_on(cfg.log.plain_lines):
        callbacks.append(PlainLines(int(cfg.trainer.get("max_steps", -1) or -1)))
        if cfg.log.plain_lines == "auto":  # not a terminal: a progress bar would never print
            trainer_kwargs["enable_progress_bar"] = False
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
    return trainer, checkpoints


def build_data(cfg: DictConfig) -> tuple[RolloutDataModule, ModelSpec, object]:
    """(the ``RolloutDataModule``, the model's ``ModelSpec``, its tokenizer) of ``cfg``, checked before any
    weight loads: the task's data, the tokenizer's chat template, the prompts against the context, the model's
    support, the LoRA targets (on the meta device), the reward functions loaded in the verifier workers.
    Raises ConfigError naming the field or file."""
    try:  # data and model problems are the user's input too: report them like config errors
        task = build_task_from_cfg(cfg)
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(f"task={cfg.task.name}: {err}") from err
    spec = ModelSpec(**OmegaConf.to_container(cfg.model, resolve=True))
    try:
        tokenizer = load_tokenizer(spec.name_or_path, spec.trust_remote_code)
    except FileNotFoundError as err:
        raise ConfigError(str(err)) from err
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(
            f"model.name_or_path={cfg.model.name_or_path!r}: the tokenizer has no chat template, "
            f"and task={cfg.task.name} formats prompts with it"
        )
    datamodule = RolloutDataModule(
        task,
        tokenizer,
        cfg.rollout.prompts_per_step,
        cfg.rollout.group_size,
        seed=cfg.seed,
        eval_examples=cfg.eval.num_examples,
        eval_batch_size=cfg.eval.batch_size,
        reward_timeout_s=cfg.reward_timeout_s,
        rewards=build_rewards(cfg, task),
    )
    config = model_config(cfg.model)
    check_context(cfg, datamodule, config)  # before the weights load
    check_model_support(cfg, datamodule, config)
    try:  # LoRA targets against the model's module names, on the meta device (no weights yet)
        check_lora_targets(config, spec.lora, spec.trust_remote_code)
    except ValueError as err:
        raise ConfigError(f"model.lora.target_modules={list(spec.lora.target_modules)}: {err}") from err
    try:  # the verifier workers start and load the reward functions (a user's module) now, not at step 1
        datamodule.rewards.prepare()
    except RuntimeError as err:
        raise ConfigError(f"reward.functions: {err}") from err
    return datamodule, spec, tokenizer


def write_run_config(prepared: Prepared) -> None:
    """The resolved config as ``config.yaml`` in the run folder, headed by what the auto settings chose; a
    continued run keeps the original and adds ``config.resume-<time>.yaml``. Global rank 0 only."""
    config_file = prepared.out / "config.yaml"
    if prepared.ckpt_path is not None and config_file.exists():  # continuing: keep the original, add this one
        config_file = prepared.out / f"config.resume-{time.strftime('%Y%m%d-%H%M%S')}.yaml"
    header = "".join(f"# {line}\n" for line in prepared.hardware)  # what the auto settings chose here, and why
    config_file.write_text(header + OmegaConf.to_yaml(prepared.cfg, resolve=True))


def load_checked_policy(cfg: DictConfig, spec: ModelSpec, tokenizer):
    """(policy, tokenizer) of ``spec``, loaded, whose log-probs the trainer reproduces (``check_head_parity``).
    Raises ConfigError for missing weights, LoRA targets PEFT refuses, or a head-side transform lit_rl does
    not know."""
    try:
        policy, tokenizer = load_policy(spec, tokenizer)
    except FileNotFoundError as err:
        raise ConfigError(str(err)) from err
    except ValueError as err:  # PEFT: no module matches model.lora.target_modules
        if spec.lora.r <= 0:
            raise
        raise ConfigError(f"model.lora.target_modules={list(spec.lora.target_modules)}: {err}") from err
    try:  # the trainer's log-probs must be the model's own distribution (head-side transforms included)
        check_head_parity(policy, len(tokenizer))
    except ValueError as err:
        raise ConfigError(f"model.name_or_path={cfg.model.name_or_path!r}: {err}") from err
    return policy, tokenizer


def enter_kernel_mode(cfg: DictConfig, policy):
    """The run's kernel mode (``kernels``) for ``policy``, entered: it wraps the whole fit (rollouts, update,
    eval), and copies of the policy made by the module (engine.dtype, the KL reference) inherit it. float32
    products go through oneDNN or torch's BLAS, whichever is measured faster on the policy's shapes (on the CPU
    at 32-true; under bf16-mixed autocast the products are bf16 and oneDNN's already). Raises ConfigError for a
    model the mode does not cover (e.g. a norm layer the batch-invariant kernels do not know). ``fit`` leaves it
    at the end of the run."""
    precision = cfg.trainer.get("precision")
    gemm = cfg.kernels.get("fp32_gemm", "auto")
    if gemm == "auto" and (uses_cuda(cfg.trainer.get("accelerator")) or precision_dtype(precision) != torch.float32):
        gemm = "aten"
    mode = kernel_mode(cfg.kernels.name, policy, fp32_gemm=gemm)
    try:
        mode.__enter__()
    except ValueError as err:
        raise ConfigError(f"model.name_or_path={cfg.model.name_or_path!r}: {err}") from err
    return mode


def build(prepared: Prepared) -> RunParts:
    """Everything a prepared run trains with, in the order that keeps failures cheap: the Trainer, the data and
    the tokenizer (checked), config.yaml, the policy (checked), the kernel mode, the ``RLModule`` (its
    algorithm, rollout source and engine). Raises ConfigError."""
    cfg = prepared.cfg
    trainer, checkpoints = build_trainer(prepared)
    if trainer.is_global_zero:
        check_output_folders(prepared.out)
    datamodule, spec, tokenizer = build_data(cfg)
    if trainer.is_global_zero:
        write_run_config(prepared)
    policy, tokenizer = load_checked_policy(cfg, spec, tokenizer)
    mode = enter_kernel_mode(cfg, policy)
    try:  # the module's copies of the policy (engine.dtype, the KL reference) are made under the mode
        module = build_module(cfg, policy, tokenizer)
    except BaseException:
        mode.__exit__(None, None, None)
        raise
    return RunParts(prepared, trainer, checkpoints, datamodule, spec, policy, tokenizer, module, mode)


def fit(parts: RunParts) -> dict[str, float]:
    """Lightning's fit of the built run under its kernel mode, from its checkpoint when it continues one (which
    must fit the module), then the final checkpoint. Returns the last logged metrics (reduced over ranks).
    Raises a ``preemption`` stop for SIGTERM / SIGUSR1 (checkpointed at a safe point), ConfigError for a
    checkpoint that does not fit."""
    prepared, trainer, module = parts.prepared, parts.trainer, parts.module
    k, ckpt_path = prepared.updates_per_rl_step, prepared.ckpt_path
    precision = prepared.cfg.trainer.get("precision")
    with parts.kernels:
        assert module.updates_per_step == k
        module.peak_flops, source = peak_flops(precision, prepared.cfg.trainer.get("accelerator", "auto"))
        if trainer.is_global_zero:
            print(
                f"lit_rl: peak {module.peak_flops / 1e12:.3g} TFLOP/s per device at {precision} ({source}): "
                f"perf/mfu divides the update's FLOP rate by it",
                flush=True,
            )
        if ckpt_path is not None:
            check_checkpoint_fits(ckpt_path, module)
        try:
            trainer.fit(module, datamodule=parts.datamodule, ckpt_path=ckpt_path)
        except SIGTERMException as stop:  # SIGTERM or SIGUSR1, checkpointed at a safe point: exit 128 + signal
            raise preempted(trainer, parts.checkpoints, prepared.out, k) from stop
        finally:  # a failed or interrupted run stops its producer and engine too (Lightning's hooks do it normally)
            module.source.close()  # idempotent; first, so no producer thread still uses the engine
            module.source.close_engine()
            finish_loggers(trainer)
        save_final_checkpoint(trainer, parts.checkpoints)
    return {k: float(v) for k, v in trainer.callback_metrics.items()}  # reduced over ranks: the same on each


def export(parts: RunParts, metrics: dict[str, float]) -> None:
    """The trained policy (``policy/``, with its tokenizer; LoRA: the adapter, or merged) and ``finished.json``
    in the run folder, written by global rank 0 (under FSDP from the gathered full weights, a collective every
    rank joins). Raises OutputWriteError when they cannot be written (the last checkpoint stays whole)."""
    trainer, out = parts.trainer, parts.prepared.out
    weights = None
    if isinstance(trainer.strategy, FSDPStrategy):
        # FSDP: each rank holds a shard; gather the full weights (a collective; full tensors on rank 0)
        full = trainer.strategy.lightning_module_state_dict()
        weights = {name[len("policy.") :]: v for name, v in full.items() if name.startswith("policy.")}
    if not trainer.is_global_zero:
        return
    export_dir = out / "policy"
    try:
        export_policy(parts.policy, export_dir, weights, merge=bool(parts.spec.lora.merge_on_export))
        parts.tokenizer.save_pretrained(export_dir)
        (out / FINISHED_MARKER).write_text(
            json.dumps({"global_step": trainer.global_step, "metrics": metrics}, indent=2)
        )
    except OSError as err:
        last = find_last(out / "checkpoints")
        raise OutputWriteError(
            f"could not write the trained policy to {export_dir} ({err.strerror or err}); the "
            f"run's last checkpoint {last} is complete: once there is room, export it by "
            f"continuing the run (ckpt_path=last)"
        ) from err
