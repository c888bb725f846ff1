"""DAPO (Yu et al. 2025, "DAPO: an open-source LLM RL system at scale").

What differs from GRPO, each in one place:
- clip-higher: asymmetric clip, eps_low 0.2 / eps_high 0.28 (``conf/algo/dapo.yaml``);
- token-level reduction sum_i sum_t l / sum_i T_i (``loss.reduction=token_mean``);
- dynamic sampling (``collect``): groups whose rewards are all equal carry no gradient, so they are
  dropped and more prompts are sampled until the step holds ``prompts_per_step`` useful groups, at most
  ``algo.dynamic_sampling.max_rounds`` generation rounds; the dropped groups whose completions are all correct /
  all wrong (the verifier's verdict, ``reward.correct_from``) are counted in rollout/groups_all_correct and
  rollout/groups_all_wrong. The filter is on the rewards, not on correctness (the paper states it as
  0 < #correct < G, which is the same with one 0/1 verifier): with several reward functions a group of equal
  correctness whose rewards differ (format, length) still has a gradient, and is kept;
- overlong reward shaping (``shape_rewards``): ``objectives.overlong_penalty`` added to the task reward;
- optionally, truncated completions masked out of the loss (``algo.mask_truncated``).

With several data-parallel ranks each rank fills its own share (P / world_size useful groups) from its
share of every round's prompts, so no prompt is generated twice; a rank that needs more rounds than the
others runs them while the others wait at the update.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import objectives as obj
from ..rollout.datamodule import PromptBatch, ScoredRollouts, add_failures, concat_scored, select_rows
from ..schema import DapoConfig
from .grpo import GRPO


class DAPO(GRPO):
    """GRPO with clip-higher, token-mean loss, dynamic sampling and overlong shaping."""

    algo_config = DapoConfig

    def collect(self, learner, batch: PromptBatch):
        ds = self.cfg.dynamic_sampling
        if not ds.enabled:
            return super().collect(learner, batch)
        target = len(batch.examples)
        dm = learner.datamodule
        kept: list[ScoredRollouts] = []
        n_kept = all_correct = all_wrong = rounds = 0
        examples = batch.examples
        rewards_seen, errors, failures = [], 0, {}
        offset, world = batch.offset, dm.world_size
        while True:
            # group ids and seeds by a prompt's position in the round's full list (all ranks): one id per group
            scored = dm.collect(
                learner.engine,
                examples,
                learner.sampling,
                batch.step,
                round=rounds,
                group_offset=rounds * target * world,
                first_index=offset,
            )
            rewards_seen.append(scored.rewards)
            errors += scored.reward_errors
            failures = add_failures(failures, scored.reward_failures)
            for g in scored.group_ids.unique().tolist():
                rows = (scored.group_ids == g).nonzero().squeeze(-1)
                r = scored.rewards[rows]
                if bool((r == r[0]).all()):  # equal rewards: zero advantages, no gradient: dropped
                    correct = scored.correct[rows]  # counted by the verifier's verdict, not by the reward
                    all_correct += int(correct.all())
                    all_wrong += int(not correct.any())
                elif n_kept < target:
                    kept.append(select_rows(scored, rows))
                    n_kept += 1
            rounds += 1
            if n_kept >= target or rounds >= ds.max_rounds:
                break
            offset, examples = dm.shard(dm.prompts_for(batch.step, round=rounds, count=target * world))
        if not kept:  # nothing useful in any round: train on the last round (zero advantages, unless overlong
            # shaping makes a group's shaped rewards differ)
            kept = [scored]
        out = concat_scored(kept, learner.tokenizer.pad_token_id)
        out.reward_failures = failures  # every round's calls, as rollout/reward_errors counts them
        generated = torch.cat(rewards_seen)
        # these replace the base's rollout metrics: reward over everything generated (comparable with the
        # other algorithms), the dropped groups' counts, and the reward of the groups kept for training
        metrics = {
            "rollout/reward_mean": float(generated.mean()),
            "rollout/reward_mean_kept": float(out.rewards.mean()),
            "rollout/groups_all_correct": float(all_correct),
            "rollout/groups_all_wrong": float(all_wrong),
            "rollout/generation_rounds": float(rounds),
            "rollout/groups_kept": float(n_kept),
            "rollout/reward_errors": float(errors),
        }
        return out, metrics

    def metric_weights(
        self, learner, batch: PromptBatch, scored: ScoredRollouts, metrics: dict[str, float]
    ) -> dict[str, float]:
        """rollout/reward_mean averages every generated completion: rounds x this rank's prompts x G."""
        weights = super().metric_weights(learner, batch, scored, metrics)
        if "rollout/generation_rounds" in metrics:
            rounds = metrics["rollout/generation_rounds"]
            weights["rollout/reward_mean"] = rounds * len(batch.examples) * learner.group_size
        return weights

    def shape_rewards(self, learner, scored: ScoredRollouts) -> Tensor:
        ol = self.cfg.overlong
        if not ol.enabled:
            return scored.rewards
        penalty = obj.overlong_penalty(scored.rollouts.response_length, learner.max_response_length, ol.buffer_length)
        return scored.rewards + penalty * ol.penalty_factor

    def finish_batch(self, learner, scored: ScoredRollouts, rb) -> None:
        """Rewards and advantages have seen every completion; truncated ones now leave the loss (both its
        numerator and its denominator) when ``algo.mask_truncated`` is on."""
        if self.cfg.mask_truncated:
            truncated = torch.tensor(
                [f == "length" for f in scored.rollouts.finish_reason], device=rb.response_mask.device
            )
            rb.response_mask = rb.response_mask & ~truncated[:, None]
