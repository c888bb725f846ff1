"""Reading back what each logger wrote, as ``compare.read_scalars`` reads TensorBoard: {tag: [(step, value)]}."""

from __future__ import annotations

import csv
import json
import struct
from pathlib import Path


def read_csv_scalars(path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Lightning's CSVLogger file (``metrics.csv``: a ``step`` column, one column per tag, empty cells)."""
    out: dict[str, list[tuple[int, float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = int(row.pop("step"))
            for tag, value in row.items():
                if value != "":
                    out.setdefault(tag, []).append((step, float(value)))
    return {tag: sorted(points) for tag, points in out.items()}


def _wandb_records(path: Path):
    """The protobuf ``Record`` payloads of a W&B transaction log (``run-<id>.wandb``): a 7-byte header ("W&B",
    magic 0xBEE1, version), then LevelDB's log format: 32 KiB blocks of records with a 7-byte header (crc32c, length,
    type: 1 full, 2 first, 3 middle, 4 last)."""
    data = path.read_bytes()
    assert data[:3] == b":W&", data[:7]  # ":W&B" + magic 0xBEE1 + version
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            continue
        if kind == 1:
            yield payload
        elif kind == 2:
            pending = payload
        elif kind == 3:
            pending += payload
        elif kind == 4:
            yield pending + payload
            pending = b""


def read_wandb_scalars(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """The history of an offline W&B run folder (``wandb/offline-run-*``), keyed by Lightning's
    ``trainer/global_step`` (the step lit_rl logs at), read with W&B's own protobuf definitions."""
    from wandb.proto import wandb_internal_pb2 as pb

    (log,) = Path(run_dir).glob("run-*.wandb")
    out: dict[str, list[tuple[int, float]]] = {}
    for payload in _wandb_records(log):
        record = pb.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") != "history":
            continue
        row = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in record.history.item}
        step = row.get("trainer/global_step")
        for tag, value in row.items():
            if tag.startswith("_") or tag == "trainer/global_step" or not isinstance(value, (int, float)):
                continue
            out.setdefault(tag, []).append((int(step), float(value)))
    return {tag: sorted(points) for tag, points in out.items()}


def _wandb_run_record(run_dir: str | Path):
    """The ``run`` record of an offline W&B run folder (its display name, its id)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (log,) = Path(run_dir).glob("run-*.wandb")
    for payload in _wandb_records(log):
        record = pb.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "run":
            return record.run
    raise ValueError(f"{log}: no run record")


def wandb_run_name(run_dir: str | Path) -> str:
    """The display name of an offline W&B run (its ``run`` record)."""
    return _wandb_run_record(run_dir).display_name


def wandb_run_id(run_dir: str | Path) -> str:
    """The run id an offline W&B run folder was written under (its ``run`` record)."""
    return _wandb_run_record(run_dir).run_id


def read_mlflow_scalars(tracking_uri: str, run_name: str) -> tuple[dict[str, list[tuple[int, float]]], object]:
    """({tag: [(step, value)]}, the run) of the MLflow run named ``run_name`` in the store at ``tracking_uri``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    runs = [
        r
        for e in client.search_experiments()
        for r in client.search_runs([e.experiment_id])
        if r.info.run_name == run_name
    ]
    (run,) = runs
    out = {}
    for tag in run.data.metrics:
        history = client.get_metric_history(run.info.run_id, tag)
        out[tag] = sorted((m.step, m.value) for m in history)
    return out, run
