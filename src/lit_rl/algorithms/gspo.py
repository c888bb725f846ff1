"""GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): one clipped ratio per completion.

s_i = exp((1/T_i) sum_t log(pi_theta / pi_old)) — the geometric mean of the token ratios over the valid
tokens — is clipped PPO-style at the sequence level; see ``objectives.gspo_loss``. The clip ranges are
small (the paper's 3e-4 / 4e-4) because a sequence ratio moves much less than a token ratio.
"""

from torch import Tensor

from .. import objectives as obj
from ..loss import TokenMetrics
from ..rollout.types import RolloutBatch
from ..schema import GspoConfig
from .grpo import GRPO


class GSPO(GRPO):
    """Group-normalised advantages (as GRPO) with a sequence-level clipped ratio."""

    algo_config = GspoConfig

    def policy_loss(self, logprobs: Tensor, old_logprobs: Tensor, mb: RolloutBatch) -> tuple[Tensor, TokenMetrics]:
        loss, clip_low, clip_high = obj.gspo_loss(
            logprobs, old_logprobs, mb.advantages, mb.response_mask, self.clip.eps_low, self.clip.eps_high
        )
        seq = mb.response_mask.any(-1)
        metrics = TokenMetrics()
        metrics.add("train/pg_clipfrac", (clip_low | clip_high).float(), seq)  # fraction of sequences
        metrics.add("train/pg_clipfrac_lower", clip_low.float(), seq)
        metrics.add("train/pg_clipfrac_upper", clip_high.float(), seq)
        return loss, metrics

    def score_coefficients(self, log_ratio: Tensor, sampled_log_ratio: Tensor, mb: RolloutBatch) -> Tensor:
        """-A s_i(v), s_i(v) the sequence ratio with v in place of the sampled token, 0 where it is clipped."""
        return obj.gspo_coef(
            log_ratio, sampled_log_ratio, mb.advantages, mb.response_mask, self.clip.eps_low, self.clip.eps_high
        )
