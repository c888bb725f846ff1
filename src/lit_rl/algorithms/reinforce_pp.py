"""REINFORCE++ (Hu et al. 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models";
OpenRLHF's ``advantage_estimator=reinforce`` / ``reinforce_baseline``): no critic, no group normalisation.

- The per-token reward folds in the KL to the frozen reference (``kl.mode=reward``, the algorithm's default):
  r_t = −beta·kl_t, plus the sequence reward R'_i on the last token; the return is G_t = R'_i − beta Σ_{s≥t} kl_s
  (``objectives.kl_penalised_returns``, gamma = 1), kl_t the ``kl.estimator`` of pi_old against the reference.
- ``algo.baseline``: ``none`` (REINFORCE++: R'_i = R_i) | ``group`` (REINFORCE++-baseline: R'_i = R_i minus
  its group's mean reward, which removes the prompt's difficulty).
- The returns are whitened over every valid token of the step (all ranks): A_t = (G_t − mean) / (std + 1e-8),
  the batch normalisation that replaces GRPO's per-group std.
- Loss: the PPO clipped surrogate (the base's, dual clip included), token-mean reduction, as OpenRLHF.
  ``kl.target`` adapts beta (Ziegler et al. 2019), logged as ``train/kl_coef``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import objectives as obj
from ..rollout.types import RolloutBatch
from ..schema import ReinforcePpConfig
from .base import Algorithm

#: ``algo.baseline`` for reinforce_pp
BASELINES_PP = ("none", "group")


class ReinforcePP(Algorithm):
    """REINFORCE++ and REINFORCE++-baseline: KL-penalised returns, batch-whitened, PPO-clipped."""

    algo_config = ReinforcePpConfig

    @torch.no_grad()
    def advantages(self, learner, rb: RolloutBatch) -> Tensor:
        """[N, T] A = whiten(R'_i − beta Σ_{s≥t} kl_s) over the step's valid tokens (all ranks), R'_i the reward
        minus its group's mean with ``baseline=group``; kl_t of pi_old (``learner.snapshot``, taken here) against
        the reference with ``kl.mode=reward``, else 0."""
        rewards = rb.rewards.float()
        if self.cfg.baseline == "group":
            valid = rb.response_mask.sum(-1) > 0
            rewards = obj.group_advantages(rewards, rb.group_ids, alpha=0.0, valid=valid, scale="none")
        learner.snapshot(rb)
        mask = rb.response_mask
        kl = learner.reference_kl(rb) if learner.kl_cfg.mode == "reward" else torch.zeros_like(rb.old_logprobs)
        returns = obj.kl_penalised_returns(rewards, kl, mask, learner.kl_coef)
        return learner.whiten(returns, mask)
