"""Extending the step from the user's own code, with nothing in src/ edited: a rollout mode is a ``RolloutSource``
registered with ``register_source`` (``lit_rl.rollout.sources``), an algorithm an ``Algorithm`` registered in
``register_algorithm``; a run uses each. The built-in modes resolve to their sources."""

import json

import pytest
import torch
from helpers import fast_config as cfg_for

from lit_rl.algorithms import register_algorithm, unregister_algorithm
from lit_rl.algorithms.grpo import GRPO
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
from lit_rl.run.train import run
from lit_rl.tools.compare import read_scalars


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
    assert [s for s, _ in scalars["rollout/reward_mean"]] == [1, 2]


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


class SignGRPO(GRPO):
    """GRPO whose advantage is only the sign of the group-normalised one (a toy estimator from a user's file)."""

    calls = 0

    def advantages(self, learner, rb):
        SignGRPO.calls += 1
        return torch.sign(super().advantages(learner, rb))


@pytest.fixture
def sign_algorithm():
    """``algo.name=test_sign`` while the test runs."""
    register_algorithm("test_sign")(SignGRPO)
    SignGRPO.calls = 0
    yield SignGRPO
    unregister_algorithm("test_sign")


def test_an_algorithm_registered_from_a_test_file_runs_a_step(tmp_path, sign_algorithm):
    overrides = ("trainer.max_steps=2", "algo.name=test_sign", "eval.num_examples=0", "log.samples_every_n_steps=1")
    run(cfg_for(*overrides), tmp_path / "r")
    assert SignGRPO.calls == 2
    samples = [json.loads(line) for line in open(tmp_path / "r" / "samples.jsonl")]
    assert samples and {s["advantage"] for s in samples} <= {-1.0, 0.0, 1.0}
    assert "train/pg_clipfrac" in read_scalars(str(tmp_path / "r"))
