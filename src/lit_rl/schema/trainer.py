"""The trainer's sections: ``update``, ``optim``, ``eval``, ``log``, ``checkpoint``, ``logger`` and the Lightning
Trainer's defaults."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from .base import Number, Problems, int_rule, is_int, is_number, rule


@dataclass
class UpdateConfig:
    """``update``: how the trainer's forward/backward is organised (none of it changes the result)."""

    #: each prompt's forward once per group (its KV cache reused by the G completions; Prefix Grouper):
    #: auto (on when rollout.group_size >= 2 and the model family is supported) | true | false
    shared_prefix: Any = "auto"


@dataclass
class EvalConfig:
    """``eval``: held-out accuracy: greedy pass@1, or mean@n, pass@k (every power of two k <= n), maj@n, best@n and
    worst@n from n samples per problem; on the task's own split (``eval/...``) and on each of ``sets``
    (``eval/<name>/...``)."""

    every_n_steps: int = 10
    #: 0 = no evaluation
    num_examples: int = 64
    batch_size: int = 64
    max_new_tokens: int = 64
    #: samples per problem; > 1 logs eval/mean@n, eval/pass@k for every power of two k <= n, eval/maj@n,
    #: eval/best@n and eval/worst@n (needs temperature > 0)
    n: int = 1
    #: one more pass@k to log besides the powers of two (1 <= k <= n), the unbiased estimator of Chen et al. 2021
    k: int = 1
    #: 0 = greedy
    temperature: Number = 0.0
    #: further eval sets, each a task config of its own (template, fields, verifier), logged as eval/<name>/...:
    #: {name: <tag name>, task: {name: gsm8k|dataset|arithmetic, ...its fields}, split: eval|train (the task's
    #: split evaluated; default eval), num_examples: (default eval.num_examples)}
    sets: list[Any] = field(default_factory=list)
    #: evaluate once before the first RL step (logged at the step before the first training step); a continued
    #: run does not
    at_start: bool = False
    #: evaluate model.name_or_path (a model or a run's policy/ folder) or the checkpoint ckpt_path, then stop: no
    #: training step (logged as eval.at_start is)
    only: bool = False

    def problems(self, run) -> Problems:
        """The evaluation's values it refuses (``schema.base``: ``config.validate`` raises ConfigError for the
        first); ``eval.max_new_tokens`` is checked beside ``sampling``'s cap."""
        yield from int_rule(self.every_n_steps, "eval.every_n_steps", 1, " (eval.num_examples=0 turns evaluation off)")
        yield from int_rule(self.num_examples, "eval.num_examples", 0, " (0 = no evaluation)")
        yield from int_rule(self.batch_size, "eval.batch_size", 1)
        n, k, temperature = self.n, self.k, self.temperature
        yield from int_rule(n, "eval.n", 1, " (samples per problem)")
        yield from rule(is_int(k) and 1 <= k <= n, "eval.k", k, f"must be an integer in [1, eval.n={n}]")
        yield from rule(is_number(temperature) and temperature >= 0, "eval.temperature", temperature, "must be >= 0")
        yield from rule(
            n == 1 or temperature > 0,
            "eval.temperature",
            temperature,
            f"must be > 0 with eval.n={n} (greedy decoding gives n equal samples)",
        )
        for key in ("at_start", "only"):
            value = getattr(self, key)
            yield from rule(isinstance(value, bool), f"eval.{key}", value, "must be true or false")
        yield from eval_set_problems(self.sets)
        yield from rule(
            not self.only or self.num_examples > 0 or bool(self.sets),
            "eval.only",
            self.only,
            "needs something to evaluate: eval.num_examples > 0 or eval.sets",
        )


#: the keys one entry of ``eval.sets`` may have
EVAL_SET_KEYS = ("name", "task", "split", "num_examples")


def eval_set_problems(sets) -> Problems:
    """What ``eval.sets`` refuses: an entry that is not a mapping of ``EVAL_SET_KEYS``, a name that is missing, not a
    plain tag word, "main" (the task's own split) or given twice, a ``task`` without its ``name``, a ``split`` other
    than eval / train, a ``num_examples`` below 1."""
    yield from rule(isinstance(sets, (list, tuple)), "eval.sets", sets, "must be a list of {name, task, ...}")
    if not isinstance(sets, (list, tuple)):
        return
    seen = set()
    for i, entry in enumerate(sets):
        where = f"eval.sets[{i}]"
        if not isinstance(entry, Mapping):
            yield where, entry, f"must be a mapping with keys {list(EVAL_SET_KEYS)}"
            continue
        unknown = sorted(set(entry) - set(EVAL_SET_KEYS))
        yield from rule(not unknown, where, unknown, f"has unknown keys; allowed: {list(EVAL_SET_KEYS)}")
        name = entry.get("name")
        ok = isinstance(name, str) and bool(re.fullmatch(r"[A-Za-z0-9_.@-]+", name)) and name != "main"
        yield from rule(ok, f"{where}.name", name, "must be a word of letters, digits, _ . @ - (not 'main')")
        yield from rule(name not in seen, f"{where}.name", name, "is given twice (eval set names are unique)")
        seen.add(name)
        task = entry.get("task")
        yield from rule(
            isinstance(task, Mapping) and isinstance(task.get("name"), str),
            f"{where}.task",
            task,
            "must be a task config with its name, e.g. {name: gsm8k, path: data/gsm8k}",
        )
        split = entry.get("split", "eval")
        yield from rule(split in ("eval", "train"), f"{where}.split", split, "must be eval or train")
        count = entry.get("num_examples")
        yield from rule(count is None or (is_int(count) and count >= 1), f"{where}.num_examples", count, "must be >= 1")


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
    #: the drift monitor (``run.drift_monitor``): before step 1 the sampler's whole distribution is recorded on
    #: the completions of this many of step 1's prompts (G each), and every step logs ``drift/sampler_kl`` (the KL
    #: from it to the policy), ``drift/sampler_kl_change`` and ``drift/entropy`` there; 0 = off
    drift_prompts: int = 0

    def problems(self, run) -> Problems:
        """The values it refuses (``schema.base``: ``config.validate`` raises ConfigError for the first)."""
        yield from int_rule(self.samples_every_n_steps, "log.samples_every_n_steps", 0, " (0 = never)")
        yield from int_rule(self.num_samples, "log.num_samples", 1)
        yield from int_rule(self.drift_prompts, "log.drift_prompts", 0, " (0 = off)")
        yield from rule(
            self.plain_lines in ("auto", True, False), "log.plain_lines", self.plain_lines, "auto, true or false"
        )


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

    def problems(self, run) -> Problems:
        """The values it refuses (``schema.base``: ``config.validate`` raises ConfigError for the first)."""
        yield from rule(is_number(self.lr) and self.lr > 0, "optim.lr", self.lr, "must be > 0")
        clip_norm = self.grad_clip
        yield from rule(
            clip_norm is None or (is_number(clip_norm) and clip_norm >= 0),
            "optim.grad_clip",
            clip_norm,
            "must be >= 0 (0 or null = no clipping)",
        )
        yield from int_rule(self.warmup_steps, "optim.warmup_steps", 0)
        yield from int_rule(self.max_nonfinite_updates, "optim.max_nonfinite_updates", 0, " (0 = never stop)")


@dataclass
class CheckpointConfig:
    """``checkpoint``: Lightning checkpoints (weights, optimizer, step) in <run>/checkpoints."""

    every_n_steps: int = 10
    #: RL steps after which the policy is also written in save_pretrained format, to <run>/policy_step{n}/
    #: (0 = the initial weights); e.g. the sampler weights of a staleness probe. [] = none
    export_at_steps: list[int] = field(default_factory=list)

    def problems(self, run) -> Problems:
        """The values it refuses (``schema.base``: ``config.validate`` raises ConfigError for them)."""
        yield from int_rule(self.every_n_steps, "checkpoint.every_n_steps", 1)
        steps = list(self.export_at_steps)
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in steps):
            yield "checkpoint.export_at_steps", steps, "a list of RL steps, integers >= 0 (0 = the initial weights)"
        elif steps and 0 < int(run.trainer.get("max_steps", -1) or -1) < max(steps):
            max_steps = run.trainer.get("max_steps")
            yield (
                "checkpoint.export_at_steps",
                steps,
                f"steps <= trainer.max_steps={max_steps} (a later one is never reached)",
            )
        elif steps and "fsdp" in str(run.trainer.get("strategy", "")).lower():
            yield "checkpoint.export_at_steps", steps, "[] under FSDP (the final policy/ is gathered; these are not)"


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
    """``logger.tensorboard``: Lightning's TensorBoardLogger, event files (and Lightning's ``hparams.yaml``) in the
    run folder itself, so TensorBoard names the run by its folder (``<run>``, not ``<run>/tensorboard``)."""

    #: sub-folder of the run folder; "" = the run folder itself. A run continued from the older layout keeps
    #: writing into its ``tensorboard/``
    name: str = ""


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
    ``logger=[tensorboard,wandb]``; ``logger=none``: none (``run.loggers.build_loggers``)."""

    tensorboard: Optional[TensorBoardLoggerConfig] = None
    csv: Optional[CSVLoggerConfig] = None
    wandb: Optional[WandbLoggerConfig] = None
    mlflow: Optional[MLflowLoggerConfig] = None
    #: the run's name in W&B and MLflow; null = the run folder's name (in a sweep: what the sweep varies)
    run_name: Optional[str] = None
