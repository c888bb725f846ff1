"""benchmarks/bit_identity.py's comparison of two runs' TensorBoard scalars, on small event files written here
(no training): identical runs pass, a one-ulp change, a missing tag and a shifted step are each reported with
the tag and step, and wall-clock tags are not compared."""

import importlib.util
import json
import math
import sys

import numpy as np
import pytest
from helpers import ROOT
from torch.utils.tensorboard import SummaryWriter

_spec = importlib.util.spec_from_file_location("bit_identity", f"{ROOT}/benchmarks/bit_identity.py")
bit_identity = importlib.util.module_from_spec(_spec)
sys.modules["bit_identity"] = bit_identity  # dataclasses look their module up by name
_spec.loader.exec_module(bit_identity)

ONE = np.float32(1.0)
ONE_ULP_UP = np.nextafter(ONE, np.float32(2.0))  # 1 + 2**-23: the next float32 the writer can store

SCALARS = {
    "train/loss": [0.5, 0.25, 0.125],
    "train/grad_norm": [1.0, 1.5, float("nan")],
    "rollout/reward_mean": [0.0, -0.0, 1.0],
    "perf/update_flops": [4.9656913920e10] * 3,
    "time/step_s": [1.1, 1.2, 1.3],
    "perf/mfu": [0.13, 0.14, 0.15],
}


def write_run(folder, scalars: dict[str, list[float]], steps=(0, 1, 2)):
    """One event file under ``folder``/tensorboard with ``scalars`` at ``steps``, as the recipe's logger writes."""
    w = SummaryWriter(str(folder / "tensorboard"))
    for i, step in enumerate(steps):
        for tag, values in scalars.items():
            if i < len(values):
                w.add_scalar(tag, values[i], step)
    w.close()
    return bit_identity.read_scalars(folder)


def test_identical_runs_compare_equal(tmp_path):
    base = write_run(tmp_path / "a", SCALARS)
    head = write_run(tmp_path / "b", SCALARS)
    assert base["train/loss"] == [(0, 0.5), (1, 0.25), (2, 0.125)]
    c = bit_identity.compare_scalars(base, head)
    assert c.identical and c.first is None
    assert c.tags == 4 and c.steps == 3 and c.records == 12  # NaN equals NaN
    assert sorted(c.skipped) == ["perf/mfu", "time/step_s"]


def test_one_ulp_is_reported_with_tag_and_step(tmp_path):
    base = write_run(tmp_path / "a", {**SCALARS, "train/entropy": [2.0, float(ONE), 3.0]})
    head = write_run(tmp_path / "b", {**SCALARS, "train/entropy": [2.0, float(ONE_ULP_UP), 3.0]})
    c = bit_identity.compare_scalars(base, head)
    assert not c.identical and len(c.differences) == 1
    d = c.first
    assert (d.tag, d.step, d.kind) == ("train/entropy", 1, "value")
    assert d.base == 1.0 and d.head == 1.0 + 2**-23
    assert "train/entropy @ step 1" in str(d)


def test_missing_tag_and_shifted_step_are_reported(tmp_path):
    base = write_run(tmp_path / "a", {**SCALARS, "eval/accuracy": [0.5]})
    head = write_run(tmp_path / "b", SCALARS)
    c = bit_identity.compare_scalars(base, head)
    assert [(d.tag, d.kind) for d in c.differences] == [("eval/accuracy", "missing")]
    assert "logged by the base only" in str(c.first)

    shifted = write_run(tmp_path / "c", SCALARS, steps=(0, 1, 3))
    c = bit_identity.compare_scalars(base | {"eval/accuracy": []}, shifted | {"eval/accuracy": []})
    assert {d.tag for d in c.differences} == {
        "train/loss",
        "train/grad_norm",
        "rollout/reward_mean",
        "perf/update_flops",
    }
    assert {(d.step, d.kind) for d in c.differences} == {(2, "steps")}


def test_wall_clock_differences_are_skipped_flop_counts_are_not(tmp_path):
    base = write_run(tmp_path / "a", SCALARS)
    head = write_run(tmp_path / "b", {**SCALARS, "time/step_s": [9.0, 9.0, 9.0], "perf/mfu": [0.9] * 3})
    assert bit_identity.compare_scalars(base, head).identical
    flops = write_run(tmp_path / "c", {**SCALARS, "perf/update_flops": [4.9656913920e10, 5e10, 4.9656913920e10]})
    c = bit_identity.compare_scalars(base, flops)
    assert [(d.tag, d.step) for d in c.differences] == [("perf/update_flops", 1)]
    for tag in ("time/rollout_s", "perf/rollout_tokens_per_s", "perf/update_tflops", "perf/threads", "mfu"):
        assert bit_identity.is_wall_clock(tag), tag
    for tag in ("perf/rollout_flops", "perf/update_flops", "train/loss"):
        assert not bit_identity.is_wall_clock(tag), tag


def test_sign_of_zero_counts_and_the_cache_round_trips_exactly(tmp_path):
    assert bit_identity.same_value(math.nan, -math.nan)
    assert not bit_identity.same_value(0.0, -0.0)
    base = write_run(tmp_path / "a", SCALARS)
    assert base["rollout/reward_mean"][1] == (1, 0.0) and math.copysign(1, base["rollout/reward_mean"][1][1]) == -1
    key = {"case": "t", "commands": [["a=1"]]}
    path = tmp_path / "cache" / "t.json"
    bit_identity.save_cached(path, key, base, 12.5)
    assert json.loads(path.read_text())["key"] == key
    loaded, seconds = bit_identity.load_cached(path, key)
    assert seconds == 12.5 and bit_identity.compare_scalars(base, loaded).identical
    assert bit_identity.load_cached(path, {**key, "case": "other"}) is None


def test_resumed_run_keeps_every_record_in_write_order(tmp_path):
    """A continued run writes a second event file; a step logged in both files is kept twice, in order."""
    write_run(tmp_path / "r", {"train/loss": [0.5, 0.25]}, steps=(0, 1))
    second = write_run(tmp_path / "r", {"train/loss": [0.24, 0.125]}, steps=(1, 2))
    assert second["train/loss"] == [(0, 0.5), (1, 0.25), (1, pytest.approx(0.24)), (2, 0.125)]


def test_a_base_that_numbers_steps_from_0_is_compared_step_for_step(tmp_path):
    """Steps are logged from 1 since ``FIRST_LOGGED_STEP``; a base from before logged from 0. The base's steps are
    moved by the difference of the two origins, so the check stays step for step: a value one step off differs."""
    assert bit_identity.first_logged_step("x = 0\nFIRST_LOGGED_STEP = 1\n") == 1
    assert bit_identity.first_logged_step("def f():\n    return 0\n") == 0  # no declaration: the code before
    assert bit_identity.step_origin(None) == 1
    base = write_run(tmp_path / "a", SCALARS)  # steps 0, 1, 2
    head = write_run(tmp_path / "b", SCALARS, steps=(1, 2, 3))
    assert not bit_identity.compare_scalars(base, head).identical
    assert bit_identity.compare_scalars(bit_identity.shift_steps(base, 1), head).identical
    late = write_run(tmp_path / "c", {**SCALARS, "train/loss": [0.5, 0.25, 0.25]}, steps=(1, 2, 3))
    c = bit_identity.compare_scalars(bit_identity.shift_steps(base, 1), late)
    assert [(d.tag, d.step, d.kind) for d in c.differences] == [("train/loss", 3, "value")]
