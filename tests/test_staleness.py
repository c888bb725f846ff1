"""Stale rollouts (``rollout.mode=lagged|async``, ``lit_rl.rollout.staleness``) on the tiny model: the
logged staleness, the r_num / r_stale split, lag 0 equal to sync, exact resume of a lagged run, async's
bound on staleness, and no producer thread left behind by an exception or Ctrl-C."""

import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading

import pytest
import torch
from helpers import FAST, MOVING, ROOT
from helpers import fast_config as cfg_for
from safetensors.torch import load_file

from lit_rl.algorithms import RLModule
from lit_rl.config import ConfigError, validate
from lit_rl.rollout.producer_process import PROCESS_NAME
from lit_rl.run.train import run
from lit_rl.tools.compare import read_scalars

# REINFORCE without a baseline on a constant reward: every step moves the weights, so versions differ
MOVING = [*MOVING, "eval.num_examples=0"]
PRODUCER = "lit_rl-rollout-producer"


def values(scalars, tag):
    return [v for _, v in scalars[tag]]


def producer_threads():
    return [t for t in threading.enumerate() if t.name == PRODUCER and t.is_alive()]


def test_lagged_k2_samples_with_the_weights_of_two_steps_ago(tmp_path):
    run(cfg_for("trainer.max_steps=5", "rollout.mode=lagged", "rollout.lag=2", *MOVING), tmp_path / "r")
    s = read_scalars(tmp_path / "r")
    # before two older versions exist the oldest one is used: 0, 1, then exactly 2
    assert values(s, "rollout/staleness_mean") == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert values(s, "rollout/staleness_max") == [0.0, 1.0, 2.0, 2.0, 2.0]
    # SPEC's decomposition: the engine copy and the trainer compute alike (float32 noise: r_num ~ 0) while the
    # versions differ (r_stale > 0 once the rollouts are stale); the first step is on-policy
    r_num, r_stale = values(s, "train/r_num_abs"), values(s, "train/r_stale_abs")
    assert all(v < 1e-4 for v in r_num), r_num
    assert r_stale[0] < 1e-4 and all(v > 100 * max(r_num) for v in r_stale[1:]), (r_stale, r_num)
    assert values(s, "train/logprob_abs_diff") == r_num  # same weights, two engines


def test_lagged_k0_equals_sync_bit_for_bit(tmp_path):
    run(cfg_for("trainer.max_steps=3", *MOVING), tmp_path / "sync")
    run(cfg_for("trainer.max_steps=3", "rollout.mode=lagged", "rollout.lag=0", *MOVING), tmp_path / "lag0")
    a, b = read_scalars(tmp_path / "sync"), read_scalars(tmp_path / "lag0")
    tags = [t for t in a if not t.startswith(("time/", "perf/"))]
    assert tags and set(tags) <= set(b)
    for tag in tags:
        assert b[tag] == a[tag], tag
    wa = load_file(tmp_path / "sync" / "policy" / "model.safetensors")
    wb = load_file(tmp_path / "lag0" / "policy" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_lagged_resume_continues_exactly(tmp_path):
    """The weight history is in the checkpoint: 3 steps, then resumed to 5, equals 5 straight (lag 2)."""
    common = ["rollout.mode=lagged", "rollout.lag=2", "checkpoint.every_n_steps=1", *MOVING]
    run(cfg_for("trainer.max_steps=5", *common), tmp_path / "straight")
    run(cfg_for("trainer.max_steps=3", *common), tmp_path / "resumed")
    run(cfg_for("trainer.max_steps=5", "ckpt_path=last", *common), tmp_path / "resumed")
    a, b = read_scalars(tmp_path / "straight"), read_scalars(tmp_path / "resumed")
    for tag in [
        "rollout/staleness_mean",
        "rollout/response_length_mean",
        "train/loss",
        "train/grad_norm",
        "train/r_stale_abs",
        "train/entropy",
    ]:
        assert b[tag] == a[tag], tag


@pytest.mark.parametrize(
    "on_stale, bound, update",
    [
        ("block", 1, "between_batches"),
        ("drop", 0, "between_batches"),
        # timing decides the spans here; the exact case is in test_async_process
        pytest.param("block", 1, "in_flight", marks=pytest.mark.slow),
    ],
)
def test_async_never_consumes_a_rollout_older_than_max_staleness(tmp_path, on_stale, bound, update):
    """``rollout/staleness_max`` is taken per token (each token's own version), so it bounds every trained token,
    also with in-flight updates where one sequence may span versions."""
    run(
        cfg_for(
            "trainer.max_steps=6",
            "rollout.mode=async",
            f"rollout.max_staleness={bound}",
            f"rollout.on_stale={on_stale}",
            f"rollout.weight_update={update}",
            *MOVING,
        ),
        tmp_path / "a",
    )
    s = read_scalars(tmp_path / "a")
    assert len(s["rollout/staleness_max"]) == 6
    assert all(v <= bound for v in values(s, "rollout/staleness_max")), s["rollout/staleness_max"]
    dropped = values(s, "rollout/dropped_samples_total")
    assert dropped == sorted(dropped)  # a running count
    if on_stale == "block":
        assert dropped[-1] == 0.0  # blocking drops nothing
    for tag in ("time/trainer_wait_frac", "time/producer_idle_frac"):
        assert len(s[tag]) == 6 and all(0.0 <= v <= 1.0 for v in values(s, tag)), s[tag]
    spans = values(s, "rollout/version_span_max")
    if update == "between_batches":
        assert spans == [1.0] * 6
    else:  # a sequence spans at most the versions inside the bound
        assert len(spans) == 6 and all(1.0 <= v <= bound + 1 for v in spans), spans
    assert not producer_threads()
    # rates are the producer's own: tokens (8 completions x mean length) and FLOPs over its generate time, not over
    # the trainer's wait for the buffer (time/rollout_s, near 0 when the batch was ready: rates of millions)
    tokens = [8 * v for v in values(s, "rollout/response_length_mean")]
    generate, wait = values(s, "time/generate_s"), values(s, "time/rollout_s")
    assert values(s, "perf/rollout_tokens_per_s") == pytest.approx([t / g for t, g in zip(tokens, generate)], rel=1e-5)
    flops = values(s, "perf/rollout_flops")
    assert values(s, "perf/rollout_tflops") == pytest.approx([f / g / 1e12 for f, g in zip(flops, generate)], rel=1e-5)
    assert generate != pytest.approx(wait, rel=1e-3)  # two different clocks: the test tells them apart


def test_exception_mid_step_leaves_no_producer_thread(tmp_path, monkeypatch):
    original, calls = RLModule.update, {"n": 0}

    def failing(self, rb):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return original(self, rb)

    monkeypatch.setattr(RLModule, "update", failing)
    with pytest.raises(RuntimeError, match="injected failure"):
        run(cfg_for("trainer.max_steps=6", "rollout.mode=async", "rollout.max_staleness=2", *MOVING), tmp_path / "x")
    assert not producer_threads()
    assert not [p for p in multiprocessing.active_children() if p.name == PROCESS_NAME]  # nor a rollout process


def test_ctrl_c_mid_step_leaves_no_producer_thread(tmp_path):
    script = os.path.join(ROOT, "tests", "helpers", "staleness_probe.py")
    res = subprocess.run(
        [
            sys.executable,
            script,
            "2",
            str(tmp_path / "i"),
            *FAST,
            "trainer.max_steps=6",
            "rollout.mode=async",
            "rollout.max_staleness=2",
            *MOVING,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    out = res.stdout + res.stderr
    # Ctrl-C stops as SIGTERM does: the second step finishes, is checkpointed, exit 130 with the continue hint
    assert res.returncode == 128 + signal.SIGINT == 130, out[-3000:]
    ckpt = tmp_path / "i" / "checkpoints" / "step=2.ckpt"
    assert (
        f"lit_rl: stopped by SIGINT after RL step 2; its checkpoint is {ckpt}. "
        f"Continue with: python recipes/train.py --resume {tmp_path / 'i'}"
    ) in res.stdout, out[-3000:]
    assert ckpt.exists() and "Detected KeyboardInterrupt" not in out
    assert "rollout producer stopped (joined)" in out, out[-3000:]
    live = next(line for line in out.splitlines() if line.startswith("live threads:"))
    assert PRODUCER not in live, live
    # the default producer (rollout.producer=auto) is a process: it is gone with the run
    pid = int(re.search(r"rollout producer in process (\d+)", out).group(1))
    assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.mode=stale"], "rollout.mode='stale' is not allowed: choose one of ['sync', 'lagged', 'async']"),
        (["rollout.mode=lagged", "rollout.lag=-1"], "rollout.lag=-1 is not allowed: must be an integer >= 0"),
        (["rollout.lag=2"], "rollout.lag=2 is not allowed: is read by rollout.mode=lagged only"),
        (["rollout.mode=async", "rollout.max_staleness=-1"], "rollout.max_staleness=-1 is not allowed"),
        (["rollout.mode=async", "rollout.on_stale=wait"], "rollout.on_stale='wait' is not allowed: choose one of"),
        (["rollout.mode=async", "rollout.buffer_size=0"], "rollout.buffer_size=0 is not allowed"),
        (  # each rank's stale weights are swapped into, or copied from, its whole module
            ["rollout.mode=lagged", "trainer=fsdp"],
            "rollout.mode='lagged' is not allowed: does not run with trainer.strategy=fsdp",
        ),
        (  # a producer beside the trainer would enter vLLM's collectives out of step with the update's
            ["rollout.mode=async", "trainer=ddp", "engine=vllm"],
            "rollout.mode='async' is not allowed: does not run with engine=vllm on trainer.devices=2",
        ),
        (  # a weight sync empties vLLM's prefix cache, which vLLM refuses while requests run: refused at start-up
            ["rollout.mode=async", "rollout.weight_update=in_flight", "engine=vllm", "engine.prefix_caching=true"],
            "engine.prefix_caching=true is not allowed: cannot be emptied at an in-flight weight update",
        ),
    ],
)
def test_bad_rollout_mode_fields_are_named(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(cfg_for(*overrides))
    assert message in str(err.value)


def test_compare_plots_a_tag_against_a_swept_value(tmp_path):
    """``compare --x rollout.lag``: per run the mean of the last N values, seeds averaged, a line per setting."""
    from helpers import write_run

    from lit_rl.tools import compare

    runs = {  # run name -> final two rewards
        "correction=tis,rollout.lag=0,seed=0": [0.4, 0.6],
        "correction=tis,rollout.lag=0,seed=1": [0.6, 0.8],
        "correction=tis,rollout.lag=4,seed=0": [0.2, 0.4],
        "correction=sc,rollout.lag=0,seed=0": [0.5, 0.5],
        "correction=sc,rollout.lag=4,seed=0": [0.3, 0.5],
    }
    for name, (a, b) in runs.items():
        write_run(str(tmp_path / "sweep" / name), {"rollout/reward_mean": {0: 0.0, 1: a, 2: b}})
    assert compare.split_key("correction=tis,rollout.lag=4", "rollout.lag") == ("correction=tis", 4.0)
    out = tmp_path / "cmp"
    assert (
        compare.main(
            [
                str(tmp_path / "sweep"),
                "--tags",
                "rollout/reward_mean",
                "--x",
                "rollout.lag",
                "--final-steps",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert (out / "rollout_reward_mean_vs_rollout.lag.png").read_bytes().startswith(b"\x89PNG")
    scalars = {n: compare.read_scalars(tmp_path / "sweep" / n) for n in runs}
    lines = compare.versus(scalars, "rollout.lag", "rollout/reward_mean", last=2)
    assert lines["correction=tis"] == [(0.0, pytest.approx(0.6), 2), (4.0, pytest.approx(0.3), 1)]
    assert lines["correction=sc"] == [(0.0, pytest.approx(0.5), 1), (4.0, pytest.approx(0.4), 1)]
    table = (out / "summary_vs_rollout.lag.md").read_text()
    assert "| correction=tis | 0.6 | 0.3 |" in table and "rollout.lag=0 | rollout.lag=4" in table


def test_compare_shift_by_staleness_aligns_rollouts_with_their_version():
    """``--shift-by rollout/staleness_mean --window A:B``: a lagged run's reward at step s belongs to version
    s - staleness(s); the window then averages the same versions for every lag."""
    from lit_rl.tools import compare

    lag2 = {
        "rollout/reward_mean": [(0, 0.1), (1, 0.2), (2, 0.3), (3, 0.4), (4, 0.5)],
        "rollout/staleness_mean": [(0, 0.0), (1, 1.0), (2, 2.0), (3, 2.0), (4, 2.0)],
    }
    assert compare.shifted(lag2["rollout/reward_mean"], lag2["rollout/staleness_mean"]) == [
        (0, 0.1),
        (0, 0.2),
        (0, 0.3),
        (1, 0.4),
        (2, 0.5),
    ]
    lag0 = {
        "rollout/reward_mean": [(0, 0.0), (1, 0.6), (2, 0.8), (3, 0.9), (4, 1.0)],
        "rollout/staleness_mean": [(s, 0.0) for s in range(5)],
    }
    lines = compare.versus(
        {"rollout.lag=0": lag0, "rollout.lag=2": lag2},
        "rollout.lag",
        "rollout/reward_mean",
        window=(1, 2),
        shift_by="rollout/staleness_mean",
    )
    assert lines["(default)"] == [(0.0, pytest.approx(0.7), 1), (2.0, pytest.approx(0.45), 1)]
