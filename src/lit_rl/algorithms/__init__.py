"""The RL step (``RLModule``, one LightningModule for every algorithm) and the algorithms, one ``Algorithm`` per
paper, each holding only what its paper changes. ``ALGORITHMS`` is the one list of them: ``algo.name`` -> class,
imported on lookup (the list is ``lit_rl.choices``, torch-free, so ``config.validate`` checks ``algo`` before torch
loads). A new algorithm is a module with its ``Algorithm`` subclass and its config dataclass, registered there or
from the user's own code (``ALGORITHMS.register("name", cls)``), plus its ``conf/algo/<name>.yaml`` (the tests
check that the lists agree).
"""

from ..choices import ALGO_CONFIGS, ALGORITHMS
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


def register_algorithm(name: str):
    """Class decorator: make ``algo.name=<name>`` train with the decorated ``Algorithm`` subclass, from the
    user's own code (verl's ``register_adv_est`` / ``register_policy_loss`` idea, for a whole algorithm). Its
    ``algo_config`` dataclass answers ``config.validate``; a run composes with ``algo.name=<name>`` over any
    algo preset whose fields the dataclass has (e.g. ``algo=grpo algo.name=<name>``). Raises ValueError for a
    taken name or a class that is not an ``Algorithm``.

        @register_algorithm("sign_grpo")
        class SignGRPO(GRPO):
            def advantages(self, learner, rb):
                return torch.sign(super().advantages(learner, rb))
    """

    def decorate(cls: type[Algorithm]) -> type[Algorithm]:
        if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
            raise ValueError(f"algo.name={name!r}: {cls!r} is not an Algorithm subclass")
        ALGORITHMS.register(name, cls)
        ALGO_CONFIGS.register(name, cls.algo_config)
        return cls

    return decorate


def unregister_algorithm(name: str) -> None:
    """Undo ``register_algorithm(name)``. Raises ``UnknownChoice`` for a name that is not registered."""
    ALGO_CONFIGS.unregister(name)
    ALGORITHMS.unregister(name)


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
    "register_algorithm",
    "unregister_algorithm",
]
