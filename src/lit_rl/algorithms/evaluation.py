"""Evaluation: pass@1 (greedy) or mean@n / pass@k on the held-out split, between RL steps; "correct" is the
verifier's verdict (``reward.correct_from``), never a threshold on the weighted reward.

``EvaluationMixin`` is part of ``RLModule`` (``algorithms.module``). The rollout source pauses around it (the async
producer finishes its batch; the engine is synced to the latest update).
"""

from __future__ import annotations

import torch

from ..rollout.datamodule import PromptBatch
from ..tasks.reward_functions import pass_at_k
from .step_logging import FIRST_LOGGED_STEP


class EvaluationMixin:
    """Lightning's validation hooks for a LightningModule with a ``source``, ``datamodule``, ``eval_sampling``
    and ``all_reduce``."""

    def on_validation_start(self) -> None:
        self.source.pause(self)  # the engine is evaluation's, synced to the latest update

    #: ``eval.n`` samples per problem and ``eval.k`` for pass@k (``lit_rl.run.train.run`` sets them from the config)
    eval_n: int = 1

    eval_k: int = 1

    def on_validation_epoch_start(self) -> None:
        # reward sum, samples, pass@k sum, problems, correct samples (this rank's share of the eval split)
        self._eval_sums = [0.0, 0.0, 0.0, 0.0, 0.0]

    def validation_step(self, batch: PromptBatch, batch_idx: int) -> None:
        if not batch.examples:  # this rank's share of the eval split is empty; it still joins the reduction
            return
        n = int(self.eval_n)
        scored = self.datamodule.collect(
            self.engine,
            batch.examples,
            self.eval_sampling,
            step=-1,
            group_size=n,
            split="eval",
            first_index=batch.offset,
        )
        self._eval_sums[0] += float(scored.rewards.sum())
        self._eval_sums[1] += len(scored.rewards)
        correct = scored.correct.view(len(batch.examples), n).sum(-1)  # the verifier's verdict, not the reward
        self._eval_sums[2] += sum(pass_at_k(n, int(c), int(self.eval_k)) for c in correct.tolist())
        self._eval_sums[3] += len(batch.examples)
        self._eval_sums[4] += float(correct.sum())

    def on_validation_epoch_end(self) -> None:
        """eval/accuracy: the share of the eval samples that are correct (the verifier's verdict,
        ``reward.correct_from``) over the whole eval split (greedy pass@1 with ``eval.n=1``, mean@n otherwise),
        summed over the ranks' shares; eval/reward_mean: their mean reward (the weighted total of
        ``reward.functions``); with ``eval.n > 1`` also ``eval/mean@n`` (the accuracy, named) and ``eval/pass@k``
        (Chen et al. 2021's unbiased estimator, ``reward_functions.pass_at_k``, over the correct samples)."""
        sums = self.all_reduce(torch.tensor(self._eval_sums, dtype=torch.float64)).tolist()
        total, count, passed, problems, correct = sums
        # already the same on every rank; sync_dist=True averages equal values (and keeps Lightning quiet when
        # vLLM has set up a one-process torch.distributed group of its own)
        accuracy = correct / count if count else 0.0
        metrics = {"eval/accuracy": accuracy, "eval/reward_mean": total / count if count else 0.0}
        if int(self.eval_n) > 1:
            metrics[f"eval/mean@{int(self.eval_n)}"] = accuracy
            metrics[f"eval/pass@{int(self.eval_k)}"] = passed / problems if problems else 0.0
        for name, value in metrics.items():  # the progress bar and callbacks; the loggers get them below
            self.log(name, value, prog_bar=name == "eval/accuracy", sync_dist=True, logger=False)
        # at the number of the step it follows (Lightning's own logging put it one step earlier)
        self.write_step_metrics(metrics, self.global_step // self.updates_per_step - 1 + FIRST_LOGGED_STEP)

    def on_validation_end(self) -> None:
        self.source.resume(self)
