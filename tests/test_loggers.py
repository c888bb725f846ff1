"""The ``logger`` config group: TensorBoard (default), CSV, W&B (offline, no network) and MLflow (a local file
store) each write the same scalars of a 2-step tiny run, read back from their own files; several at once."""

import json
import math

import pytest
from helpers import MOVING, compose_config, fast_config
from helpers.loggers import (
    read_csv_scalars,
    read_mlflow_scalars,
    read_wandb_scalars,
    wandb_run_id,
    wandb_run_name,
)

from lit_rl.config import ConfigError
from lit_rl.run.loggers import ContinuedCSVLogger, build_loggers
from lit_rl.run.train import run
from lit_rl.tools.compare import read_scalars


def same(a, b, tag):
    assert [s for s, _ in a] == [s for s, _ in b], tag
    for (_, x), (_, y) in zip(a, b):
        assert math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-9) or (math.isnan(x) and math.isnan(y)), (tag, x, y)


def test_every_logger_writes_the_same_scalars_as_tensorboard(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "algo=grpo,seed=0"  # a sweep job's folder: its name is the sweep's run name
    run(fast_config("trainer.max_steps=2", *MOVING, "logger=[tensorboard,csv,wandb,mlflow]"), out)
    reference = read_scalars(out)
    assert len(reference["train/loss"]) == 2 and "eval/accuracy" in reference
    (wandb_dir,) = (out / "wandb").glob("offline-run-*")
    mlflow, mlflow_run = read_mlflow_scalars((out / "mlruns").as_uri(), "algo=grpo,seed=0")
    written = {
        "csv": read_csv_scalars(out / "csv" / "metrics.csv"),
        "wandb": read_wandb_scalars(wandb_dir),
        "mlflow": mlflow,
    }
    for name, scalars in written.items():
        assert set(reference) <= set(scalars), (name, sorted(set(reference) - set(scalars)))
        for tag, points in reference.items():
            same(points, scalars[tag], f"{name}:{tag}")
    assert mlflow_run.info.run_name == "algo=grpo,seed=0"
    assert wandb_run_name(wandb_dir) == "algo=grpo,seed=0"


def test_a_continued_run_keeps_one_history_in_every_logger(tmp_path, monkeypatch):
    """Lightning #4935 (rf-detr #1321): 2 steps, then ``--resume <run> trainer.max_steps=3`` (``ckpt_path=last``,
    as a SIGTERM resume and a SLURM requeue continue too). The CSV held only step 2 (Lightning's writer deleted the
    file it found), W&B and MLflow started a second run. Now each logger holds steps 0, 1, 2 of one run, with the
    values TensorBoard holds."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    loggers = "logger=[tensorboard,csv,wandb,mlflow]"
    run(fast_config("trainer.max_steps=2", *MOVING, loggers), out)
    run(fast_config("trainer.max_steps=3", *MOVING, loggers, f"resume={out}"), tmp_path / "ignored")
    reference = read_scalars(out)
    assert [step for step, _ in reference["train/loss"]] == [1, 2, 3]
    wandb_dirs = sorted((out / "wandb").glob("offline-run-*"))  # one folder per process, as wandb writes offline
    assert len(wandb_dirs) == 2 and len({wandb_run_id(d) for d in wandb_dirs}) == 1, wandb_dirs
    wandb = {}
    for folder in wandb_dirs:  # `wandb sync` uploads both, in order, into the one run
        for tag, points in read_wandb_scalars(folder).items():
            wandb.setdefault(tag, []).extend(points)
    mlflow, mlflow_run = read_mlflow_scalars((out / "mlruns").as_uri(), "run")  # one run of that name
    run_id = mlflow_run.info.run_id
    written = {"csv": read_csv_scalars(out / "csv" / "metrics.csv"), "wandb": wandb, "mlflow": mlflow}
    for name, scalars in written.items():
        for tag, points in reference.items():
            same(points, sorted(scalars[tag]), f"{name}:{tag}")
    assert json.loads((out / "loggers.json").read_text()) == {"wandb": wandb_run_id(wandb_dirs[0]), "mlflow": run_id}


def test_a_continued_csv_file_keeps_its_rows_and_drops_the_steps_logged_again(tmp_path):
    """Killed after step 3's scalars were written, with a checkpoint every 2 steps: the run continues from step 2
    and logs steps 2 and 3 again. The file keeps steps 0 and 1 (and step 1's eval) once, then the new rows,
    under one header that gains the column only the continuation logs."""
    (tmp_path / "csv").mkdir()
    path = tmp_path / "csv" / "metrics.csv"
    path.write_text("eval/accuracy,step,train/loss\n,0,1.0\n,1,2.0\n0.5,1,\n,2,3.0\n,3,4.0\n")
    logger = ContinuedCSVLogger(save_dir=tmp_path, name="csv", version="")
    logger.log_metrics({"train/loss": 30.0, "train/new": 7.0}, step=2)
    logger.save()
    logger.log_metrics({"train/loss": 40.0}, step=3)
    logger.save()
    assert path.read_text().count("step") == 1
    assert read_csv_scalars(path) == {
        "train/loss": [(0, 1.0), (1, 2.0), (2, 30.0), (3, 40.0)],
        "eval/accuracy": [(1, 0.5)],
        "train/new": [(2, 7.0)],
    }


def test_tensorboard_writes_into_the_run_folder_and_a_continued_old_run_keeps_its_folder(tmp_path):
    """TensorBoard names a run by the folder of its event files: they go in the run folder (every run showed as
    ``<run>/tensorboard``). A run continued from the layout before keeps writing into its ``tensorboard/``, so its
    history stays in one folder; ``logger.tensorboard.name`` still picks a sub-folder."""
    new, old = tmp_path / "new", tmp_path / "old"
    (old / "tensorboard").mkdir(parents=True)
    (old / "tensorboard" / "events.out.tfevents.1.host.0").write_bytes(b"")

    def log_dir(out, *overrides):
        return build_loggers(compose_config(*overrides), out)[0].log_dir.rstrip("/")

    assert log_dir(new) == log_dir(new, "ckpt_path=last") == str(new)
    assert log_dir(old) == str(old)  # a new run in that folder: the new layout
    assert log_dir(old, "ckpt_path=last") == str(old / "tensorboard")
    assert log_dir(new, "logger.tensorboard.name=tb") == str(new / "tb")


def test_the_logger_group_composes_one_several_or_none(tmp_path):
    assert [type(lg).__name__ for lg in build_loggers(compose_config(), tmp_path)] == ["TensorBoardLogger"]
    both = build_loggers(compose_config("logger=[tensorboard,csv]"), tmp_path)
    assert [type(lg).__name__ for lg in both] == ["TensorBoardLogger", "CSVLogger"]
    assert build_loggers(compose_config("logger=none"), tmp_path) == []
    named = compose_config("logger=mlflow", "logger.run_name=mine")
    assert build_loggers(named, tmp_path)[0]._run_name == "mine"
    with pytest.raises(ConfigError, match="logger.wandb.mode='sometimes'"):
        build_loggers(compose_config("logger=wandb", "logger.wandb.mode=sometimes"), tmp_path)
    with pytest.raises(Exception, match="logger"):  # a typo in a logger's key fails at composition
        compose_config("logger=csv", "logger.csv.nmae=x")


def test_an_online_wandb_run_without_a_login_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    """A new user's case: ``logger=wandb`` with no WANDB_MODE and no API key loaded the model, then stopped in
    fit with wandb's 40-line ``UsageError: No API key configured``. Now one line, at start-up."""
    import io

    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr("sys.stdin", io.StringIO())  # a batch job: wandb cannot prompt for a key
    netrc = tmp_path / "netrc"
    netrc.write_text("machine example.org login me password x\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    cfg = compose_config("logger=wandb")
    with pytest.raises(ConfigError, match=r"logger=wandb runs online but has no login for api.wandb.ai .*WANDB_MODE="):
        build_loggers(cfg, tmp_path)
    assert build_loggers(compose_config("logger=wandb", "logger.wandb.mode=offline"), tmp_path)  # no login needed
    netrc.write_text("machine api.wandb.ai login user password k" + "0" * 39 + "\n")  # what `wandb login` writes
    assert build_loggers(cfg, tmp_path)
    netrc.write_text("")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert build_loggers(cfg, tmp_path)
