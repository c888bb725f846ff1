"""Kernel modes (the ``kernels`` config group): ``default`` (torch's and transformers' own kernels) or
``batch_invariant`` (``batch_invariant.BatchInvariantMode``: the engine's rollout log-probs equal the
trainer's bit for bit before the first update)."""

from __future__ import annotations

import contextlib

from ..registry import Registry
from .batch_invariant import BatchInvariantMode

#: ``kernels`` -> what the mode does (``kernel_mode`` builds it); each has its ``conf/kernels/<name>.yaml``
KERNELS: Registry[str] = Registry(
    "kernels",
    {
        "default": "torch's and transformers' own kernels",
        "batch_invariant": "lit_rl's CPU kernels: rollout log-probs equal the trainer's bit for bit",
    },
)


def kernel_mode(name: str, *models):
    """A context manager that runs its body under kernel mode ``name`` for ``models`` (transformers causal
    LMs): ``default`` changes nothing, ``batch_invariant`` is ``BatchInvariantMode(*models)``.
    Raises ValueError for another name."""
    if name == "default":
        return contextlib.nullcontext()
    if name == "batch_invariant":
        import torch

        from .batch_invariant import GEMM_ROWS

        print(
            f"lit_rl: kernels=batch_invariant: matrix products in fixed blocks of {GEMM_ROWS} rows at "
            f"{torch.get_num_threads()} torch threads (the thread count stays fixed for the run); "
            f"CPU only",
            flush=True,
        )
        return BatchInvariantMode(*models)
    raise ValueError(f"kernels={name!r} is not allowed: choose one of {list(KERNELS)}")


__all__ = ["KERNELS", "BatchInvariantMode", "kernel_mode"]
