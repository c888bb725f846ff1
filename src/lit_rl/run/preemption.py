"""Preemption that loses nothing: SIGTERM, SIGUSR1 or SIGINT (Ctrl-C) checkpoint the run at the next safe point
and stop it with a non-zero exit status; under SLURM the job requeues itself and continues from that checkpoint.

What SLURM and Kubernetes send before they stop a job is SIGTERM (SLURM: ``--signal=USR1@<seconds>`` adds an
early SIGUSR1). Lightning's signal connector already turns SIGTERM into ``trainer.received_sigterm``, which
its loops check after each optimizer step (and between evaluation batches, and, under DDP, broadcast from rank
0 before each step) and then raise ``SIGTERMException`` -- a ``SystemExit`` with status 0, and no checkpoint:
a preempted run looked like a success, and the steps since the last checkpoint were lost. ``RunCheckpoint``
(the run's ``ModelCheckpoint``) completes that mechanism rather than replacing it:

- SIGUSR1 (or the ``requeue_signal`` of Lightning's ``SLURMEnvironment``) raises the same flag as SIGTERM, so
  both take Lightning's path to the same safe points. On one process the handler raises it at once; under
  data parallelism the ranks raise it together at the end of a step, where they all-reduce what they received
  (``RunCheckpoint.agree``): a signal reaching one rank after that point is acted on one step later, never
  on one rank alone (that rank would leave the loop while the others wait in the next step's collectives).
  Lightning's own SLURM handler for it is not installed (it checkpoints inside the signal handler, in the
  middle of whatever runs then), nor, once training starts, its SIGTERM handler (it raises the flag on the
  rank it reaches and runs a collective inside the handler).
- a signal that arrives during a step: the step finishes (rollout, update, its log line) and its checkpoint is
  written in ``on_train_batch_end``, exactly where a regular ``checkpoint.every_n_steps`` checkpoint is;
- on one process, a signal between steps (after a step's checkpoint hook: evaluation, logging): no further
  step starts;
  ``SIGTERMException`` is raised and ``on_exception`` checkpoints the last finished step.

Ctrl-C (SIGINT) takes the same path once training has started: Lightning would turn it into a
``KeyboardInterrupt``, exit 1 and keep no checkpoint of the steps since the last one. The first Ctrl-C finishes
the step, checkpoints it and stops as SIGTERM does; a second one, while that step finishes, is Python's
``KeyboardInterrupt`` again (stop at once; the checkpoints written before stay whole). A process started with
SIGINT ignored (``nohup``, a background job of a non-interactive shell) keeps ignoring it.

``lit_rl.run.train.run`` then raises ``Preempted``: a ``SystemExit`` with status 128 + the signal (143 for SIGTERM,
138 for SIGUSR1, 130 for SIGINT), after printing how to continue. Checkpoints are written by
``AtomicCheckpointIO`` (beside the target, fsynced, renamed), so a second signal during the write cannot leave a
partial file under a checkpoint's name: SIGTERM and SIGUSR1 only raise the flag again, and anything that kills
the process mid-write leaves the previous checkpoint whole.

Under SLURM with ``SLURMEnvironment(auto_requeue=True)`` (Lightning's default when it detects SLURM), the
requeue signal also runs ``scontrol requeue <job id>`` (as Lightning's handler would, after the checkpoint
instead of before it); the requeued job, started again with the same command and the same
``hydra.run.dir``, continues from the run's last checkpoint (``slurm_requeued``).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import threading

import lightning as L
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger(__name__)


class Preempted(SystemExit):
    """The run stopped on ``signum`` after checkpointing its last finished step; exit status 128 + signum
    (143 for SIGTERM, 138 for SIGUSR1, 130 for SIGINT), so a scheduler never counts it a success. ``checkpoint``:
    the file written (None when no step had finished), ``message``: what was printed (how to continue)."""

    def __init__(self, signum: int, checkpoint: str | None, message: str):
        super().__init__(128 + int(signum))
        self.signum, self.checkpoint, self.message = int(signum), checkpoint, message

    def __str__(self) -> str:
        return self.message


def requeue_signal(trainer: L.Trainer) -> int:
    """The signal that asks for a checkpoint and (under SLURM with auto-requeue) a requeue: the cluster
    environment's ``requeue_signal`` under SLURM, else SIGUSR1."""
    env = trainer._accelerator_connector.cluster_environment
    if isinstance(env, SLURMEnvironment) and env.requeue_signal is not None:
        return int(env.requeue_signal)
    return int(signal.SIGUSR1)


def slurm_job_id() -> str:
    """The job to requeue: ``<array job>_<task>`` for an array task, else ``SLURM_JOB_ID`` (as Lightning)."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job is not None:
        return f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ["SLURM_JOB_ID"]


def slurm_requeued() -> bool:
    """True in a SLURM job that SLURM has started again (``SLURM_RESTART_COUNT`` > 0, e.g. after a requeue)."""
    return SLURMEnvironment.detect() and os.environ.get("SLURM_RESTART_COUNT", "0").strip() not in ("", "0")


class RunCheckpoint(ModelCheckpoint):
    """The run's ``ModelCheckpoint`` (every ``every_n_train_steps``, ``last.ckpt``, ``save_top_k``), which also
    checkpoints at the next safe point after SIGTERM or SIGUSR1 (module docstring). ``signum``: the first
    such signal received (None before); ``preempted_path``: the checkpoint written for it."""

    def __init__(self, *args, updates_per_step: int = 1, **kwargs):
        kwargs.setdefault("filename", "step={rl_step}")  # step=N.ckpt: N RL steps done, the last one logged as N
        kwargs.setdefault("auto_insert_metric_name", False)
        super().__init__(*args, **kwargs)
        self.updates_per_step = max(1, int(updates_per_step))
        self.signum: int | None = None
        self.preempted_path: str | None = None
        self._trainer: L.Trainer | None = None
        self._previous_handlers: dict = {}
        self._requeue_signal: int | None = None

    # -- signals ----------------------------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage) -> None:
        super().setup(trainer, pl_module, stage)
        # installed before Lightning registers its handlers (after the setup hooks): Lightning then keeps ours
        # for this signal instead of its SLURM handler, and adds SIGTERM's, which sets trainer.received_sigterm
        self._trainer = trainer
        self._requeue_signal = requeue_signal(trainer)
        if threading.current_thread() is threading.main_thread():
            self._previous_handlers = {
                s: signal.getsignal(s) for s in (self._requeue_signal, signal.SIGTERM, signal.SIGINT)
            }
            signal.signal(self._requeue_signal, self._on_signal)

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        # Lightning has now registered its SIGTERM handler, which raises the flag on the rank it reaches (and
        # broadcasts inside the handler): replaced by ours, which under data parallelism defers to ``agree``.
        # Ctrl-C too, unless the process was started with SIGINT ignored (a background job): it stays ignored
        if self._previous_handlers and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_signal)
            if self._previous_handlers[signal.SIGINT] is not signal.SIG_IGN:
                signal.signal(signal.SIGINT, self._on_signal)

    def teardown(self, trainer, pl_module, stage) -> None:
        super().teardown(trainer, pl_module, stage)
        if self._previous_handlers and threading.current_thread() is threading.main_thread():
            for s, handler in self._previous_handlers.items():  # those from before the run, Lightning's not kept
                signal.signal(s, handler if handler is not None else signal.SIG_DFL)
            self._previous_handlers = {}

    def _on_signal(self, signum, frame) -> None:
        """SIGTERM, SIGINT or the requeue signal (a SIGINT after any of them raises ``KeyboardInterrupt``: stop at
        once, without this step's checkpoint; a run stuck after a scheduler's SIGTERM still stops on Ctrl-C). On one
        process: Lightning's flag (``trainer.received_sigterm``), so its loops stop at their next safe point. Under
        data parallelism the signal is only noted here: the ranks raise the flag together where they agree
        (``agree``, at the end of each step). A flag raised on one rank at any other moment -- as Lightning's own
        SIGTERM handler does, which also runs a collective inside the handler -- lets that rank leave the loop
        while the others enter the next step's collectives, and the run hangs. Nothing else happens inside the
        handler."""
        if signum == signal.SIGINT and self.signum is not None:
            raise KeyboardInterrupt  # Ctrl-C after a stop signal: Lightning's shutdown, exit 1, checkpoints kept
        self.signum = self.signum or int(signum)
        rank = self._trainer.global_rank if self._trainer is not None else 0
        what = (
            "; finishing this step, then checkpointing it (Ctrl-C again stops at once)"
            if signum == signal.SIGINT
            else ""
        )
        os.write(2, f"lit_rl: received {signal.Signals(signum).name} (rank {rank}){what}\n".encode())  # unbuffered
        if self._trainer is not None and self._trainer.world_size == 1:
            self._trainer._signal_connector.received_sigterm = True

    def requested(self, trainer) -> int | None:
        """The signal that asked the run to stop (SIGTERM when Lightning's flag is all there is), or None."""
        if self.signum is None and trainer.received_sigterm:
            self.signum = int(signal.SIGTERM)
        return self.signum

    # -- checkpoints --------------------------------------------------------------------------------------------
    def _monitor_candidates(self, trainer) -> dict:
        """Lightning's values for the file name, with ``rl_step``: RL steps done (``global_step`` counts optimizer
        steps, ``updates_per_step`` of them per RL step)."""
        candidates = super()._monitor_candidates(trainer)
        candidates["rl_step"] = torch.tensor(trainer.global_step // self.updates_per_step)
        return candidates

    def _save_now(self, trainer) -> None:
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)
        self.preempted_path = self.best_model_path or self.last_model_path

    def agree(self, trainer) -> int | None:
        """``requested`` agreed over all ranks (a max all-reduce of the signal numbers; nothing to reduce on one
        device): a rank that got no signal learns that another did, raises Lightning's flag too, and every rank
        writes the checkpoint (a collective) at the same step."""
        mine = self.requested(trainer)
        if trainer.world_size > 1:
            agreed = int(
                trainer.strategy.reduce(
                    torch.tensor(float(mine or 0), device=trainer.strategy.root_device), reduce_op="max"
                ).item()
            )
            if agreed:
                self.signum = self.signum or agreed
                trainer._signal_connector.received_sigterm = True  # on every rank at once: they stop together
            return agreed or None
        return mine

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.agree(trainer) is not None and not self._should_skip_saving_checkpoint(trainer):
            self._save_now(trainer)  # the step the signal interrupted has finished: its checkpoint, here
            return
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.requested(trainer) is not None and self._last_global_step_saved == trainer.global_step:
            self.preempted_path = self.best_model_path or self.last_model_path

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException) or self.requested(trainer) is None:
            return  # a crash is not a safe point: the checkpoints written before it stay the ones to resume
        if trainer.global_step > 0 and self._last_global_step_saved != trainer.global_step:
            self._save_now(trainer)  # the signal came between steps: the last finished one
        elif self._last_global_step_saved == trainer.global_step and self.preempted_path is None:
            self.preempted_path = self.best_model_path or self.last_model_path
        env = trainer._accelerator_connector.cluster_environment
        if (
            self.signum == self._requeue_signal
            and isinstance(env, SLURMEnvironment)
            and env.auto_requeue
            and trainer.is_global_zero
        ):
            requeue_slurm_job()


def requeue_slurm_job() -> int:
    """``scontrol requeue <job id>`` (``slurm_job_id``); returns its exit status, logged (as Lightning's
    SLURM handler does; the checkpoint is already written when this runs)."""
    job_id = slurm_job_id()
    if not re.fullmatch(r"[0-9_-]+", job_id):
        raise ValueError(f"SLURM job id {job_id!r} is not a job id")
    result = subprocess.call(["scontrol", "requeue", job_id])
    print(
        f"lit_rl: requeued SLURM job {job_id}"
        if result == 0
        else f"lit_rl: scontrol requeue {job_id} failed (exit status {result})",
        flush=True,
    )
    return result


def preempted(trainer: L.Trainer, checkpoints: RunCheckpoint, out, updates_per_step: int = 1) -> Preempted:
    """The ``Preempted`` exception for a run that Lightning stopped on a signal (``SIGTERMException``), its
    message printed by global rank 0: the signal, the last finished RL step, its checkpoint and the command that
    continues the run."""
    signum = checkpoints.requested(trainer) or int(signal.SIGTERM)
    name = signal.Signals(signum).name
    path = checkpoints.preempted_path
    step = trainer.global_step // max(1, updates_per_step)
    if path:
        message = (
            f"stopped by {name} after RL step {step}; its checkpoint is {path}. Continue with: "
            f"python recipes/train.py --resume {out}"
        )
    else:
        message = f"stopped by {name} before the first step finished: nothing to continue, start the run again"
    if trainer.is_global_zero:
        print(f"lit_rl: {message}", flush=True)
    return Preempted(signum, path, message)
