"""recipes/study.py: a preset's sweep expanded as Hydra would, one command per job, folders compare.py reads."""

import os

import pytest

from lit_rl.tools import compare
from lit_rl.tools.study import expand, main, preset_params


def test_expand_orders_seed_by_seed_and_keeps_fixed_overrides():
    jobs = expand({"correction": "tis,sc", "rollout.lag": "0,2"}, ["seed=0,1", "trainer.max_steps=3"])
    assert [j.name for j in jobs[:4]] == [
        "correction=tis,rollout.lag=0,seed=0",
        "correction=tis,rollout.lag=2,seed=0",
        "correction=sc,rollout.lag=0,seed=0",
        "correction=sc,rollout.lag=2,seed=0",
    ]
    assert len(jobs) == 8 and all(j.name.endswith("seed=1") for j in jobs[4:])
    assert jobs[0].overrides == ["trainer.max_steps=3", "correction=tis", "rollout.lag=0", "seed=0"]
    # a command-line sweep replaces the preset's values of that key; so does a single value, which stays in the
    # names: a study split over commands (seed=0,1, then seed=2) names its folders alike, for compare.py's groups
    assert [j.name for j in expand({"correction": "tis,sc"}, ["correction=none,sc"])] == [
        "correction=none",
        "correction=sc",
    ]
    only = expand({"correction": "tis,sc", "seed": "0,1"}, ["correction=sc"])
    assert [j.name for j in only] == ["correction=sc,seed=0", "correction=sc,seed=1"]
    assert only[0].overrides == ["correction=sc", "seed=0"]
    split = [j.name for args in (["seed=0,1"], ["seed=2"]) for j in expand({"correction": "sc", "seed": "0,1,2"}, args)]
    assert split == ["correction=sc,seed=0", "correction=sc,seed=1", "correction=sc,seed=2"]


def test_preset_params_are_read_from_the_experiment():
    assert preset_params(["experiment=staleness_seeds"]) == {
        "correction": "tis,sc,sc+tis",
        "rollout.lag": "0,2,4,8",
        "seed": "0,1,2",
    }


@pytest.mark.slow  # 35 s: four real jobs; the default suite keeps the study tool's own unit tests
def test_study_runs_each_job_and_compare_groups_the_seeds(tmp_path, capsys):
    out = tmp_path / "study"
    args = [
        "model=tiny",
        "trainer.max_steps=1",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "sampling.max_new_tokens=4",
        "eval.num_examples=0",
        "trainer.enable_progress_bar=false",
        "engine.logit_noise=0,1",
        "seed=0,1",
        "--out",
        str(out),
    ]
    assert main(args + ["--dry-run"]) == 0
    assert not out.exists() and "hydra.run.dir=" in capsys.readouterr().out
    assert main(args + ["--drop-weights"]) == 0
    names = sorted(os.listdir(out))
    assert names == [
        "engine.logit_noise=0,seed=0",
        "engine.logit_noise=0,seed=1",
        "engine.logit_noise=1,seed=0",
        "engine.logit_noise=1,seed=1",
        "study_log.tsv",
    ]
    assert all((out / n / "finished.json").exists() for n in names[:4])
    assert not any((out / n / w).exists() for n in names[:4] for w in ("checkpoints", "policy"))  # dropped
    assert all(any((out / n).glob("events.out.tfevents*")) for n in names[:4])  # what compare.py reads stays
    assert len((out / "study_log.tsv").read_text().splitlines()) == 4
    assert main(args) == 0  # everything finished: nothing runs again
    assert len((out / "study_log.tsv").read_text().splitlines()) == 4
    groups = compare.group_runs(compare.find_runs([str(out)]))
    assert groups == {
        "engine.logit_noise=0": ["engine.logit_noise=0,seed=0", "engine.logit_noise=0,seed=1"],
        "engine.logit_noise=1": ["engine.logit_noise=1,seed=0", "engine.logit_noise=1,seed=1"],
    }


def test_an_invalid_job_is_named_before_any_job_starts_dry_run_too(tmp_path, capsys):
    args = ["model=tiny", "engine.logit_noise=0,-1", "seed=0,1", "--out", str(tmp_path / "s")]
    for extra in (["--dry-run"], []):
        assert main(args + extra) == 2
        err = capsys.readouterr().err
        assert err.splitlines()[:3] == [
            "study: error: 2 of the study's 4 jobs have invalid configs; no job was started:",
            "  engine.logit_noise=-1,seed=0: engine.logit_noise=-1 is not allowed: must be finite and >= 0 (0 = off)",
            "  engine.logit_noise=-1,seed=1: engine.logit_noise=-1 is not allowed: must be finite and >= 0 (0 = off)",
        ], err
    assert not (tmp_path / "s").exists()
