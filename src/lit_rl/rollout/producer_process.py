"""The rollout process of ``rollout.mode=async rollout.producer=process``: the embedded engine in a process of its own,
on cores of its own, reading the trainer's weights from a ``WeightStore``.

``ProcessEngine`` is the trainer's side: a ``RolloutEngine`` whose ``generate`` is served by a spawned process
(``serve``) that holds the engine's own copy of the weights. The copy travels once, when the process starts
(``torch.multiprocessing`` hands its tensors over in shared memory, not by value); after that only versions move,
through the store: ``sync_weights(v)`` writes version v into the store once (the trainer's state dict), and the
process loads the version a request names (``copy_`` from the store's slot into its model, under the store's lock)
before it generates. A request carries the prompts, the sampling settings, the seeds and the caller's autocast
state (the trainer's precision context), so the process samples exactly as the engine would in the trainer's
thread: same model, same kernels (the batch-invariant or oneDNN kernels are installed in the process too), same
seeds, same thread count (``rollout.producer_threads``).

Faults: a process that dies is an error at the caller's next look (twice a second), naming the exit code; one that
does not answer within ``rollout.producer_timeout_s`` is a TimeoutError naming the option; neither ever hangs the
trainer. The process ignores SIGINT, SIGTERM and SIGUSR1 (a scheduler's stop or pre-emption warning sent to the
process group must not kill it before the trainer has checkpointed: the trainer stops it, ``close``), and leaves by
itself when its parent is gone. The same holds for multiprocessing's resource tracker, which the store's lock and
the queues register with: it ignores SIGINT and SIGTERM by itself, and is started with SIGUSR1 blocked
(``shielded_start``); a tracker killed by SIGUSR1 broke the next queue operation, and the run failed instead of
checkpointing.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import signal
import time
import traceback
from multiprocessing import resource_tracker

import torch

from ..run.hardware import keep_freed_memory
from .torch_engine import GenerationCancelled, GenerationStats, TorchEngine
from .types import Rollouts, SamplingConfig
from .weight_store import WeightStore

PROCESS_NAME = "lit_rl-rollout-process"
POLL_S = 0.5  # how often a waiting caller looks at the process (alive? cancelled?)


#: what a scheduler sends the job's process group before it stops it (SLURM ``--signal=USR1@<s>``, then SIGTERM)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


@contextlib.contextmanager
def shielded_start():
    """Block ``STOP_SIGNALS`` in this thread while a helper process starts, so that it starts with them blocked
    (a child inherits its parent thread's signal mask): a signal then reaches the trainer only, which checkpoints
    and stops the helpers itself. Signals that arrive meanwhile are delivered when the block ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class ProducerDied(RuntimeError):
    """The rollout process ended (crashed, was killed) while the trainer needed it."""


def _kernel_mode(name: str, model):
    """The trainer's kernel mode, installed in this process for ``model`` (``kernels.kernel_mode``)."""
    if name == "batch_invariant":
        from ..kernels import BatchInvariantMode

        return BatchInvariantMode(model)
    if name == "onednn":
        from ..kernels import OneDNNGemm

        return OneDNNGemm()
    return contextlib.nullcontext()


def trainer_kernels() -> str:
    """The kernels installed in this process now: ``batch_invariant``, ``onednn`` (float32 products through
    oneDNN) or ``default``."""
    from ..kernels import BatchInvariantMode, OneDNNGemm

    if BatchInvariantMode._active is not None:
        return "batch_invariant"
    return "onednn" if OneDNNGemm._active is not None else "default"


def serve(model, engine_kwargs: dict, store: WeightStore, requests, replies, threads: int, kernels: str, parent: int):
    """The rollout process's loop: load the version a request names from ``store`` into ``model`` (the engine's
    copy), generate, reply ``(request id, "ok", Rollouts, GenerationStats)`` or ``(id, "error", traceback text,
    None)``; a ``None`` request ends it, and so does the end of process ``parent``. ``engine_kwargs`` may hold
    ``in_flight`` (look at the store between decode steps and load a newer version) and ``kv_on_update``."""
    for signum in STOP_SIGNALS:  # the trainer owns this process's life (``ProcessEngine.close``)
        signal.signal(signum, signal.SIG_IGN)
    torch.set_num_threads(int(threads))
    keep_freed_memory()  # as the trainer's process (``run.resolve``): no page faults for each step's buffers
    int8, in_flight = engine_kwargs.pop("int8_roundtrip"), engine_kwargs.pop("in_flight", False)
    kv_on_update = engine_kwargs.pop("kv_on_update", "recompute")
    engine = TorchEngine(model, **engine_kwargs)  # shares ``model`` (no copy) ...
    engine.own_copy, engine.int8_roundtrip = True, int8  # ... which is the engine's own copy, loaded from the store
    engine.version = -1
    if in_flight:

        def newer(step: int) -> bool:
            newest = store.newest()
            return newest > engine.version and store.load_into(newest, lambda w: engine.sync_weights(newest, w))

        engine.between_steps = newer
    engine.kv_on_update = kv_on_update
    with torch.no_grad(), _kernel_mode(kernels, model):
        while True:
            try:
                request = requests.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent:  # the trainer is gone
                    return
                continue
            if request is None:
                return
            rid, version, prompts, params, seeds, autocast, partial = request
            try:
                if version != engine.version and not (in_flight and version < engine.version):
                    # in flight the process may already hold a newer version than the request names: never go back
                    held = version if version in store else store.newest()  # pruned meanwhile: the newest
                    if not store.load_into(held, lambda weights: engine.sync_weights(held, weights)):
                        raise RuntimeError(f"weight version {version} is not in the weight store")
                enabled, dtype = autocast
                with torch.autocast("cpu", dtype=dtype, enabled=enabled):
                    if partial is None:
                        out = engine.generate(prompts, params, seeds)
                    else:  # rollout.partial: (group keys, groups wanted, oldest version allowed, look-ahead groups,
                        # the oldest version the look-ahead's batch allows)
                        out = engine.generate_partial(prompts, params, seeds, *partial)
                replies.put((rid, "ok", out, engine.last))
            except BaseException:  # noqa: BLE001 - reported to the trainer, which raises it
                replies.put((rid, "error", traceback.format_exc(), None))


class ProcessEngine:
    """A ``RolloutEngine`` served by a rollout process of its own (see the module docstring).

    Args:
        engine: the embedded engine with its own copy of the weights (``own_copy=True``): its copy is handed to
            the process when it starts; its settings (pad and stop ids, mismatch dials) are the process's.
        threads: torch threads of the rollout process (``rollout.producer_threads``).
        timeout_s: the longest wait for one reply (``rollout.producer_timeout_s``; the first includes the process's
            start-up, a few seconds of imports).
        in_flight: ``rollout.weight_update=in_flight``: the process looks at the store between decode steps and
            loads a newer version (``TorchEngine.between_steps``), the cache handled per ``kv_on_update``.

    ``store`` (a ``WeightStore``) must be attached before the first ``sync_weights``. ``cancel`` (a
    ``threading.Event``) makes a waiting ``generate`` raise ``GenerationCancelled``. Raises ValueError for an
    engine without its own copy.
    """

    def __init__(
        self, engine: TorchEngine, threads: int, timeout_s: float, in_flight: bool = False, kv_on_update="recompute"
    ):
        if not engine.own_copy:
            raise ValueError("ProcessEngine needs an engine with its own copy of the weights (own_copy=True)")
        with shielded_start():  # before the store's lock registers with it: a SIGUSR1 to the group spares it
            resource_tracker.ensure_running()
        self.local, self.threads, self.timeout_s = engine, int(threads), float(timeout_s)
        self.in_flight, self.kv_on_update = bool(in_flight), kv_on_update
        self.version, self.own_copy, self.cancel = engine.version, True, None
        self.partial, self.partial_min_version = False, None  # rollout.partial: served by the process's engine
        self.partial_ahead_min_version = None  # rollout.partial: the look-ahead's batch's bound
        self.store: WeightStore | None = None
        self.process = None
        self.last = GenerationStats()
        self.swap_totals = [0, 0.0]  # in-flight swaps and their seconds over every generate call so far
        self.partial_totals: dict[str, float] | None = None  # rollout.partial: the process's running totals
        self.recompute_totals: dict[str, int] = {}  # the process's engine's caches rebuilt (``TorchEngine``'s)
        self._ids = itertools.count()

    @property
    def source(self) -> torch.nn.Module:
        """The trainer's module (what ``sync_weights`` without weights publishes)."""
        return self.local.source

    def attach(self, store: WeightStore) -> None:
        """Read weights from ``store`` (before the process starts)."""
        self.store = store

    def start(self) -> None:
        """Spawn the rollout process (idempotent). Raises RuntimeError when no store is attached."""
        if self.process is not None:
            return
        if self.store is None:
            raise RuntimeError("attach a WeightStore before the rollout process starts")
        ctx = torch.multiprocessing.get_context("spawn")
        self.requests, self.replies = ctx.Queue(), ctx.Queue()
        e = self.local
        kwargs = {
            "pad_token_id": e.pad_token_id,
            "stop_token_ids": e.stop_token_ids,
            "int8_roundtrip": e.int8_roundtrip,
            "logit_noise": e.logit_noise,
            "temperature_offset": e.temperature_offset,
            "packed_linear": e.casts.packed,
            "decode_attention": e.decode_attention,
            "fused_sampler": e.fused_sampler,
            "in_flight": self.in_flight,
            "kv_on_update": self.kv_on_update,
        }
        args = (e.model, kwargs, self.store, self.requests, self.replies, self.threads, trainer_kernels(), os.getpid())
        self.process = ctx.Process(target=serve, args=args, name=PROCESS_NAME, daemon=True)
        with shielded_start():  # no stop signal before ``serve`` ignores them
            self.process.start()
        layout = self.store.describe()
        print(
            f"lit_rl: rollout producer in process {self.process.pid} at {self.threads} torch threads (trainer: "
            f"{torch.get_num_threads()}); weights through a {layout['transport']} store of {layout['slots']} "
            f"versions ({layout['bytes'] / 2**20:.1f} MiB)",
            flush=True,
        )

    @property
    def pid(self) -> int | None:
        """The rollout process's id (None before it starts)."""
        return None if self.process is None else self.process.pid

    def sync_weights(self, version: int, weights=None) -> None:
        """Sample with version ``version`` from the next ``generate``: ``weights`` (a state dict of the trainer's
        names) or, None, the trainer's current weights are written into the store unless it holds the version."""
        if self.store is None:
            raise RuntimeError("attach a WeightStore before syncing the rollout process")
        if version not in self.store:
            self.store.write(version, weights if weights is not None else self.local.source.state_dict())
        self.version = int(version)

    def generate(self, prompts: list[list[int]], params: SamplingConfig, seeds: list[int]) -> Rollouts:
        """``TorchEngine.generate`` in the rollout process, with the version of the last ``sync_weights``.
        Raises ProducerDied, TimeoutError (``rollout.producer_timeout_s``), GenerationCancelled, or RuntimeError
        carrying the process's traceback."""
        return self._request(prompts, params, seeds, None)

    def generate_partial(
        self, prompts, params: SamplingConfig, seeds, keys: list, want: int, min_version=None, ahead: int = 0,
        ahead_min_version=None,
    ):  # fmt: skip
        """``TorchEngine.generate_partial`` in the rollout process (the carried rows stay there between calls);
        ``min_version`` None: ``partial_min_version``, ``ahead_min_version`` None: ``partial_ahead_min_version``.
        Raises as ``generate``."""
        min_version = self.partial_min_version if min_version is None else min_version
        if ahead_min_version is None:
            ahead_min_version = self.partial_ahead_min_version
        partial = (list(keys), int(want), min_version, int(ahead), ahead_min_version)
        return self._request(prompts, params, seeds, partial)

    def _request(self, prompts, params: SamplingConfig, seeds, partial):
        self.start()
        rid = next(self._ids)
        autocast = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        request = (rid, self.version, [list(p) for p in prompts], params, list(seeds), autocast, partial)
        self.requests.put(request)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                got, status, payload, stats = self.replies.get(timeout=POLL_S)
            except queue.Empty:
                self._check_alive()
                if self.cancel is not None and self.cancel.is_set():
                    raise GenerationCancelled("generation cancelled") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the rollout process (pid {self.pid}) sent no rollouts within rollout.producer_timeout_s="
                        f"{self.timeout_s:g} s; raise it if one batch legitimately takes longer"
                    ) from None
                continue
            if got != rid:  # the reply to a request cancelled earlier
                continue
            if status != "ok":
                raise RuntimeError(f"the rollout process (pid {self.pid}) failed:\n{payload}")
            self.last = stats
            if stats.partial is not None:
                self.partial_totals = dict(stats.partial)
            if stats.recompute is not None:
                self.recompute_totals = dict(stats.recompute)
            self.swap_totals[0] += stats.swaps
            self.swap_totals[1] += stats.swap_seconds
            return payload

    def _check_alive(self) -> None:
        if self.process is not None and not self.process.is_alive():
            raise ProducerDied(
                f"the rollout process (pid {self.pid}) died with exit code {self.process.exitcode} "
                f"(rollout.producer=process); the run cannot continue without it"
            )

    def sleep(self) -> None:
        """Nothing to release."""

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the rollout process (idempotent): asked to end, killed if it has not within ``timeout_s``."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.is_alive():
            with contextlib.suppress(Exception):
                self.requests.put(None)
            process.join(timeout_s)
        if process.is_alive():
            process.kill()
            process.join(timeout_s)
        for q in (self.requests, self.replies):
            q.cancel_join_thread()
            q.close()
