"""Continuing a run cannot switch it; a checkpoint that cannot be written stops the run at that step; a sweep
checks every job's config before the first starts and reports the jobs that failed."""

import os
import re
import resource
import signal
import subprocess
import sys

import pytest
import yaml
from helpers import ROOT
from helpers import fast_config as cfg_for

from lit_rl.config import ConfigError
from lit_rl.run.train import run
from lit_rl.tools.compare import read_scalars

SCRIPT = os.path.join(ROOT, "recipes", "train.py")
FAST_CLI = [
    "model=tiny",
    "trainer.precision=32-true",
    "trainer.enable_progress_bar=false",
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "sampling.max_new_tokens=8",
    "eval.num_examples=0",
]
# the run to continue: DAPO with its own learning rate, one step, checkpointed
DAPO = [
    "algo=dapo",
    "algo.overlong.buffer_length=4",
    "optim.lr=1e-5",
    "eval.num_examples=0",
    "checkpoint.every_n_steps=1",
]


def cli(*args, preexec_fn=None, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, SCRIPT, *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=ROOT,
        preexec_fn=preexec_fn,
    )


def saved(folder, name="config.yaml"):
    return yaml.safe_load((folder / name).read_text())


def resume_file(folder):
    (path,) = folder.glob("config.resume-*.yaml")
    return yaml.safe_load(path.read_text())


@pytest.fixture
def dapo_run(tmp_path):
    # a sweep job's folder name: '=' and ',' in it
    out = tmp_path / "multirun" / "algo=dapo,advantage.alpha=0"
    run(cfg_for("trainer.max_steps=1", *DAPO), out)
    assert saved(out)["algo"]["name"] == "dapo"
    return out


def test_continuing_without_overrides_keeps_the_run_s_algorithm_and_learning_rate(dapo_run):
    """The README's command (ckpt_path=last, no other override) composes the defaults (GRPO, lr 2e-6); the run
    continues as the DAPO run it is, with its lr, and only the explicitly given max_steps changes."""
    given = ["trainer.max_steps=2", "ckpt_path=last"]
    run(cfg_for(*given), dapo_run, overrides=given)
    used = resume_file(dapo_run)
    assert used["algo"]["name"] == "dapo" and used["optim"]["lr"] == 1e-5 and used["trainer"]["max_steps"] == 2
    scalars = read_scalars(dapo_run)
    assert [s for s, _ in scalars["rollout/reward_mean_kept"]] == [1, 2]  # DAPO's own metric at both steps
    # continued again to the step it finished at: refused (it used to run no step and rewrite policy/)
    with pytest.raises(
        ConfigError,
        match=rf"output folder {re.escape(str(dapo_run))} holds a run that finished at RL step 2 "
        r"\(trainer.max_steps=2\): nothing to continue; to train it further, give a larger trainer.max_steps",
    ):
        run(cfg_for(*given), dapo_run, overrides=given)


@pytest.mark.parametrize(
    "given, named",
    [
        (["algo=grpo"], r"algo.name \(the run: 'dapo', now: 'grpo'\)"),
        (["optim.lr=0.001"], r"optim.lr \(the run: 1e-05, now: 0.001\)"),
    ],
)
def test_continuing_with_an_override_that_changes_the_run_is_refused(dapo_run, given, named):
    overrides = [*given, "ckpt_path=last"]
    with pytest.raises(
        ConfigError,
        match=rf"ckpt_path=last continues the run in {re.escape(str(dapo_run))} with its "
        rf"saved config.yaml, and \d+ fields? differs? from it: (.*; )?{named}(; .*)?"
        r"\. A continued run may change only trainer.max_steps, ",
    ):
        run(cfg_for(*overrides), dapo_run, overrides=overrides)
    assert not list(dapo_run.glob("config.resume-*.yaml"))  # refused before anything was written


def test_a_library_call_compares_the_whole_config(dapo_run):
    with pytest.raises(ConfigError, match=r"algo.name \(the run: 'dapo', now: 'grpo'\)"):
        run(cfg_for("trainer.max_steps=2", "ckpt_path=last"), dapo_run)
    run(cfg_for("trainer.max_steps=2", "ckpt_path=last", *DAPO), dapo_run)  # the same config: continues
    assert resume_file(dapo_run)["trainer"]["max_steps"] == 2


def test_resume_flag_continues_a_sweep_job_by_its_folder(dapo_run):
    """``--resume <folder>`` (and ``'resume="<folder>"'``) continue a run whose folder name Hydra could not take
    unquoted; the record of the first command in .hydra/ is kept, the continuation's beside it."""
    (dapo_run / ".hydra").mkdir()
    (dapo_run / ".hydra" / "overrides.yaml").write_text("- algo=dapo\n")
    res = cli("--resume", dapo_run, "trainer.max_steps=2", "trainer.enable_progress_bar=false")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "lit_rl: continuing" in res.stdout and "trainer.max_steps=2" in res.stdout
    assert resume_file(dapo_run)["algo"]["name"] == "dapo"
    assert [s for s, _ in read_scalars(dapo_run)["train/loss"]] == [1, 2]
    assert (dapo_run / ".hydra" / "overrides.yaml").read_text() == "- algo=dapo\n"
    assert list((dapo_run / ".hydra").glob("resume-*/overrides.yaml"))
    from hydra.core.override_parser.overrides_parser import OverridesParser

    (parsed,) = OverridesParser.create().parse_overrides([f'resume="{dapo_run}"'])  # the quoted form
    assert parsed.value() == str(dapo_run)


def test_resume_of_a_folder_without_a_run_is_named(tmp_path):
    with pytest.raises(
        ConfigError, match=rf"resume='{re.escape(str(tmp_path))}': no lit_rl run there \(no config.yaml\)"
    ):
        run(cfg_for(f"resume={tmp_path}"), tmp_path / "ignored")


def limit_file_size():
    """In the child: files larger than 4 MiB cannot be written (EFBIG) — the tiny model's checkpoint is ~40 MB,
    its TensorBoard events and config a few kB: a disk that refuses the first checkpoint."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))


def test_a_checkpoint_that_cannot_be_written_stops_the_run_at_that_step(tmp_path):
    out = tmp_path / "run"
    res = cli(
        *FAST_CLI,
        "trainer.max_steps=3",
        "checkpoint.every_n_steps=1",
        f"hydra.run.dir={out}",
        preexec_fn=limit_file_size,
    )
    assert res.returncode == 1, res.stderr[-3000:]
    assert f"lit_rl: stopped: could not write the checkpoint of global step 1 to {out / 'checkpoints'}" in res.stderr
    assert "File too large" in res.stderr and "No earlier checkpoint was written" in res.stderr
    assert "Traceback" not in res.stderr
    # stopped at step 1's checkpoint, not at the end of the run: one step logged, no partial file left
    assert [s for s, _ in read_scalars(out)["train/loss"]] == [1]
    assert not [p for p in (out / "checkpoints").iterdir() if ".partial" in p.name]
    assert not (out / "finished.json").exists()


def test_a_sweep_with_an_invalid_job_starts_no_job_and_lists_it(tmp_path):
    res = cli("-m", *FAST_CLI, "advantage.alpha=7,0.5,1", "rollout.group_size=4,1", f"hydra.sweep.dir={tmp_path}")
    assert res.returncode == 2, res.stderr[-3000:]
    assert "lit_rl: error: 4 of the sweep's 6 jobs have invalid configs; no job was started:" in res.stderr
    assert (
        "#0 advantage.alpha=7,rollout.group_size=4: advantage.alpha=7 is not allowed: must lie in [0, 1]" in res.stderr
    )
    assert "#5 advantage.alpha=1,rollout.group_size=1: rollout.group_size=1 is not allowed" in res.stderr
    assert "#2 " not in res.stderr  # advantage.alpha=0.5,rollout.group_size=4 is valid
    assert "Traceback" not in res.stderr
    assert not [p for p in tmp_path.iterdir() if p.name != ".hydra" and p.is_dir() and "=" in p.name]


@pytest.mark.slow  # 11 s: a real multirun
def test_a_sweep_goes_on_past_a_failed_job_and_reports_it(tmp_path):
    """The first job fails at start-up (its prompts do not fit the tiny model's 2048-token context, which
    config.validate cannot see); the second still runs, and the sweep ends with a summary and exit code 1."""
    res = cli("-m", *FAST_CLI, "trainer.max_steps=1", "sampling.max_new_tokens=3000,8", f"hydra.sweep.dir={tmp_path}")
    assert res.returncode == 1, res.stderr[-3000:]
    assert "lit_rl: 1 of 2 jobs failed:" in res.stderr
    assert "sampling.max_new_tokens=3000: error: task=arithmetic: the longest train prompt" in res.stderr
    assert (tmp_path / "sampling.max_new_tokens=8" / "finished.json").exists()
    assert not (tmp_path / "sampling.max_new_tokens=3000" / "finished.json").exists()
