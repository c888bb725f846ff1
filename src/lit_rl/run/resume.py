"""Continuing a run, and the runs a folder already holds: which checkpoint ``ckpt_path`` names
(``resolve_ckpt_path``), the continued run's config (``resumed_config``: its saved config.yaml plus the fields a
continuation may change), whether a folder may take a run (``check_run_folder``), whether a checkpoint fits the
module (``check_checkpoint_fits``) and the final checkpoint a finished run can be continued from
(``save_final_checkpoint``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf, open_dict

from ..algorithms.module import upgraded_state_dict
from ..config import ConfigError
from .checkpoints import find_last
from .preemption import slurm_requeued

FINISHED_MARKER = "finished.json"


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
    "reward.max_failed_steps",
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
        events = sorted(out.glob("events.out.tfevents*")) + sorted((out / "tensorboard").glob("events.*"))
        started = sorted((out / "checkpoints").glob("*.ckpt")) + events  # events: in the run folder, or older runs'
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


def finished_rl_step(marker: Path, updates_per_rl_step: int) -> int | None:
    """The RL step a finished run stopped at, from its ``finished.json`` (``global_step`` counts optimizer
    steps: ``updates_per_rl_step`` per RL step); None when the file cannot be read."""
    try:
        return int(json.loads(marker.read_text())["global_step"]) // max(1, updates_per_rl_step)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_checkpoint_fits(ckpt_path: str, module: L.LightningModule) -> None:
    """ConfigError when the checkpoint's weights do not fit ``module`` (another algorithm, value model or
    model), naming what it was written with; read memory-mapped, before any state is touched."""
    saved = torch.load(ckpt_path, map_location="cpu", mmap=True, weights_only=False)
    expected = module.state_dict()
    got = upgraded_state_dict(saved.get("state_dict", {}))  # keys as they are loaded (PPO's before the split)
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
    steps = trainer.global_step // max(1, getattr(checkpoints, "updates_per_step", 1))  # RL steps done
    match = re.search(r"step=(\d+)", os.path.basename(previous or ""))
    if match and int(match.group(1)) == steps:
        return
    folder = Path(checkpoints.dirpath)
    final = folder / f"step={steps}.ckpt"
    trainer.save_checkpoint(final)
    if trainer.is_global_zero:
        link = folder / "last.ckpt"
        tmp = folder / f"last.ckpt.partial-{os.getpid()}"
        os.symlink(final.name, tmp)
        os.replace(tmp, link)
        if previous and Path(previous).is_file() and Path(previous) != final:
            Path(previous).unlink()
    trainer.strategy.barrier()
