"""The run's loggers (``logger`` group): Lightning's TensorBoard, CSV, W&B and MLflow loggers, each refused at
start-up with the fix when it cannot work (a missing package, an online W&B run without a login).
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger

from ..config import ConfigError
from ..schema import TrainConfig

#: ``logger`` options -> the package each needs (None: installed with lit_rl)
LOGGER_PACKAGES = {"tensorboard": None, "csv": None, "wandb": "wandb", "mlflow": "mlflow"}


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
    sweep's run name, e.g. ``algo=dapo,seed=1``) names the W&B and MLflow runs; TensorBoard and CSV write into
    ``<run>/<name>``. Raises ConfigError naming the install command when a logger's package is missing, and
    for ``logger.wandb.mode`` outside online | offline | disabled."""
    import importlib.util

    from lightning.pytorch.loggers import CSVLogger

    chosen = cfg.logger
    name = chosen.run_name or out.resolve().name
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
            loggers.append(TensorBoardLogger(save_dir=str(out), name=options.name, version="", default_hp_metric=False))
        elif key == "csv":
            loggers.append(CSVLogger(save_dir=str(out), name=options.name, version=""))
        elif key == "wandb":
            from lightning.pytorch.loggers import WandbLogger

            mode = options.mode
            if mode not in (None, "online", "offline", "disabled"):
                raise ConfigError(f"logger.wandb.mode={mode!r}: choose online, offline, disabled or null")
            kwargs = {"mode": mode} if mode else {}
            check_wandb_login(mode)
            loggers.append(
                WandbLogger(name=name, save_dir=str(out), project=options.project, entity=options.entity, **kwargs)
            )
        elif key == "mlflow":
            from lightning.pytorch.loggers import MLFlowLogger

            uri = options.tracking_uri or (out / "mlruns").resolve().as_uri()
            if uri.startswith("file:"):  # MLflow 3 refuses its file store (maintenance mode) unless told to allow it;
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # a database store needs sqlalchemy
            loggers.append(MLFlowLogger(experiment_name=options.experiment_name, run_name=name, tracking_uri=uri))
    return loggers


def finish_loggers(trainer: L.Trainer) -> None:
    """End the W&B run of a ``WandbLogger`` (its history is complete on disk, in offline mode too, only once
    ``wandb.finish`` returns; Lightning leaves the run open)."""
    from lightning.pytorch.loggers import WandbLogger

    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger) and logger._experiment is not None:
            logger._experiment.finish()
