"""Evaluation between RL steps (and before the first, ``eval.at_start``): every eval set (the task's own split,
then ``eval.sets``), n samples per problem, scored the way practitioners read them (``tasks.eval_metrics``):
accuracy (mean@n), pass@k for every power of two k <= n, maj@n, best@n, worst@n. "Correct" is the set's
verifier's verdict (``reward.correct_from`` for the task's own split), never a threshold on the weighted reward.

``EvaluationMixin`` is part of ``RLModule`` (``algorithms.module``). The rollout source pauses around it (the async
producer finishes its batch; the engine is synced to the latest update). Each evaluation is logged at the x of the
last RL step trained (``eval_step``), so the one before the first step (``eval.at_start``, ``eval.only``) sits at
the step before the first training step.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..rollout.datamodule import PromptBatch
from ..tasks.eval_metrics import pass_ks, problem_scores
from ..tasks.rewards import extract_answer
from .step_logging import FIRST_LOGGED_STEP

#: the run folder's sub-folder of eval generations, one JSON-lines file per set (``<set>.jsonl``)
EVAL_GENERATIONS = "eval_generations"


class EvaluationMixin:
    """Lightning's validation hooks for a LightningModule with a ``source``, ``datamodule``, ``eval_sampling``,
    ``updates_per_step``, ``all_reduce_dict`` and ``write_step_metrics``."""

    #: ``eval.n`` samples per problem and ``eval.k``, a pass@k reported besides the powers of two
    #: (``lit_rl.run.train.build_module`` sets them from the config)
    eval_n: int = 1

    eval_k: int = 1

    #: ``eval.at_start``: evaluate before the first RL step (a run that starts, not one that continues)
    eval_at_start: bool = False

    #: where each set's generations go (``<eval_dir>/<set>.jsonl``, rank r > 0: ``<set>.rank<r>.jsonl``); None: kept
    #: nowhere (``lit_rl.run.train`` sets ``<run>/eval_generations``)
    eval_dir: Path | None = None

    def on_train_start(self) -> None:
        """``eval.at_start``: one evaluation before the first RL step, through Lightning's own validation loop (as
        between steps), logged at x = 0 RL steps done. Skipped when continuing a run."""
        trainer = self.trainer
        if not self.eval_at_start or trainer.global_step > 0 or not trainer.limit_val_batches:
            return
        loop = trainer.fit_loop.epoch_loop
        first_iter = trainer._logger_connector._first_loop_iter
        trainer.validating = True
        loop.val_loop.run()
        trainer.training = True
        trainer._logger_connector._first_loop_iter = first_iter

    def rl_steps_done(self) -> int:
        """RL steps trained so far: Lightning's optimizer steps // the optimizer steps of one RL step; 0 before the
        first. ``RLModule.training_step`` numbers its step by it."""
        return self.global_step // self.updates_per_step

    def eval_step(self) -> int:
        """The x an evaluation is logged at: that of the last RL step trained (``RLModule.training_step`` logs the
        step after ``rl_steps_done`` steps at x = ``rl_steps_done + FIRST_LOGGED_STEP``), hence the step before the
        first training step (0) when none has been trained (``eval.at_start``)."""
        return self.rl_steps_done() - 1 + FIRST_LOGGED_STEP

    def on_validation_start(self) -> None:
        self.source.pause(self)  # the engine is evaluation's, synced to the latest update

    def on_validation_epoch_start(self) -> None:
        self._eval_sums: dict[str, float] = {}  # "<set index>:<name>" -> this rank's sum over its problems
        self._eval_rows: dict[int, list[dict]] = {}

    def validation_step(self, batch: PromptBatch, batch_idx: int) -> None:
        if not batch.examples:  # this rank's share of the set is empty; it still joins the reduction
            return
        eval_set = self.datamodule.eval_sets[batch.eval_set]
        n = int(self.eval_n)
        scored = eval_set.data.collect(
            self.engine,
            batch.examples,
            self.eval_sampling,
            step=-1,
            group_size=n,
            split="eval",
            first_index=batch.offset,
        )
        answer_format = getattr(eval_set.data.task, "answer_format", "flexible")
        ks = pass_ks(n, int(self.eval_k))
        for p, ex in enumerate(batch.examples):
            rows = range(p * n, (p + 1) * n)
            correct = [bool(scored.correct[i]) for i in rows]  # the verifier's verdict, not the reward
            rewards = [float(scored.rewards[i]) for i in rows]
            answers = [extract_answer(scored.texts[i], answer_format) for i in rows]
            scores = problem_scores(correct, rewards, ks, answers if eval_set.has_answers else None)
            scores.update(reward=sum(rewards), problems=1.0)
            for key, value in scores.items():
                name = f"{batch.eval_set}:{key}"
                self._eval_sums[name] = self._eval_sums.get(name, 0.0) + value
            self._eval_rows.setdefault(batch.eval_set, []).extend(
                {
                    "step": self.eval_step(),
                    "problem": batch.offset + p,
                    "id": ex.id,
                    "sample": j,
                    "completion": scored.texts[i],
                    "answer": answers[j],
                    "gold": ex.answer,
                    "correct": correct[j],
                    "reward": rewards[j],
                }
                for j, i in enumerate(rows)
            )

    def on_validation_epoch_end(self) -> None:
        """Per eval set, over its problems summed over the ranks' shares (so the numbers equal one device's):
        ``accuracy`` the share of correct samples (greedy pass@1 with ``eval.n=1`` and ``eval.temperature=0``,
        mean@n otherwise) and ``reward_mean`` their mean reward (the weighted total); with ``eval.n`` > 1 also
        ``mean@n`` (= accuracy), ``pass@k`` for every power of two k <= n and ``eval.k`` (Chen et al. 2021's
        unbiased estimator), ``maj@n`` (sets whose examples all have a gold answer) and ``best@n`` / ``worst@n``
        (the mean over problems of the largest / smallest reward). The task's own split logs as ``eval/<metric>``,
        set ``name`` of ``eval.sets`` as ``eval/<name>/<metric>``."""
        n = int(self.eval_n)
        sets = self.datamodule.eval_sets
        local = {f"{i}:{key}": 0.0 for i, s in enumerate(sets) for key in self._eval_keys(s.has_answers)}
        local.update(self._eval_sums)
        sums = self.all_reduce_dict(local, "sum")
        logged: dict[str, float] = {}
        for i, eval_set in enumerate(sets):
            prefix = "eval/" if eval_set.name == "main" else f"eval/{eval_set.name}/"
            problems = sums[f"{i}:problems"]
            keys = self._eval_keys(eval_set.has_answers)
            mean = {key: sums[f"{i}:{key}"] / problems if problems else 0.0 for key in keys}
            metrics = {"accuracy": mean.get("mean@n", 0.0), "reward_mean": mean.get("reward", 0.0) / n}
            if n > 1:
                metrics[f"mean@{n}"] = metrics["accuracy"]
                metrics.update({k: v for k, v in mean.items() if k.startswith("pass@")})
                for key in ("maj", "best", "worst"):
                    if f"{key}@n" in mean:
                        metrics[f"{key}@{n}"] = mean[f"{key}@n"]
            logged.update({prefix + key: value for key, value in metrics.items()})
        self.write_step_metrics(logged, self.eval_step())  # on global rank 0, already reduced over ranks
        # for the progress bar and the run's returned metrics: already the same on every rank; sync_dist=True
        # averages equal values (and keeps Lightning quiet when vLLM has set up a torch.distributed group of its own)
        for key, value in logged.items():
            self.log(key, value, prog_bar=key == "eval/accuracy", sync_dist=True, logger=False)
        self.save_eval_rows(sets)

    def _eval_keys(self, has_answers: bool) -> list[str]:
        """The per-problem sums one set keeps (every rank the same names, ``all_reduce_dict`` checks)."""
        ks = pass_ks(int(self.eval_n), int(self.eval_k))
        return ["mean@n", *(f"pass@{k}" for k in ks), *(["maj@n"] if has_answers else []), "best@n", "worst@n"] + [
            "reward",
            "problems",
        ]

    def save_eval_rows(self, sets) -> None:
        """Append this rank's generations of each set to ``eval_dir/<set>.jsonl`` (rank r > 0: ``.rank<r>``)."""
        if self.eval_dir is None:
            return
        folder = Path(self.eval_dir)
        folder.mkdir(parents=True, exist_ok=True)
        suffix = "" if self.global_rank == 0 else f".rank{self.global_rank}"
        for i, rows in self._eval_rows.items():
            with open(folder / f"{sets[i].name}{suffix}.jsonl", "a") as f:
                f.writelines(json.dumps({"set": sets[i].name, **row}) + "\n" for row in rows)

    def on_validation_end(self) -> None:
        self.source.resume(self)


__all__ = ["EVAL_GENERATIONS", "EvaluationMixin"]
