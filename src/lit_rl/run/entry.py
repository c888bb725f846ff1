"""The Python entry point: ``lit_rl.train(TrainConfig(...))``, the same run as ``python recipes/train.py``.

    import lit_rl
    from lit_rl.schema import TrainConfig, ModelConfig

    def brevity(prompts, completions, **columns):          # TRL's batched convention, or
        return [-len(c) / 100 for c in completions]         # fn(prompt, completion, example) per completion

    if __name__ == "__main__":                              # the verifier workers import this file: guard the run
        cfg = lit_rl.compose("algo=dapo", "correction=sc+tis")   # or TrainConfig(...) field by field
        result = lit_rl.train(cfg, "outputs/mine", reward_functions=["math", brevity],
                              train_dataset=[{"prompt": "2+2?", "answer": "4"}, ...])
        print(result.metrics["eval/accuracy"], result.policy_dir)

What a TRL user passes as objects is taken as objects, then recorded so that the run folder still describes the
run (``config.yaml``) and ``train(resume=<folder>)`` continues it without them:

- ``reward_functions``: callables (and ``reward.functions`` names). Rewards are computed in the verifier pool's
  worker processes, which import each function by name (``tasks.verifier_pool``), so a callable is recorded as
  ``module:function``, or ``path/to/script.py:function`` when it is defined in the script that runs; lambdas,
  nested functions and other objects are refused (as ``multiprocessing``'s spawn refuses them). A worker runs
  the script's top level when it imports it: the call to ``train`` must sit under ``if __name__ == "__main__":``
  (a worker that reaches it raises instead of starting a second run).
- ``train_dataset`` / ``eval_dataset``: a ``datasets.Dataset`` or a list of row dicts (``prompt``: text or chat
  messages; ``answer``: the gold answer; other columns reach the reward functions), saved to ``<run>/data`` and
  read from there as ``task=dataset`` (its ``prompt_field`` / ``answer_field`` / template options apply).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..schema import DatasetConfig, TrainConfig, train_config
from ..tasks.verifier_pool import IN_VERIFIER_WORKER

#: not empty while ``train`` runs in this process: a second call (the user's script imported for its reward
#: functions, without its ``__main__`` guard) is refused
_active: list[bool] = []
#: the folder of the run where ``train`` saves in-memory datasets (``task.path`` points there)
DATA_FOLDER = "data"


@dataclass
class TrainResult:
    """What ``train`` returns: the run folder and the last logged metrics (reduced over ranks)."""

    out_dir: Path
    metrics: dict[str, float]

    @property
    def policy_dir(self) -> Path:
        """The trained policy (``save_pretrained`` format; with LoRA the adapter, or merged)."""
        return self.out_dir / "policy"


def conf_dir() -> Path:
    """The recipe's config folder, ``conf/`` at the root of the source tree. Raises FileNotFoundError when
    lit_rl is installed without it."""
    folder = Path(__file__).resolve().parents[3] / "conf"
    if not (folder / "train.yaml").is_file():
        raise FileNotFoundError(
            f"{folder / 'train.yaml'}: lit_rl's config folder is not there; install lit_rl from its source tree "
            f"(pip install -e .), or build the config field by field with lit_rl.schema.TrainConfig"
        )
    return folder


def compose(*overrides: str) -> TrainConfig:
    """The typed config ``python recipes/train.py <overrides>`` runs with: ``conf/train.yaml`` composed with
    Hydra's override strings (``"algo=dapo"``, ``"correction=sc+tis"``, ``"trainer.max_steps=10"``). Hydra
    refuses an unknown group option or key and a value of the wrong type (its own errors); ``train`` checks the
    rest (``config.validate``) once the datasets it is given are in place."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return train_config(hydra_compose(config_name="train", overrides=list(overrides)))


def reward_spec(fn: str | Callable) -> str:
    """How reward function ``fn`` is named in ``reward.functions`` (a string is returned as it is): ``module:name``
    for a function defined at the top level of an importable module, ``/abs/path/script.py:name`` for one defined
    in the running script. Raises ValueError naming ``fn`` for what the verifier workers cannot import by name
    (a lambda, a nested function, a method, a ``functools.partial`` or another callable object, a function of an
    interactive session)."""
    if isinstance(fn, str):
        return fn
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    why = "it is not a plain function"
    if callable(fn) and module and name and not any(c in name for c in "<>."):
        if module == "__main__":
            script = getattr(sys.modules["__main__"], "__file__", None)
            if script is not None:
                return f"{Path(script).resolve()}:{name}"
            why = "it is defined in an interactive session (no file to import it from)"
        else:
            try:
                found = getattr(importlib.import_module(module), name, None)
            except ImportError:
                found = None
            if found is fn:
                return f"{module}:{name}"
            why = f"{module}.{name} is not this object"
    raise ValueError(
        f"reward_functions: {fn!r} cannot reach the verifier workers ({why}); they import each function by name: "
        f"define it with def at the top level of a module or of the script that runs"
    )


def as_dataset(data: Any, name: str):
    """``data`` (a ``datasets.Dataset`` or a list of row dicts) as a ``datasets.Dataset``. Raises TypeError
    naming the argument for anything else, ValueError for no rows."""
    import datasets

    if isinstance(data, datasets.Dataset):
        ds = data
    elif isinstance(data, Sequence) and not isinstance(data, (str, bytes)) and all(isinstance(r, dict) for r in data):
        ds = datasets.Dataset.from_list(list(data))
    else:
        raise TypeError(f"{name}: give a datasets.Dataset or a list of row dicts, got {type(data).__name__}")
    if len(ds) == 0:
        raise ValueError(f"{name} has no rows")
    return ds


def default_out_dir() -> Path:
    """``outputs/<date>/<time>-<pid>``: the folder ``python recipes/train.py`` would choose."""
    return Path("outputs") / time.strftime("%Y-%m-%d") / f"{time.strftime('%H-%M-%S')}-{os.getpid()}"


def save_datasets(cfg: TrainConfig, out: Path, train_dataset, eval_dataset, continuing: bool) -> TrainConfig:
    """``cfg`` reading ``train_dataset`` (and ``eval_dataset``) from ``<out>/data``, where they are saved
    (``DatasetDict.save_to_disk``) unless a continued run has them there already (they are never overwritten).
    ``cfg.task`` keeps its dataset options when it is ``task=dataset``. Raises ConfigError when ``out`` holds
    another run or its data."""
    import datasets

    folder = out / DATA_FOLDER
    splits = {"train": as_dataset(train_dataset, "train_dataset")}
    if eval_dataset is not None:
        splits["test"] = as_dataset(eval_dataset, "eval_dataset")
    if folder.exists() and not continuing:
        raise ConfigError(
            f"output folder {out} already holds {DATA_FOLDER}/ (another run's data): choose another out_dir, or "
            f"continue that run with resume={str(out)!r}"
        )
    if not folder.exists():
        if (out / "config.yaml").exists() and not continuing:
            raise ConfigError(f"output folder {out} already holds a run: choose another out_dir")
        partial = out / f"{DATA_FOLDER}.partial-{os.getpid()}"
        datasets.DatasetDict(splits).save_to_disk(str(partial))
        partial.rename(folder)
    task = cfg.task if isinstance(cfg.task, DatasetConfig) else DatasetConfig(answer_format=cfg.task.answer_format)
    eval_split = "test" if eval_dataset is not None else None
    task = dataclasses.replace(task, name="dataset", path=str(folder.resolve()), data_files=None, split="train")
    return dataclasses.replace(cfg, task=dataclasses.replace(task, eval_split=eval_split))


def train(
    config: TrainConfig | None = None,
    out_dir: str | os.PathLike | None = None,
    *,
    reward_functions: Sequence[str | Callable] | None = None,
    train_dataset=None,
    eval_dataset=None,
    resume: str | os.PathLike | None = None,
) -> TrainResult:
    """Train as ``python recipes/train.py`` does, from Python (the module docstring has an example).

    Args:
        config: the run (``TrainConfig``, whose defaults are the recipe's; ``compose(...)`` gives the recipe's
            with overrides; a ``DictConfig`` is typed). None: the recipe's defaults (``compose()``), or with
            ``resume`` the continued run's saved config.
        out_dir: the run folder; None: ``outputs/<date>/<time>-<pid>``, as the recipe. Ignored with ``resume``.
        reward_functions: replaces ``reward.functions``: callables (``reward_spec``) and names of built-ins or
            ``module:function``; ``reward.weights`` gives one weight per entry (null: all 1).
        train_dataset, eval_dataset: the prompts (``as_dataset``), saved to ``<run>/data`` and trained on as
            ``task=dataset``; ``eval_dataset`` None: no evaluation split unless ``task.eval_fraction`` holds some
            rows out.
        resume: a run folder to continue (its config.yaml, its last checkpoint); ``config`` then differs from the
            saved one only where a continued run allows it (``trainer.max_steps``...: ``resume.SAFE_ON_RESUME``).

    Returns:
        ``TrainResult``: the run folder and the last logged metrics.

    Raises:
        ConfigError: a bad config (named field), an out_dir that holds another run; ValueError / TypeError: a
        reward function or dataset that cannot be used (named); RuntimeError: called while a run is starting in
        this process or in a verifier worker (a script imported for its reward functions, without its
        ``if __name__ == "__main__":`` guard); the run's own errors (``run.train.run``).
    """
    if os.environ.get(IN_VERIFIER_WORKER) or _active:
        raise RuntimeError(
            "lit_rl.train() was called while the script was imported for its reward functions (by the config "
            'check or a verifier worker): put the call under `if __name__ == "__main__":` so that importing the '
            "script does not start a run"
        )
    _active.append(True)
    try:
        return _train(config, out_dir, reward_functions, train_dataset, eval_dataset, resume)
    finally:
        _active.clear()


def _train(config, out_dir, reward_functions, train_dataset, eval_dataset, resume) -> TrainResult:
    from omegaconf import OmegaConf

    from .train import run

    out = Path(resume if resume is not None else (out_dir or default_out_dir())).expanduser()
    if config is None and resume is not None and (out / "config.yaml").is_file():
        config = OmegaConf.load(out / "config.yaml")
    cfg = train_config(copy.deepcopy(config) if config is not None else compose())  # the caller's stays as is
    if reward_functions is not None:
        cfg.reward.functions = [reward_spec(fn) for fn in reward_functions]
    if train_dataset is not None:
        out.mkdir(parents=True, exist_ok=True)
        cfg = save_datasets(cfg, out, train_dataset, eval_dataset, continuing=resume is not None)
    elif eval_dataset is not None:
        raise ValueError("eval_dataset needs train_dataset (the task reads both from the run folder)")
    cfg.resume = None if resume is None else str(out)
    metrics = run(OmegaConf.structured(cfg), out)
    return TrainResult(out, metrics)
