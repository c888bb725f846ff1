"""Prompt sources with verifiable rewards.

``build_task("arithmetic", digits=2)`` or ``build_task({"name": "gsm8k", "path": ...})`` makes a
``Task``; ``task.messages(ex)`` gives chat messages and ``task.reward(completion, ex)`` gives 1.0
or 0.0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lit_rl.registry import Registry
from lit_rl.tasks.arithmetic import ArithmeticTask
from lit_rl.tasks.base import ConstantReward, Example, Task
from lit_rl.tasks.dataset import DatasetTask
from lit_rl.tasks.gsm8k import Gsm8kTask
from lit_rl.tasks.multiturn import CalculatorTask, GuessNumberTask
from lit_rl.tasks.rewards import ANSWER_MODES, answers_match, extract_answer, math_reward

__all__ = [
    "ANSWER_MODES",
    "ArithmeticTask",
    "CalculatorTask",
    "GuessNumberTask",
    "ConstantReward",
    "DatasetTask",
    "Example",
    "Gsm8kTask",
    "TASKS",
    "Task",
    "answers_match",
    "build_task",
    "extract_answer",
    "math_reward",
]

#: ``task.name`` -> Task class: the one list of tasks (each has its ``conf/task/<name>.yaml``)
TASKS: Registry[type[Task]] = Registry(
    "task",
    {
        "arithmetic": ArithmeticTask,
        "gsm8k": Gsm8kTask,
        "dataset": DatasetTask,
        "calculator": CalculatorTask,
        "guess_number": GuessNumberTask,
    },
)


def build_task(name: str | Mapping[str, Any], **kwargs: Any) -> Task:
    """Build a task by name.

    Args:
        name: ``"arithmetic"``, ``"gsm8k"`` or ``"dataset"``; or a mapping (a dict or an OmegaConf
            ``DictConfig``) with a ``name`` key and the constructor arguments as other keys; a
            ``constant_reward`` key that is not None wraps the task in ``ConstantReward``; ``environment``
            (``module:Class``) and ``tools`` (``module:function`` list) keys make it multi-turn: kept on the task
            as ``env_spec`` / ``tool_specs`` for ``rollout.environments.task_environment``.
        **kwargs: constructor arguments; they override keys of the mapping.

    Returns:
        The task instance.

    Raises:
        ValueError: unknown task name (the message lists the choices) or a mapping without
            ``name``.
        TypeError: an argument the task's constructor does not take.
    """
    constant = kwargs.pop("constant_reward", None)
    env_spec, tool_specs = kwargs.pop("environment", None), kwargs.pop("tools", None)
    if isinstance(name, Mapping):
        cfg = dict(name)
        constant = cfg.pop("constant_reward", constant)
        env_spec, tool_specs = cfg.pop("environment", env_spec), cfg.pop("tools", tool_specs)
        if "name" not in cfg:
            raise ValueError(f"task config needs a 'name' key, one of {sorted(TASKS)}; got keys {sorted(cfg)}")
        name = cfg.pop("name")
        kwargs = {**cfg, **kwargs}
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choices: {sorted(TASKS)}")
    task = TASKS[name](**kwargs)
    task.env_spec, task.tool_specs = env_spec, list(tool_specs) if tool_specs else None
    return task if constant is None else ConstantReward(task, float(constant))
