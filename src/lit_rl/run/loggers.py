"""The run's loggers (``logger`` group): Lightning's TensorBoard, CSV, W&B and MLflow loggers, each refused at
start-up with the fix when it cannot work (a missing package, an online W&B run without a login).

A continued run (``ckpt_path`` set: ``--resume``, a SIGTERM or SLURM resume, a longer ``trainer.max_steps``)
keeps one history in every logger: TensorBoard appends event files, the CSV file is appended to
(``ContinuedCSVLogger``), and W&B and MLflow log into the run they started, by the ids recorded in
``<run>/loggers.json`` (``RUN_IDS_FILE``).
"""

from __future__ import annotations

import csv
import json
import os
import secrets
from pathlib import Path

import lightning as L
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from ..config import ConfigError
from ..schema import TrainConfig

#: ``logger`` options -> the package each needs (None: installed with lit_rl)
LOGGER_PACKAGES = {"tensorboard": None, "csv": None, "wandb": "wandb", "mlflow": "mlflow"}

#: ``{"wandb": <run id>, "mlflow": <run id>}`` of the run's W&B and MLflow runs, in the run folder
RUN_IDS_FILE = "loggers.json"


class ContinuedCSVWriter(ExperimentWriter):
    """Lightning's CSV writer, continuing the ``metrics.csv`` it finds instead of deleting it (Lightning #4935).

    The file's header becomes the known columns, so Lightning's ``save`` appends (and rewrites the file with the
    wider header when a tag appears that the file lacks). At the first save, rows at or after the first step this
    writer logs are dropped: they were logged after the checkpoint the run continues from (a kill between a
    step's scalars and its checkpoint, or ``checkpoint.every_n_steps`` > 1), and the run logs those steps again."""

    def _check_log_dir_exists(self) -> None:  # Lightning's deletes metrics.csv here
        self._continuing = self._fs.isfile(self.metrics_file_path)
        if self._continuing:
            with self._fs.open(self.metrics_file_path, "r", newline="") as file:
                self.metrics_keys = list(csv.DictReader(file).fieldnames or [])

    def save(self) -> None:
        if self._continuing and self.metrics:
            self._continuing = False
            first = min(row["step"] for row in self.metrics)
            with self._fs.open(self.metrics_file_path, "r", newline="") as file:
                rows = list(csv.DictReader(file))
            kept = [row for row in rows if int(row["step"]) < first]
            if len(kept) < len(rows):
                with self._fs.open(self.metrics_file_path, "w", newline="") as file:
                    writer = csv.DictWriter(file, fieldnames=self.metrics_keys)
                    writer.writeheader()
                    writer.writerows(kept)
        super().save()


class ContinuedCSVLogger(CSVLogger):
    """Lightning's ``CSVLogger`` writing through ``ContinuedCSVWriter``: a continued run's rows follow the ones the
    run already wrote in ``metrics.csv``."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ContinuedCSVWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = ContinuedCSVWriter(log_dir=self.log_dir)
        return self._experiment


#: where event files went before they moved into the run folder (``logger.tensorboard.name: tensorboard``)
OLD_TENSORBOARD_DIR = "tensorboard"


def tensorboard_dir(out: Path, name: str, continuing: bool = False) -> Path:
    """The folder of the run's TensorBoard event files: ``<out>/<name>``, the run folder itself for ``name`` "".
    TensorBoard names a run by the path of the folder holding its event files, so in the run folder a run shows as
    ``<date>/<time>-<pid>`` (a sweep job as its overrides), where ``<run>/tensorboard`` showed every run's name
    ending in ``/tensorboard``. A continued run whose events are in ``<out>/tensorboard`` (the layout before) keeps
    writing there, so its history stays in one folder."""
    if not name and continuing and any((out / OLD_TENSORBOARD_DIR).glob("events.out.tfevents*")):
        return out / OLD_TENSORBOARD_DIR
    return out / name if name else out


def read_run_ids(out: Path) -> dict[str, str]:
    """The W&B and MLflow run ids recorded in ``<out>/loggers.json``; {} when there is none (a run that predates
    it) or it cannot be read (the continued run then starts new W&B and MLflow runs)."""
    try:
        ids = json.loads((out / RUN_IDS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {key: str(value) for key, value in ids.items() if value} if isinstance(ids, dict) else {}


def write_run_ids(out: Path, ids: dict[str, str]) -> None:
    """Record ``ids`` in ``<out>/loggers.json``, atomically (global rank 0 only)."""
    if rank_zero_only.rank != 0 or not ids:
        return
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"{RUN_IDS_FILE}.partial-{os.getpid()}"
    tmp.write_text(json.dumps(ids, indent=1) + "\n")
    os.replace(tmp, out / RUN_IDS_FILE)


def check_wandb_login(mode: str | None) -> None:
    """Refuse, before the model loads, an online W&B run that would stop at its first log for want of a login.

    Online (``logger.wandb.mode``, else ``$WANDB_MODE``, else online) in a process without a terminal (a batch
    job: wandb cannot prompt) needs ``WANDB_API_KEY`` or a netrc entry for the W&B host (``wandb login`` writes
    it; ``$WANDB_BASE_URL`` names another host). Without either, wandb used to raise ``UsageError: No API key
    configured`` inside fit, after the model loaded, as a traceback. Raises ConfigError saying what to set."""
    import netrc
    import sys
    from urllib.parse import urlparse

    effective = mode or os.environ.get("WANDB_MODE") or "online"
    if effective != "online" or os.environ.get("WANDB_API_KEY") or sys.stdin.isatty():
        return
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        found = netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        found = False
    if not found:
        raise ConfigError(
            f"logger=wandb runs online but has no login for {host} (no WANDB_API_KEY, no netrc entry): run "
            "`wandb login` or set WANDB_API_KEY, or log without an account: WANDB_MODE=offline (or "
            "logger.wandb.mode=offline; `wandb sync` uploads it later)"
        )


def build_loggers(cfg: TrainConfig, out: Path) -> list:
    """Lightning loggers for every ``logger.<name>`` that is set (``schema.LoggerConfig``), in the order
    tensorboard, csv, wandb, mlflow; [] for ``logger=none``. Each logs the same scalars (Lightning's
    ``log_metrics``). The run name (``logger.run_name``, else the run folder's name: a sweep job's folder is the
    sweep's run name, e.g. ``algo=dapo,seed=1``) names the W&B and MLflow runs; TensorBoard writes into the run
    folder itself (``tensorboard_dir``: TensorBoard then names the run by its folder), CSV into ``<run>/csv``. A
    continued run (``cfg.ckpt_path`` set) appends to the CSV file and resumes the W&B and MLflow runs whose ids
    ``<run>/loggers.json`` holds; the ids of the runs used are written there. Raises ConfigError naming the
    install command when a logger's package is missing, and for ``logger.wandb.mode`` outside online | offline |
    disabled."""
    import importlib.util

    chosen = cfg.logger
    name = chosen.run_name or out.resolve().name
    continuing = cfg.ckpt_path not in (None, "", "null")
    ids = read_run_ids(out) if continuing else {}
    loggers = []
    for key, package in LOGGER_PACKAGES.items():
        options = getattr(chosen, key)
        if options is None:
            continue
        if package is not None and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"logger={key}: the {package} package is not installed; pip install 'lit_rl[loggers]' "
                f"(or {'mlflow-skinny' if key == 'mlflow' else package})"
            )
        if key == "tensorboard":
            sub = tensorboard_dir(out, options.name, continuing).relative_to(out).as_posix()
            loggers.append(
                TensorBoardLogger(
                    save_dir=str(out), name="" if sub == "." else sub, version="", default_hp_metric=False
                )
            )
        elif key == "csv":
            kind = ContinuedCSVLogger if continuing else CSVLogger
            loggers.append(kind(save_dir=str(out), name=options.name, version=""))
        elif key == "wandb":
            from lightning.pytorch.loggers import WandbLogger

            mode = options.mode
            if mode not in (None, "online", "offline", "disabled"):
                raise ConfigError(f"logger.wandb.mode={mode!r}: choose online, offline, disabled or null")
            kwargs = {"mode": mode} if mode else {}
            check_wandb_login(mode)
            ids.setdefault("wandb", secrets.token_hex(4))  # chosen here, so a continuation finds it if killed
            loggers.append(
                WandbLogger(
                    name=name,
                    save_dir=str(out),
                    project=options.project,
                    entity=options.entity,
                    id=ids["wandb"],
                    resume="allow",  # the run of that id if it exists (a continuation), else a new one
                    **kwargs,
                )
            )
        elif key == "mlflow":
            from lightning.pytorch.loggers import MLFlowLogger

            uri = options.tracking_uri or (out / "mlruns").resolve().as_uri()
            if uri.startswith("file:"):  # MLflow 3 refuses its file store (maintenance mode) unless told to allow it;
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # a database store needs sqlalchemy
            logger = MLFlowLogger(
                experiment_name=options.experiment_name, run_name=name, tracking_uri=uri, run_id=ids.get("mlflow")
            )
            if rank_zero_only.rank == 0:  # MLflow names a run only once it exists: create it now (Lightning's code)
                if "mlflow" in ids:
                    logger.experiment.update_run(ids["mlflow"], status="RUNNING")  # it ended FINISHED or FAILED
                ids["mlflow"] = logger.run_id
            loggers.append(logger)
    write_run_ids(out, ids)
    return loggers


def finish_loggers(trainer: L.Trainer) -> None:
    """End the W&B run of a ``WandbLogger`` (its history is complete on disk, in offline mode too, only once
    ``wandb.finish`` returns; Lightning leaves the run open)."""
    from lightning.pytorch.loggers import WandbLogger

    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger) and logger._experiment is not None:
            logger._experiment.finish()
