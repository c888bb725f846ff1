"""GRPO (Shao et al. 2024, DeepSeekMath, eq. 3): group-normalised advantages, PPO-clipped ratio.

The advantage (``advantages``): A_i = (R_i − mean_g R) / (std_g R + eps)^alpha over the completions of the same
prompt (``objectives.group_advantages``; alpha = 1 is GRPO, alpha = 0 gives Dr.GRPO's mean-only advantage; the
``advantage`` group also picks the std (population or sample) and its scale: the group, the whole step, or none).
The objective is the base's PPO clipped surrogate (``objectives.ppo_clip_loss``); the reduction is the config's
``loss.reduction`` (GRPO's own is ``seq_mean_token_mean``: (1/G) sum_i (1/T_i) sum_t). DAPO, Dr.GRPO, GSPO, CISPO
and SAPO keep this advantage and change what their papers change.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import objectives as obj
from ..rollout.types import RolloutBatch
from .base import Algorithm


class GRPO(Algorithm):
    """Group Relative Policy Optimization; see the module docstring for where each piece lives."""

    def advantages(self, learner, rb: RolloutBatch) -> Tensor:
        """[N] float32 group-normalised advantages of ``rb.rewards`` within ``rb.group_ids`` (rows without a
        response count for nothing). With ``advantage.scale=batch`` on several ranks the std spans every rank's
        rewards. ``advantage.multi_reward=normalize_then_sum``: GDPO's (``gdpo_advantages``)."""
        valid = rb.response_mask.sum(-1) > 0
        rewards = rb.rewards
        a = learner.advantage_cfg
        if a.multi_reward == "normalize_then_sum":
            return self.gdpo_advantages(learner, rb, valid)
        batch_std = None
        if a.scale == "batch" and learner.world_size > 1:  # the step's std spans every rank's rewards
            r = torch.where(valid, rewards.double(), torch.zeros_like(rewards, dtype=torch.float64))
            moments = learner.all_reduce(torch.stack([valid.sum().double(), r.sum(), (r**2).sum()]))
            batch_std = float(obj.std_from_moments(*moments.tolist(), a.std))
        return obj.group_advantages(
            rewards,
            rb.group_ids,
            alpha=a.alpha,
            eps=a.eps,
            valid=valid,
            std=a.std,
            scale=a.scale,
            batch_std=batch_std,
        )

    def gdpo_advantages(self, learner, rb: RolloutBatch, valid: Tensor) -> Tensor:
        """GDPO (``objectives.gdpo_advantages``): each of ``reward.functions`` normalised in its group, summed with
        ``reward.weights``, whitened over the step (every rank's rows). An algorithm that shapes the rewards (DAPO's
        overlong penalty: ``rb.rewards`` minus the weighted functions) adds one more reward of weight 1; a run scored
        by the task's verifier alone has one reward, ``rb.rewards``. Keeps each reward's mean |A_k| for
        ``batch_metrics``."""
        rewards = learner.datamodule.rewards
        if rb.reward_parts is not None and rb.reward_parts.shape[1] == len(rewards.weights):
            parts, weights, names = (
                rb.reward_parts.float(),
                list(rewards.weights),
                list(rewards.names[: len(rewards.weights)]),
            )
            w = torch.tensor(weights, dtype=parts.dtype, device=parts.device)
            shaping = rb.rewards - (w * parts.nan_to_num(0.0)).sum(-1)
            if type(self).shape_rewards is not Algorithm.shape_rewards:  # the same on every rank, whatever the data
                parts, weights, names = torch.cat([parts, shaping[:, None]], 1), [*weights, 1.0], [*names, "shaping"]
        else:
            parts, weights, names = rb.rewards.float()[:, None], [1.0], ["task"]
        a = learner.advantage_cfg
        sum_over_ranks = learner.all_reduce if learner.world_size > 1 else None
        advantages, per_reward = obj.gdpo_advantages(
            parts, weights, rb.group_ids, a.alpha, a.eps, valid, a.std, a.scale, sum_over_ranks
        )
        count = int(valid.sum())
        self._reward_advantages = {
            f"rollout/advantage/{name}": float(per_reward[k].abs()[valid].mean()) if count else 0.0
            for k, name in enumerate(names)
        }
        return advantages

    def batch_metrics(self, learner, rb: RolloutBatch) -> dict[str, float]:
        """``rollout/advantage/<reward>``: each reward's mean |A_k| over the step's completions under
        ``advantage.multi_reward=normalize_then_sum`` (how much it moves the update); none with ``sum``."""
        metrics, self._reward_advantages = getattr(self, "_reward_advantages", {}), {}
        return metrics
