"""lit_rl: PyTorch Lightning recipes for RL of language models with verifiable rewards.

``lit_rl.train(cfg)`` runs what ``python recipes/train.py`` runs, from Python; ``lit_rl.compose(*overrides)``
gives the recipe's typed config (``lit_rl.schema.TrainConfig``) with Hydra's overrides (``lit_rl.run.entry``).
Both load lazily: ``import lit_rl`` imports neither torch nor Lightning.
"""

from . import schema as _schema  # noqa: F401  (stores the typed config schemas conf/ starts from in Hydra's ConfigStore)

__version__ = "0.1.0"
__all__ = ["TrainResult", "compose", "train"]


def __getattr__(name: str):
    if name in __all__:
        from .run import entry

        return getattr(entry, name)
    raise AttributeError(f"module 'lit_rl' has no attribute {name!r}")
