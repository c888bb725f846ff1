"""Whether the Hugging Face hub can be used, asked without torch and in a second or two: ``config.validate`` asks
it for data the run would download (``task=gsm8k`` without ``task.path``), ``models`` for a model id.

Offline, ``datasets.load_dataset`` and ``from_pretrained`` retry for half a minute or more and then raise a
``ConnectionError`` traceback; a DNS probe of the hub's host answers at once (``HF_HUB_OFFLINE`` set) or within
its timeout.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

__all__ = ["hub_dataset_cached", "hub_offline_reason", "hub_reachable"]

HUB_HOST = "huggingface.co"


def hub_offline_reason(host: str = HUB_HOST, timeout_s: float = 2.0) -> str | None:
    """Why the hub may not be used (``HF_HUB_OFFLINE`` is set, or ``host`` does not resolve by DNS), or None."""
    offline = os.environ.get("HF_HUB_OFFLINE", "0")
    if offline not in ("0", "", "false", "False"):
        return f"HF_HUB_OFFLINE={offline}"
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(timeout_s)
    try:
        socket.getaddrinfo(host, 443)
        return None
    except OSError:
        return f"{host} does not resolve"
    finally:
        socket.setdefaulttimeout(previous)


def hub_reachable(host: str = HUB_HOST, timeout_s: float = 2.0) -> bool:
    """True if the hub may be used: ``HF_HUB_OFFLINE`` unset and ``host`` resolves by DNS."""
    return hub_offline_reason(host, timeout_s) is None


def hub_dataset_cached(hub_id: str) -> bool:
    """Whether hub dataset ``hub_id`` (``org/name``) has a local copy ``datasets`` may load offline: its files in
    the hub cache (``HF_HUB_CACHE``) or its prepared splits in the datasets cache (``HF_DATASETS_CACHE``, by
    default ``$HF_HOME/datasets``). A folder that exists counts; whether it is complete is ``datasets``' to say."""
    from huggingface_hub import constants

    datasets_cache = os.environ.get("HF_DATASETS_CACHE") or Path(constants.HF_HOME) / "datasets"
    return (Path(constants.HF_HUB_CACHE) / f"datasets--{hub_id.replace('/', '--')}").is_dir() or (
        Path(datasets_cache) / hub_id.replace("/", "___")
    ).is_dir()
