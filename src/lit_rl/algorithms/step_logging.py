"""The step's metrics: FLOPs and rates, the reduction over data-parallel ranks, the reward functions' failure
tally (``count_reward_failures``), the write to the loggers and the train–inference gap guard
(``check_logprob_gap``).

``StepLoggingMixin`` is part of ``RLModule`` (``algorithms.module``); the bookkeeping of the reductions lives in
``parallel``, the FLOP counts in ``lit_rl.run.flops``.
"""

from __future__ import annotations

import warnings

from torch import Tensor

from ..rollout.datamodule import ScoredRollouts
from ..rollout.types import RolloutBatch
from ..run.flops import FlopModel
from . import parallel

#: the number the first RL step is logged, shown and checkpointed under: 1, as Lightning's ``global_step`` and TRL
#: count after the optimizer step (``benchmarks/bit_identity.py`` reads it to compare runs across the change from 0)
FIRST_LOGGED_STEP = 1


class LogprobGapExceeded(RuntimeError):
    """``train/logprob_abs_diff`` of a step exceeded ``correction.guard.logprob_abs_diff_max`` with
    ``correction.guard.action=stop``."""


def logprob_gap_problem(metrics: dict[str, float], threshold: float | None) -> str | None:
    """The guard's message when the step's ``train/logprob_abs_diff`` (mean |log μ − log π_old| per token, nats)
    exceeds ``threshold`` (None: off), else None. A NaN gap counts as exceeding (slime's
    ``--ci-train-rollout-logprob-abs-diff-threshold``, which asserts the same bound in its CI runs)."""
    gap = metrics.get("train/logprob_abs_diff")
    if threshold is None or gap is None or gap <= threshold:
        return None
    return (
        f"train/logprob_abs_diff = {gap:.3g} nats per token exceeds correction.guard.logprob_abs_diff_max = "
        f"{threshold:g}: the rollout engine and the trainer score the same tokens this differently (kernels, "
        "precision, a weight sync that did not land)"
    )


class StepLoggingMixin:
    """Efficiency metrics, collectives over ranks and the per-step write, for a LightningModule with a
    ``policy``, ``epochs`` and Lightning's ``trainer``."""

    #: peak FLOP/s of one device at the run's precision (``hardware.peak_flops``), that ``perf/mfu`` divides
    #: by; ``lit_rl.run.train.run`` sets it at start-up, else the first step measures it
    peak_flops: float | None = None

    @property
    def flop_model(self) -> FlopModel:
        """The policy's ``FlopModel`` (verl's FlopsCounter convention), built once."""
        if getattr(self, "_flop_model", None) is None:
            self._flop_model = FlopModel.from_config(
                self.policy.config, num_parameters=sum(p.numel() for p in self.policy.parameters())
            )
        return self._flop_model

    def step_flops(self, scored: ScoredRollouts, rb: RolloutBatch) -> dict[str, float]:
        """This rank's FLOPs of the step (``lit_rl.run.flops``): ``perf/rollout_flops``, generating the scored
        completions (2·N per generated token + attention), and ``perf/update_flops``, ``epochs`` forward +
        backward passes over the rows that carry loss (6·N per valid prompt and response token + attention)."""
        r = scored.rollouts
        rollout = self.flop_model.rollout_flops([len(p) for p in r.prompt_ids], r.response_length.tolist())
        response = rb.response_mask.sum(-1)
        seq = (rb.prompt_mask.sum(-1) + response)[response > 0]
        update = self.epochs * self.flop_model.update_flops(seq.tolist())
        return {"perf/rollout_flops": rollout, "perf/update_flops": update}

    def flop_rates(self, metrics: dict[str, float]) -> dict[str, float]:
        """From the step's FLOPs and times, reduced over ranks (FLOPs summed, times the slowest rank's):
        ``perf/update_tflops`` and ``perf/rollout_tflops`` (TFLOP/s), ``perf/peak_tflops`` (all ranks' peak)
        and ``perf/mfu`` = update FLOP rate / peak. The rollout's rate divides by ``time/generate_s``, the engine's
        own generation (and scoring) time: async's producer's, not the trainer's wait for its buffer (which could
        be near 0 and gave ~20 TFLOP/s on a 0.95 TFLOP/s CPU); ``time/rollout_s`` where no source reported one.
        Measures ``peak_flops`` on first use if unset."""
        if self.peak_flops is None:
            from ..run.hardware import peak_flops

            accelerator = "cuda" if self.device.type == "cuda" else "cpu"
            precision = self.trainer.precision if self._trainer is not None else "32-true"
            self.peak_flops = peak_flops(precision, accelerator)[0]
        t_train, t_generate = metrics["time/train_s"], metrics.get("time/generate_s", metrics["time/rollout_s"])
        update = metrics["perf/update_flops"] / t_train if t_train > 0 else 0.0
        rollout = metrics["perf/rollout_flops"] / t_generate if t_generate > 0 else 0.0
        peak = self.peak_flops * self.world_size
        return {
            "perf/update_tflops": update / 1e12,
            "perf/rollout_tflops": rollout / 1e12,
            "perf/peak_tflops": peak / 1e12,
            "perf/mfu": update / peak if peak > 0 else 0.0,
        }

    #: step metrics summed / maximised over ranks (``parallel.reduce_step_metrics``); others are weighted means
    SUMMED_METRICS = parallel.SUMMED_METRICS

    MAX_METRICS = parallel.MAX_METRICS

    @property
    def world_size(self) -> int:
        """Data-parallel ranks (1 without a trainer or on one device)."""
        return self.trainer.world_size if self._trainer is not None else 1

    def all_reduce(self, values: Tensor, op: str = "sum") -> Tensor:
        """``values`` (any shape) summed (``op="sum"``) or maximised (``"max"``) elementwise over the
        data-parallel ranks with Lightning's ``strategy.reduce``, on ``values``' device; on one rank the
        tensor itself. A collective: every rank calls it at the same point with the same shape."""
        if self.world_size == 1:
            return values
        return self.trainer.strategy.reduce(values.detach().to(self.device).clone(), reduce_op=op).to(values.device)

    def all_gather_cat(self, values: Tensor) -> Tensor:
        """Every data-parallel rank's 1-D ``values`` concatenated in rank order (``parallel.all_gather_cat`` over
        Lightning's ``strategy.all_gather``; lengths may differ); on one rank ``values`` itself. A collective."""
        if self.world_size == 1:
            return values

        def gather(t: Tensor) -> Tensor:
            return self.trainer.strategy.all_gather(t.to(self.device)).to(values.device)

        return parallel.all_gather_cat(values, gather, world_size=self.world_size)

    def all_reduce_dict(self, values: dict[str, float], op: str = "sum") -> dict[str, float]:
        """``values`` reduced name by name over the ranks (``parallel.all_reduce_dict``)."""
        return parallel.all_reduce_dict(values, self.all_reduce, op, world_size=self.world_size, rank=self.global_rank)

    def count_reward_failures(self, scored: ScoredRollouts, step: int) -> None:
        """``RewardFunctions.count_failed_step`` of the step's reward calls, summed over the ranks (a collective,
        so every rank stops together): a function that failed on every call of ``reward.max_failed_steps`` steps
        in a row raises ``RewardFunctionFailed`` here, before the step's update and its metrics, so the run folder
        ends at the last step trained (its checkpoints, the loggers' history)."""
        rewards = getattr(self.datamodule, "rewards", None) if self._trainer is not None else None
        if rewards is None or not rewards.max_failed_steps:
            return
        values = {}
        for name in rewards.names:  # the same names on every rank, in the same order
            failed, called = scored.reward_failures.get(name, (0, 0))
            values[f"failed:{name}"], values[f"called:{name}"] = float(failed), float(called)
        values = self.all_reduce_dict(values, "sum")
        rewards.count_failed_step({n: (values[f"failed:{n}"], values[f"called:{n}"]) for n in rewards.names}, step)

    def reduce_step_metrics(self, metrics: dict[str, float], weights: dict[str, float]) -> dict[str, float]:
        """This rank's step metrics combined with the other ranks' (``parallel.reduce_step_metrics`` with this
        class's ``SUMMED_METRICS`` and ``MAX_METRICS``). A collective (every rank calls it once per step)."""
        if self.world_size == 1:
            return dict(metrics)
        return parallel.reduce_step_metrics(
            metrics, weights, self.all_reduce_dict, summed=self.SUMMED_METRICS, maxima=self.MAX_METRICS
        )

    def write_step_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Write the step's scalars to the logger at x = ``step`` and flush them, inside the step.

        ``step`` is the step's number counted from 1 (``FIRST_LOGGED_STEP``): the first RL step is logged as step 1,
        as Lightning's ``global_step`` and TRL count after the optimizer step, so the plain lines, TensorBoard, CSV,
        W&B, MLflow, ``samples.jsonl``, evaluation (logged after step N at N) and the checkpoints' names
        (``step=N.ckpt``: N steps done) all name a step by one number.

        Lightning hands ``self.log`` values to the logger only after the step's checkpoint is written, and
        TensorBoard buffers them; a kill in between would leave a checkpoint whose step has no metrics, and
        a resume would never log them. Written here, every checkpointed step has its scalars on disk.
        ``metrics`` must already be reduced over ranks (``reduce_step_metrics``): Lightning's loggers write
        on global rank 0 only, so one TensorBoard run holds the values of the whole step.
        Every configured logger (``logger=[tensorboard,csv,wandb,mlflow]``) gets the same scalars; TensorBoard's
        events and the CSV file are flushed to disk here (W&B and MLflow write as they receive).
        """
        from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

        for logger in self.loggers:
            logger.log_metrics(metrics, step=step)
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.flush()
            elif isinstance(logger, CSVLogger):
                logger.save()

    def check_logprob_gap(self, metrics: dict[str, float], rl_step: int) -> None:
        """The guard (``correction.guard``): warn, or raise ``LogprobGapExceeded`` with ``action=stop``, when the
        step's ``train/logprob_abs_diff`` exceeds ``logprob_abs_diff_max``. Called after the step's metrics are
        written, with metrics already reduced over ranks, so every rank stops alike and the step shows."""
        guard = self.correction.guard
        problem = logprob_gap_problem(metrics, guard.logprob_abs_diff_max)
        if problem is None:
            return
        if guard.action == "stop":
            raise LogprobGapExceeded(f"step {rl_step}: {problem}")
        warnings.warn(f"step {rl_step}: {problem}", RuntimeWarning, stacklevel=2)
