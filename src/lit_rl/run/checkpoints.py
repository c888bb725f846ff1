"""Checkpoints that survive a kill: atomic writes and a ``last`` that always names a complete file.

Lightning's default writer stages a checkpoint in the system temp folder and moves it into place; where that
folder is on another file system the move is a copy, and a kill during it leaves a truncated ``.ckpt`` under
the final name. ``AtomicCheckpointIO`` writes beside the target, fsyncs, and renames (atomic on POSIX), so a
checkpoint path holds either the previous complete file or the new complete file, never a part.

``ModelCheckpoint`` (``save_top_k=1``, ``save_last="link"``) removes the previous step file before it points
``last.ckpt`` at the new one; a kill between the two leaves ``last.ckpt`` dangling. ``find_last`` then falls
back to the newest complete checkpoint in the folder.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

TMP_SUFFIX = ".partial"


class OutputWriteError(RuntimeError):
    """A checkpoint (or the final policy) could not be written; the message names the file and the reason, and
    the checkpoints written before are whole (the run stops at that step, ``ckpt_path=last`` continues it)."""


class _RecordingWriter:
    """A binary file for ``torch.save`` that keeps the first ``OSError`` of a write (``error``): torch's zip
    writer turns a failed or short write (full disk, file size limit) into ``RuntimeError: unexpected pos``,
    which does not say why."""

    def __init__(self, f) -> None:
        self.f = f
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            view = memoryview(data).cast("B")
            written = 0
            while written < len(view):
                n = self.f.write(view[written:])
                if not n:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                written += n
            return written
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        self.f.flush()

    def fileno(self) -> int:
        """The file's descriptor (for ``os.fsync`` by whoever holds the writer, e.g. tests/fault_injection.py)."""
        return self.f.fileno()


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose ``save_checkpoint`` is atomic on a local file system.

    Writes ``<path>.partial-<pid>`` in the target's folder, flushes and fsyncs it, then ``os.replace``s it
    onto ``path`` and fsyncs the folder. A leftover ``.partial-*`` file (a kill mid-write) is never read.
    A write that fails (``OSError``) raises ``OutputWriteError`` at that step, the partial file removed.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options, got {storage_options!r}")
        path = Path(path)
        tmp = path.with_name(f"{path.name}{TMP_SUFFIX}-{os.getpid()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                with open(tmp, "wb") as f:
                    writer = _RecordingWriter(f)
                    try:
                        torch.save(checkpoint, writer)
                    except RuntimeError as err:  # torch's zip writer reports a failed write as a position
                        if writer.error is None:  # mismatch; the OSError behind it is the reason to name
                            raise
                        raise writer.error from err
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            finally:
                if tmp.exists():
                    tmp.unlink()
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as err:  # full disk, file size limit, lost permission, ...: stop at this step
            previous = find_last(path.parent) if path.parent.is_dir() else None
            raise OutputWriteError(
                f"could not write the checkpoint of global step {checkpoint.get('global_step', '?')} to {path} "
                f"({err.strerror or err}); the run stops here. "
                + (
                    f"The previous checkpoint {previous} is whole: continue with ckpt_path=last once the "
                    f"checkpoint folder can be written"
                    if previous
                    else "No earlier checkpoint was written"
                )
            ) from err


def find_last(folder: str | os.PathLike) -> Path | None:
    """The checkpoint to resume from in ``folder``: ``last.ckpt`` when it resolves to a file, else the
    most recently written ``*.ckpt`` (never a ``.partial-*`` leftover); None when there is none."""
    folder = Path(folder)
    last = folder / "last.ckpt"
    if last.is_file():  # follows the link; False for a dangling one
        return last
    candidates = [p for p in folder.glob("*.ckpt") if p.is_file()]
    return max(candidates, key=lambda p: p.stat().st_mtime_ns) if candidates else None
