"""REINFORCE (Williams 1992) with a baseline b(x) that does not depend on the sampled completion.

loss = -A * sum_t log pi(y_t | h_t), A = R - b. Baselines (``algo.baseline``): ``none`` (A = R),
``batch_mean`` (mean reward of the step) and ``rloo`` (leave-one-out mean of the other completions of the
same prompt; Ahmadian et al. 2024, "Back to Basics"). The paper's per-sequence sum over tokens is the
``seq_mean_token_sum`` reduction.
"""

import torch
from torch import Tensor

from .. import objectives as obj
from ..loss import TokenMetrics
from ..rollout.types import RolloutBatch
from ..schema import ReinforceConfig
from .base import Algorithm


class Reinforce(Algorithm):
    """Plain policy gradient: no ratio, no clip; only the baseline is a choice."""

    algo_config = ReinforceConfig

    def advantages(self, learner, rb: RolloutBatch) -> Tensor:
        """[N] A = R - b. ``batch_mean`` averages over the whole step, all data-parallel ranks; ``rloo``
        needs only the group, which stays on one rank."""
        rewards, baseline = rb.rewards, self.cfg.baseline
        if baseline == "batch_mean" and learner.world_size > 1:
            sums = torch.stack([rewards.sum().double(), torch.tensor(float(len(rewards)), dtype=torch.float64)])
            total, count = learner.all_reduce(sums).tolist()
            return rewards.float() - rewards.new_tensor(total / count, dtype=torch.float32)
        return obj.baseline_advantages(rewards, rb.group_ids, baseline)

    def policy_loss(self, logprobs: Tensor, old_logprobs: Tensor, mb: RolloutBatch) -> tuple[Tensor, TokenMetrics]:
        adv = mb.advantages if mb.advantages.dim() == 2 else mb.advantages[:, None]
        return -adv * logprobs, TokenMetrics()

    def score_coefficients(self, log_ratio: Tensor, sampled_log_ratio: Tensor, mb: RolloutBatch) -> Tensor:
        """-A for every token: REINFORCE's coefficient does not depend on the ratio."""
        return obj.reinforce_coef(log_ratio, mb.advantages)
