"""GRPO (Shao et al. 2024, DeepSeekMath, eq. 3): group-normalised advantages, PPO-clipped ratio.

Everything GRPO needs is the base's default: ``objectives.group_advantages`` with alpha = 1 (alpha = 0
gives Dr.GRPO's mean-only advantage) and ``objectives.ppo_clip_loss``; the reduction is the config's
``loss.reduction`` (GRPO's own is ``seq_mean_token_mean``: (1/G) sum_i (1/T_i) sum_t).
"""

from .base import RLAlgorithm


class GRPO(RLAlgorithm):
    """Group Relative Policy Optimization; see the module docstring for where each piece lives."""
