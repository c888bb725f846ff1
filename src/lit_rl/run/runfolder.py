"""One run per folder: a run claims its folder at start-up, atomically, and holds the claim while it lives.

Two runs started in the same second used to resolve the same default ``hydra.run.dir`` (one-second
resolution), both passed the start-up checks before either had written anything, and then shared config.yaml,
event files and checkpoints. Two things prevent that now:

- the default folder name carries the process id (``outputs/<date>/<HH-MM-SS>-<pid>``, ``run_tag``): two
  processes alive on one machine never have the same pid, so runs started together take their own folders;
- ``claim_run_folder`` takes an exclusive ``flock`` on ``<run>/.lit_rl.lock`` before the start-up checks read
  the folder, and holds it until the run ends. A second process that claims the same folder (the same
  ``hydra.run.dir`` given twice, or two machines writing one shared file system) is refused with a one-line
  ``ConfigError`` naming the folder and the live run's pid and host. The kernel drops the lock when its process
  dies (any way, ``kill -9`` included), so a dead run's claim never blocks: its folder is then judged by the
  usual rules (a new run is refused a folder that holds a run's checkpoints or events; ``--resume`` takes it
  over).

Only the process that writes the run's files claims it: global rank 0 (``lightning_rank``). The other ranks of
a ``trainer=ddp`` run share rank 0's folder by design.

The folders' names come from the resolvers ``conf/train.yaml`` uses (``register_resolvers``: ``run_dir``,
``run_name``, ``run_tag``, ``hydra_subdir``); like everything here they import no torch, so ``recipes/train.py``
registers them before anything heavy loads.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from ..config import ConfigError

LOCK_NAME = ".lit_rl.lock"


def run_tag() -> str:
    """The suffix of a default run folder's name: this process's id (``hydra.run.dir`` and
    ``hydra.sweep.dir`` resolve once per process, so the tag is the same everywhere in it)."""
    return str(os.getpid())


def swept_keys(args) -> set[str]:
    """Keys that the override strings ``args`` sweep, as Hydra's own override parser reads them: choices
    (``algo=grpo,dapo``, ``optim.betas=[0.9,0.99],[0.8,0.9]``), ``range(...)``, ``glob(...)``. Flags and
    strings Hydra cannot parse are skipped."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    keys = set()
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            (override,) = parser.parse_overrides([arg])
        except Exception:  # noqa: BLE001 - not ours to judge: Hydra reports bad overrides itself
            continue
        if override.is_sweep_override():
            keys.add(override.key_or_group.lstrip("+~"))
    return keys


def run_name(task_overrides, sweeper_params=None, argv=None) -> str:
    """Name of a multirun job's folder from the overrides the sweep varies, e.g. ``algo=dapo,seed=1``
    (``job_folder_name``: one level, "/" in a value written ``%2F``).

    A key is swept when the command line sweeps it (``swept_keys``) or an experiment preset lists it under
    ``hydra.sweeper.params``; fixed overrides stay out of the name (they are in each run's config.yaml),
    which keeps folder and TensorBoard run names short and telling. Falls back to ``run`` when nothing is
    swept.
    """
    swept = set(dict(sweeper_params or {}).keys())
    swept |= swept_keys(sys.argv[1:] if argv is None else argv)
    parts = [o for o in task_overrides if o.split("=", 1)[0].lstrip("+~") in swept]
    return job_folder_name(parts)


# a file name's limit on Linux and macOS file systems is 255 bytes; longer names are cut and made unique by a hash
NAME_MAX = 255


def job_folder_name(items) -> str:
    """One path component naming a job from its swept ``key=value`` items, joined by ",": ``algo=dapo,seed=1``.

    A value with "/" (a data path ``task.path=data/a.jsonl``, a model id ``org/name``) used to make the job's
    folder two levels deep, and ``..`` in it (``docs/examples/../examples/x.jsonl``) landed two jobs in one
    folder. "%" and "/" are percent-encoded (``%25``, ``%2F``: plain ASCII, no shell quoting, and
    ``urllib.parse.unquote`` gives the items back), so the name is one level and two different item lists
    never give the same name; values are kept as written, not normalised. A name longer than ``NAME_MAX``
    bytes is cut and ends in ``~`` and 10 hex digits of its SHA-1, unique still. ``run`` when nothing is swept.
    """
    name = ",".join(items).replace("%", "%25").replace("/", "%2F") or "run"
    if len(name.encode()) <= NAME_MAX:
        return name
    import hashlib

    digest = hashlib.sha1(name.encode()).hexdigest()[:10]
    head = name.encode()[: NAME_MAX - len(digest) - 1].decode(errors="ignore")
    return f"{head}~{digest}"


def run_dir(resume, default: str) -> str:
    """``hydra.run.dir``: the folder of ``resume=<folder>`` (the run continues where it is), else ``default``."""
    return str(resume) if resume not in (None, "", "null") else default


def hydra_subdir(resume, ckpt_path) -> str:
    """``hydra.output_subdir``: ``.hydra`` for a new run; ``.hydra/resume-<time>`` when a run is continued, so
    the record of the command that started it (``.hydra/overrides.yaml``) is kept, not overwritten."""
    if resume in (None, "", "null") and ckpt_path in (None, "", "null"):
        return ".hydra"
    return f".hydra/resume-{time.strftime('%Y%m%d-%H%M%S')}"


def register_resolvers() -> None:
    """Register ``lit_rl_run_name`` (``hydra.sweep.subdir``), ``lit_rl_run_dir`` (``hydra.run.dir``),
    ``lit_rl_run_tag`` (the per-process suffix of default run and sweep folders, ``runfolder.run_tag``) and
    ``lit_rl_hydra_subdir`` (``hydra.output_subdir``) once."""
    for name, fn in (
        ("lit_rl_run_name", run_name),
        ("lit_rl_run_dir", run_dir),
        ("lit_rl_run_tag", run_tag),
        ("lit_rl_hydra_subdir", hydra_subdir),
    ):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


def lightning_rank() -> int:
    """The global rank this process was launched as, from the variables launchers set (torchrun's ``RANK``,
    Lightning's ``LOCAL_RANK`` for the ranks it starts, SLURM's ``SLURM_PROCID``), in Lightning's order
    (``rank_zero_only.rank``); 0 for a plain process."""
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if os.environ.get(key, "").strip().isdigit():
            return int(os.environ[key])
    return 0


class RunFolderClaim:
    """An exclusive claim on a run folder, held from ``claim_run_folder`` until ``release`` (or the process's end).

    ``previous``: what the lock file said before this claim (``{"pid", "host", "started"}`` of the run that
    last claimed the folder, which is no longer alive), or None for a folder never claimed."""

    def __init__(self, path: Path, fd: int | None, previous: dict | None):
        self.path, self.fd, self.previous = path, fd, previous

    def release(self) -> None:
        """Drop the lock (idempotent); the file stays, naming the last run that claimed the folder."""
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor releases the flock
            self.fd = None


def _read(fd: int) -> dict | None:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 4096)
    try:
        return json.loads(raw) if raw.strip() else None
    except ValueError:
        return None


def _read_holder(fd: int, wait_s: float = 2.0) -> dict | None:
    """The live holder's record. A run that has just taken the lock writes its record a moment later, so a
    claim refused in that window waits up to ``wait_s`` for a record that names a process (not an old one
    left by a dead run: that one carries a pid that is no longer alive, and is returned when nothing newer
    comes)."""
    deadline = time.monotonic() + wait_s
    info = _read(fd)
    while time.monotonic() < deadline:
        if info and (_alive_here(info) or info.get("host") != socket.gethostname() or info.get("pid") == os.getpid()):
            return info
        time.sleep(0.02)
        info = _read(fd)
    return info


def _holder(info: dict | None) -> str:
    if not info:
        return "another process"
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, started {info.get('started', '?')}"


def claim_run_folder(out: str | os.PathLike, resume: bool = False) -> RunFolderClaim:
    """Claim the run folder ``out`` (created if missing) for this process, atomically.

    Raises ConfigError when a live process holds it (its pid, host and start time named): a new run should
    take another folder (``hydra.run.dir=...``); a continued one (``resume``) waits until that run has stopped.
    On a file system without ``flock`` (some network mounts) the claim falls back to the pid and host written
    in the lock file: refused while that pid is alive on this host."""
    out = Path(out)
    path = out / LOCK_NAME
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise ConfigError(
            f"output folder {out} cannot be written ({err.strerror or err}); the run would fail at its first "
            f"checkpoint or at the end: choose another folder (hydra.run.dir=...) or make it writable"
        ) from err
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        locked = err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
        info = _read_holder(fd) if locked else _read(fd)
        if locked or _alive_here(info):
            os.close(fd)
            what = (
                "wait until it has stopped, then continue it"
                if resume
                else "choose another folder (hydra.run.dir=...), or leave the default, which is unique per process"
            )
            raise ConfigError(
                f"output folder {out} is in use by a running lit_rl run ({_holder(info)}): {what}"
            ) from err
        # no flock on this file system (ENOLCK, EOPNOTSUPP) and no live holder here: the pid record is the claim
    previous = _read(fd)
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    data = json.dumps(record).encode()
    os.pwrite(fd, data, 0)  # written over the old record, then cut to length: the file is never empty
    os.ftruncate(fd, len(data))
    os.fsync(fd)
    return RunFolderClaim(path, fd, previous)


def _alive_here(info: dict | None) -> bool:
    """True when ``info`` names a process alive on this host other than this one."""
    if not info or info.get("host") != socket.gethostname() or info.get("pid") == os.getpid():
        return False
    try:
        os.kill(int(info["pid"]), 0)
    except (OSError, ValueError, TypeError):
        return False
    return True


# what a run folder holds when start-up was refused before the run wrote anything: Hydra's record of the
# composed config, its (empty or start-up-only) log file, and the claim's lock file
_REFUSED_START_ENTRIES = frozenset({".hydra", "train.log", LOCK_NAME})


def discard_refused_run_folder(out: str | os.PathLike) -> bool:
    """Remove the run folder ``out`` of a run refused at start-up, when it holds nothing a run wrote.

    Hydra creates the folder (``.hydra/``, ``train.log``) before lit_rl's checks run, so every refused start
    used to leave an empty-looking run folder behind, which ``compare.py`` and TensorBoard then list. The folder
    is removed only when its entries are a subset of ``.hydra``, ``train.log`` and the lock file (no config.yaml,
    events, checkpoints or anything a user put there) and no live process holds its claim (a run that has just
    started has the same few entries: it keeps them). Returns True when the folder was removed. Never raises."""
    import shutil

    out = Path(out)
    try:
        if not out.is_dir() or not set(os.listdir(out)) <= _REFUSED_START_ENTRIES:
            return False
        fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a live run holds it: not ours to remove
            if not set(os.listdir(out)) <= _REFUSED_START_ENTRIES:
                return False
            shutil.rmtree(out)
        finally:
            os.close(fd)
    except OSError:
        return False
    return True


def check_output_folders(out: Path) -> None:
    """ConfigError unless the run folder can be written, and with it the ``checkpoints/``, ``tensorboard/`` (an
    older run's event files) and ``policy/`` folders the run writes into later: each that exists already must be a
    writable folder.
    A probe file is written, flushed and removed in each, so a read-only mount, a missing permission or a
    file in a folder's place fails here, before the model loads, and not at the first checkpoint."""
    for folder in (out, out / "checkpoints", out / "tensorboard", out / "policy"):
        if folder != out and not os.path.lexists(folder):
            continue  # created later inside ``out``, which is checked
        probe = folder / f".lit_rl-write-probe-{os.getpid()}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with open(probe, "wb") as f:
                f.write(b"lit_rl")
                f.flush()
                os.fsync(f.fileno())
            probe.unlink()
        except OSError as err:
            raise ConfigError(
                f"output folder {folder} cannot be written ({err.strerror or err}); the run would "
                f"fail at its first checkpoint or at the end: choose another folder "
                f"(hydra.run.dir=...) or make it writable"
            ) from err
