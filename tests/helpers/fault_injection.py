"""Run the recipe in this process and SIGKILL it at a chosen point; the fault tests launch it.

    python tests/helpers/fault_injection.py <fault> <call> <out_dir> [hydra overrides...]

fault: none | rollout (inside the engine's generate) | update (after backward, before the optimizer step)
| ckpt_write (half-way through writing a checkpoint file) | ckpt_link (new checkpoint written, the previous
removed, last.ckpt not yet pointed at the new one). ``call`` is which call of that point dies (1-based).
"""

import io
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for helpers
from helpers import compose_config  # noqa: E402  (and the same thread and offline settings as the tests)

from lit_rl.algorithms.base import RLAlgorithm  # noqa: E402
from lit_rl.rollout.torch_engine import TorchEngine  # noqa: E402
from lit_rl.train import run  # noqa: E402


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_on_call(owner, name: str, call: int, before=None) -> None:
    """Replace ``owner.name`` by a wrapper that SIGKILLs this process on its ``call``-th call."""
    original = getattr(owner, name)
    count = {"n": 0}

    def wrapper(*args, **kwargs):
        count["n"] += 1
        if count["n"] == call:
            if before is not None:
                return before(original, *args, **kwargs)
            die()
        return original(*args, **kwargs)

    import inspect

    static = isinstance(inspect.getattr_static(owner, name), staticmethod)
    setattr(owner, name, staticmethod(wrapper) if static else wrapper)


def half_write_then_die(original, obj, f, *args, **kwargs):
    buf = io.BytesIO()
    original(obj, buf, *args, **kwargs)
    data = buf.getvalue()
    f.write(data[: len(data) // 2])
    f.flush()
    os.fsync(f.fileno())
    die()


def main() -> None:
    fault, call, out, *overrides = sys.argv[1:]
    call = int(call)
    if fault == "rollout":
        kill_on_call(TorchEngine, "generate", call)
    elif fault == "update":
        kill_on_call(RLAlgorithm, "optimizer_step", call)
    elif fault == "ckpt_write":
        kill_on_call(torch, "save", call, before=half_write_then_die)
    elif fault == "ckpt_link":
        from lightning.pytorch.callbacks import ModelCheckpoint

        kill_on_call(ModelCheckpoint, "_link_checkpoint", call)
    elif fault != "none":
        raise SystemExit(f"unknown fault {fault!r}")
    cfg = compose_config(*overrides)
    run(cfg, out)


if __name__ == "__main__":
    main()
