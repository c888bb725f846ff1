"""One LightningModule per algorithm, on the shared base ``RLAlgorithm``."""

from .base import RLAlgorithm
from .grpo import GRPO

ALGORITHMS: dict[str, type[RLAlgorithm]] = {"grpo": GRPO}

__all__ = ["ALGORITHMS", "GRPO", "RLAlgorithm"]
