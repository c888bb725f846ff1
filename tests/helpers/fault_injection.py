"""Run the recipe in this process and SIGKILL it at a chosen point; the fault tests launch it.

    python tests/helpers/fault_injection.py <fault> <call> <out_dir> [hydra overrides...]

fault: none | rollout (inside the engine's generate) | update (after backward, before the optimizer step)
| ckpt_write (half-way through writing a checkpoint file) | ckpt_link (new checkpoint written, the previous
removed, last.ckpt not yet pointed at the new one). ``call`` is which call of that point dies (1-based).

Preemption (the process signals itself and goes on; the run must checkpoint and stop): sigterm_rollout /
sigusr1_rollout (inside the ``call``-th generate: mid-step) | sigterm_between / sigusr1_between (in the
module's ``on_train_batch_end`` of step ``call``, after the callbacks' checkpoint hook: between two steps);
sigterm_group_between / sigusr1_group_between: the same sent to the whole process group (launch the script in a
session of its own), as SLURM signals every process of a job step; sigterm_group_rollout / sigusr1_group_rollout:
to the group as the ``call``-th request goes to the rollout process (``rollout.producer=process``).
Every checkpoint write after the signal gets the same signal again while it writes (a second signal). Under
``trainer=ddp`` (Lightning starts the other ranks with this same command) only rank 0 signals itself.

short_rank1: under several ranks, rank 1's engine stops every completion after ``call`` tokens (rank 0 samples
the configured length): ranks whose completions end at different lengths.
"""

import io
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for helpers
from helpers import compose_config  # noqa: E402  (and the same thread and offline settings as the tests)

from lit_rl.algorithms import RLModule  # noqa: E402
from lit_rl.rollout.torch_engine import TorchEngine  # noqa: E402
from lit_rl.run.train import run  # noqa: E402


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


def signal_on_call(owner, name: str, call: int, signum: int, group: bool = False) -> None:
    """``owner.name`` sends ``signum`` to this process (``group``: to its whole process group, as a scheduler
    does: the rollout process and any other child too) on its ``call``-th call, then runs as usual; from then on
    every ``torch.save`` (a checkpoint being written) receives the signal again first."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return  # under DDP: rank 0 alone gets the signal

    def send() -> None:
        if group:
            os.killpg(os.getpgid(0), signum)
        else:
            os.kill(os.getpid(), signum)

    sent = {"n": 0}

    def send_then_run(original, *args, **kwargs):
        sent["n"] += 1
        send()
        return original(*args, **kwargs)

    kill_on_call(owner, name, call, before=send_then_run)
    original_save = torch.save

    def save(*args, **kwargs):
        if sent["n"]:
            send()  # a second signal while the checkpoint is written
        return original_save(*args, **kwargs)

    torch.save = save


def short_completions_on_rank_1(length: int) -> None:
    if os.environ.get("LOCAL_RANK", "0") != "1":
        return
    from dataclasses import replace

    original = TorchEngine.generate

    def generate(self, prompts, params, seeds):
        return original(self, prompts, replace(params, max_new_tokens=min(length, params.max_new_tokens)), seeds)

    TorchEngine.generate = generate


def main() -> None:
    fault, call, out, *overrides = sys.argv[1:]
    call = int(call)
    if fault == "sigterm_rollout":
        signal_on_call(TorchEngine, "generate", call, signal.SIGTERM)
    elif fault == "sigusr1_rollout":
        signal_on_call(TorchEngine, "generate", call, signal.SIGUSR1)
    elif fault == "sigterm_between":
        signal_on_call(RLModule, "on_train_batch_end", call, signal.SIGTERM)
    elif fault == "sigusr1_between":
        signal_on_call(RLModule, "on_train_batch_end", call, signal.SIGUSR1)
    elif fault in ("sigterm_group_between", "sigusr1_group_between"):
        signum = signal.SIGTERM if fault.startswith("sigterm") else signal.SIGUSR1
        signal_on_call(RLModule, "on_train_batch_end", call, signum, group=True)
    elif fault in ("sigterm_group_rollout", "sigusr1_group_rollout"):
        from lit_rl.rollout.producer_process import ProcessEngine

        signum = signal.SIGTERM if fault.startswith("sigterm") else signal.SIGUSR1
        signal_on_call(ProcessEngine, "generate", call, signum, group=True)
    elif fault == "short_rank1":
        short_completions_on_rank_1(call)
    elif fault == "rollout":
        kill_on_call(TorchEngine, "generate", call)
    elif fault == "update":
        kill_on_call(RLModule, "optimizer_step", call)
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
