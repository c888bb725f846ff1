"""lit_rl: PyTorch Lightning recipes for RL of language models with verifiable rewards."""

from . import schema as _schema  # noqa: F401  (stores the typed config schemas conf/ starts from in Hydra's ConfigStore)

__version__ = "0.1.0"
