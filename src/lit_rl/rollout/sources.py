"""Rollout sources: where a step's scored rollouts come from, with which weights, and when the engine is synced.

The learner (``RLModule``) never branches on the rollout mode: it asks its ``RolloutSource`` for the step's
rollouts and hands it the hooks below. A source owns

- the rollout engine (``RolloutEngine``: the embedded torch sampler or vLLM) and every weight sync into it
  (under FSDP from the gathered full weights; after evaluation's pause the engine is synced again);
- the weight versions a stale mode keeps (``rollout.staleness``) and their checkpoint state;
- the end of the run (the async producer thread, then the engine).

``rollout.mode`` names the source (``ROLLOUT_SOURCES``): ``sync`` (``SyncSource``: sample with the weights
about to be trained) and ``lagged`` / ``async`` (``StaleSource``: older weights). A new rollout mode is a new
source class registered here (``register_source``) plus its YAML values, not a branch in the learner::

    @register_source("my_mode", "what it samples with")
    class MySource(SyncSource):
        def collect(self, learner, batch): ...

The learner side of the contract is ``staleness.Learner`` (its policy, engine, version counter, ``collect``
of one prompt batch with the engine, ``score_rows``...), plus ``full_policy_weights()`` (None unless the
weights are sharded) for the sync.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from ..choices import ROLLOUT_MODES, RolloutMode
from ..registry import Registry
from ..schema import RolloutConfig, config_of
from .multiturn import episode_metrics
from .staleness import StaleRollouts
from .types import RolloutEngine


class RolloutSource:
    """The ``sync`` source, and the base every source extends: sample with the weights about to be trained.

    Args:
        engine: the ``RolloutEngine`` this source samples with (closed by ``close``).
        rollout: the ``rollout`` config section (``schema.RolloutConfig`` or a mapping of its fields).

    Hooks the learner calls, in a step's order: ``setup`` (once, before a strategy wraps the module),
    ``before_step`` (Lightning's ``on_train_batch_start``), ``collect``, ``score_behaviour`` (after the
    batch is built); ``pause`` / ``resume`` around evaluation; ``state_dict`` / ``load_state_dict`` with
    the checkpoint; ``close`` at the end of the run (idempotent).
    """

    @classmethod
    def engine_owns_weights(cls, rollout: RolloutConfig) -> bool:
        """True when the engine must hold its own copy of the weights (``build_engine``'s ``own_copy``)."""
        return False

    def __init__(self, engine: RolloutEngine, rollout: RolloutConfig | Mapping | None = None):
        self.engine = engine
        self.cfg = config_of(RolloutConfig, rollout)
        self._presynced_s: float | None = None

    # -- the weights -------------------------------------------------------------------------------------
    def sync(self, learner) -> float:
        """Push the learner's current weights (version ``learner.policy_version``) into the engine; returns the
        seconds it took. Under FSDP the full weights are gathered from the shards first (a collective every
        rank joins, once per sync: ``learner.full_policy_weights``)."""
        t0 = time.perf_counter()
        self.engine.sync_weights(learner.policy_version, learner.full_policy_weights())
        return time.perf_counter() - t0

    def setup(self, learner, sharded: bool) -> None:
        """Before the strategy wraps the module: under FSDP the embedded engine samples from a copy of its own
        (``TorchEngine.take_own_copy``), filled from the gathered full weights at every sync, never through
        the sharded forward."""
        if sharded and hasattr(self.engine, "take_own_copy"):
            self.engine.take_own_copy()

    def before_step(self, learner, sharded: bool) -> None:
        """Under FSDP the engine is synced here, before the step: Lightning runs ``training_step`` inside the
        wrapped root's forward, where the shards cannot be gathered into a full state dict."""
        self._presynced_s = self.sync(learner) if sharded else None

    # -- the step's rollouts -----------------------------------------------------------------------------
    def collect(self, learner, batch) -> tuple[Any, dict[str, float], float]:
        """This rank's ``(ScoredRollouts, metrics, weight-sync seconds)`` for prompt batch ``batch``: the engine
        synced to the weights about to be trained (unless ``before_step`` did it), then ``learner.collect``
        (the algorithm's way of filling a batch: one round, or DAPO's dynamic sampling)."""
        if self._presynced_s is None:
            t_sync = self.sync(learner)
        else:
            t_sync, self._presynced_s = self._presynced_s, None
        scored, metrics = learner.collect(batch)
        self.engine.sleep()  # vLLM with sleep_mode frees its GPU memory for the update; a no-op otherwise
        if scored.episodes is not None:  # multi-turn: turns, tool calls and errors, environment tokens
            metrics = {**metrics, **episode_metrics(scored.episodes)}
        return scored, metrics, t_sync

    def score_behaviour(self, learner, rb) -> None:
        """Fill ``rb.behaviour_logprobs`` (p_o of stale rows) where the source sampled with older weights; a
        no-op for a source whose rows are all of the trained version."""

    # -- evaluation, checkpoints, the end ----------------------------------------------------------------
    def pause(self, learner) -> None:
        """Before evaluation: the engine is the evaluator's, synced to the latest update."""
        self.sync(learner)

    def resume(self, learner) -> None:
        """After evaluation."""

    def state_dict(self) -> dict | None:
        """What a checkpoint keeps of the source (None: nothing)."""
        return None

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        """Restore ``state_dict``'s output (``device``: where the weights live)."""

    def close(self) -> None:
        """Stop what the source runs beside the trainer (idempotent). The engine is closed by ``close_engine``."""

    def close_engine(self) -> None:
        """Shut the engine down (vLLM's engine core and its files)."""
        self.engine.close()


class SyncSource(RolloutSource):
    """``rollout.mode=sync``: generate with the weights about to be trained, then train; staleness 0."""


class StaleSource(RolloutSource):
    """``rollout.mode=lagged | async``: sample with older weights (``staleness.StaleRollouts``: the lagged
    weight history, or the async producer thread and its buffer). The rows' versions and, with
    ``rollout.behaviour_logprobs``, their generating weights' log-probs (p_o) go to the update."""

    def __init__(self, engine: RolloutEngine, rollout: RolloutConfig | Mapping | None = None):
        super().__init__(engine, rollout)
        ro = self.cfg
        trainer_threads = None
        if ro.mode == "async" and self.producer_kind(ro, engine) == "process":  # the engine in a process of its own
            from .producer_process import ProcessEngine

            producer_threads, trainer_threads = core_split(ro)
            self.engine = ProcessEngine(
                engine, producer_threads, ro.producer_timeout_s, ro.weight_update == "in_flight", ro.kv_on_update
            )
        elif hasattr(engine, "kv_on_update"):
            engine.kv_on_update = ro.kv_on_update
        if ro.partial and ro.mode == "async":  # unfinished groups carried between batches
            if not hasattr(self.engine, "partial"):  # engine=auto that became vllm (config.validate names vllm)
                raise ValueError(
                    f"rollout.partial=true runs in the embedded engine only, not {type(self.engine).__name__}: "
                    "use engine=torch, or rollout.partial=false"
                )
            self.engine.partial = True
        self.stale = StaleRollouts(
            ro.mode,
            lag=ro.lag,
            max_staleness=ro.max_staleness,
            on_stale=ro.on_stale,
            buffer_size=ro.buffer_size,
            behaviour_logprobs=ro.behaviour_logprobs,
            save_history=ro.save_history,
            producer_timeout_s=ro.producer_timeout_s,
            trainer_threads=trainer_threads,
            in_flight=ro.mode == "async" and ro.weight_update == "in_flight",
        )

    @staticmethod
    def producer_kind(rollout: RolloutConfig, engine: RolloutEngine) -> str:
        """``rollout.producer`` resolved for ``engine``: ``auto`` is ``process`` for the embedded engine on the CPU
        without a LoRA adapter (what the rollout process serves and what has run), else ``thread``."""
        if rollout.producer != "auto":
            return rollout.producer
        from ..models import has_lora
        from .torch_engine import TorchEngine

        if not isinstance(engine, TorchEngine) or has_lora(engine.source):
            return "thread"
        return "process" if next(engine.source.parameters()).device.type == "cpu" else "thread"

    @classmethod
    def engine_owns_weights(cls, rollout: RolloutConfig) -> bool:
        """async: the producer thread samples while the trainer updates its weights."""
        return rollout.mode == "async"

    def before_step(self, learner, sharded: bool) -> None:
        """Nothing: the stale collection syncs the engine with the version it samples."""

    def collect(self, learner, batch) -> tuple[Any, dict[str, float], float]:
        scored, metrics = self.stale.collect(learner, batch)  # the sync is part of the stale collection
        self.engine.sleep()
        return scored, metrics, 0.0

    def score_behaviour(self, learner, rb) -> None:
        self.stale.score_behaviour(learner, rb)

    def pause(self, learner) -> None:
        self.stale.pause()  # async: the producer finishes its batch and leaves the engine to evaluation
        super().pause(learner)

    def resume(self, learner) -> None:
        self.stale.resume()

    def state_dict(self) -> dict:
        return self.stale.state_dict()  # lagged: the weight history, so a resumed run samples exactly as before

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        self.stale.load_state_dict(state, device)

    def close(self) -> None:
        self.stale.close()  # no producer thread outlives the run (exceptions: ``RolloutSourceShutdown``)
        if getattr(self.engine, "pid", None) is not None:  # nor a rollout process
            self.engine.close()


def core_split(rollout: RolloutConfig) -> tuple[int, int]:
    """(rollout process threads, trainer threads) of ``rollout.producer=process``: ``producer_threads`` (null: half
    of this process's torch threads, at least 1) and ``trainer_threads`` (null: the rest, at least 1); on the
    project's 2-core machine 1 + 1. Under ``kernels=batch_invariant`` both keep the run's count (``threads``): the
    bits of a product depend on the thread count, and the engine's must equal the trainer's."""
    from .producer_process import trainer_kernels

    total = torch.get_num_threads()
    if trainer_kernels() == "batch_invariant":
        return total, total
    producer = int(rollout.producer_threads or max(1, total // 2))
    return producer, int(rollout.trainer_threads or max(1, total - producer))


#: ``rollout.mode`` -> its ``RolloutSource`` class (the names and what the checks know: ``choices.ROLLOUT_MODES``)
ROLLOUT_SOURCES: Registry[type[RolloutSource]] = Registry(
    "rollout.mode", {"sync": SyncSource, "lagged": StaleSource, "async": StaleSource}
)


def register_source(
    name: str,
    description: str,
    reads: tuple[str, ...] = (),
    multi_rank: bool = False,
    stale: bool = True,
    sharded: bool = False,
    background: bool = False,
):
    """Class decorator: make ``rollout.mode=<name>`` build the decorated ``RolloutSource`` subclass; the rest is
    what ``config.validate`` knows of the mode (``choices.RolloutMode``: what it samples with, the ``rollout``
    fields only it reads, whether it runs on several ranks, with sharded weights, with an engine beside the
    trainer, whether its rows may come from older weights: True unless declared otherwise, so
    ``correction.bypass`` stays refused). Raises ValueError for a taken name."""

    def decorate(cls: type[RolloutSource]) -> type[RolloutSource]:
        ROLLOUT_SOURCES.register(name, cls)
        mode = RolloutMode(
            description, tuple(reads), bool(multi_rank), bool(sharded), bool(background), stale=bool(stale)
        )
        ROLLOUT_MODES.register(name, mode)
        return cls

    return decorate


def unregister_source(name: str) -> None:
    """Undo ``register_source(name, ...)``. Raises ``UnknownChoice`` for a name that is not registered."""
    ROLLOUT_SOURCES.unregister(name)
    ROLLOUT_MODES.unregister(name)


def source_class(rollout: RolloutConfig | Mapping | None) -> type[RolloutSource]:
    """The ``RolloutSource`` class of the ``rollout`` config section's ``mode``. Raises ``UnknownChoice``."""
    return ROLLOUT_SOURCES[config_of(RolloutConfig, rollout).mode]


class RolloutSourceShutdown(Callback):
    """Stops the source (the async producer) when the fit loop ends in any way: Lightning calls
    ``on_exception`` for an exception or Ctrl-C (then ``teardown``), which the LightningModule itself is not
    told about."""

    @staticmethod
    def _close(pl_module) -> None:
        source = getattr(pl_module, "source", None)
        if source is not None:
            source.close()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._close(pl_module)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._close(pl_module)
