"""The start-up checks of the reward (``config.validate`` runs them): a run whose reward can never be earned, and
the ``reward`` section, whose functions are loaded here (the user's reward files and modules, their imports with
them), so a bad name, file or module fails before any model loads, naming it. Torch-free, as ``config`` is."""

from __future__ import annotations

from omegaconf import DictConfig

from ..config import ConfigError, _check, _check_int
from ..schema.base import is_number

#: the built-in reward functions that compare a completion with the gold answer (``tasks.reward_functions``)
ANSWER_FUNCTIONS = ("math", "exact")


def check_answer_needed(cfg: DictConfig) -> None:
    """``task=dataset`` with ``task.answer_field`` null has no gold answer: refuse a reward that compares with
    one, since it can never reward a completion. The task's verifier (``reward.functions`` null) scores every
    completion 0, and ``math`` / ``exact`` (``ANSWER_FUNCTIONS``) score None (not applicable) on every one, which
    also leaves ``eval/accuracy`` at 0 when one of them decides correctness. A ``task.constant_reward`` run
    rewards the constant, as it means to: accepted."""
    task = cfg.task
    if task.name != "dataset" or task.get("answer_field", "answer") is not None:
        return
    if task.get("constant_reward") is not None:
        return
    functions = cfg.reward.functions
    fix = (
        "give the rows' gold-answer column (task.answer_field=<column>), or reward.functions that need no answer "
        "(format, length_penalty, or your own 'module:function' / 'path/to/file.py:function')"
    )
    if functions is None:
        raise ConfigError(
            "task.answer_field=null: the rows have no gold answer, and with reward.functions null the task's "
            f"verifier compares each completion with it, so every reward would be 0 and the run learns nothing: {fix}"
        )
    listed = [str(f) for f in functions if str(f) in ANSWER_FUNCTIONS]
    if listed:
        raise ConfigError(
            f"task.answer_field=null: the rows have no gold answer, and reward.functions lists {listed[0]!r}, "
            f"which compares each completion with it, so it would score None (not applicable) on every one: "
            f"{fix}; or drop {listed[0]!r}"
        )


def check_reward(cfg: DictConfig) -> None:
    """The ``reward`` section: the functions load (a bad name, file or module fails here, naming it), one
    weight per function, ``correct_from`` one of the functions, at least one worker, ``max_failed_steps`` >= 0."""
    from omegaconf import OmegaConf

    r = OmegaConf.to_container(cfg.reward, resolve=True)
    _check_int(r["num_workers"], "reward.num_workers", 1)
    _check_int(r.get("max_failed_steps", 3), "reward.max_failed_steps", 0, " (0 = never stop)")
    if r["functions"] is None:
        _check(r["weights"] is None, "reward.weights", r["weights"], "needs reward.functions (one per function)")
        _check(
            r["correct_from"] is None,
            "reward.correct_from",
            r["correct_from"],
            "needs reward.functions (it names one of them); with reward.functions null the task's verifier decides",
        )
        return
    from .reward_functions import function_name, load_function

    functions = list(r["functions"])
    _check(len(functions) > 0, "reward.functions", functions, "list at least one, or null for the task's verifier")
    names = [function_name(str(s)) for s in functions]
    _check(len(set(names)) == len(names), "reward.functions", functions, "two functions have one name")
    for spec in functions:
        try:
            load_function(str(spec))
        except Exception as err:  # noqa: BLE001 - the user's file or module: its error, on one line
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(
                first if first.startswith("reward.functions") else f"reward.functions: {spec!r}: {first}"
            ) from err
    if r["weights"] is not None:
        weights = list(r["weights"])
        _check(
            len(weights) == len(functions) and all(is_number(w) for w in weights),
            "reward.weights",
            weights,
            f"give one number per function ({len(functions)}), or null for all 1",
        )
    correct_from = r["correct_from"]
    _check(
        correct_from is None or correct_from in names or correct_from in functions,
        "reward.correct_from",
        correct_from,
        f"choose one of reward.functions {names}, or null for the task's verifier",
    )


def check_task_code(cfg: DictConfig) -> None:
    """``task.environment`` (``module:Class``) and ``task.tools`` (``module:function`` or ``path/to/file.py:function``)
    load, so a misspelt module, file or name fails here, naming the field, before the trainer and the model are
    built (``rollout.environments.load_environment`` builds the class later and checks what it is)."""
    from .reward_functions import load_function

    task = cfg.task
    specs = [("task.environment", task.get("environment"), "class")]
    specs += [("task.tools", spec, "function") for spec in (task.get("tools") or [])]
    for field, spec, kind in specs:
        if not spec:
            continue
        try:
            load_function(str(spec), builtins=False)
        except Exception as err:  # noqa: BLE001 - the user's file or module: its error, on one line
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            first = first.removeprefix("reward.functions: ").replace(" has no function ", f" has no {kind} ")
            first = first.replace(
                "'module:function' / 'path/to/file.py:function'", f"'module:{kind}' / 'file.py:{kind}'"
            )
            raise ConfigError(f"{field}: {first}" if str(spec) in first else f"{field}: {spec!r}: {first}") from err
