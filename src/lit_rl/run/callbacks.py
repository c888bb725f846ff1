"""The Lightning callbacks a run adds besides its checkpoints: ``AdaptiveThreads`` (``threads: adaptive``),
``SampleLogger`` (a step's samples to TensorBoard and ``samples.jsonl``), ``PlainLines`` (one line per step
on stdout, for log files), ``PolicyExports`` (``checkpoint.export_at_steps``: the policy in save_pretrained format
at chosen RL steps) and the progress bar (``step_progress_bar``: RL steps, not epochs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger
from omegaconf import DictConfig

from ..rollout.multiturn import episode_record
from .hardware import ThreadGovernor


class AdaptiveThreads(L.Callback):
    """``threads: adaptive``: before every RL step ``hardware.ThreadGovernor`` sets as many torch threads as
    the cores other processes left free during the previous step (at most the start-up count, ``auto``'s).
    The thread count then depends on the machine's load, and with it the floating-point summation order:
    two runs (or a run and its resumption) are no longer equal bit for bit."""

    def __init__(self, max_threads: int):
        self.governor = ThreadGovernor(max_threads)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.governor.update()


def adaptive_threads(cfg: DictConfig, requested) -> AdaptiveThreads | None:
    """The ``AdaptiveThreads`` callback for ``threads: adaptive`` (``requested``: the value before
    ``resolve_hardware`` made it a count), else None. Where ``threads: adaptive`` is refused (several ranks,
    ``kernels=batch_invariant``, an out-of-process vLLM engine) ``config.validate`` has already raised
    (``config.check_adaptive_threads``)."""
    if requested != "adaptive":
        return None
    return AdaptiveThreads(int(cfg.threads))


def _cell(text) -> str:
    """``text`` as one Markdown table cell: pipes escaped, line breaks as <br>."""
    return str(text).replace("|", "\\|").replace("\n", "<br>")


class SampleLogger(L.Callback):
    """Every ``every`` RL steps, ``count`` rows of the step (prompt, completion, reward, advantage), spread over
    its prompts, to TensorBoard's text tab (tag ``samples``) and one JSON line each to ``<run>/samples.jsonl``.
    Global rank 0 writes its own rows."""

    def __init__(self, every: int, count: int, out: Path):
        self.every, self.count, self.file = int(every), int(count), out / "samples.jsonl"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        last = getattr(pl_module, "last_step", None)
        if last is None or not trainer.is_global_zero:
            return
        step, scored, advantages = last
        pl_module.last_step = None
        if self.every <= 0 or (step - 1) % self.every:  # steps 1, 1 + every, ...: the first step is sampled
            return
        n = len(scored.texts)
        rows = sorted({i * n // self.count for i in range(min(self.count, n))})
        tok = pl_module.tokenizer
        samples = [
            {
                "step": step,
                "prompt": tok.decode(scored.rollouts.prompt_ids[i], skip_special_tokens=True),
                "completion": scored.texts[i],
                "reward": float(scored.rewards[i]),
                "advantage": float(advantages[i]),
                # multi-turn: the whole episode, its messages with the model turns' token spans and rewards
                **({"episode": episode_record(scored.episodes[i])} if scored.episodes is not None else {}),
            }
            for i in rows
        ]
        with open(self.file, "a") as f:
            f.writelines(json.dumps(s) + "\n" for s in samples)
        tensorboard = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        experiment = tensorboard[0].experiment if tensorboard else None
        if hasattr(experiment, "add_text"):
            table = "| prompt | completion | reward | advantage |\n|---|---|---|---|\n" + "".join(
                f"| {_cell(s['prompt'])} | {_cell(s['completion'])} | {s['reward']:.4g} | {s['advantage']:.4g} |\n"
                for s in samples
            )
            experiment.add_text("samples", table, global_step=step)
            experiment.flush()


class PlainLines(L.Callback):
    """One plain line per RL step (step, reward, response length, s/step, and tokens/s: the engine's own generation
    rate, ``perf/rollout_tokens_per_s``, in async mode the producer's, not tokens over the trainer's wait): on
    stdout when ``console`` (what a log file or a cluster job's output shows, where a progress bar never prints),
    else to the run's ``run_log`` only (``runlog.RunLog.note``: the console shows the progress bar)."""

    def __init__(self, max_steps: int, console: bool = True, run_log=None):
        self.max_steps, self.console, self.run_log = max_steps, console, run_log

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not trainer.is_global_zero:
            return
        m = {k: float(v) for k, v in trainer.callback_metrics.items()}
        step = trainer.global_step // pl_module.updates_per_step
        total = f"/{self.max_steps}" if self.max_steps > 0 else ""
        line = (
            f"lit_rl: step {step}{total} reward {m.get('rollout/reward_mean', float('nan')):.4f} "
            f"length {m.get('rollout/response_length_mean', float('nan')):.1f} "
            f"s/step {m.get('time/step_s', float('nan')):.2f} "
            f"tokens/s {m.get('perf/rollout_tokens_per_s', float('nan')):.1f}"
        )
        self._emit(line)

    def on_validation_end(self, trainer, pl_module) -> None:
        """One plain line per evaluation with its ``eval/`` values (``eval.only`` printed none before: its scores
        were only in the event files): ``lit_rl: eval step 0 eval/accuracy 0.2500 eval/pass@1 0.2500 ...``."""
        if not trainer.is_global_zero or trainer.sanity_checking:
            return
        m = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("eval/")}
        if m:
            values = " ".join(f"{k} {v:.4f}" for k, v in sorted(m.items()))
            self._emit(f"lit_rl: eval step {trainer.global_step // pl_module.updates_per_step} {values}")

    def _emit(self, line: str) -> None:
        if self.console:
            print(line, flush=True)  # the run's log takes it from stdout
        elif self.run_log is not None:
            self.run_log.note(line)


class PolicyExports(L.Callback):
    """``checkpoint.export_at_steps``: the policy as it is after RL step n (0 = the initial weights, before the
    first update), written by global rank 0 to ``<out>/policy_step{n}/`` in save_pretrained format with its
    tokenizer, like the final ``policy/`` (``export``: a function ``(policy, folder)``; LoRA: the adapter, or
    merged). A folder that already holds a ``config.json`` is never overwritten (a continued run that passes the
    step again keeps the first export). Refused under FSDP at start-up (``schema.CheckpointConfig``)."""

    def __init__(self, steps, out: Path, export, tokenizer):
        self.steps, self.out, self.export, self.tokenizer = {int(s) for s in steps}, out, export, tokenizer

    def _write(self, trainer, pl_module, step: int) -> None:
        folder = self.out / f"policy_step{step}"
        if step not in self.steps or not trainer.is_global_zero or (folder / "config.json").exists():
            return
        self.export(pl_module.policy, folder)
        self.tokenizer.save_pretrained(folder)
        print(f"lit_rl: the policy after RL step {step} written to {folder} (checkpoint.export_at_steps)", flush=True)

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_step == 0:
            self._write(trainer, pl_module, 0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        k = pl_module.updates_per_step
        if trainer.global_step % k == 0:  # the last of the RL step's optimizer steps (PPO: several)
            self._write(trainer, pl_module, trainer.global_step // k)


def plain_lines_on(setting) -> bool:
    """``log.plain_lines``: true, false, or auto (on when stdout is not a terminal)."""
    if setting == "auto":
        return not sys.stdout.isatty()
    return bool(setting)


def step_progress_bar() -> L.Callback:
    """Lightning's progress bar (rich when installed, else tqdm, as Lightning picks) describing its count as RL
    steps: a run has one endless epoch and ``max_epochs=-1``, which Lightning showed as ``Epoch 0/-2``. The count
    is the RL steps done (one batch per RL step) out of ``trainer.max_steps``."""
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
    from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

    class StepRichProgressBar(RichProgressBar):
        def _get_train_description(self, current_epoch: int) -> str:
            return "RL step"

    class StepTQDMProgressBar(TQDMProgressBar):
        def on_train_epoch_start(self, trainer, *args) -> None:
            super().on_train_epoch_start(trainer, *args)
            self.train_progress_bar.set_description("RL step")

    return StepRichProgressBar() if _RICH_AVAILABLE else StepTQDMProgressBar()
