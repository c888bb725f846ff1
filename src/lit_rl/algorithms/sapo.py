"""SAPO (Soft Adaptive Policy Optimization, arXiv 2511.20347; Qwen 2025): a smooth gate in place of the hard clip.

loss_t = −f(r_t)·A with f(r) = σ(τ (r − 1))·4/τ, τ = ``algo.sapo.tau_pos`` (1.0) for A > 0 and ``tau_neg`` (1.05)
for A < 0, the paper's defaults (``objectives.sapo_loss``). The gradient weight 4rσ(1 − σ) is 1 on-policy (the
REINFORCE gradient) and decays smoothly as the token's ratio leaves 1, faster for negative advantages; no token
is cut off as by PPO's clip. GRPO otherwise: group-normalised advantages, its reduction.
"""

from torch import Tensor

from .. import objectives as obj
from ..loss import TokenMetrics
from ..rollout.types import RolloutBatch
from ..schema import SapoConfig
from .grpo import GRPO


class SAPO(GRPO):
    """Group-normalised advantages with SAPO's soft, temperature-controlled gate on the token ratio."""

    algo_config = SapoConfig

    def policy_loss(self, logprobs: Tensor, old_logprobs: Tensor, mb: RolloutBatch) -> tuple[Tensor, TokenMetrics]:
        gate = self.cfg.sapo
        adv = mb.advantages if mb.advantages.dim() == 2 else mb.advantages[:, None]
        # the gradient weight 4 r σ (1 − σ): 1 on-policy, smaller as the ratio moves away
        weight = obj.sapo_weight(logprobs.detach() - old_logprobs, adv, gate.tau_pos, gate.tau_neg)
        metrics = TokenMetrics().add("train/sapo_gate", weight, mb.response_mask)
        return obj.sapo_loss(logprobs, old_logprobs, mb.advantages, gate.tau_pos, gate.tau_neg), metrics

    def score_coefficients(self, log_ratio: Tensor, sampled_log_ratio: Tensor, mb: RolloutBatch) -> Tensor:
        """−A · 4 r_v σ(1 − σ) at the token's own ratio."""
        gate = self.cfg.sapo
        return obj.sapo_coef(log_ratio, mb.advantages, gate.tau_pos, gate.tau_neg)
