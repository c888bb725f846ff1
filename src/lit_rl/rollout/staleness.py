"""Stale rollouts: ``rollout.mode=lagged`` (exactly k steps old, reproducible) and ``rollout.mode=async``
(a producer thread generating while the trainer trains, at most ``max_staleness`` versions behind).

Versions. The weights after v optimizer steps are version v (Lightning's ``global_step``); every rollout
records the version that generated it (``Rollouts.policy_version``). Staleness is counted in RL steps:
(version being trained - version that generated the row) / updates per RL step, so with one update per
step (every algorithm but PPO) it is the number of updates between sampling and training.

- ``sync`` (default): generate with the weights being trained, then train; staleness 0. Not handled here.
- ``lagged``: RL step s samples with the weights of step s - k (``rollout.lag``), or the oldest kept
  before k steps exist (so step j < k has staleness j). Keeps a history of the last k + 1 versions
  (k + 1 copies of the weights) and loads the one it needs into the engine's own copy. Deterministic: a
  lagged run is as reproducible as a sync run, and ``lag=0`` equals ``sync`` bit for bit. The history is
  saved in checkpoints (``rollout.save_history``), so a resumed lagged run continues exactly.
- ``async``: ``RolloutProducer``, a daemon thread, generates the step stream ahead with its own copy of the
  weights, refreshed from the newest version the trainer has published (one per RL step, at its start) at
  each of its batch boundaries, so a sequence never mixes versions. A bounded buffer between them;
  ``rollout.on_stale=block`` holds the producer back so that no consumed rollout is more than
  ``max_staleness`` steps old (nothing is dropped); ``drop`` lets it run ahead (bounded by the buffer) and
  the trainer drops what is too old when it takes it, counted in ``rollout/dropped_samples``. Not
  reproducible in general (timing decides the versions), except with ``on_stale=block``, ``max_staleness=1``
  and its default buffer of one batch: the trainer publishes version s before it takes batch s, and the
  producer has room for batch s + 1 only then, so step s samples with the weights of step s - 1 (step 0 with
  its own), as ``lagged`` with ``lag=1`` (the DDP tests compare on it). On resume the
  buffer is regenerated, not restored: the producer restarts at the checkpoint's step with the checkpoint's
  weights, so the first resumed batch has staleness 0 (an uninterrupted run's batch there would have been up to
  ``max_staleness`` old), and every logged staleness is that of the versions that really sampled the tokens.

Data parallel (``trainer=ddp``): each rank runs its own source: its own lagged history, or its own producer
(thread or process) and weight store, fed by its own module (the ranks hold identical weights after each
all-reduced update), sampling its own share of each step's prompts, as sync DDP does. Nothing in the stale
collection is a collective, so the producers never enter the update's all-reduces. The step's metrics are
reduced over ranks as every step metric (``algorithms.parallel``): ``rollout/staleness_max`` and
``rollout/version_span_max`` by max, ``rollout/staleness_mean`` weighted by each rank's valid tokens (the
one-device token mean), ``rollout/dropped_samples`` summed, ``rollout/buffered_steps``, ``rollout/weight_swaps``
and the ``time/*_frac`` overlap fractions as means over ranks. With ``on_stale=drop`` each rank drops by its own
clock, so ranks may train shares of different prompt steps in one update.

The trainer's ``old_logprobs`` are always its own log-probs at the version being trained; the corrections
(TIS, MIS, SC) compare them with the true behaviour log-probs (``rollout_logprobs``, top-k head). With
``rollout.behaviour_logprobs`` (default on) the trainer also scores stale rows with the weights that
generated them (``RolloutBatch.behaviour_logprobs``, p_o), so ``train/r_num_abs`` (same weights, two
engines) and ``train/r_stale_abs`` (same engine, two versions) are SPEC's decomposition, logged apart.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

# rollout.mode and rollout.on_stale: the one lists, torch-free there so that config.validate checks them first
from ..choices import ON_STALE, ROLLOUT_MODES  # noqa: F401  (re-exported)
from .types import RolloutEngine, row_versions
from .weight_store import WeightStore

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 60.0


@runtime_checkable
class Learner(Protocol):
    """What stale rollouts need from the learner (``RLModule`` implements it; a test checks it): the
    weights to record and swap, the engine to sample with, the step counter, and three calls. Nothing else
    of the learner is touched, so the rollout package stays independent of the loss.

    Attributes:
        policy: the trainer's module (its weights are recorded per version and swapped in and out).
        engine: the ``RolloutEngine`` stale rollouts sample with.
        policy_version: optimizer steps taken so far (the version of ``policy``'s current weights).
        updates_per_step: optimizer steps per RL step (versions count optimizer steps).
    """

    policy: torch.nn.Module
    engine: RolloutEngine
    policy_version: int
    updates_per_step: int

    def collect(self, batch) -> tuple[Any, dict[str, float]]:
        """Generate and score a prompt batch with ``engine``: ``(ScoredRollouts, metrics)``."""
        ...

    def prompt_batch(self, step: int):
        """The ``PromptBatch`` of RL step ``step`` (this rank's share)."""
        ...

    def precision_context(self) -> contextlib.AbstractContextManager:
        """The trainer's precision context (autocast is per thread: the producer thread enters its own)."""
        ...

    def score_rows(self, rb, rows: Tensor) -> Tensor:
        """float32 [len(rows), T] log-probs of rows ``rows`` of ``rb`` under ``policy``'s current weights."""
        ...


def weights_snapshot(module: torch.nn.Module) -> dict[str, Tensor]:
    """A detached copy of ``module``'s state dict, each storage once (tied embeddings are kept under their
    first name; loading it into a module with the same ties restores both)."""
    seen, out = set(), {}
    for name, value in module.state_dict().items():
        key = (value.data_ptr(), value.shape, value.stride()) if value.numel() else (name,)
        if key in seen:
            continue
        seen.add(key)
        out[name] = value.detach().clone()
    return out


@torch.no_grad()
def load_weights(module: torch.nn.Module, weights: dict[str, Tensor]) -> None:
    """Copy ``weights`` (a ``weights_snapshot``) into ``module``'s tensors in place (parameters keep their
    identity, so an optimizer holding them is unaffected)."""
    target = module.state_dict()
    for name, value in weights.items():
        target[name].copy_(value)


@contextlib.contextmanager
def swapped_weights(module: torch.nn.Module, weights: dict[str, Tensor], restore: dict[str, Tensor]):
    """``module`` holds ``weights`` inside the block and ``restore`` (a snapshot of its own weights) after it,
    also on an exception. In place: the same tensors, so the same kernels and an optimizer unaffected."""
    if weights is restore:
        yield
        return
    try:
        load_weights(module, weights)
        yield
    finally:
        load_weights(module, restore)


def token_staleness(rollouts, version_now: int, updates_per_step: int = 1) -> dict[str, float]:
    """``rollout/staleness_mean`` and ``rollout/staleness_max`` over the valid tokens of ``rollouts`` (``Rollouts``),
    each token by the version that sampled it (``token_versions``), in RL steps: (``version_now`` - version) /
    ``updates_per_step``; and ``rollout/version_span_max``: the most distinct versions inside one sequence (1 when
    no sequence spans an update)."""
    mask = rollouts.response_mask.bool()
    versions = torch.where(mask, rollouts.token_versions, rollouts.policy_version[:, None])
    lag = (version_now - versions).double() / updates_per_step
    valid = lag[mask] if mask.any() else lag.flatten()
    distinct = (versions.sort(dim=1).values.diff(dim=1) != 0).sum(dim=1) + 1
    return {
        "rollout/staleness_mean": float(valid.mean()) if valid.numel() else 0.0,
        "rollout/staleness_max": float(valid.max()) if valid.numel() else 0.0,
        "rollout/version_span_max": float(distinct.max()) if distinct.numel() else 1.0,
    }


def partial_fraction(rollouts) -> dict[str, float]:
    """``rollout/partial_fraction``: the share of ``rollouts``' rows (``Rollouts``, N rows) that an earlier batch
    started and this one finished (``carried``, ``rollout.partial``); {} when partial rollouts are off (no
    ``carried``). 0 for an empty batch."""
    carried = getattr(rollouts, "carried", None)
    if carried is None:
        return {}
    return {"rollout/partial_fraction": float(carried.float().mean()) if carried.numel() else 0.0}


class WeightHistory:
    """version -> weights snapshot of the versions stale rollouts may still need."""

    def __init__(self):
        self.versions: dict[int, dict[str, Tensor]] = {}

    def record(self, version: int, module: torch.nn.Module) -> dict[str, Tensor]:
        """Snapshot ``module`` as ``version`` (once; a version already kept is returned as is)."""
        if version not in self.versions:
            self.versions[version] = weights_snapshot(module)
        return self.versions[version]

    def oldest(self) -> int:
        return min(self.versions)

    def prune(self, keep_from: int) -> None:
        """Forget every version older than ``keep_from``."""
        for v in [v for v in self.versions if v < keep_from]:
            del self.versions[v]

    def state_dict(self) -> dict[int, dict[str, Tensor]]:
        return {v: {k: t.cpu() for k, t in w.items()} for v, w in self.versions.items()}

    def load_state_dict(self, state: dict[int, dict[str, Tensor]], device) -> None:
        self.versions = {int(v): {k: t.to(device) for k, t in w.items()} for v, w in state.items()}


@dataclass
class _Item:
    """One RL step's worth of rollouts in the async buffer: prompt step ``step``, generated with ``version``."""

    step: int
    version: int
    scored: Any
    metrics: dict
    seconds: float = 0.0  # the producer's generation and scoring time of this batch

    @classmethod
    def of(cls, step: int, scored, metrics: dict, seconds: float, engine_version: int) -> _Item:
        """The buffer's item for prompt step ``step``: its ``version`` is the batch's oldest token's (the rows'
        ``policy_version`` is each row's oldest token's), so ``take``'s ``max_staleness`` check bounds every token
        of the batch, also when in-flight updates let one sequence span versions; ``engine_version`` for an empty
        batch."""
        rows = scored.rollouts.policy_version
        return cls(step, int(rows.min()) if rows.numel() else int(engine_version), scored, metrics, seconds)


class RolloutProducer:
    """A daemon thread that generates the step stream ahead of the trainer (``rollout.mode=async``).

    ``module`` is the ``Learner``: the producer calls ``module.collect(module.prompt_batch(p))`` for prompt
    steps p = first_step, first_step + 1, ... with ``module.engine`` (its own copy of the weights), under
    the trainer's precision context (autocast is per thread). The trainer ``publish``-es each new version;
    the producer loads the newest one before each batch. ``lock`` guards the engine: the trainer holds it
    while it evaluates. A failure in the thread is re-raised by ``take`` in the trainer's thread.
    """

    def __init__(
        self, module, first_step: int, max_staleness: int, on_stale: str, capacity: int, in_flight: bool = False
    ):
        self.module, self.engine = module, module.engine
        self.max_staleness, self.on_stale, self.capacity = max_staleness, on_stale, capacity
        self.updates_per_step = module.updates_per_step
        self.next_step = first_step
        self.buffer: deque[_Item] = deque()
        self.cond = threading.Condition()
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.published: tuple[int, dict[str, Tensor]] | None = None
        self.error: BaseException | None = None
        self.generated = 0
        self.idle_s = 0.0  # seconds the producer waited for weights or buffer room (time/producer_idle_frac)
        self.engine.cancel = self.stop_event
        self.threads = torch.get_num_threads()  # torch's intra-op thread count is per thread: copy the trainer's
        self.thread = threading.Thread(target=self._run, name="lit_rl-rollout-producer", daemon=True)
        if in_flight and hasattr(self.engine, "between_steps"):  # a rollout process looks at its store itself
            self.engine.between_steps = self._newer_weights

    def _newer_weights(self, step: int) -> bool:
        """``rollout.weight_update=in_flight``, between two decode steps: load the newest published version into
        the engine if it is newer than the one sampling (True then)."""
        with self.cond:
            published = self.published
        if published is None or published[0] <= self.engine.version:
            return False
        self.engine.sync_weights(*published)
        return True

    def start(self) -> None:
        self.thread.start()

    # -- trainer side ---------------------------------------------------------------------------------
    def publish(self, version: int, weights: dict[str, Tensor]) -> None:
        """The trainer's weights of ``version`` (a snapshot nobody mutates) for the producer's next batch."""
        with self.cond:
            self.published = (version, weights)
            self.cond.notify_all()

    def take(self, version_now: int, timeout_s: float | None = None) -> tuple[_Item, int]:
        """The next buffered batch not older than ``max_staleness`` RL steps at ``version_now`` (blocks until
        there is one), and the number of rollout rows dropped for being too old on the way."""
        dropped = 0
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self.cond:
                while not self.buffer:
                    if self.error is not None:
                        raise RuntimeError(f"the rollout producer failed: {self.error}") from self.error
                    if self.stop_event.is_set():
                        raise RuntimeError("the rollout producer was stopped")
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(
                            f"no rollouts from the producer within rollout.producer_timeout_s={timeout_s:g} s "
                            f"(alive: {self.thread.is_alive()}); raise it if one batch legitimately takes longer"
                        )
                    self.cond.wait(timeout=1.0 if remaining is None else min(1.0, remaining))
                item = self.buffer.popleft()
                self.cond.notify_all()  # room in the buffer
            if (version_now - item.version) / self.updates_per_step > self.max_staleness:
                dropped += len(item.scored.rewards)
                continue
            return item, dropped

    def close(self, timeout_s: float = JOIN_TIMEOUT_S) -> bool:
        """Stop the thread (a generation in progress is cancelled at its next decode step) and join it.
        Returns True when it has ended. Idempotent."""
        self.stop_event.set()
        with self.cond:
            self.cond.notify_all()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout_s)
        alive = self.thread.is_alive()
        if not alive and self.engine.cancel is self.stop_event:
            self.engine.cancel = None
        return not alive

    # -- producer side --------------------------------------------------------------------------------
    def _ready(self, step: int) -> bool:
        if len(self.buffer) >= self.capacity or self.published is None:
            return False
        if self.on_stale == "block":  # generate step p only with weights that will be <= max_staleness old
            return self.published[0] >= (step - self.max_staleness) * self.updates_per_step
        return True

    def _swap_marks(self) -> list:
        """The engine's running totals before a batch, for ``_swap_metrics``: [swaps, seconds, ``partial_totals``,
        ``recompute_totals``] (empty dicts where the engine has none)."""
        marks = list(getattr(self.engine, "swap_totals", (0, 0.0)))
        marks.append(dict(getattr(self.engine, "partial_totals", None) or {}))
        marks.append(dict(getattr(self.engine, "recompute_totals", None) or {}))
        return marks

    def _swap_metrics(self, before) -> dict[str, float]:
        """``rollout/weight_swaps`` and ``time/weight_swap_s`` of every generate call of the batch just collected
        (DAPO's rounds, partial rollouts' calls), from the engine's running totals (``swap_totals``) since ``before``
        ([swaps, seconds], then optionally ``partial_totals`` and ``recompute_totals`` then: ``_swap_marks``), with
        the partial rollouts' counters as ``rollout/partial_*`` and their seconds as ``time/partial_*_s``, and the
        caches rebuilt over sampled tokens (recompute swaps, carried rows under newer weights) as
        ``rollout/recompute_prefill_tokens`` (ids fed, a shared prompt once) beside ``rollout/recompute_context_tokens``
        (the rows' contexts: what a per-row re-prefill feeds); empty for an engine without them."""
        totals = getattr(self.engine, "swap_totals", None)
        if totals is None:
            return {}
        swaps, seconds = totals[0] - before[0], totals[1] - before[1]
        out = {"rollout/weight_swaps": float(swaps), "time/weight_swap_s": float(seconds)}
        partial = getattr(self.engine, "partial_totals", None)
        if partial:  # rollout.partial: what the batch's calls prefilled, decoded and threw away
            earlier = before[2] if len(before) > 2 and before[2] else {}
            for name, value in partial.items():
                tag = f"time/partial_{name[:-2]}_s" if name.endswith("_s") else f"rollout/partial_{name}"
                out[tag] = float(value - earlier.get(name, 0.0))
        recompute = getattr(self.engine, "recompute_totals", None)
        if recompute:
            earlier = before[3] if len(before) > 3 and before[3] else {}
            for name in ("prefill_tokens", "context_tokens"):
                out[f"rollout/recompute_{name}"] = float(recompute.get(name, 0) - earlier.get(name, 0))
        return out

    def _run(self) -> None:
        from .torch_engine import GenerationCancelled

        torch.set_num_threads(self.threads)
        try:
            with self.module.precision_context():
                while not self.stop_event.is_set():
                    step = self.next_step
                    idle_from = time.perf_counter()
                    with self.cond:
                        while not self._ready(step) and not self.stop_event.is_set():
                            self.cond.wait(timeout=1.0)
                        self.idle_s += time.perf_counter() - idle_from
                        if self.stop_event.is_set():
                            return
                        version, weights = self.published
                    while not self.lock.acquire(timeout=1.0):  # the trainer is evaluating
                        if self.stop_event.is_set():
                            return
                    try:
                        if version > self.engine.version or self.engine.version < 0:
                            self.engine.sync_weights(version, weights)
                        if getattr(self.engine, "partial", False):  # the oldest version step ``step`` may train
                            self.engine.partial_min_version = (step - self.max_staleness) * self.updates_per_step
                            # and its look-ahead, the next step's groups
                            self.engine.partial_ahead_min_version = (
                                self.engine.partial_min_version + self.updates_per_step
                            )
                        swaps_before = self._swap_marks()
                        start = time.perf_counter()
                        scored, metrics = self.module.collect(self.module.prompt_batch(step))
                        seconds = time.perf_counter() - start
                        metrics = {**metrics, **self._swap_metrics(swaps_before)}
                        item = _Item.of(step, scored, metrics, seconds, self.engine.version)
                    finally:
                        self.lock.release()
                    with self.cond:
                        self.buffer.append(item)
                        self.generated += len(scored.rewards)
                        self.cond.notify_all()
                    self.next_step += 1
        except GenerationCancelled:
            return
        except BaseException as err:  # noqa: BLE001 - handed to the trainer's thread by ``take``
            self.error = err
            with self.cond:
                self.cond.notify_all()


class StaleRollouts:
    """The rollout source of ``rollout.mode=lagged|async`` (see the module docstring).

    Args:
        mode: ``lagged`` or ``async``.
        lag: k for ``lagged`` (>= 0).
        max_staleness: the most RL steps a consumed rollout may lag the trained weights (``async``).
        on_stale: ``block`` or ``drop`` (``async``).
        buffer_size: batches (RL steps of rollouts) the async buffer holds; None = max(1, max_staleness).
        behaviour_logprobs: score stale rows with their generating weights (p_o) for the decomposition.
        save_history: keep the lagged weight history in checkpoints (exact resume).
        producer_timeout_s: the longest wait for the producer's next batch (``async``; a dead rollout process is
            reported at once).
        trainer_threads: torch threads of the trainer once a rollout process runs beside it (None: unchanged).
        in_flight: ``rollout.weight_update=in_flight``: the engine takes a newer version between decode steps.

    With an engine that runs in a process of its own (``producer_process.ProcessEngine``: it has ``attach``) the
    versions travel through a ``WeightStore`` of ``max_staleness + 1`` slots in shared memory, which is also the
    history stale tokens are scored from.
    """

    def __init__(
        self,
        mode: str,
        lag: int = 0,
        max_staleness: int = 1,
        on_stale: str = "block",
        buffer_size: int | None = None,
        behaviour_logprobs: bool = True,
        save_history: bool = True,
        producer_timeout_s: float | None = None,
        trainer_threads: int | None = None,
        in_flight: bool = False,
    ):
        if mode not in ("lagged", "async"):
            raise ValueError(f"StaleRollouts handles rollout.mode lagged or async, not {mode!r}")
        self.mode, self.lag, self.max_staleness, self.on_stale = mode, int(lag), int(max_staleness), on_stale
        self.buffer_size = int(buffer_size) if buffer_size else max(1, self.max_staleness)
        self.behaviour_logprobs, self.save_history = bool(behaviour_logprobs), bool(save_history)
        self.producer_timeout_s, self.trainer_threads, self.in_flight = producer_timeout_s, trainer_threads, in_flight
        self.history: WeightHistory | WeightStore = WeightHistory()
        self.producer: RolloutProducer | None = None
        self._held: RolloutProducer | None = None  # the producer whose engine lock the trainer holds
        self.dropped_total = 0
        self._started, self._marks = 0.0, None  # time/trainer_wait_frac, time/producer_idle_frac

    # -- the step's rollouts --------------------------------------------------------------------------
    def collect(self, module: Learner, batch) -> tuple[Any, dict[str, float]]:
        """This step's ``(ScoredRollouts, metrics)`` for ``module`` (the ``Learner`` at ``policy_version``)."""
        version_now, per_step = module.policy_version, module.updates_per_step
        if self.mode == "lagged":
            current = self.history.record(version_now, module.policy)
            target = max(version_now - self.lag * per_step, self.history.oldest())
            self.history.prune(target)
            if module.engine.own_copy:  # a mismatch-injecting engine (engine.dtype / int8): load the copy
                module.engine.sync_weights(target, self.history.versions[target])
                return module.collect(batch)
            # the engine samples with the trainer's module: swap the old weights in and back (so lag 0 is sync)
            with swapped_weights(module.policy, self.history.versions[target], current):
                module.engine.sync_weights(target)
                return module.collect(batch)
        if self.producer is None and hasattr(module.engine, "attach"):  # a rollout process: a shared weight store
            self.history = WeightStore(module.policy.state_dict(), slots=self.max_staleness + 1)
            module.engine.attach(self.history)
            if self.trainer_threads:
                torch.set_num_threads(int(self.trainer_threads))
        # forget first, then write: max_staleness + 1 versions at most, the newest included
        self.history.prune(version_now - self.max_staleness * per_step)
        if not self.behaviour_logprobs:  # only the newest is needed (the producer's next load)
            self.history.prune(version_now)
        weights = self.history.record(version_now, module.policy)
        if self.producer is None:
            self.producer = RolloutProducer(
                module, batch.step, self.max_staleness, self.on_stale, self.buffer_size, self.in_flight
            )
            self.producer.start()
            self._started, self._marks = time.perf_counter(), None
        self.producer.publish(version_now, weights)
        wait_from = time.perf_counter()
        item, dropped = self.producer.take(version_now, self.producer_timeout_s)
        metrics = self._overlap(time.perf_counter() - wait_from)
        self.dropped_total += dropped
        metrics.update(item.metrics)
        metrics["rollout/dropped_samples"] = float(dropped)
        metrics["rollout/dropped_samples_total"] = float(self.dropped_total)
        metrics["rollout/buffered_steps"] = float(len(self.producer.buffer))
        metrics["time/generate_s"] = item.seconds  # time/rollout_s is the trainer's wait for the buffer
        return item.scored, metrics

    def _overlap(self, wait_s: float) -> dict[str, float]:
        """Since the previous batch was taken (the first: since the producer started): ``time/trainer_wait_frac``,
        the trainer's share of that time spent waiting for this batch (``wait_s``), and ``time/producer_idle_frac``,
        the producer's share spent waiting for weights or buffer room. Both near 0: the two overlap fully."""
        now, idle = time.perf_counter(), self.producer.idle_s
        since, idle_before = self._marks if self._marks is not None else (self._started, 0.0)
        self._marks = (now, idle)
        wall = max(now - since, 1e-9)
        return {
            "time/trainer_wait_frac": min(1.0, wait_s / wall),
            "time/producer_idle_frac": min(1.0, (idle - idle_before) / wall),
        }

    @torch.no_grad()
    def score_behaviour(self, module: Learner, rb) -> None:
        """Fill ``rb.behaviour_logprobs`` with the trainer's log-probs under the weights that sampled each token
        (``rb.token_versions``; None: each row's ``policy_version``): a row whose tokens span versions is scored
        once per version, each score kept on that version's tokens, so r_num and r_stale split exactly per
        token. Tokens of the trained version hold NaN (their p_o is the update's own ``old_logprobs``). No-op when
        no token is stale or the option is off. The trainer's weights are swapped in place and restored exactly
        (each data-parallel rank its own module, with no collective; ``trainer=fsdp``'s sharded weights are
        refused by ``config.validate``)."""
        version_now = module.policy_version
        mask = rb.response_mask.bool()
        versions = (
            rb.token_versions if rb.token_versions is not None else row_versions(rb.policy_version, mask.shape[1])
        )
        stale_versions = sorted({int(v) for v in versions[mask].unique().tolist()} - {version_now})
        if not self.behaviour_logprobs or not stale_versions:
            return
        kept = self.history.versions
        missing = [v for v in stale_versions if v not in kept]
        if missing:  # e.g. the first async steps after a resume; leave the decomposition to the update
            log.warning("no weights kept for versions %s; r_num/r_stale of this step use the trained weights", missing)
            return
        # NaN marks tokens of the trained version: their p_o is the update's own old_logprobs
        out = torch.full_like(rb.rollout_logprobs, float("nan"))
        for v in stale_versions:
            mine = mask & (versions == v)
            rows = mine.any(-1).nonzero().squeeze(-1)
            with swapped_weights(module.policy, kept[v], kept[version_now]):
                scores = module.score_rows(rb, rows)
            out[rows] = torch.where(mine[rows], scores, out[rows])
        rb.behaviour_logprobs = out.masked_fill(~mask, 0.0)

    # -- evaluation, shutdown, checkpoints ------------------------------------------------------------
    def pause(self) -> None:
        """Hold the engine for the trainer (evaluation); the producer finishes its batch first."""
        if self.producer is not None and self._held is None:
            self.producer.lock.acquire()
            self._held = self.producer

    def resume(self) -> None:
        """Give the engine back to the producer (after ``pause``)."""
        held, self._held = self._held, None
        if held is not None:
            held.lock.release()

    def close(self) -> None:
        """Stop and join the producer thread (idempotent); says what was left in the buffer."""
        producer, self.producer = self.producer, None
        if producer is None:
            return
        self.resume()  # an exception during evaluation may leave the engine held
        ended = producer.close()
        unused = sum(len(i.scored.rewards) for i in producer.buffer)
        msg = (
            f"lit_rl: rollout producer stopped ({'joined' if ended else 'STILL RUNNING after the join timeout'}); "
            f"{producer.generated} samples generated, {self.dropped_total} dropped as too stale, "
            f"{unused} left unused in the buffer"
        )
        print(msg, flush=True)  # printed, not logged too: the console handler showed the line twice

    def state_dict(self) -> dict:
        state = {"dropped_total": self.dropped_total}
        if self.mode == "lagged" and self.save_history:
            state["history"] = self.history.state_dict()
        return state

    def load_state_dict(self, state: dict, device) -> None:
        self.dropped_total = int(state.get("dropped_total", 0))
        if "history" in state:
            self.history.load_state_dict(state["history"], device)
