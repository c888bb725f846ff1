"""benchmarks/main_job_speed.py's read-outs on hand-made scalars (no training): the median after the first step,
the ratios against the issue's targets, and the batch-invariant fingerprint's step-by-step comparison."""

import importlib.util
import sys

from helpers import ROOT

sys.path.insert(0, f"{ROOT}/benchmarks")
_spec = importlib.util.spec_from_file_location("main_job_speed", f"{ROOT}/benchmarks/main_job_speed.py")
speed = importlib.util.module_from_spec(_spec)
sys.modules["main_job_speed"] = speed
_spec.loader.exec_module(speed)


def test_median_leaves_out_the_first_step():
    assert speed.median_after_first([(1, 10.0), (2, 3.0), (3, 5.0), (4, 4.0)]) == 4.0
    assert speed.median_after_first([(1, 7.0)]) == 7.0


def test_timing_table_reads_the_ratios_against_the_targets():
    base = {"time/rollout_s": [(1, 9.0), (2, 8.0), (3, 8.0)], "time/train_s": [(1, 5.0), (2, 4.0), (3, 4.0)],
            "time/step_s": [(1, 14.0), (2, 12.0), (3, 12.0)], "perf/mfu": [(1, 0.5), (2, 0.5), (3, 0.5)]}  # fmt: skip
    head = {"time/rollout_s": [(1, 9.0), (2, 4.0), (3, 4.0)], "time/train_s": [(1, 5.0), (2, 4.0), (3, 4.0)],
            "time/step_s": [(1, 14.0), (2, 9.0), (3, 9.0)], "perf/mfu": [(1, 0.5), (2, 0.6), (3, 0.6)]}  # fmt: skip
    rows = {line.split(" | ")[0].strip("| "): line for line in speed.timing_table({"base": base, "head": head})}
    assert "| 8.000 | 4.000 | 0.500x | <= 0.5x: met |" in rows["time/rollout_s"]
    assert "| 12.000 | 9.000 | 0.750x | <= 0.7x: not met |" in rows["time/step_s"]
    assert "| 0.500 | 0.600 | 1.200x | >= 0.7: not met |" in rows["perf/mfu"]


def test_fingerprint_differences_name_the_tag_and_first_step():
    base = {"rollout/reward_mean": [(1, 0.25), (2, 0.5), (3, 0.5)], "perf/rollout_flops": [(1, 1e12), (2, 2e12)]}
    assert speed.fingerprint_differences(base, dict(base)) == []
    head = {"rollout/reward_mean": [(1, 0.25), (2, 0.5), (3, 0.5625)], "perf/rollout_flops": [(1, 1e12)]}
    assert speed.fingerprint_differences(base, head) == [
        "rollout/reward_mean: step 3: base 0.5, working tree 0.5625",
        "perf/rollout_flops: steps [1, 2] against [1]",
    ]
    # a tag only one side logs is not compared
    assert speed.fingerprint_differences({**base, "rollout/truncation_rate": [(1, 0.0)]}, dict(base)) == []


def test_async_speedup_leaves_out_the_first_step():
    """Steps are logged from 1: the first step (a rollout process starting, first-use timings) is left out by
    position. (A ``step > 0`` filter kept it, and with it the process producer's start-up, from 2026-12-02 on.)"""
    sys.path.insert(0, f"{ROOT}/benchmarks")
    import _common
    import async_speedup

    assert _common.after_first([(2, 3.0), (1, 30.0), (3, 5.0)]) == [3.0, 5.0]
    assert _common.after_first([(1, 7.0)]) == [7.0]
    s = {
        "time/step_s": [(1, 30.0), (2, 4.0), (3, 6.0)], "time/train_s": [(1, 3.0), (2, 3.0), (3, 5.0)],
        "time/rollout_s": [(1, 27.0), (2, 1.0), (3, 1.0)], "rollout/staleness_max": [(1, 0.0), (2, 1.0), (3, 1.0)],
    }  # fmt: skip
    r = async_speedup.summary(s)
    assert (r["step"], r["train"], r["rollout"], r["staleness_max"]) == (5.0, 4.0, 1.0, 1.0)
    assert r["partial"] == 0.0  # a tag the setting does not log


def test_async_speedup_ratio_interval():
    """RL steps per minute and trained tokens per second of one setting over another, with a bootstrap interval over
    the steps: hand-computed values, an interval that holds them, a point interval for constant steps."""
    sys.path.insert(0, f"{ROOT}/benchmarks")
    import async_speedup

    a = {"step_series": [5.0, 5.0, 5.0], "token_series": [100.0, 100.0, 100.0]}
    b = {"step_series": [10.0, 10.0, 10.0], "token_series": [400.0, 400.0, 400.0]}
    assert async_speedup.ratio_interval(a, b, "steps") == (2.0, 2.0, 2.0)
    assert async_speedup.ratio_interval(a, b, "tokens") == (0.5, 0.5, 0.5)  # 20 against 40 tokens a second
    a = {"step_series": [4.0, 6.0, 5.0, 5.0], "token_series": [80.0, 120.0, 100.0, 100.0]}
    point, low, high = async_speedup.ratio_interval(a, b, "steps")
    assert point == 2.0 and low < 2.0 < high and low > 1.5 and high < 2.6
    assert async_speedup.ratio_interval(a, b, "tokens")[0] == 0.5  # every step of a at 20 tokens a second


def test_async_speedup_ratio_interval_with_one_step_a_side_or_missing_tokens():
    """One timed step a side (``--steps 2``): the ratio with a NaN interval, not scipy's error after every run; token
    counts that do not match the steps are named."""
    import math

    sys.path.insert(0, f"{ROOT}/benchmarks")
    import async_speedup
    import pytest

    point, low, high = async_speedup.ratio_interval(
        {"step_series": [5.0], "token_series": [100.0]}, {"step_series": [10.0], "token_series": [100.0]}, "steps"
    )
    assert point == 2.0 and math.isnan(low) and math.isnan(high)
    with pytest.raises(ValueError, match="0 token counts for 2 steps"):
        async_speedup.ratio_interval(
            {"step_series": [5.0, 5.0], "token_series": []}, {"step_series": [1.0, 1.0], "token_series": [1.0, 1.0]},
            "tokens",
        )  # fmt: skip


def test_async_speedup_keeps_run_folders_without_overwriting_one(tmp_path):
    """``--keep``: one folder per setting, named after it; a folder already there is refused before any run (exit 2,
    naming it), and left as it was."""
    import subprocess

    sys.path.insert(0, f"{ROOT}/benchmarks")
    import async_speedup

    assert async_speedup.setting_folder("async, process producer, 1+1") == "async-process-producer-1-1"
    assert async_speedup.setting_folder("async, process, in flight (keep) + partial") == (
        "async-process-in-flight-keep-partial"
    )
    mine = tmp_path / "sync-1-thread"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    done = subprocess.run(
        [sys.executable, f"{ROOT}/benchmarks/async_speedup.py", "--force", "--keep", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2 and f"--keep: {mine} already exist(s)" in done.stderr
    assert (mine / "notes.txt").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == [mine.name]
