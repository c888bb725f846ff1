"""Finding runs and reading their TensorBoard scalars: the folders that hold event files, and each run's
{tag: [(step, value)]}."""

from __future__ import annotations

import errno
import fcntl
import os

EVENT_FILE_PREFIX = "events.out.tfevents"
TB_SUBDIR = "tensorboard"
# What a run folder records at its end (written after the final checkpoint and the policy), and the lock file a
# live run holds while it writes the folder (lit_rl.run.runfolder).
FINISHED_MARKER = "finished.json"
LOCK_NAME = ".lit_rl.lock"


class CompareError(Exception):
    """A user's mistake (missing folder, no runs, unknown tag): reported as one line, exit code 2."""


def _has_event_files(folder: str) -> bool:
    try:
        return any(f.startswith(EVENT_FILE_PREFIX) for f in os.listdir(folder))
    except OSError:
        return False


def _event_dirs(run_dir: str) -> list[str]:
    """The folders of one run that hold event files: the run folder itself and its ``tensorboard/``."""
    return [d for d in (run_dir, os.path.join(run_dir, TB_SUBDIR)) if _has_event_files(d)]


def _runs_under(folder: str) -> dict[str, str]:
    """{name relative to ``folder``: run folder} for every run under ``folder`` (walked in sorted order)."""
    runs: dict[str, str] = {}
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        if not any(f.startswith(EVENT_FILE_PREFIX) for f in files):
            continue
        run_dir = os.path.dirname(root) if os.path.basename(os.path.normpath(root)) == TB_SUBDIR else root
        run_dir = os.path.normpath(run_dir)
        name = os.path.relpath(run_dir, folder).replace(os.sep, "/")
        if name == "." or name.startswith(".."):  # the folder given is the run (or its tensorboard/)
            name = os.path.basename(os.path.abspath(run_dir))
        runs.setdefault(name, run_dir)
    return runs


def find_runs(folders: list[str]) -> dict[str, str]:
    """Every run under ``folders``: {run name: run folder}.

    A run is a folder holding TensorBoard event files, directly or in a ``tensorboard/`` subfolder; its name
    is its path relative to the folder given (``algo=dapo,seed=1``; the folder's own name when the folder
    given is a single run). When two folders hold runs of the same name, every name is prefixed with its
    folder's name (``10-00-00/algo=dapo,seed=1``), or with the folder's path as given when those clash too.
    Raises CompareError for a folder that does not exist or holds no event files.
    """
    per_folder: list[tuple[str, dict[str, str]]] = []
    seen: set[str] = set()
    for folder in folders:
        if not os.path.isdir(folder):
            raise CompareError(f"no such folder: {folder}")
        real = os.path.realpath(folder)
        if real in seen:  # the same folder named twice
            continue
        seen.add(real)
        runs = _runs_under(folder)
        if not runs:
            raise CompareError(f"no TensorBoard event files under {folder}")
        per_folder.append((folder, runs))

    names = [n for _, runs in per_folder for n in runs]
    if len(names) == len(set(names)):
        return {n: d for _, runs in per_folder for n, d in runs.items()}
    labels = [os.path.basename(os.path.abspath(f)) for f, _ in per_folder]
    if len(labels) != len(set(labels)):
        labels = [os.path.normpath(f).replace(os.sep, "/") for f, _ in per_folder]
    return {f"{label}/{n}": d for label, (_, runs) in zip(labels, per_folder) for n, d in runs.items()}


def read_scalars(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...] sorted by step} of one run, read with TensorBoard's EventAccumulator.

    Reads the event files in ``run_dir`` and in ``run_dir/tensorboard``: classic scalar summaries
    (``SummaryWriter.add_scalar``, Lightning's TensorBoardLogger) and tensor summaries of the scalars plugin
    (``tensorboard.summary.Writer``). When a step was logged more than once (a resumed run logs again from
    its checkpoint) the last value written wins.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    merged: dict[str, dict[int, float]] = {}
    for folder in _event_dirs(os.fspath(run_dir)):
        acc = EventAccumulator(folder, size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        tags = acc.Tags()
        for tag in tags.get("scalars", []):
            series = merged.setdefault(tag, {})
            for ev in acc.Scalars(tag):
                series[int(ev.step)] = float(ev.value)
        for tag in tags.get("tensors", []):
            if acc.SummaryMetadata(tag).plugin_data.plugin_name != "scalars":
                continue
            series = merged.setdefault(tag, {})
            for ev in acc.Tensors(tag):
                arr = tensor_util.make_ndarray(ev.tensor_proto)
                if arr.size == 1:
                    series[int(ev.step)] = float(arr.reshape(()))
    return {tag: sorted(series.items()) for tag, series in merged.items() if series}


def run_state(run_dir: str) -> str:
    """``"finished"`` when the run folder holds ``finished.json`` (the training run writes it last, after the
    final checkpoint and policy); else ``"still being written (a live process holds it)"`` while a process holds
    the folder's ``.lit_rl.lock`` (a run holds an exclusive ``flock`` on it from start-up to its end, and the
    kernel drops it when the process dies), else ``"stopped early (continue it with --resume <run>)"``."""
    if os.path.exists(os.path.join(run_dir, FINISHED_MARKER)):
        return "finished"
    stopped = f"stopped early (continue it with --resume {run_dir})"
    try:
        fd = os.open(os.path.join(run_dir, LOCK_NAME), os.O_RDONLY)
    except OSError:  # no lock file: no live run
        return stopped
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return "still being written (a live process holds it)"
    finally:
        os.close(fd)  # closing the descriptor drops the shared lock just taken
    return stopped
