"""Faults during a run: SIGKILL at any point then ``ckpt_path=last`` continues exactly; atomic checkpoints;
non-finite updates skipped, counted, and a stop after too many in a row."""

import math
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
from helpers import FAST, MOVING, ROOT
from helpers import fast_config as cfg_for

from lit_rl.algorithms import GRPO, NonFiniteUpdates
from lit_rl.run.checkpoints import AtomicCheckpointIO, find_last
from lit_rl.run.train import run
from lit_rl.tools.compare import read_scalars

SCRIPT = os.path.join(ROOT, "tests", "helpers", "fault_injection.py")
# REINFORCE without a baseline on a constant reward: A = 1 on every token, so every step moves the weights
# and the optimizer state (on the tiny model the arithmetic reward is always 0 and GRPO would never move)
COMMON = [*FAST, *MOVING, "eval.num_examples=0", "checkpoint.every_n_steps=1", "trainer.max_steps=4"]
TAGS = [
    "rollout/reward_mean",
    "rollout/response_length_mean",
    "train/loss",
    "train/grad_norm",
    "train/entropy",
    "train/skipped_updates",
    "train/logprob_abs_diff",
]


def launch(fault, call, out, *overrides, env=None):
    return subprocess.run(
        [sys.executable, SCRIPT, fault, str(call), str(out), *COMMON, *overrides],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight") / "run"
    res = launch("none", 0, out)
    assert res.returncode == 0, res.stderr[-3000:]
    scalars = read_scalars(out)
    assert all(v > 0 for _, v in scalars["train/grad_norm"])  # the weights move at every step
    return scalars


# the update and checkpoint-write kill points run with -m slow (the default suite is at its time limit): rollout
# covers a kill mid-step, ckpt_link one during checkpointing, test_atomic_checkpoint_io_replaces_whole_files the
# half-written file
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "fault",
    [
        "rollout",
        pytest.param("update", marks=SLOW),
        pytest.param("ckpt_write", marks=SLOW),
        pytest.param("ckpt_link", marks=SLOW),
    ],
)
def test_sigkill_then_resume_equals_an_uninterrupted_run(straight, tmp_path, fault):
    """Killed during the third step's rollout or update, or while its checkpoint is written or linked."""
    out = tmp_path / "run"
    res = launch(fault, 3, out)
    assert res.returncode == -signal.SIGKILL, (res.returncode, res.stderr[-3000:])
    assert not (out / "finished.json").exists()
    if fault == "ckpt_write":  # the half-written file never took the checkpoint's name
        assert any(".partial-" in p.name for p in (out / "checkpoints").iterdir())
    if fault == "ckpt_link":  # the previous step file is gone and last.ckpt dangles: resume finds the new one
        assert os.path.islink(out / "checkpoints" / "last.ckpt")
        assert not (out / "checkpoints" / "last.ckpt").exists()
    resumed_from = find_last(out / "checkpoints")
    expected_step = {"rollout": 2, "update": 2, "ckpt_write": 2, "ckpt_link": 3}[fault]
    assert torch.load(resumed_from, weights_only=False)["global_step"] == expected_step

    res = launch("none", 0, out, "ckpt_path=last")
    assert res.returncode == 0, res.stderr[-3000:]
    got = read_scalars(out)
    for tag in TAGS:
        assert [s for s, _ in got[tag]] == [s for s, _ in straight[tag]] == [1, 2, 3, 4], tag  # no lost step
        assert [v for _, v in got[tag]] == [v for _, v in straight[tag]], tag  # identical, not close


def assert_resumes_exactly(straight, out, *overrides, env=None):
    """Continue the stopped run in ``out``; every logged value equals the uninterrupted run's, step for step."""
    res = launch("none", 0, out, *overrides, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    got = read_scalars(out)
    for tag in TAGS:
        assert [s for s, _ in got[tag]] == [s for s, _ in straight[tag]] == [1, 2, 3, 4], tag
        assert [v for _, v in got[tag]] == [v for _, v in straight[tag]], tag  # identical, not close
    return res


def assert_stopped_with_checkpoint(res, out, signame, step):
    """Stopped after RL step ``step`` (no later step logged), its checkpoint the only one, named in the message."""
    ckpt = out / "checkpoints" / f"step={step}.ckpt"
    assert (
        f"lit_rl: stopped by {signame} after RL step {step}; its checkpoint is {ckpt}. "
        f"Continue with: python recipes/train.py --resume {out}"
    ) in res.stdout, res.stdout[-2000:]
    assert not (out / "finished.json").exists()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["last.ckpt", ckpt.name]  # no partial file
    assert torch.load(find_last(out / "checkpoints"), weights_only=False)["global_step"] == step
    assert [s for s, _ in read_scalars(out)["train/loss"]] == list(range(1, step + 1))  # the last logged is `step`


# checkpoint.every_n_steps=10: the checkpoint a preempted run leaves is the one the signal made it write
RARE_CHECKPOINTS = "checkpoint.every_n_steps=10"


@pytest.mark.parametrize(
    "fault, step",
    [
        ("sigterm_rollout", 3),  # during the third step's rollout: the step finishes, then its checkpoint
        # after the second step's checkpoint hook: no third step starts (-m slow; the DDP test below covers the
        # between-steps window with two ranks in the default suite)
        pytest.param("sigterm_between", 2, marks=pytest.mark.slow),
    ],
)
def test_sigterm_checkpoints_the_last_finished_step_exits_143_and_resumes_exactly(straight, tmp_path, fault, step):
    """SIGTERM (what SLURM and Kubernetes send before preempting) used to exit 0 without a checkpoint. A second
    SIGTERM arrives while the checkpoint is written; the file is whole all the same."""
    out = tmp_path / "run"
    res = launch(fault, step if fault == "sigterm_between" else 3, out, RARE_CHECKPOINTS)
    assert res.returncode == 128 + signal.SIGTERM == 143, (res.returncode, res.stderr[-3000:])
    assert_stopped_with_checkpoint(res, out, "SIGTERM", step)
    assert res.stderr.count("lit_rl: received SIGTERM (rank 0)") == 2  # the second came during the checkpoint's write
    assert_resumes_exactly(straight, out, RARE_CHECKPOINTS, "ckpt_path=last")


@pytest.mark.slow  # ~30 s: three launches; the default suite checkpoints and stops on SIGTERM mid-step above
def test_sigusr1_under_slurm_checkpoints_requeues_and_the_requeued_job_continues(straight, tmp_path):
    """A simulated SLURM job (Lightning's SLURMEnvironment detects it; auto_requeue is its default) gets SIGUSR1
    (``#SBATCH --signal=USR1@90``): the step finishes, is checkpointed, the job requeues itself through
    ``scontrol`` (a stand-in on PATH records its arguments) and exits 138; started again by SLURM with the same
    command (``SLURM_RESTART_COUNT=1``), it continues from that checkpoint and ends as the uninterrupted run."""
    record = tmp_path / "scontrol.args"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {record}\n')
    (bin_dir / "scontrol").chmod(0o755)
    slurm = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "lit_rl",
        "SLURM_NTASKS": "1",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NODELIST": "localhost",
    }
    out = tmp_path / "run"
    res = launch("sigusr1_rollout", 3, out, RARE_CHECKPOINTS, env=dict(os.environ, **slurm))
    assert res.returncode == 128 + signal.SIGUSR1 == 138, (res.returncode, res.stderr[-3000:])
    assert_stopped_with_checkpoint(res, out, "SIGUSR1", 3)
    assert record.read_text() == "requeue 4242\n"  # once, after the checkpoint (the line above)
    assert res.stdout.index("lit_rl: requeued SLURM job 4242") < res.stdout.index("lit_rl: stopped by SIGUSR1")
    res = assert_resumes_exactly(
        straight, out, RARE_CHECKPOINTS, env=dict(os.environ, **slurm, SLURM_RESTART_COUNT="1")
    )
    assert f"lit_rl: SLURM started this job again: continuing {out} from its last checkpoint" in res.stdout
    assert record.read_text() == "requeue 4242\n"  # the finished job did not requeue


def test_atomic_checkpoint_io_replaces_whole_files(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "ckpt" / "a.ckpt"
    io.save_checkpoint({"global_step": 1, "w": torch.ones(3)}, path)
    io.save_checkpoint({"global_step": 2, "w": torch.zeros(3)}, path)
    assert torch.load(path)["global_step"] == 2
    assert os.listdir(path.parent) == ["a.ckpt"]  # no temporary left behind
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({}, path, storage_options={"x": 1})


def test_find_last_prefers_the_link_then_the_newest_complete_file(tmp_path):
    assert find_last(tmp_path) is None
    (tmp_path / "step=1.ckpt").write_bytes(b"1")
    (tmp_path / "step=2.ckpt").write_bytes(b"2")
    os.utime(tmp_path / "step=1.ckpt", ns=(1, 1))
    (tmp_path / "step=3.ckpt.partial-99").write_bytes(b"3")
    assert find_last(tmp_path).name == "step=2.ckpt"
    os.symlink("step=1.ckpt", tmp_path / "last.ckpt")
    assert find_last(tmp_path).name == "last.ckpt"
    os.symlink("gone.ckpt", tmp_path / "dangling")
    os.replace(tmp_path / "dangling", tmp_path / "last.ckpt")
    assert find_last(tmp_path).name == "step=2.ckpt"


def nan_advantages_at(steps):
    """GRPO advantages that are NaN at the given optimizer steps (a diverged batch)."""
    original = GRPO.advantages

    def advantages(self, learner, rb):
        adv = original(self, learner, rb)
        return torch.full_like(adv, math.nan) if learner.global_step in steps else adv

    return advantages


def test_a_non_finite_update_is_skipped_and_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(GRPO, "advantages", nan_advantages_at({1}))
    run(cfg_for("trainer.max_steps=3", "eval.num_examples=0", "checkpoint.every_n_steps=1"), tmp_path / "r")
    s = read_scalars(tmp_path / "r")
    assert [v for _, v in s["train/skipped_updates"]] == [0.0, 1.0, 1.0]
    assert math.isnan(s["train/grad_norm"][1][1]) and math.isfinite(s["train/grad_norm"][2][1])


def test_too_many_non_finite_updates_in_a_row_stop_the_run_naming_the_step(tmp_path, monkeypatch):
    monkeypatch.setattr(GRPO, "advantages", nan_advantages_at({1, 2, 3, 4, 5}))
    with pytest.raises(
        NonFiniteUpdates,
        match=r"3 updates in a row .* stopped at RL step 4 .*"  # the fourth step (steps are numbered from 1)
        r"optim.max_nonfinite_updates=3",
    ):
        run(cfg_for("trainer.max_steps=6", "eval.num_examples=0", "checkpoint.every_n_steps=1"), tmp_path / "r")
    # the checkpoints written before stay; the run is not marked finished
    assert find_last(tmp_path / "r" / "checkpoints") is not None
    assert not (tmp_path / "r" / "finished.json").exists()


def test_a_finished_run_checkpoints_its_last_step_whatever_every_n_steps_is(tmp_path):
    """max_steps=3 with a checkpoint every 2 steps: the end of the run is checkpointed too, last.ckpt points
    at it, and only that one file is kept (save_top_k=1)."""
    out = tmp_path / "r"
    run(cfg_for("trainer.max_steps=3", "checkpoint.every_n_steps=2", "eval.num_examples=0", *MOVING), out)
    last = find_last(out / "checkpoints")
    assert torch.load(last, weights_only=False)["global_step"] == 3
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["last.ckpt", "step=3.ckpt"]


def test_continuing_with_another_algorithm_is_a_config_error(tmp_path):
    from lit_rl.config import ConfigError

    out = tmp_path / "r"
    run(cfg_for("trainer.max_steps=1", "eval.num_examples=0"), out)
    # the run's folder: its saved config is the run's config, and another algorithm differs from it
    with pytest.raises(ConfigError, match=r"algo.name \(the run: 'grpo', now: 'ppo'\)"):
        run(cfg_for("algo=ppo", "trainer.max_steps=2", "eval.num_examples=0", "ckpt_path=last"), out)
    # a checkpoint file started from elsewhere: its weights do not fit the new module
    with pytest.raises(
        ConfigError,
        match=r"does not fit this config \(it was written by algo=grpo\): missing "
        r"\['algorithm.value_head.weight'",
    ):
        run(
            cfg_for(
                "algo=ppo", "trainer.max_steps=2", "eval.num_examples=0", f"ckpt_path={find_last(out / 'checkpoints')}"
            ),
            tmp_path / "elsewhere",
        )


def test_constant_reward_is_for_training_only_eval_uses_the_real_verifier(tmp_path):
    """Correctness stays the verifier's in training too: a reward of 1 for every completion does not make the
    2 groups all correct; the random tiny model answers no sum right, so both are all wrong."""
    out = tmp_path / "r"
    run(cfg_for("trainer.max_steps=1", "eval.num_examples=4", "eval.every_n_steps=1", *MOVING), out)
    s = read_scalars(out)
    assert [v for _, v in s["rollout/reward_mean"]] == [1.0]
    assert [v for _, v in s["eval/accuracy"]] == [0.0]  # the random tiny model answers no sum right
    assert [v for _, v in s["eval/reward_mean"]] == [0.0]
    assert [v for _, v in s["rollout/groups_all_correct"]] == [0.0]
    assert [v for _, v in s["rollout/groups_all_wrong"]] == [2.0]


@pytest.mark.parametrize(
    "fault, call, step",
    [
        # right after the ranks agreed at the end of step 2 (the window where a flag raised on rank 0 alone
        # made it leave the loop while rank 1 waited in step 3's first collective: a hang, seen in CI)
        ("sigusr1_between", 2, 3),
        # mid-step (Lightning's own SIGTERM handler is replaced during training); -m slow: one process's
        # mid-step SIGTERM runs in the default suite above
        pytest.param("sigterm_rollout", 2, 2, marks=pytest.mark.slow),
    ],
)
def test_a_signal_to_rank_0_of_a_ddp_run_stops_both_ranks_at_one_checkpointed_step(tmp_path, fault, call, step):
    """``trainer=ddp trainer.devices=2`` (2 CPU processes, gloo), a signal to rank 0 alone: the ranks agree on
    it at the end of a step (an all-reduce) and raise Lightning's flag together, both write the checkpoint (a
    collective) and stop, none hangs; exit status 128 + signal. A signal that arrives after a step's
    agreement is acted on at the end of the next step."""
    out = tmp_path / "ddp"
    signum = signal.SIGUSR1 if "sigusr1" in fault else signal.SIGTERM
    cmd = [sys.executable, SCRIPT, fault, str(call), str(out), *COMMON, RARE_CHECKPOINTS, "trainer.max_steps=6"]
    cmd += ["trainer=ddp", "trainer.devices=2", "threads=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(  # its own process group: the cleanup below ends both ranks, a hung one included
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # rank 1 too, should it outlive rank 0 (before: a hang)
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == 128 + signum, (proc.returncode, stderr[-3000:])
    assert stderr.count(f"lit_rl: received {signal.Signals(signum).name} (rank 1)") == 0  # rank 0 alone
    assert_stopped_with_checkpoint(
        subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), out, signal.Signals(signum).name, step
    )


def test_a_helper_started_shielded_outlives_the_stop_signals():
    """``producer_process.shielded_start``: a process started inside it (the rollout process, multiprocessing's
    resource tracker) has SIGINT, SIGTERM and SIGUSR1 blocked, so a signal to the process group is the trainer's
    alone; the trainer's own mask is restored afterwards."""
    import time

    from lit_rl.rollout.producer_process import STOP_SIGNALS, shielded_start

    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    with shielded_start():
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before
        for signum in STOP_SIGNALS:
            os.kill(child.pid, signum)
        time.sleep(0.5)
        assert child.poll() is None  # SIGUSR1's default action would have ended it
        blocked = int(re.search(r"SigBlk:\s*([0-9a-f]+)", open(f"/proc/{child.pid}/status").read()).group(1), 16)
        assert all(blocked >> (int(s) - 1) & 1 for s in STOP_SIGNALS)
    finally:
        child.kill()
        child.wait()


@pytest.mark.slow  # ~70 s each: a recipe launch stopped by the signal, then the continued run
@pytest.mark.parametrize(
    "fault, stop_step, staleness",
    [
        # as the first batch is requested from the rollout process (the trainer waits for it): step 1 finishes
        ("sigusr1_group_rollout", 1, [0.0, 0.0, 1.0, 1.0]),
        # between steps 2 and 3 (after step 2's checkpoint hook)
        ("sigterm_group_between", 2, [0.0, 1.0, 0.0, 1.0]),
    ],
)
def test_a_signal_to_an_async_run_s_process_group_checkpoints_stops_both_and_resume_regenerates(
    tmp_path, fault, stop_step, staleness
):
    """``rollout.mode=async`` with its rollout process, the signal sent to the whole process group (as SLURM
    signals every process of a job step): the rollout process, the resource tracker and the verifier workers
    leave it to the trainer, which finishes the step, checkpoints it, stops the rollout process and exits
    128 + signal. (Before, SIGUSR1 killed the verifier workers and the tracker: the run failed with
    BrokenPipeError and no checkpoint.) The continued run regenerates the buffer from the checkpoint's weights:
    its first batch has staleness 0 (the uninterrupted run's would have had 1), then 1 again, and the logged
    staleness and ``train/r_stale_abs`` are those of the versions that sampled each token."""
    out = tmp_path / "run"
    overrides = [*COMMON, RARE_CHECKPOINTS, "rollout.mode=async", "rollout.producer=process"]
    res = subprocess.run(
        [sys.executable, SCRIPT, fault, str(stop_step), str(out), *overrides],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        start_new_session=True,  # the group signalled is the run's alone
    )
    signame = "SIGUSR1" if "sigusr1" in fault else "SIGTERM"
    assert res.returncode == 128 + signal.Signals[signame], (res.returncode, res.stderr[-3000:])
    assert_stopped_with_checkpoint(res, out, signame, stop_step)
    pid = int(re.search(r"rollout producer in process (\d+)", res.stdout).group(1))
    assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()
    assert "BrokenPipeError" not in res.stderr
    res = launch("none", 0, out, RARE_CHECKPOINTS, "rollout.mode=async", "rollout.producer=process", "ckpt_path=last")
    assert res.returncode == 0, res.stderr[-3000:]
    got = read_scalars(out)
    assert [s for s, _ in got["rollout/staleness_max"]] == [1, 2, 3, 4]
    assert [v for _, v in got["rollout/staleness_max"]] == [v for _, v in got["rollout/staleness_mean"]] == staleness
    r_stale = [v for _, v in got["train/r_stale_abs"]]
    assert [v > 0 for v in r_stale] == [v > 0 for v in staleness]  # exactly 0 where no token is stale


@pytest.mark.slow  # ~3 min: two launches of 2 ranks
def test_a_sigusr1_to_an_async_ddp_run_s_group_stops_both_ranks_and_rollout_processes_at_one_step(tmp_path):
    """``trainer=ddp trainer.devices=2 rollout.mode=async``: SIGUSR1 to the whole group (both ranks, their rollout
    processes, the trackers) right after the ranks agreed at the end of step 2 is acted on at the end of step 3 by
    both ranks together; the checkpoint is step 3's, both rollout processes are stopped, exit 138. The continued
    run's producers regenerate their buffers: staleness 0 at step 4, then 1."""
    out = tmp_path / "run"
    ddp = ["trainer=ddp", "trainer.devices=2", "threads=1", "rollout.mode=async", "rollout.producer=process"]
    overrides = [*COMMON, RARE_CHECKPOINTS, "trainer.max_steps=6", *ddp]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, "sigusr1_group_between", "2", str(out), *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=400)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything left of the group, should a rank hang
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == 138, (proc.returncode, stderr[-3000:])
    res = subprocess.CompletedProcess([], proc.returncode, stdout, stderr)
    assert_stopped_with_checkpoint(res, out, "SIGUSR1", 3)
    pids = [int(p) for p in re.findall(r"rollout producer in process (\d+)", stdout)]
    assert len(pids) == 2  # one per rank
    assert all(not os.path.exists(f"/proc/{p}") or "zombie" in open(f"/proc/{p}/status").read().lower() for p in pids)
    res = launch("none", 0, out, RARE_CHECKPOINTS, "trainer.max_steps=6", *ddp, "ckpt_path=last", env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    staleness = read_scalars(out)["rollout/staleness_max"]
    assert staleness == [(1, 0.0), (2, 1.0), (3, 1.0), (4, 0.0), (5, 1.0), (6, 1.0)]


@pytest.mark.slow  # ~35 s (a cold start of the recipe); test_staleness.py covers Ctrl-C mid-step in the default suite
def test_ctrl_c_checkpoints_the_step_exits_130_with_the_continue_hint(tmp_path):
    """Ctrl-C (SIGINT from outside, to ``python recipes/train.py``) used to exit 1 through Lightning's
    KeyboardInterrupt with no checkpoint and no hint: it now stops as SIGTERM does. The signal comes once the
    second step's line is out, so the run stops after a step that no periodic checkpoint covered."""
    import re

    out = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "recipes", "train.py"), *COMMON, RARE_CHECKPOINTS]
    cmd += ["trainer.max_steps=40", "log.plain_lines=true", f"hydra.run.dir={out}"]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        # a background job of a non-interactive shell inherits SIGINT ignored: give the run a terminal's default
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("lit_rl: step 2/"):
                proc.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal sends
                break
        stdout = "".join(lines) + proc.stdout.read()
        stderr = proc.stderr.read()
        code = proc.wait(timeout=300)
    finally:
        proc.kill()
    assert code == 128 + signal.SIGINT == 130, (code, stderr[-3000:])
    assert "Detected KeyboardInterrupt" not in stdout + stderr
    assert "lit_rl: received SIGINT (rank 0); finishing this step, then checkpointing it" in stderr
    m = re.search(
        r"lit_rl: stopped by SIGINT after RL step (\d+); its checkpoint is (\S+)\. Continue with: (.*)", stdout
    )
    assert m is not None, stdout[-2000:]
    step = int(m.group(1))
    assert 2 <= step < 40 and m.group(3) == f"python recipes/train.py --resume {out}"
    assert m.group(2) == str(out / "checkpoints" / f"step={step}.ckpt")
    assert torch.load(m.group(2), weights_only=False)["global_step"] == step
    assert not (out / "finished.json").exists()


@pytest.mark.parametrize("first", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT], ids=["term", "usr1", "int"])
def test_ctrl_c_after_any_stop_signal_stops_at_once(first, capfd):
    """A run that a stop signal did not end (stuck before its next safe point) stops on Ctrl-C: a SIGINT after
    SIGTERM or SIGUSR1 used to be noted again and nothing happened (a new user had to kill -9 such a run)."""
    from lit_rl.run.preemption import RunCheckpoint

    cb = RunCheckpoint()
    cb._on_signal(first, None)
    assert cb.signum == first and f"received {first.name}" in capfd.readouterr().err
    with pytest.raises(KeyboardInterrupt):
        cb._on_signal(signal.SIGINT, None)
