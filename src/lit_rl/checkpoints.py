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

import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

TMP_SUFFIX = ".partial"


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose ``save_checkpoint`` is atomic on a local file system.

    Writes ``<path>.partial-<pid>`` in the target's folder, flushes and fsyncs it, then ``os.replace``s it
    onto ``path`` and fsyncs the folder. A leftover ``.partial-*`` file (a kill mid-write) is never read.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options, got {storage_options!r}")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}{TMP_SUFFIX}-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
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


def find_last(folder: str | os.PathLike) -> Path | None:
    """The checkpoint to resume from in ``folder``: ``last.ckpt`` when it resolves to a file, else the
    most recently written ``*.ckpt`` (never a ``.partial-*`` leftover); None when there is none."""
    folder = Path(folder)
    last = folder / "last.ckpt"
    if last.is_file():  # follows the link; False for a dangling one
        return last
    candidates = [p for p in folder.glob("*.ckpt") if p.is_file()]
    return max(candidates, key=lambda p: p.stat().st_mtime_ns) if candidates else None
