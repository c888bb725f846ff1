"""A run folder belongs to one run: default folders are unique per process, and a run claims its folder
atomically at start-up (issue 19, item 4: two runs started in the same second shared one)."""

import glob
import os
import re
import subprocess
import sys
import time

import pytest
import yaml
from helpers import ROOT
from helpers import fast_config as cfg_for

from lit_rl.config import ConfigError
from lit_rl.run.runfolder import LOCK_NAME, claim_run_folder, discard_refused_run_folder
from lit_rl.run.train import run
from lit_rl.tools.compare import read_scalars

BARRIER = os.path.join(ROOT, "tests", "helpers", "barrier_start.py")
CLI = [
    "model=tiny",
    "trainer.precision=32-true",
    "trainer.enable_progress_bar=false",
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "sampling.max_new_tokens=8",
    "eval.num_examples=0",
    "trainer.max_steps=1",
]


def start_together(cwd, runs: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """Start one ``recipes/train.py`` per argument list, released at the same moment (a barrier file)."""
    barrier = str(cwd / "go")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.join(ROOT, "src"))
    procs = [
        subprocess.Popen(
            [sys.executable, BARRIER, barrier, *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in runs
    ]
    deadline = time.monotonic() + 300
    while len(glob.glob(barrier + ".ready-*")) < len(procs):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.01)
    open(barrier, "w").close()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


@pytest.mark.slow  # ~25 s: two real runs; the default folder names are checked without a run below
def test_two_runs_started_together_with_the_default_folder_take_their_own(tmp_path):
    """The shell loop of the issue (``for s in 0 1; do python recipes/train.py seed=$s & done``), released by a
    barrier: each run has its own folder, config, events and finished.json."""
    results = start_together(tmp_path, [[*CLI, "seed=0"], [*CLI, "seed=1"]])
    for res in results:
        assert res.returncode == 0, res.stderr[-3000:]
    folders = sorted(glob.glob(str(tmp_path / "outputs" / "*" / "*")))
    assert len(folders) == 2, folders
    seeds = sorted(yaml.safe_load(open(os.path.join(f, "config.yaml")))["seed"] for f in folders)
    assert seeds == [0, 1]
    for folder in folders:
        assert os.path.isfile(os.path.join(folder, "finished.json"))
        assert len(glob.glob(os.path.join(folder, "events.*"))) == 1  # one run's events
        assert [s for s, _ in read_scalars(folder)["train/loss"]] == [1]


def test_two_runs_started_together_in_one_named_folder_never_share_it(tmp_path):
    """The same ``hydra.run.dir`` given to two runs released together: one claims it and runs, the other is
    refused with one line naming the folder and the run that holds it, before it writes a file of the run."""
    out = tmp_path / "shared"
    results = start_together(
        tmp_path, [[*CLI, "seed=0", f"hydra.run.dir={out}"], [*CLI, "seed=1", f"hydra.run.dir={out}"]]
    )
    codes = sorted(r.returncode for r in results)
    assert codes == [0, 2], [r.stderr[-2000:] for r in results]
    winner, loser = sorted(results, key=lambda r: r.returncode)
    lines = [line for line in loser.stderr.splitlines() if line.startswith("lit_rl: error:")]
    assert len(lines) == 1 and "Traceback" not in loser.stderr
    assert lines[0].startswith(f"lit_rl: error: output folder {out} is in use by a running lit_rl run (pid ")
    winner_seed = 0 if "seed=0" in winner.args else 1
    assert yaml.safe_load((out / "config.yaml").read_text())["seed"] == winner_seed
    assert len(list(out.glob("events.*"))) == 1
    assert (out / "finished.json").is_file()


def test_a_live_claim_refuses_a_second_run_and_resume_and_a_dead_one_is_taken_over(tmp_path):
    out = tmp_path / "run"
    held = claim_run_folder(out)  # as a run alive in this folder holds it
    try:
        with pytest.raises(
            ConfigError, match=rf"output folder {out} is in use by a running lit_rl run \(pid {os.getpid()} on host "
        ):
            run(cfg_for("trainer.max_steps=1", "eval.num_examples=0"), out)
    finally:
        held.release()
    run(cfg_for("trainer.max_steps=1", "eval.num_examples=0"), out)  # released: the folder is free
    assert (out / LOCK_NAME).is_file() and (out / "finished.json").is_file()
    # a claim left by a process that died: the kernel dropped its lock; the folder's usual rules apply
    script = (
        f"from lit_rl.run.runfolder import claim_run_folder as c; c({str(out)!r}, resume=True); import os; os._exit(9)"
    )
    res = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src")))
    assert res.returncode == 9
    with pytest.raises(ConfigError, match="already holds a finished run"):
        run(cfg_for("trainer.max_steps=1", "eval.num_examples=0"), out)
    run(cfg_for("trainer.max_steps=2", "eval.num_examples=0", "ckpt_path=last"), out)  # continuing takes it over
    assert [s for s, _ in read_scalars(out)["train/loss"]] == [1, 2]


def test_a_claim_refused_while_the_holder_writes_its_record_names_the_holder(tmp_path):
    """CI case: the loser of a start-together race tried the lock after the winner had taken it but before the
    winner had written its pid, and named "another process". The refused claim now waits for the record."""
    import fcntl
    import json
    import socket
    import threading

    out = tmp_path / "run"
    out.mkdir()
    path = out / LOCK_NAME
    path.write_text(json.dumps({"pid": 999999999, "host": socket.gethostname(), "started": "old"}))  # a dead run's
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the winner holds the lock; its record is not written yet

    def write_record():
        time.sleep(0.3)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": "now"}).encode(), 0)
        os.ftruncate(fd, len(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": "now"})))

    writer = threading.Thread(target=write_record)
    writer.start()
    try:
        with pytest.raises(
            ConfigError, match=rf"in use by a running lit_rl run \(pid {os.getpid()} on host .*, started now\)"
        ):
            claim_run_folder(out)
    finally:
        writer.join()
        os.close(fd)
    claim_run_folder(out).release()  # the lock dropped: the folder is free again


def test_default_run_and_sweep_folders_carry_the_process_id():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from lit_rl.run.runfolder import register_resolvers

    register_resolvers()
    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["model=tiny"], return_hydra_config=True)
    run_dir = OmegaConf.select(cfg, "hydra.run.dir")
    sweep_dir = OmegaConf.select(cfg, "hydra.sweep.dir")
    stamp = r"\d{4}-\d{2}-\d{2}/\d{2}-\d{2}-\d{2}"
    assert re.fullmatch(rf"outputs/{stamp}-{os.getpid()}", run_dir), run_dir
    assert re.fullmatch(rf"outputs/multirun/{stamp}-{os.getpid()}", sweep_dir), sweep_dir


def test_a_refused_start_s_folder_is_removed_only_when_nothing_was_written_and_nobody_holds_it(tmp_path):
    def refused_folder(name, *extra):
        out = tmp_path / name
        (out / ".hydra").mkdir(parents=True)
        (out / ".hydra" / "config.yaml").write_text("seed: 0\n")
        (out / "train.log").write_text("")
        for entry in extra:
            (out / entry).write_text("x")
        return out

    out = refused_folder("bare")
    claim_run_folder(out).release()  # the refused run had claimed it (its lock file stays)
    assert discard_refused_run_folder(out) and not out.exists()
    kept = refused_folder("kept", "config.yaml")  # a run's own file: not a refused start's folder
    assert not discard_refused_run_folder(kept) and (kept / "config.yaml").read_text() == "x"
    live = refused_folder("live")
    claim = claim_run_folder(live)  # a run that has just started looks the same: its claim protects it
    assert not discard_refused_run_folder(live) and (live / ".hydra" / "config.yaml").exists()
    claim.release()
    assert not discard_refused_run_folder(tmp_path / "missing")


# --------------------------------------------------------------------------- sweep job folder names (issue 33, item 5)
def test_a_swept_value_with_a_slash_names_one_folder_level_unique_per_job():
    from urllib.parse import unquote

    from lit_rl.run.runfolder import NAME_MAX, job_folder_name, run_name

    argv = ["-m", "seed=0,1", "task=dataset", "task.path=data/a.jsonl,data/b.jsonl"]
    name = run_name(["seed=0", "task=dataset", "task.path=data/a.jsonl"], argv=argv)
    assert name == "seed=0,task.path=data%2Fa.jsonl" and "/" not in name
    assert unquote(name) == "seed=0,task.path=data/a.jsonl"  # reversible
    model = run_name(["model.name_or_path=org/name", "seed=1"], argv=["model.name_or_path=org/name,x/y", "seed=0,1"])
    assert model == "model.name_or_path=org%2Fname,seed=1"
    # two spellings of one path are two jobs: values are kept as written, never normalised into one folder
    same = ["docs/examples/sums.jsonl", "docs/examples/../examples/sums.jsonl"]
    names = {job_folder_name([f"task.path={p}", f"seed={s}"]) for p in same for s in (0, 1)}
    assert len(names) == 4 and not any("/" in n or n in (".", "..") for n in names)
    assert job_folder_name(["a=50%2F"]) != job_folder_name(["a=50/"])  # "%" is escaped too: no collisions
    long = [job_folder_name([f"task.path={'d/' * 200}{i}.jsonl"]) for i in range(2)]
    assert long[0] != long[1] and all(len(n.encode()) <= NAME_MAX for n in long)
    assert job_folder_name([]) == "run"


def test_study_names_its_job_folders_as_a_multirun_does():
    from lit_rl.tools.study import expand

    jobs = expand({}, ["task=dataset", "task.path=data/a.jsonl,data/b.jsonl", "seed=0,1"])
    assert [j.name for j in jobs] == [
        "task.path=data%2Fa.jsonl,seed=0",
        "task.path=data%2Fb.jsonl,seed=0",
        "task.path=data%2Fa.jsonl,seed=1",
        "task.path=data%2Fb.jsonl,seed=1",
    ]


@pytest.mark.slow  # 11 s: a real multirun
def test_multirun_over_two_spellings_of_one_path_runs_every_job_in_its_own_folder(tmp_path):
    sweep = tmp_path / "sweep"
    paths = "docs/examples/sums.jsonl,docs/examples/../examples/sums.jsonl"
    cmd = [sys.executable, os.path.join(ROOT, "recipes", "train.py"), "-m", "seed=0,1", "task=dataset"]
    cmd += [f"task.path={paths}", "task.prompt_field=problem", "task.answer_field=solution", *CLI]
    cmd += [f"hydra.sweep.dir={sweep}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.join(ROOT, "src"))
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    jobs = sorted(p for p in os.listdir(sweep) if not p.startswith(".") and p != "multirun.yaml")
    assert len(jobs) == 4 and all((sweep / j / "finished.json").is_file() for j in jobs), jobs
    from lit_rl.tools.compare import find_runs, group_runs

    groups = group_runs(find_runs([str(sweep)]))
    assert sorted(len(v) for v in groups.values()) == [2, 2], groups  # 2 settings x 2 seeds
