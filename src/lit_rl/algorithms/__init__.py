"""One LightningModule per algorithm, on the shared base ``RLAlgorithm``; each holds only what differs.

``ALGORITHMS`` is the one list of them: ``algo.name`` -> class. A new algorithm is a module here with its
subclass, one line below and its ``conf/algo/<name>.yaml`` (the tests check that the two lists agree).
"""

from ..registry import Registry
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

ALGORITHMS: Registry[type[RLAlgorithm]] = Registry(
    "algo",
    {
        "reinforce": Reinforce,
        "ppo": PPO,
        "grpo": GRPO,
        "dapo": DAPO,
        "dr_grpo": DrGRPO,
        "gspo": GSPO,
        "cispo": CISPO,
        "reinforce_pp": ReinforcePP,
        "sapo": SAPO,
    },
)

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
