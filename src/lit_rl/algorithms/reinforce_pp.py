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
from ..rollout.datamodule import ScoredRollouts
from ..rollout.types import RolloutBatch
from ..schema import ReinforcePpConfig, config_of
from .base import RLAlgorithm

#: ``algo.baseline`` for reinforce_pp
BASELINES_PP = ("none", "group")


class ReinforcePP(RLAlgorithm):
    """REINFORCE++ and REINFORCE++-baseline: KL-penalised returns, batch-whitened, PPO-clipped."""

    algo_config = ReinforcePpConfig
    group_normalised = False  # advantage.std / scale are refused: the batch whitening replaces them
    kl_in_reward = True

    @classmethod
    def group_baseline(cls, algo) -> bool:
        """True for ``algo.baseline=group`` (REINFORCE++-baseline: the group's mean reward is subtracted)."""
        return config_of(cls.algo_config, algo).baseline == "group"

    def advantages(self, scored: ScoredRollouts, rewards: Tensor) -> Tensor:
        """[N] R'_i: the reward, minus its group's mean with ``baseline=group`` (the per-token advantages
        come from ``snapshot``, which needs pi_old and the reference)."""
        rewards = rewards.float()
        if self.algo_cfg.baseline == "group":
            valid = scored.rollouts.response_length > 0
            return obj.group_advantages(rewards, scored.group_ids, alpha=0.0, valid=valid, scale="none")
        return rewards

    def start_update(self, rb: RolloutBatch) -> None:
        """The snapshot (pi_old, the KL-penalised whitened returns) runs even for a single update."""
        self.snapshot(rb)

    @torch.no_grad()
    def snapshot(self, rb: RolloutBatch) -> None:
        """pi_old, then A [N, T] = whiten(R'_i − beta Σ_{s≥t} kl_s) over the step's valid tokens."""
        super().snapshot(rb)
        mask = rb.response_mask
        kl = self.reference_kl(rb) if self.kl_cfg.mode == "reward" else torch.zeros_like(rb.old_logprobs)
        returns = obj.kl_penalised_returns(rb.advantages, kl, mask, self.kl_coef)
        rb.advantages = self.whiten(returns, mask)
