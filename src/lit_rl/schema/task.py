"""``task``: the prompt source and its verifier, one schema per option (``tasks.build_task``); and ``reward``,
what scores a completion."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from .base import Number


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
class RewardConfig:
    """``reward``: what scores a completion (``tasks.reward_functions``; docs/data.md)."""

    #: null: the task's own verifier; or a list of built-ins (math, exact, format, length_penalty),
    #: 'module:function' or 'path/to/file.py:function'
    functions: Optional[list[str]] = None
    #: one weight per function; null = all 1. The reward is the weighted sum (a None counts 0)
    weights: Optional[list[Number]] = None
    #: verifier processes (persistent, one thread each); a call past reward_timeout_s kills and replaces one
    num_workers: int = 2
