"""Build everything a config names and run Lightning's fit loop; ``recipes/train.py`` is its Hydra front.

    run(cfg, out_dir) -> dict of the last logged metrics

Order matters for users: the config is validated first (a bad value fails in a second, before any model
loads), then the output folder is checked (a finished run is never overwritten), then the model loads.

Several ranks (``trainer=ddp``, ``trainer=fsdp``): every rank runs this function (Lightning's launcher
starts the other local ranks by running the same command again; torchrun and SLURM start them all), and
only global rank 0 writes files: config.yaml, the TensorBoard run, checkpoints, policy/ and finished.json.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from ..algorithms import RLModule
from ..algorithms.base import updates_per_step
from ..algorithms.evaluation import EVAL_GENERATIONS
from ..config import ConfigError, check_world_size, validate
from ..corrections import sc_tail_samples
from ..kernels import kernel_mode
from ..logprobs import check_head_parity
from ..models import (
    check_lora_targets,
    checkpoint_config,
    dropout_probabilities,
    load_policy,
    load_tokenizer,
    merged_weights,
    original_dropout,
    peft_model,
)
from ..rollout.datamodule import RolloutDataModule
from ..rollout.sources import RolloutSourceShutdown
from ..schema import ModelConfig, TrainConfig, train_config
from ..tasks import build_task
from ..tasks.reward_functions import RewardFunctions
from .callbacks import AdaptiveThreads, PlainLines, PolicyExports, SampleLogger, plain_lines_on, step_progress_bar
from .checkpoints import AtomicCheckpointIO, OutputWriteError, find_last
from .drift_monitor import SamplerDriftMonitor
from .hardware import peak_flops, precision_dtype, uses_cuda
from .loggers import build_loggers, finish_loggers
from .model_checks import check_context, check_episode_context, check_model_support, model_config
from .preemption import RunCheckpoint, preempted
from .resolve import resolve_settings
from .resume import (
    FINISHED_MARKER,
    check_checkpoint_fits,
    check_run_folder,
    continued_run,
    finished_rl_step,
    resolve_ckpt_path,
    save_final_checkpoint,
)
from .runfolder import RunFolderClaim, check_output_folders, claim_run_folder, lightning_rank
from .runlog import RUN_LOG, RunLog
from .teacher import check_teacher, load_teacher

log = logging.getLogger(__name__)

#: the run folder's file of what the reward functions print (their verifier workers' stdout and stderr)
REWARD_OUTPUT = "reward_output.log"


def export_policy(policy, folder: Path, weights: dict | None = None, merge: bool = False) -> None:
    """Write the trained policy to ``folder`` in save_pretrained format (safetensors): the full model, or with
    LoRA the adapter (PEFT's ``adapter_config.json`` + ``adapter_model.safetensors``, loadable with
    ``PeftModel.from_pretrained`` on the base model) -- or, with ``merge``, the merged full model
    (W0 + (alpha / r) B A, the base model's names: loadable without PEFT). ``weights``: the full state dict
    (FSDP's gathered one), None for the module's own."""
    wrapper = peft_model(policy)
    with checkpoint_config(policy):  # the checkpoint's own dropout in config.json, not the zeros trained with
        if wrapper is None:
            policy.save_pretrained(folder, state_dict=weights, safe_serialization=True)
        elif merge:
            policy.save_pretrained(folder, state_dict=merged_weights(policy), safe_serialization=True)
        else:
            wrapper.save_pretrained(folder, safe_serialization=True)


def precision_plugins(trainer_kwargs: dict) -> list:
    """Lightning precision plugins ``trainer_kwargs`` needs, removing ``precision`` from it when a plugin
    takes its place. ``16-mixed`` on the CPU is float16 autocast with a ``torch.amp.GradScaler("cpu")``
    (Lightning would silently run bf16-mixed instead; an explicit precision is honoured)."""
    if str(trainer_kwargs.get("precision")) in ("16-mixed", "16") and not uses_cuda(trainer_kwargs.get("accelerator")):
        from lightning.pytorch.plugins.precision import MixedPrecision

        trainer_kwargs.pop("precision")
        return [MixedPrecision("16-mixed", "cpu")]
    return []


def build_module(cfg: TrainConfig | DictConfig, policy, tokenizer, teacher=None):
    """The ``RLModule`` of ``cfg`` (its algorithm: ``algo.name``; its rollout source: ``rollout.mode``) around an
    already loaded policy. ``cfg``: the run's typed config (``schema.train_config``; a ``DictConfig`` is typed
    here). ``teacher``: the ``distill.teacher`` model already loaded (``teacher.load_teacher``), or None: loaded
    here when ``distill.teacher`` is set, except under ``eval.only`` (no update scores a token: the teacher is
    neither loaded nor kept). Raises ConfigError for a score-centering head larger than the vocabulary, or a
    teacher that does not fit the student (``teacher.check_teacher``)."""
    cfg = train_config(cfg)
    distill = cfg.distill
    if cfg.eval.only:
        distill, teacher = dataclasses.replace(distill, teacher=None), None
    sampling = cfg.sampling
    sc = cfg.correction.sc
    if sc.enabled:  # the engine must record the head H that score centering sums over
        vocab = policy.get_output_embeddings().weight.shape[0]
        top_k = vocab if sc.mode == "exact" else int(sc.top_k)
        if top_k > vocab:
            raise ConfigError(f"correction.sc.top_k={top_k} is larger than the vocabulary ({vocab} tokens)")
        sampling = dataclasses.replace(sampling, logprobs_top_k=max(int(sampling.logprobs_top_k), top_k))
        # the sampled tail: the engine draws exactly the m tail tokens the correction reads after the head (0: none)
        sampling = dataclasses.replace(sampling, logprobs_tail_samples=sc_tail_samples(cfg.correction))
    eval_sampling = dataclasses.replace(
        sampling,
        temperature=float(cfg.eval.temperature),
        top_k=0,
        top_p=1.0,
        logprobs_top_k=0,
        logprobs_tail_samples=0,
        max_new_tokens=cfg.eval.max_new_tokens,
    )
    module = RLModule(
        policy=policy,
        tokenizer=tokenizer,
        sampling=sampling,
        eval_sampling=eval_sampling,
        group_size=cfg.rollout.group_size,
        micro_batch_size=cfg.rollout.micro_batch_size,
        advantage=cfg.advantage,
        loss=cfg.loss,
        algo=cfg.algo,
        kl=cfg.kl,
        optim=cfg.optim,
        logprob_chunk_tokens=cfg.logprob_chunk_tokens,
        correction=cfg.correction,
        engine=cfg.engine,
        rollout_mode=cfg.rollout,
        update=cfg.update,
        distill=distill,
        teacher=teacher if teacher is not None or distill.teacher is None else checked_teacher(cfg, tokenizer),
    )
    module.eval_n, module.eval_k = int(cfg.eval.n), int(cfg.eval.k)
    module.eval_at_start = bool(cfg.eval.at_start)
    if cfg.task.multi_turn:  # an episode's model tokens count against its whole budget (docs/environments.md)
        module.max_response_length = int(cfg.rollout.max_total_tokens)
    return module


def checked_teacher(cfg: TrainConfig, tokenizer):
    """The ``distill.teacher`` model, checked against the student's tokenizer and vocabulary, then loaded."""
    check_teacher(cfg, tokenizer)
    return load_teacher(cfg, tokenizer)


def build_task_from_cfg(cfg: TrainConfig | DictConfig):
    """The ``Task`` of ``cfg.task`` (``tasks.build_task``)."""
    return build_task(dataclasses.asdict(train_config(cfg).task))


def build_rewards(cfg: TrainConfig, task, output_log: Path | None = None) -> RewardFunctions:
    """The run's ``RewardFunctions``: ``reward.functions`` (or the task's verifier) in the verifier pool, their
    output to ``output_log`` (None: the console), and the verifier of correctness (``reward.correct_from``);
    prints which one when the default fell back to the first function (``task=dataset`` without a built-in
    verifier among the functions)."""
    r = cfg.reward
    try:
        rewards = RewardFunctions(
            task,
            functions=r.functions,
            weights=r.weights,
            num_workers=r.num_workers,
            timeout_s=cfg.reward_timeout_s,
            max_completion_length=cfg.sampling.max_new_tokens,
            correct_from=r.correct_from,
            max_failed_steps=r.max_failed_steps,
            output_log=output_log,
        )
    except (ValueError, FileNotFoundError, ImportError) as err:
        raise ConfigError(str(err)) from err
    if rewards.correct_note:
        print(rewards.correct_note, flush=True)
    return rewards


def build_environment(cfg: TrainConfig, task, tokenizer):
    """(the task's ``Environment``, its ``MultiTurnLimits``) for a multi-turn task, (None, None) for a single-turn
    one; the chat template's prefix property checked on a real two-turn conversation (``check_prefix_property``).
    Raises ConfigError naming the field (a tool or environment that cannot be loaded, a template that rewrites
    earlier turns)."""
    from ..rollout.environments import chat_tools, task_environment
    from ..rollout.multiturn import MultiTurnLimits, check_prefix_property

    ro = cfg.rollout
    try:
        environment = task_environment(task, ro.max_tool_calls)
        if environment is None:
            return None, None
        tool_text, schemas = chat_tools(tokenizer, environment)
        check_prefix_property(tokenizer, tool_text, schemas)
    except ValueError as err:
        raise ConfigError(f"task={cfg.task.name}: {err}") from err
    limits = MultiTurnLimits(
        ro.max_turns, ro.max_total_tokens, ro.max_tool_output_chars, cfg.reward_timeout_s, ro.episode_reward
    )
    return environment, limits


def build_strategy(name):
    """The Lightning strategy for ``trainer.strategy``: ``fsdp`` becomes an ``FSDPStrategy`` that shards
    each transformer block (every transformers decoder layer is a ``GradientCheckpointingLayer``) as one
    unit, with full (unsharded) checkpoints; any other value is handed to Lightning as is."""
    if name != "fsdp":
        return name
    from transformers import GenerationMixin
    from transformers.modeling_layers import GradientCheckpointingLayer

    from ..algorithms.parallel import FSDPStrategy as AnyDeviceFSDPStrategy  # also on CPU processes (gloo)

    return AnyDeviceFSDPStrategy(
        auto_wrap_policy={GradientCheckpointingLayer, GenerationMixin},
        sharding_strategy="FULL_SHARD",
        state_dict_type="full",
    )


def run(cfg: DictConfig, out_dir: str | os.PathLike, overrides: list[str] | None = None) -> dict[str, float]:
    """Train with ``cfg`` writing TensorBoard logs, checkpoints and the final policy under ``out_dir``.

    Continuing a run (``ckpt_path`` set, or ``resume=<run folder>``, which replaces ``out_dir`` and means
    ``ckpt_path=last``): the run folder's saved config.yaml is the config (``resumed_config``; ``overrides``,
    the command line's override strings, say which fields the user set).

    Raises ConfigError for a bad config, an ``out_dir`` that already holds a finished run, is in use by a
    running one (``runfolder.claim_run_folder``: global rank 0 claims it before the checks, until the run
    ends) or cannot be written, or prompts that do not fit the context; OutputWriteError when a checkpoint or
    the policy export cannot be written during the run (the checkpoints written before stay whole).

    What the run prints, and the error that ends it, also go to ``<run>/train.log`` (``runlog.RunLog``; global
    rank 0, once the folder is checked as this run's).
    """
    claims: list[RunFolderClaim] = []  # the run folder's claim, held until the run ends however it ends
    run_log = RunLog.start()
    try:
        return _run(cfg, out_dir, overrides, claims, run_log)
    except BaseException as err:
        run_log.end(err)
        raise
    finally:
        run_log.close()
        for claim in claims:
            claim.release()


@dataclass
class Prepared:
    """A run's config and folder once ``prepare_output`` has checked them.

    cfg: the typed config (``schema.train_config``; a continued run's: its saved one, with the command line's
    changes), validated and with its auto settings resolved, built once here and passed through; out: the run folder
    (claimed); ckpt_path: the checkpoint it continues from, or None; hardware: what the auto settings chose, one
    line each (printed, and written at the top of config.yaml); governor: the ``threads=adaptive`` callback or None;
    updates_per_rl_step: optimizer steps per RL step; log: the run's ``RunLog`` (None: the console only).
    """

    cfg: TrainConfig
    out: Path
    ckpt_path: str | None
    hardware: list[str]
    governor: AdaptiveThreads | None
    updates_per_rl_step: int
    log: RunLog | None = None


@dataclass
class ModelParts:
    """What ``assemble`` makes of a config, without a Trainer.

    datamodule: the prompts, the verifier pool (its workers started); spec / policy / tokenizer: the model, its
    log-probs checked; module: the ``RLModule``; kernels: the kernel mode's context manager, entered (the
    module's copies of the policy inherit it): the caller leaves it.
    """

    datamodule: RolloutDataModule
    spec: ModelConfig
    policy: torch.nn.Module
    tokenizer: object
    module: RLModule
    kernels: object


@dataclass
class RunParts:
    """What ``build`` makes of a prepared run: everything ``fit`` runs.

    trainer: Lightning's Trainer (loggers, callbacks, strategy, precision); checkpoints: its ``RunCheckpoint``;
    model: what ``assemble`` built (data, model, ``RLModule``, the kernel mode ``fit`` leaves at the end).
    """

    prepared: Prepared
    trainer: L.Trainer
    checkpoints: RunCheckpoint
    model: ModelParts


def _run(cfg: DictConfig, out_dir, overrides, claims: list, run_log: RunLog) -> dict[str, float]:
    prepared = prepare_output(cfg, out_dir, overrides, claims, run_log)
    parts = build(prepared)
    metrics = fit(parts)
    if not prepared.cfg.eval.only:  # an evaluation alone leaves no policy and no finished.json
        export(parts, metrics)
    return metrics


def prepare_output(cfg: DictConfig, out_dir, overrides, claims: list, run_log: RunLog | None = None) -> Prepared:
    """Check the config and claim the run folder, before anything heavy: the continued run's config
    (``continued_run``), ``config.validate``, the hardware and engine settings resolved (``resolve_settings``),
    the folder claimed by global rank 0 (appended to ``claims``, released by ``run``) and checked
    (``check_run_folder``), the seed set; then the typed config is built (``schema.train_config``), once. ``run_log``
    (global rank 0) writes to the checked folder's ``train.log`` from then on. Raises ConfigError."""
    cfg, out = continued_run(cfg, Path(out_dir), overrides)
    validate(cfg)
    hardware, governor = resolve_settings(cfg)
    cfg = train_config(cfg)
    # Lightning warns that with manual optimisation a step's checkpoint holds the weights after its update;
    # that is exactly what resuming needs here (the next step starts from them), so the warning is noise
    warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
    ckpt_path = resolve_ckpt_path(cfg.ckpt_path, out)
    if lightning_rank() == 0:  # first, so two runs cannot both pass the checks below before either writes
        claims.append(claim_run_folder(out, resume=ckpt_path is not None))
    check_run_folder(out, ckpt_path)
    L.seed_everything(cfg.seed, workers=True, verbose=False)

    k = updates_per_step(cfg.algo)
    max_steps = int(cfg.trainer.get("max_steps", -1))
    if ckpt_path is not None and (out / FINISHED_MARKER).exists():
        finished_at = finished_rl_step(out / FINISHED_MARKER, k)
        if finished_at is not None and 0 < max_steps <= finished_at:
            raise ConfigError(  # continuing it would run no step and rewrite its exported policy
                f"output folder {out} holds a run that finished at RL step {finished_at} "
                f"(trainer.max_steps={max_steps}): nothing to continue; to train it further, give a "
                f"larger trainer.max_steps (e.g. --resume {out} trainer.max_steps={finished_at + 10})"
            )
    if lightning_rank() == 0:  # where its scalars, checkpoints and policy go: a new user looked for it
        print(f"lit_rl: run folder {out} (tensorboard --logdir {out})", flush=True)
    if run_log is not None and lightning_rank() == 0:
        run_log.attach(out / RUN_LOG)
    elif run_log is not None:  # the other ranks' console only (they would hold their lines to the end)
        run_log.close()
        run_log = None
    return Prepared(cfg, out, ckpt_path, hardware, governor, k, run_log)


def build_trainer(prepared: Prepared) -> tuple[L.Trainer, RunCheckpoint]:
    """Lightning's Trainer of a prepared run (loggers, checkpoints every ``checkpoint.every_n_steps`` RL steps,
    the rollout source's shutdown, the sample logger, plain lines, the strategy and precision plugins) and its
    ``RunCheckpoint``. ``trainer.max_steps`` counts RL steps; Lightning counts optimizer steps. Raises
    ConfigError for a trainer Lightning refuses (e.g. trainer=gpu without a GPU) or a world size the run
    cannot use."""
    cfg, out, k = prepared.cfg, prepared.out, prepared.updates_per_rl_step
    logger = build_loggers(cfg, out)
    checkpoints = RunCheckpoint(  # a ModelCheckpoint that also checkpoints on SIGTERM/SIGUSR1/SIGINT (preemption.py)
        updates_per_step=k,  # named step=<RL steps done>.ckpt
        dirpath=out / "checkpoints",
        every_n_train_steps=cfg.checkpoint.every_n_steps * k,
        save_last="link",
        save_top_k=1,
    )
    trainer_kwargs = copy.deepcopy(cfg.trainer)
    # trainer.max_steps counts RL steps; Lightning counts optimizer steps (several per RL step for PPO)
    if trainer_kwargs.get("max_steps", -1) > 0:
        trainer_kwargs["max_steps"] *= k
    if "strategy" in trainer_kwargs:
        trainer_kwargs["strategy"] = build_strategy(trainer_kwargs["strategy"])
    plugins = precision_plugins(trainer_kwargs)
    eval_every = cfg.eval.every_n_steps if cfg.eval.num_examples > 0 or cfg.eval.sets else None
    callbacks = [checkpoints, RolloutSourceShutdown()]  # the latter stops an async rollout producer
    if prepared.governor is not None:
        callbacks.append(prepared.governor)
    callbacks.append(SampleLogger(cfg.log.samples_every_n_steps, cfg.log.num_samples, out))
    if cfg.log.drift_prompts:  # drift/*: the KL from the first weights' sampler to the policy on fixed prefixes
        callbacks.append(SamplerDriftMonitor(cfg.log.drift_prompts))
    console = plain_lines_on(cfg.log.plain_lines)
    if console or prepared.log is not None:  # the run's log has them even where the console shows a progress bar
        callbacks.append(PlainLines(int(cfg.trainer.get("max_steps", -1) or -1), console, prepared.log))
    if console and cfg.log.plain_lines == "auto":  # not a terminal: a progress bar would never print
        trainer_kwargs["enable_progress_bar"] = False
    if trainer_kwargs.get("enable_progress_bar", True):
        callbacks.append(step_progress_bar())  # "RL step n/N", not Lightning's "Epoch 0/-2"
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


def build_data(cfg: TrainConfig, reward_log: Path | None = None) -> tuple[RolloutDataModule, ModelConfig, object]:
    """(the ``RolloutDataModule``, the model's ``ModelConfig``, its tokenizer) of ``cfg``, checked before any
    weight loads: the task's data, the tokenizer's chat template, the prompts against the context, the model's
    support, the LoRA targets (on the meta device), the reward functions loaded in the verifier workers (what
    they print to ``reward_log``, None: the console). Raises ConfigError naming the field or file."""
    try:  # data and model problems are the user's input too: report them like config errors
        task = build_task_from_cfg(cfg)
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(f"task={cfg.task.name}: {err}") from err
    note = getattr(getattr(task, "task", task), "dropped_note", None)  # ConstantReward wraps the task
    if note:
        print(note, flush=True)  # rows left out for a prompt with no text (task.empty_prompts=drop)
    spec = cfg.model
    try:
        tokenizer = load_tokenizer(spec.name_or_path, spec.trust_remote_code)
    except FileNotFoundError as err:
        raise ConfigError(str(err)) from err
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(
            f"model.name_or_path={cfg.model.name_or_path!r}: the tokenizer has no chat template, "
            f"and task={cfg.task.name} formats prompts with it"
        )
    environment, limits = build_environment(cfg, task, tokenizer)
    datamodule = RolloutDataModule(
        task,
        tokenizer,
        cfg.rollout.prompts_per_step,
        cfg.rollout.group_size,
        seed=cfg.seed,
        eval_examples=cfg.eval.num_examples,
        eval_batch_size=cfg.eval.batch_size,
        reward_timeout_s=cfg.reward_timeout_s,
        rewards=build_rewards(cfg, task, reward_log),
        environment=environment,
        limits=limits,
    )
    add_eval_sets(cfg, datamodule, reward_log)
    config = model_config(cfg.model)
    check_context(cfg, datamodule, config)  # before the weights load
    check_episode_context(cfg, datamodule, config)
    check_model_support(cfg, datamodule, config)
    try:  # LoRA targets against the model's module names, on the meta device (no weights yet)
        check_lora_targets(config, spec.lora, spec.trust_remote_code)
    except ValueError as err:
        raise ConfigError(f"model.lora.target_modules={list(spec.lora.target_modules)}: {err}") from err
    try:  # the verifier workers start and load the reward functions (a user's module) now, not at step 1
        datamodule.rewards.prepare()
        for eval_set in datamodule.extra_eval_sets:
            eval_set.data.rewards.prepare()
    except RuntimeError as err:
        raise ConfigError(f"reward.functions: {err}") from err
    return datamodule, spec, tokenizer


def add_eval_sets(cfg: TrainConfig, datamodule: RolloutDataModule, reward_log: Path | None) -> None:
    """``eval.sets`` added to ``datamodule`` (``RolloutDataModule.add_eval_set``), each with its own task (its template,
    fields and verifier, which decides correctness) and its split's first ``num_examples`` examples (default
    ``eval.num_examples``). Prints which sets have no gold answers (they skip maj@n). Raises ConfigError naming the
    set for a task that cannot be built or an empty set."""
    for i, entry in enumerate(cfg.eval.sets):
        where = f"eval.sets[{i}] ({entry['name']})"
        try:
            task = build_task(dict(entry["task"]))
            split = entry.get("split") or "eval"
            examples = list(task.eval_examples() if split == "eval" else task.train_examples())
        except (ValueError, FileNotFoundError, TypeError) as err:
            raise ConfigError(f"{where}.task: {err}") from err
        examples = examples[: entry.get("num_examples") or cfg.eval.num_examples or len(examples)]
        if not examples:
            raise ConfigError(f"{where}: its task's {split} split holds no examples")
        rewards = RewardFunctions(
            task, timeout_s=cfg.reward_timeout_s, max_completion_length=cfg.eval.max_new_tokens, output_log=reward_log
        )
        datamodule.add_eval_set(entry["name"], task, examples, rewards)
        if not datamodule.extra_eval_sets[-1].has_answers and int(cfg.eval.n) > 1:
            print(f"lit_rl: {where} has examples without a gold answer: no maj@n for it", flush=True)


def write_run_config(prepared: Prepared) -> None:
    """The resolved config as ``config.yaml`` in the run folder, headed by what the auto settings chose; a
    continued run keeps the original and adds ``config.resume-<time>.yaml``. Global rank 0 only."""
    config_file = prepared.out / "config.yaml"
    if prepared.ckpt_path is not None and config_file.exists():  # continuing: keep the original, add this one
        config_file = prepared.out / f"config.resume-{time.strftime('%Y%m%d-%H%M%S')}.yaml"
    header = "".join(f"# {line}\n" for line in prepared.hardware)  # what the auto settings chose here, and why
    config_file.write_text(header + OmegaConf.to_yaml(prepared.cfg, resolve=True))


def load_checked_policy(cfg: TrainConfig, spec: ModelConfig, tokenizer):
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
    if lightning_rank() == 0:
        report_dropout(spec, policy)
    return policy, tokenizer


def report_dropout(spec: ModelConfig, policy) -> None:
    """One printed line when the configured model has dropout: what ``model.keep_dropout=false`` turned off in
    the trainer's forward (the checkpoint config's probabilities, ``model.lora.dropout``), or with ``true`` what
    stays on and what it costs."""
    if spec.keep_dropout:
        probabilities = dropout_probabilities(policy)
        what = "model.keep_dropout=true: dropout stays on in the trainer's forward ({}); the engine samples without "
        what += "it, and train/logprob_abs_diff includes its noise"
    else:
        probabilities = original_dropout(policy)
        if spec.lora.r > 0 and spec.lora.dropout > 0:
            probabilities["model.lora.dropout"] = spec.lora.dropout
        what = "dropout off in the trainer's forward, as in the engine's ({}); model.keep_dropout=true keeps it"
    if probabilities:
        print("lit_rl: " + what.format(", ".join(f"{k}={v:g}" for k, v in probabilities.items())), flush=True)


def enter_kernel_mode(cfg: TrainConfig, policy):
    """The run's kernel mode (``kernels``) for ``policy``, entered: it wraps the whole fit (rollouts, update,
    eval), and copies of the policy made by the module (engine.dtype, the KL reference) inherit it. float32
    products go through oneDNN or torch's BLAS, whichever is measured faster on the policy's shapes (on the CPU
    at 32-true; under bf16-mixed autocast the products are bf16 and oneDNN's already); on the CPU the trainer's
    attention backward is ``kernels.attention_backward``'s, resolved at the precision's compute dtype. Raises
    ConfigError for a model the mode does not cover (e.g. a norm layer the batch-invariant kernels do not know).
    ``fit`` leaves it at the end of the run."""
    precision = cfg.trainer.get("precision")
    gemm = cfg.kernels.fp32_gemm
    if gemm == "auto" and (uses_cuda(cfg.trainer.get("accelerator")) or precision_dtype(precision) != torch.float32):
        gemm = "aten"
    backward = cfg.kernels.attention_backward
    if backward != "flash" and uses_cuda(cfg.trainer.get("accelerator")):
        print(
            f"lit_rl: kernels.attention_backward={backward}: flash on CUDA (torch's is the fast one there)", flush=True
        )
        backward = "flash"
    try:
        mode = kernel_mode(
            cfg.kernels.name,
            policy,
            fp32_gemm=gemm,
            linear_attention=cfg.kernels.linear_attention,
            attention_backward=backward,
            attention_dtype=precision_dtype(precision),
        )
        mode.__enter__()
    except ValueError as err:
        raise ConfigError(f"model.name_or_path={cfg.model.name_or_path!r}: {err}") from err
    return mode


def assemble(
    cfg: TrainConfig | DictConfig,
    before_weights: Callable[[], None] | None = None,
    reward_log: Path | None = None,
) -> ModelParts:
    """The data, the model and the ``RLModule`` of a validated config whose auto settings are filled in
    (``resolve_settings``; a ``DictConfig`` is typed here, ``schema.train_config``), without a Trainer, in the order
    that keeps failures cheap: the data and the tokenizer (checked: ``build_data``; ``distill.teacher``'s tokenizer
    and vocabulary against it), then ``before_weights()`` when given, the policy (checked), the kernel mode
    (entered), the module (its algorithm, rollout source and engine; the teacher loaded).
    What ``build`` trains with, and what the gradient probe and the benchmarks measure. The caller leaves the kernel
    mode (``parts.kernels``) when done. ``reward_log``: the file the reward functions' output goes to (a run's
    ``REWARD_OUTPUT``), None: the console. Raises ConfigError."""
    cfg = train_config(cfg)
    datamodule, spec, tokenizer = build_data(cfg, reward_log)
    check_teacher(cfg, tokenizer)  # distill.teacher: the student's tokenizer and vocabulary, before any weight
    if before_weights is not None:
        before_weights()
    policy, tokenizer = load_checked_policy(cfg, spec, tokenizer)
    mode = enter_kernel_mode(cfg, policy)
    try:  # the module's copies of the policy (engine.dtype, the KL reference) are made under the mode
        module = build_module(cfg, policy, tokenizer, load_teacher(cfg, tokenizer))
    except BaseException:
        mode.__exit__(None, None, None)
        raise
    return ModelParts(datamodule, spec, policy, tokenizer, module, mode)


def build(prepared: Prepared) -> RunParts:
    """Everything a prepared run trains with, in the order that keeps failures cheap: the Trainer, then
    ``assemble`` (the data and the tokenizer, checked; config.yaml; the policy, checked; the kernel mode; the
    ``RLModule``). The reward functions' output goes to ``<run>/reward_output.log`` (``REWARD_OUTPUT``, appended
    to by every rank, and by a continued run). Raises ConfigError."""
    trainer, checkpoints = build_trainer(prepared)
    write_config = None
    if trainer.is_global_zero:
        check_output_folders(prepared.out)
        write_config = partial(write_run_config, prepared)  # once the data passed its checks, before the weights
    parts = assemble(prepared.cfg, before_weights=write_config, reward_log=prepared.out / REWARD_OUTPUT)
    parts.module.eval_dir = prepared.out / EVAL_GENERATIONS
    if prepared.cfg.checkpoint.export_at_steps:  # policy_step{n}/ folders: needs the tokenizer, so added here
        merge = bool(parts.spec.lora.merge_on_export)
        export = partial(export_policy, merge=merge)
        trainer.callbacks.append(
            PolicyExports(prepared.cfg.checkpoint.export_at_steps, prepared.out, export, parts.tokenizer)
        )
    return RunParts(prepared, trainer, checkpoints, parts)


def fit(parts: RunParts) -> dict[str, float]:
    """Lightning's fit of the built run under its kernel mode, from its checkpoint when it continues one (which
    must fit the module), then the final checkpoint. Returns the last logged metrics (reduced over ranks).
    Raises a ``preemption`` stop for SIGTERM / SIGUSR1 / SIGINT (checkpointed at a safe point), ConfigError for a
    checkpoint that does not fit."""
    prepared, trainer, module = parts.prepared, parts.trainer, parts.model.module
    k, ckpt_path = prepared.updates_per_rl_step, prepared.ckpt_path
    precision = prepared.cfg.trainer.get("precision")
    with parts.model.kernels:
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
            if prepared.cfg.eval.only:  # the model (or checkpoint) evaluated, logged at step 0; no training
                trainer.validate(module, datamodule=parts.model.datamodule, ckpt_path=ckpt_path, verbose=False)
            else:
                trainer.fit(module, datamodule=parts.model.datamodule, ckpt_path=ckpt_path)
        except SIGTERMException as stop:  # SIGTERM, SIGUSR1 or Ctrl-C, checkpointed at a safe point: exit 128 + signal
            raise preempted(trainer, parts.checkpoints, prepared.out, k) from stop
        finally:  # a failed or interrupted run stops its producer and engine too (Lightning's hooks do it normally)
            module.source.close()  # idempotent; first, so no producer thread still uses the engine
            module.source.close_engine()
            finish_loggers(trainer)
        if not prepared.cfg.eval.only:
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
        model = parts.model
        export_policy(model.policy, export_dir, weights, merge=bool(model.spec.lora.merge_on_export))
        model.tokenizer.save_pretrained(export_dir)
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
