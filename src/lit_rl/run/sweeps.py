"""Multiruns that say what happened to every job: configs checked before the first job starts, failures
counted instead of ending the sweep, and a summary with a non-zero exit code when a job failed.

``SweepReport`` is a Hydra callback (``hydra.callbacks`` in ``conf/train.yaml``):

* ``on_multirun_start``: expands the sweep the way Hydra's basic sweeper does (command-line sweeps and an
  experiment's ``hydra.sweeper.params``), composes every job's config and runs ``config.validate`` on each.
  If any is invalid, no job starts: every bad job is listed with its message and the process exits with 2.
* ``on_job_end``: records each job's outcome. ``recipes/train.py`` catches a job's error in a multirun (prints
  it, returns ``{"failed": message}``) so the sweep goes on with the next job.
* ``on_multirun_end``: prints one line per failed job and exits with 1 when any failed.

Without it a config error in job 1 of ``-m advantage.alpha=7,0.5,1`` stopped the whole sweep there and the
jobs never run were not mentioned.
"""

from __future__ import annotations

import sys
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

FAILED = "failed"


def sweep_jobs(config: DictConfig) -> list[list[str]]:
    """The override list of every job of the multirun ``config`` (its ``hydra`` node), in launch order, as
    Hydra's ``BasicSweeper`` builds them: the sweeper's ``params`` first, then the command line's overrides."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
    overrides = OverridesParser.create().parse_overrides(params + list(config.hydra.overrides.task))
    return [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]


def check_jobs(config_name: str, jobs: list[list[str]]) -> list[tuple[int, list[str], str]]:
    """(job number, overrides, message) of every job whose composed config fails ``config.validate`` (or does
    not compose); [] when all are valid. Needs Hydra's global state (inside a running app)."""
    from hydra import compose

    from ..config import validate

    bad = []
    for number, overrides in enumerate(jobs):
        try:
            validate(compose(config_name=config_name, overrides=overrides))
        except Exception as err:  # noqa: BLE001 - a config error or a composition error: both the user's
            bad.append((number, overrides, str(err).splitlines()[0]))
    return bad


def swept(config: DictConfig) -> list[str]:
    """The keys the multirun ``config`` sweeps, in the command line's order (a key's last occurrence):
    command-line sweeps, then the sweeper's ``params``."""
    from .runfolder import swept_keys

    task = list(config.hydra.overrides.task)
    keys = swept_keys(task)
    last = {k: i for i, k in enumerate(o.split("=", 1)[0].lstrip("+~") for o in task)}  # a key given twice:
    ordered = sorted((k for k in keys if k in last), key=last.__getitem__)  # where its sweep (the last) stands
    ordered += [k for k in keys if k not in ordered] + list((config.hydra.sweeper.get("params") or {}).keys())
    return list(dict.fromkeys(ordered))


def job_label(overrides, keys: list[str] | set[str] | None = None) -> str:
    """A job's name from its overrides: those of the swept ``keys`` (all when None), e.g. ``advantage.alpha=7``,
    in the order of ``keys`` when it is a list (the command line's order; Hydra's job overrides need not keep it)."""
    items = [str(o) for o in overrides]
    if keys:
        key_of = {o: o.split("=", 1)[0].lstrip("+~") for o in items}
        items = [o for o in items if key_of[o] in keys]
        if isinstance(keys, list):
            items.sort(key=lambda o: keys.index(key_of[o]))
    return ",".join(items) or "(no overrides)"


class SweepReport(Callback):
    """Validates every job of a multirun before the first starts; reports failed jobs at the end (exit 1)."""

    def __init__(self) -> None:
        self.results: list[tuple[str, str | None]] = []  # (job name, failure message or None)
        self.keys: list[str] | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        config_name = kwargs.get("config_name") or config.hydra.job.config_name
        self.keys = swept(config)
        jobs = sweep_jobs(config)
        bad = check_jobs(config_name, jobs)
        if bad:
            print(
                f"lit_rl: error: {len(bad)} of the sweep's {len(jobs)} jobs have invalid configs; no job was started:",
                file=sys.stderr,
            )
            for number, overrides, message in bad:
                print(f"  #{number} {job_label(overrides, self.keys)}: {message}", file=sys.stderr)
            sys.exit(2)
        self.results.clear()

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        overrides = job_label(job_return.overrides or [], self.keys)
        if job_return.status == JobStatus.FAILED:
            self.results.append((overrides, f"{type(job_return._return_value).__name__}: {job_return._return_value}"))
        else:
            value = job_return._return_value
            failed = value.get(FAILED) if isinstance(value, dict) else None
            self.results.append((overrides, failed))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        failed = [(o, m) for o, m in self.results if m]
        if not failed:
            return
        print(f"lit_rl: {len(failed)} of {len(self.results)} jobs failed:", file=sys.stderr)
        for overrides, message in failed:
            print(f"  {overrides}: {message}", file=sys.stderr)
        sys.exit(1)
