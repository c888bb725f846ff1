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
        rewards."""
        valid = rb.response_mask.sum(-1) > 0
        rewards = rb.rewards
        a = learner.advantage_cfg
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
