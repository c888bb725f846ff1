"""CISPO (MiniMax-M1, 2025): clip the importance weight itself and stop its gradient.

loss_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A * log pi_theta(y_t), token-mean reduction; unlike
PPO's clip no token loses its gradient (``objectives.cispo_loss``). The paper sets no lower bound
(eps_low >= 1 means the weight is only capped above) and tunes eps_high.
"""

from torch import Tensor

from .. import objectives as obj
from ..loss import TokenMetrics
from ..rollout.types import RolloutBatch
from ..schema import CispoConfig
from .grpo import GRPO


class CISPO(GRPO):
    """Clipped, stop-gradient importance weights times the REINFORCE score, group advantages."""

    algo_config = CispoConfig

    def policy_loss(self, logprobs: Tensor, old_logprobs: Tensor, mb: RolloutBatch) -> tuple[Tensor, TokenMetrics]:
        eps_low, eps_high = self.clip.eps_low, self.clip.eps_high
        ratio = (logprobs.detach() - old_logprobs).exp()
        metrics = TokenMetrics()
        metrics.add("train/pg_clipfrac_lower", (ratio < 1 - eps_low).float(), mb.response_mask)
        metrics.add("train/pg_clipfrac_upper", (ratio > 1 + eps_high).float(), mb.response_mask)
        metrics.add("train/pg_clipfrac", ((ratio < 1 - eps_low) | (ratio > 1 + eps_high)).float(), mb.response_mask)
        return obj.cispo_loss(logprobs, old_logprobs, mb.advantages, eps_low, eps_high), metrics

    def score_coefficients(self, log_ratio: Tensor, sampled_log_ratio: Tensor, mb: RolloutBatch) -> Tensor:
        """-sg(clip(r_v)) A: the clipped weight of the token's own ratio."""
        return obj.cispo_coef(log_ratio, mb.advantages, self.clip.eps_low, self.clip.eps_high)
