"""``task``: the prompt source and its verifier, one schema per option (``tasks.build_task``); and ``reward``,
what scores a completion."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

from omegaconf import MISSING

from .base import Number, Problems, int_rule, is_int, is_number, rule


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
    #: multi-turn: 'module:Class' of the user's ``rollout.environments.Environment`` (docs/environments.md)
    environment: Optional[str] = None
    #: multi-turn: the user's tools, 'module:function' or 'path/to/file.py:function' (a ``ToolEnvironment``)
    tools: Optional[list[str]] = None
    #: the option's episodes are multi-turn whatever ``environment`` / ``tools`` say (calculator, guess_number)
    own_environment: ClassVar[bool] = False

    @property
    def multi_turn(self) -> bool:
        """Whether the task's rollouts are multi-turn episodes (``rollout.multiturn``)."""
        return self.own_environment or bool(self.environment) or bool(self.tools)

    def problems(self, run) -> Problems:
        """The values this task option refuses (``schema.base``: ``config.validate`` raises ConfigError for the
        first); ``run``: the whole config. The base: ``constant_reward``, and for a multi-turn task a rollout mode
        that serves episodes (``choices.RolloutMode.multi_turn``); each option adds its own fields'."""
        constant = self.constant_reward
        yield from rule(
            constant is None or is_number(constant), "task.constant_reward", constant, "must be null or a number"
        )
        yield from rule(
            not (self.environment and self.tools),
            "task.tools",
            self.tools,
            "give task.environment or task.tools, not both (an Environment lists its own tools)",
        )
        if self.multi_turn:
            from ..choices import ROLLOUT_MODES  # here, not at the top: choices imports the schema

            mode = run.rollout.mode
            serving = ROLLOUT_MODES.names_where(lambda spec: spec.multi_turn)
            yield from rule(
                mode not in ROLLOUT_MODES or ROLLOUT_MODES[mode].multi_turn,
                "rollout.mode",
                mode,
                f"task={self.name} runs multi-turn episodes, which rollout.mode={' | '.join(serving)} serves "
                f"(rollout.mode={mode} does not collect episodes in this version)",
            )


@dataclass
class CalculatorConfig(TaskConfig):
    """``task=calculator``: two-step arithmetic with the ``add`` / ``mul`` tools (``tasks.CalculatorTask``)."""

    name: str = "calculator"
    seed: int = 0
    #: digits per operand
    digits: int = 2
    num_train: int = 10000
    num_eval: int = 200
    #: reward of a turn whose tool calls are all well formed (logged per turn; 0 = off)
    format_reward: Number = 0.0
    #: the question ends with its own first step written as a tool call (a demonstration of the format)
    example_call: bool = False
    own_environment: ClassVar[bool] = True

    def problems(self, run) -> Problems:
        """Beyond the base's: ``format_reward`` is a number >= 0."""
        yield from super().problems(run)
        yield from format_reward_rule(self.format_reward)


@dataclass
class GuessNumberConfig(TaskConfig):
    """``task=guess_number``: guess an integer in [1, high] from "higher" / "lower" (``tasks.GuessNumberTask``)."""

    name: str = "guess_number"
    seed: int = 0
    high: int = 20
    num_train: int = 10000
    num_eval: int = 200
    #: reward of a wrong guess that is well formed (one integer, nothing else but whitespace and punctuation,
    #: the turn ended by its stop token: ``rollout.environments.well_formed_guess``), logged per turn; 0 = off.
    #: The right guess gets 1 however it is written
    format_reward: Number = 0.0
    own_environment: ClassVar[bool] = True

    def problems(self, run) -> Problems:
        """Beyond the base's: ``high`` >= 2, ``format_reward`` a number in [0, 1) (below the right guess's 1,
        which ``rollout.episode_reward=last`` takes as the solved episode's reward)."""
        yield from super().problems(run)
        yield from int_rule(self.high, "task.high", 2)
        yield from format_reward_rule(self.format_reward, below=1.0)


def format_reward_rule(value, below: float | None = None) -> Problems:
    """The problem unless ``task.format_reward`` is a number >= 0 (and < ``below`` when given)."""
    ok = is_number(value) and math.isfinite(value) and value >= 0 and (below is None or value < below)
    bound = f" and < {below:g} (the right guess's reward)" if below is not None else ""
    allowed = f"must be a finite number >= 0{bound}"
    yield from rule(ok, "task.format_reward", value, allowed)


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

    def problems(self, run) -> Problems:
        """Beyond the base's: ``path`` is a folder; without one, the hub dataset can be read (a local copy in
        the cache, or the hub reachable: ``hub.hub_offline_reason``, a second or two), which offline would
        otherwise end in a ConnectionError traceback after half a minute of retries."""
        yield from super().problems(run)
        if self.path:
            path = Path(self.path).expanduser()
            yield from rule(
                path.is_dir(), "task.path", self.path, "must be a folder holding train.jsonl and test.jsonl"
            )
            return
        from ..hub import hub_dataset_cached, hub_offline_reason

        offline = None if hub_dataset_cached(self.hub_id) else hub_offline_reason()
        yield from rule(offline is None, "task.path", self.path, gsm8k_offline_message(self.hub_id, offline))


def gsm8k_offline_message(hub_id: str, reason: str | None) -> str:
    """What ``task=gsm8k`` without ``task.path`` says when hub dataset ``hub_id`` cannot be read (``reason``)."""
    return (
        f"task=gsm8k without task.path reads {hub_id} from the Hugging Face hub, which is not reachable "
        f"({reason}), and the local cache has no copy of it: set task.path to a local folder holding "
        f"train.jsonl and test.jsonl (GSM8K's, or your own in its format: docs/data.md)"
    )


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
    #: the gold-answer column; null = none, for reward functions that need no answer (the task's verifier, math and
    #: exact compare with it: refused with null, ``tasks.reward_checks.check_answer_needed``)
    answer_field: Optional[str] = "answer"
    system_prompt: Optional[str] = None
    #: a str.format template over the row's columns for text prompts, e.g. "{question} Answer after ####."
    prompt_template: Optional[str] = None
    #: the first rows of each split only; null = all
    max_examples: Optional[int] = None
    #: a prompt longer than the context leaves for max_new_tokens: drop (counted) | error
    overlong_prompts: str = "drop"
    #: a row whose prompt holds no text (null, empty or white space): drop (counted, said at start-up) | error
    empty_prompts: str = "drop"

    def problems(self, run) -> Problems:
        """Beyond the base's: what can be checked without reading the data: a local path or data file exists, the
        options lie in range, and an evaluation has a split to read (``run.eval.num_examples``). The data's own
        problems (splits, columns, rows) are reported when the task loads, still before the model
        (``tasks.DatasetTask``)."""
        yield from super().problems(run)
        from ..tasks.dataset import EMPTY_PROMPTS, FORMATS, OVERLONG_PROMPTS, looks_local

        yield from rule(
            bool(self.path) or bool(self.data_files),
            "task.path",
            self.path,
            "task=dataset needs task.path (a data file, a saved-dataset folder or a hub id) or task.data_files",
        )
        if self.path and looks_local(str(self.path)):
            yield from rule(
                Path(str(self.path)).expanduser().exists(),
                "task.path",
                self.path,
                f"no such file or folder (a data file {'/'.join(FORMATS)}, a folder, or a hub id org/name)",
            )
        fraction = self.eval_fraction
        yield from rule(is_number(fraction) and 0 <= fraction < 1, "task.eval_fraction", fraction, "must lie in [0, 1)")
        yield from rule(
            self.max_examples is None or (is_int(self.max_examples) and self.max_examples >= 1),
            "task.max_examples",
            self.max_examples,
            "must be null or an integer >= 1",
        )
        yield from rule(
            self.overlong_prompts in OVERLONG_PROMPTS,
            "task.overlong_prompts",
            self.overlong_prompts,
            f"choose one of {list(OVERLONG_PROMPTS)}",
        )
        yield from rule(
            self.empty_prompts in EMPTY_PROMPTS,
            "task.empty_prompts",
            self.empty_prompts,
            f"choose one of {list(EMPTY_PROMPTS)}",
        )
        yield from rule(
            self.eval_split is not None or fraction > 0 or run.eval.num_examples == 0,
            "eval.num_examples",
            run.eval.num_examples,
            "task=dataset has no evaluation split: set task.eval_split, or task.eval_fraction (a held-out share), "
            "or eval.num_examples=0",
        )


@dataclass
class RewardConfig:
    """``reward``: what scores a completion (``tasks.reward_functions``; docs/data.md)."""

    #: null: the task's own verifier; or a list of built-ins (math, exact, format, length_penalty),
    #: 'module:function' or 'path/to/file.py:function'
    functions: Optional[list[str]] = None
    #: one weight per function; null = all 1. The reward is the weighted sum (a None counts 0)
    weights: Optional[list[Number]] = None
    #: the function whose verdict is "correct" (eval/accuracy, pass@k, groups_all_correct); null = the task's
    #: verifier (task=dataset: math or exact when listed, else the first function, said at start-up)
    correct_from: Optional[str] = None
    #: verifier processes (persistent, one thread each); a call past reward_timeout_s kills and replaces one
    num_workers: int = 2
    #: stop the run after this many RL steps in a row in which every call of one function failed (raised, returned
    #: a NaN or a non-number, timed out, killed its worker), naming it and its first error; 0 = never
    max_failed_steps: int = 3
