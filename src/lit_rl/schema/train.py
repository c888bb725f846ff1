"""``TrainConfig``: the whole run, ``conf/train.yaml``'s root: the groups chosen in its defaults list and its own
sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .algo import AlgoConfig
from .base import Number
from .loss import AdvantageConfig, CorrectionConfig, DistillConfig, KlConfig, LossConfig
from .model import ModelConfig
from .rollout import KernelsConfig, RolloutConfig, SamplingConfig
from .task import RewardConfig
from .trainer import (
    CheckpointConfig,
    EvalConfig,
    LogConfig,
    LoggerConfig,
    OptimConfig,
    TensorBoardLoggerConfig,
    UpdateConfig,
    _trainer_defaults,
)


@dataclass
class TrainConfig:
    """The whole run (``conf/train.yaml``): the groups chosen in its defaults list and its own sections.

    ``trainer`` is the Lightning Trainer's keyword arguments, left open (Lightning checks them). ``task`` and
    ``engine`` are typed by their option's own schema (``SCHEMAS``); everything else by the fields below. The
    defaults are ``python recipes/train.py``'s (a test compares), except an algorithm's own defaults, which come
    with its config class (``DapoConfig()``...) or from ``lit_rl.compose("algo=dapo")``.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    task: Any = field(default_factory=lambda: {"name": "arithmetic"})
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    engine: Any = field(default_factory=lambda: {"name": "torch"})
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    trainer: dict[str, Any] = field(default_factory=_trainer_defaults)
    seed: int = 0
    #: a verifier that raises or runs longer scores 0, counted in rollout/reward_errors
    reward_timeout_s: Number = 10.0
    #: torch intra-op threads: auto (the physical cores this process may run on, ``hardware.auto_threads``) |
    #: adaptive (auto's count, then per step the cores other processes leave free) | an integer
    threads: Any = "auto"
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    kl: KlConfig = field(default_factory=KlConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    #: TensorBoard, the recipe's default (``conf/train.yaml`` clears it for its ``logger`` group to choose)
    logger: LoggerConfig = field(default_factory=lambda: LoggerConfig(tensorboard=TensorBoardLoggerConfig()))
    #: resume: a .ckpt path, or "last" (with hydra.run.dir=<the run>)
    ckpt_path: Optional[str] = None
    #: a run folder to continue (``train.resumed_config``): its saved config.yaml, its last checkpoint, its folder
    resume: Optional[str] = None
    #: rows of float32 logits alive at once when the trainer scores tokens (100 MB at V=49152)
    logprob_chunk_tokens: int = 512
