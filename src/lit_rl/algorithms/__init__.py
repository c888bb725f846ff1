"""One LightningModule per algorithm, on the shared base ``RLAlgorithm``; each holds only what differs.

``ALGORITHMS`` is the one list of them: ``algo.name`` -> class, imported on lookup (the list is
``lit_rl.choices``, torch-free, so ``config.validate`` checks ``algo`` before torch loads). A new algorithm is a
module here with its subclass, one line there and its ``conf/algo/<name>.yaml`` (the tests check that the lists
agree).
"""

from ..choices import ALGORITHMS
from .base import NonFiniteUpdates, RLAlgorithm
from .cispo import CISPO
from .dapo import DAPO
from .dr_grpo import DrGRPO
from .grpo import GRPO
from .gspo import GSPO
from .ppo import PPO
from .reinforce import Reinforce
from .reinforce_pp import ReinforcePP
from .sapo import SAPO

__all__ = [
    "ALGORITHMS",
    "CISPO",
    "DAPO",
    "DrGRPO",
    "GRPO",
    "GSPO",
    "NonFiniteUpdates",
    "PPO",
    "RLAlgorithm",
    "Reinforce",
    "ReinforcePP",
    "SAPO",
]
