"""The versioned weight store the trainer publishes into and a rollout process reads from (``rollout.producer``).

A store holds ``slots`` copies of the trainer's state dict (``rollout.max_staleness + 1`` versions: the newest the
engine loads, and the older ones stale tokens are scored with, ``rollout.behaviour_logprobs``). Each slot is a
set of tensors allocated once, in shared memory on the CPU (``torch.multiprocessing``: a process that receives
the store maps the same pages; no tensor is pickled by value), and overwritten in place by ``record``: a version
is written once, by the trainer, and read by the engine's process with a ``copy_`` into its own model. A small
shared table says which version each slot holds (-1: empty); one lock orders a write against a read, so a slot
is never read half-written.

Transports (``WeightStore.transport``):
- ``cpu_shm``: the slots live in shared memory (``Tensor.share_memory_``). What runs on this project's machines.
- ``cuda_ipc``: the slots live on the trainer's GPU; handing the store to the rollout process sends CUDA IPC
  handles of the same memory (``torch.multiprocessing``'s CUDA reductions), and the engine copies device to
  device into its own weights on its own GPU (peer access) or through the host. Written, checked here by a dry
  run (``describe`` of a store built with ``device="meta"``: the slot layout and the bytes each version moves);
  it has not run on a GPU yet (docs/rollout-modes.md, "The weight store").
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterator, Mapping

import torch
from torch import Tensor

TRANSPORTS = {"cpu": "cpu_shm", "cuda": "cuda_ipc", "meta": "dry_run"}
#: the longest wait for the store's lock: a reader holds it only while it copies one version (well under a second
#: for SmolLM2-135M); a reader killed while holding it would otherwise block the trainer forever
LOCK_TIMEOUT_S = 120.0


class WeightStore:
    """``slots`` versions of one state dict, shared with a rollout process (see the module docstring).

    Args:
        template: a name -> tensor dict with the shapes and dtypes every version has (the trainer's state
            dict; tied tensors are stored once, under their first name: loading a version into a module with the
            same ties restores both).
        slots: versions kept at once (>= 1): ``max_staleness + 1``.
        device: where the slots live: ``cpu`` (shared memory), ``cuda[:i]`` (IPC handles) or ``meta`` (a dry
            run: the layout without memory). Default: the template's device.
        context: the multiprocessing context whose lock orders reads and writes (default: spawn's).

    Behaves like ``staleness.WeightHistory`` (``record``, ``oldest``, ``prune``, ``versions``), so stale rows
    are scored from it. Raises ValueError for ``slots`` < 1 or an empty template.
    """

    def __init__(self, template: Mapping[str, Tensor], slots: int, device=None, context=None):
        if int(slots) < 1:
            raise ValueError(f"a weight store needs >= 1 slot, got {slots}")
        if not template:
            raise ValueError("a weight store needs a non-empty template state dict")
        device = torch.device(device if device is not None else next(iter(template.values())).device)
        if device.type not in TRANSPORTS:
            raise ValueError(f"weight store device {device} is not allowed: choose one of {sorted(TRANSPORTS)}")
        self.device, self.transport = device, TRANSPORTS[device.type]
        seen, names = set(), {}
        for name, value in template.items():  # tied tensors (input and output embeddings) once, under the first name
            shared = value.numel() and value.device.type != "meta"  # meta tensors have no address
            key = (value.data_ptr(), tuple(value.shape), value.stride()) if shared else (name,)
            if key not in seen:
                seen.add(key)
                names[name] = value
        self.slots: list[dict[str, Tensor]] = [
            {k: torch.empty(v.shape, dtype=v.dtype, device=device) for k, v in names.items()} for _ in range(slots)
        ]
        #: version held by each slot, -1 = empty (shared: the reader looks a version up here)
        self.table = torch.full((slots,), -1, dtype=torch.long)
        if device.type == "cpu":
            for slot in self.slots:
                for t in slot.values():
                    t.share_memory_()
            self.table.share_memory_()
        self.lock = (context or multiprocessing.get_context("spawn")).Lock()

    @contextlib.contextmanager
    def locked(self):
        """The store's lock, or RuntimeError after ``LOCK_TIMEOUT_S`` (its holder died while reading a version)."""
        if not self.lock.acquire(timeout=LOCK_TIMEOUT_S):
            raise RuntimeError(
                f"the weight store's lock was not released within {LOCK_TIMEOUT_S:g} s: the rollout process "
                "probably died while it copied a version"
            )
        try:
            yield
        finally:
            self.lock.release()

    # -- the trainer's side ------------------------------------------------------------------------------
    def write(self, version: int, weights: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Store ``weights`` as ``version`` (once: a version already held is returned as is), in the slot of the
        oldest version (or an empty one). Returns the slot. Raises KeyError for a name missing from ``weights``."""
        version = int(version)
        with self.locked():
            held = self._slot_of(version)
            if held is not None:
                return self.slots[held]
            versions = self.table.tolist()
            i = versions.index(-1) if -1 in versions else min(range(len(versions)), key=versions.__getitem__)
            self.table[i] = -1  # the slot is being written: no reader takes it
            with torch.no_grad():
                for name, dst in self.slots[i].items():
                    dst.copy_(weights[name])
            self.table[i] = version
            return self.slots[i]

    def record(self, version: int, module: torch.nn.Module) -> dict[str, Tensor]:
        """``write`` of ``module``'s current state dict as ``version`` (``WeightHistory.record``'s contract)."""
        if self._slot_of(int(version)) is not None:
            return self.slots[self._slot_of(int(version))]
        return self.write(version, module.state_dict())

    def prune(self, keep_from: int) -> None:
        """Forget every version older than ``keep_from`` (their slots are free for the next writes)."""
        with self.locked():
            old = (self.table >= 0) & (self.table < int(keep_from))
            self.table[old] = -1

    # -- the reader's side -------------------------------------------------------------------------------
    def _slot_of(self, version: int) -> int | None:
        hits = (self.table == version).nonzero()
        return int(hits[0]) if hits.numel() else None

    def newest(self) -> int:
        """The newest version held (-1: none)."""
        return int(self.table.max())

    def oldest(self) -> int:
        """The oldest version held. Raises ValueError when the store is empty."""
        held = self.table[self.table >= 0]
        if not held.numel():
            raise ValueError("the weight store holds no version")
        return int(held.min())

    def load_into(self, version: int, load) -> bool:
        """Call ``load(weights)`` with ``version``'s slot while holding the lock (so the trainer cannot overwrite
        it meanwhile); ``load`` copies what it needs. Returns False when the store does not hold ``version``."""
        with self.locked():
            i = self._slot_of(int(version))
            if i is None:
                return False
            load(self.slots[i])
            return True

    @property
    def versions(self) -> dict[int, dict[str, Tensor]]:
        """version -> its slot, for the versions held now (a read in the trainer's process, which writes)."""
        return {int(v): self.slots[i] for i, v in enumerate(self.table.tolist()) if v >= 0}

    def __contains__(self, version: int) -> bool:
        return self._slot_of(int(version)) is not None

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self.versions))

    def describe(self) -> dict[str, float | int | str]:
        """The store's layout: transport, slots, tensors per version, bytes per version (what one ``write``
        moves) and in all. The dry run of a transport that cannot run here (``device="meta"``)."""
        per_version = sum(t.numel() * t.element_size() for t in self.slots[0].values())
        return {
            "transport": self.transport,
            "device": str(self.device),
            "slots": len(self.slots),
            "tensors": len(self.slots[0]),
            "bytes_per_version": per_version,
            "bytes": per_version * len(self.slots),
        }

    # -- checkpoints: what WeightHistory's callers use -----------------------------------------------------
    def state_dict(self) -> dict[int, dict[str, Tensor]]:
        return {v: {k: t.detach().cpu().clone() for k, t in w.items()} for v, w in self.versions.items()}

    def load_state_dict(self, state: Mapping[int, Mapping[str, Tensor]], device=None) -> None:
        for v in sorted(state, key=int):
            self.write(int(v), state[v])
