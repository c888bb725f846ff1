"""The RL step (``RLModule``, one LightningModule for every algorithm) and the algorithms, one ``Algorithm`` per
paper, each holding only what its paper changes. ``ALGORITHMS`` is the one list of them: ``algo.name`` -> class.
A new algorithm is a module with its ``Algorithm`` subclass, registered here or from the user's own code
(``ALGORITHMS.register("name", cls)``), plus its ``conf/algo/<name>.yaml`` (the tests check that the lists agree).
"""

from ..registry import Registry
from .base import Algorithm, PolicyTerms
from .cispo import CISPO
from .dapo import DAPO
from .dr_grpo import DrGRPO
from .grpo import GRPO
from .gspo import GSPO
from .module import RLModule
from .optimization import NonFiniteUpdates
from .ppo import PPO
from .reinforce import Reinforce
from .reinforce_pp import ReinforcePP
from .sapo import SAPO

ALGORITHMS: Registry[type[Algorithm]] = Registry(
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
    "Algorithm",
    "CISPO",
    "DAPO",
    "DrGRPO",
    "GRPO",
    "GSPO",
    "NonFiniteUpdates",
    "PPO",
    "PolicyTerms",
    "RLModule",
    "Reinforce",
    "ReinforcePP",
    "SAPO",
]
