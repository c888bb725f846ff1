"""lit_rl: PyTorch Lightning recipes for RL of language models with verifiable rewards."""

__version__ = "0.1.0"
