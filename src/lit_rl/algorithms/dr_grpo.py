"""Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-like Training"): GRPO without its two biases.

The advantage keeps only the mean baseline, A_i = R_i - mean R (``advantage.alpha = 0``: no division by
the group's std), and the loss is normalised by a constant, (1/(G * L_max)) sum_i sum_t (the
``constant`` reduction), so a completion's weight does not depend on its own length.
Both are set in ``conf/algo/dr_grpo.yaml``; the objective is GRPO's PPO clip.
"""

from ..schema import DrGrpoConfig
from .grpo import GRPO


class DrGRPO(GRPO):
    """GRPO with mean-only advantages and a constant loss normaliser (see the module docstring)."""

    algo_config = DrGrpoConfig
