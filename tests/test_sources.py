"""Rollout sources (``lit_rl.rollout.sources``): a new rollout mode is a source class registered from the user's
own code, and a run uses it with nothing in src/ edited; the built-in modes resolve to their sources."""

import pytest
from helpers import fast_config as cfg_for

from lit_rl.registry import UnknownChoice
from lit_rl.rollout.sources import (
    ROLLOUT_SOURCES,
    StaleSource,
    SyncSource,
    register_source,
    source_class,
    unregister_source,
)
from lit_rl.rollout.staleness import ROLLOUT_MODES
from lit_rl.tools.compare import read_scalars
from lit_rl.train import run


class CountingSource(SyncSource):
    """Sync sampling that logs how many batches it collected and how many times it synced the engine."""

    def __init__(self, engine, rollout=None):
        super().__init__(engine, rollout)
        self.collected = self.synced = 0

    def sync(self, learner) -> float:
        self.synced += 1
        return super().sync(learner)

    def collect(self, learner, batch):
        scored, metrics, t_sync = super().collect(learner, batch)
        self.collected += 1
        return scored, {**metrics, "rollout/test_collected": float(self.collected)}, t_sync


@pytest.fixture
def counting_source():
    """``rollout.mode=test_counting`` while the test runs (the other tests see the built-in modes only)."""
    register_source("test_counting", "the weights about to be trained, counting its own calls")(CountingSource)
    yield CountingSource
    unregister_source("test_counting")
    assert "test_counting" not in ROLLOUT_MODES


def test_a_source_registered_from_a_test_file_runs_a_step(tmp_path, counting_source):
    run(cfg_for("trainer.max_steps=2", "rollout.mode=test_counting", "eval.num_examples=0"), tmp_path / "r")
    scalars = read_scalars(str(tmp_path / "r"))
    assert [v for _, v in scalars["rollout/test_collected"]] == [1.0, 2.0]
    assert [s for s, _ in scalars["rollout/reward_mean"]] == [0, 1]


def test_the_built_in_modes_resolve_to_their_sources(counting_source):
    assert source_class({"mode": "sync"}) is SyncSource
    assert source_class({"mode": "lagged"}) is StaleSource and source_class({"mode": "async"}) is StaleSource
    assert ROLLOUT_SOURCES["test_counting"] is CountingSource
    assert StaleSource.engine_owns_weights(cfg_for("rollout.mode=async").rollout)
    assert not StaleSource.engine_owns_weights(cfg_for("rollout.mode=lagged").rollout)
    with pytest.raises(UnknownChoice, match="rollout.mode='nope' is not allowed"):
        source_class({"mode": "nope"})
    with pytest.raises(ValueError, match="registered twice"):
        register_source("sync", "again")(SyncSource)
