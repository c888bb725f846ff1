"""The typed config: one dataclass per config group, with each field's type, default and meaning in one place.

``conf/train.yaml`` starts from ``TrainConfig`` (stored in Hydra's ConfigStore as ``schema: train``), so every
key a config file or preset sets must be a field here: a typo (``algo: {ppo_epoch: 4}``) fails at compose
time, naming the key and the file, as it does on the command line. The task group's options start from their
own schema (``base_arithmetic``, ``base_gsm8k``). The YAML files stay the user-facing defaults with their
comments; the defaults here are the same values (a test composes the default config and compares), so a
module built from Python (tests, benchmarks, ``lit_rl.expectation``) runs as the recipe does.

One module per family of groups, each torch-free; every name is importable from ``lit_rl.schema``:

- ``model``: ``model`` and ``model.lora``;
- ``task``: the ``task`` options and ``reward``;
- ``algo``: ``algo``, each algorithm's defaults and the start-up rules ``config.validate`` asks it for;
- ``rollout``: the ``engine`` options, ``kernels``, ``rollout`` and ``sampling``;
- ``loss``: ``correction``, ``advantage``, ``loss`` and ``kl``;
- ``trainer``: ``update``, ``optim``, ``eval``, ``log``, ``checkpoint``, ``logger`` and the Trainer's defaults;
- ``train`` and ``probe``: the primary configs, ``TrainConfig`` (``conf/train.yaml``) and ``ProbeRunConfig``
  (``conf/probe.yaml``);
- ``base``: the ``Number`` field type, ``config_of`` and the pieces of ``problems``.

Adding a field: add it to its dataclass (type, default, ``#:`` doc), to the group's YAML file with a comment,
and read it as an attribute (``cfg.algo.ppo_epochs``). A range check that involves only its own section goes to
the dataclass's ``problems`` (``base``: what it yields, torch-free), one across sections to ``config.validate``.

``train_config(cfg)`` is the typed config of a run, built once (``OmegaConf.to_object`` of the composed config)
and passed through the build: every section a dataclass (``task`` and ``engine`` their option's), ``trainer`` a
dict. ``config_of(cls, mapping)`` turns a plain dict (what a test writes) into one dataclass, filling what the
mapping leaves out with the defaults and refusing unknown keys. Importing this package stores the schemas in
Hydra's ConfigStore (``register_configs``).
"""

from __future__ import annotations

from collections.abc import Mapping

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from .algo import (
    AlgoConfig,
    CispoConfig,
    ClipConfig,
    DapoConfig,
    DrGrpoConfig,
    DynamicSamplingConfig,
    GaeConfig,
    GspoConfig,
    OverlongConfig,
    PpoConfig,
    ReinforceConfig,
    ReinforcePpConfig,
    SapoConfig,
    SapoGateConfig,
    ValueConfig,
)
from .base import C, Number, config_of, plain_data
from .loss import (
    AdvantageConfig,
    CorrectionConfig,
    DistillConfig,
    KlConfig,
    LossConfig,
    MisConfig,
    ScConfig,
    TisConfig,
)
from .model import LoraConfig, ModelConfig
from .probe import ProbeConfig, ProbeEngineOverrides, ProbeRunConfig, ProbeSetting
from .rollout import EngineConfig, KernelsConfig, RolloutConfig, SamplingConfig, VLLMEngineConfig
from .task import (
    ArithmeticConfig,
    CalculatorConfig,
    DatasetConfig,
    Gsm8kConfig,
    GuessNumberConfig,
    RewardConfig,
    TaskConfig,
)
from .train import TrainConfig
from .trainer import (
    CheckpointConfig,
    CSVLoggerConfig,
    EvalConfig,
    LogConfig,
    LoggerConfig,
    MLflowLoggerConfig,
    OptimConfig,
    TensorBoardLoggerConfig,
    UpdateConfig,
    WandbLoggerConfig,
)

__all__ = [
    "SCHEMAS",
    "AdvantageConfig",
    "AlgoConfig",
    "ArithmeticConfig",
    "CalculatorConfig",
    "GuessNumberConfig",
    "C",
    "CSVLoggerConfig",
    "CheckpointConfig",
    "CispoConfig",
    "ClipConfig",
    "CorrectionConfig",
    "DapoConfig",
    "DatasetConfig",
    "DistillConfig",
    "DrGrpoConfig",
    "DynamicSamplingConfig",
    "EngineConfig",
    "EvalConfig",
    "GaeConfig",
    "Gsm8kConfig",
    "GspoConfig",
    "KernelsConfig",
    "KlConfig",
    "LogConfig",
    "LoggerConfig",
    "LoraConfig",
    "LossConfig",
    "MLflowLoggerConfig",
    "MisConfig",
    "ModelConfig",
    "Number",
    "OptimConfig",
    "OverlongConfig",
    "PpoConfig",
    "ProbeConfig",
    "ProbeEngineOverrides",
    "ProbeRunConfig",
    "ProbeSetting",
    "ReinforceConfig",
    "ReinforcePpConfig",
    "RewardConfig",
    "RolloutConfig",
    "SamplingConfig",
    "SapoConfig",
    "SapoGateConfig",
    "ScConfig",
    "TaskConfig",
    "TensorBoardLoggerConfig",
    "TisConfig",
    "TrainConfig",
    "UpdateConfig",
    "VLLMEngineConfig",
    "ValueConfig",
    "WandbLoggerConfig",
    "config_of",
    "plain_data",
    "register_configs",
    "train_config",
]

#: the schemas stored in Hydra's ConfigStore (``register_configs``): name -> (group, dataclass). The primary
#: configs' bases (group ``schema``, merged at the root: ``conf/train.yaml`` lists ``schema: train`` first,
#: ``conf/probe.yaml`` overrides it with ``probe``), and the per-option bases of the groups whose options have
#: different fields (task, engine)
SCHEMAS: dict[str, tuple[str | None, type]] = {
    "train": ("schema", TrainConfig),
    "probe": ("schema", ProbeRunConfig),
    "base_arithmetic": ("task", ArithmeticConfig),
    "base_gsm8k": ("task", Gsm8kConfig),
    "base_dataset": ("task", DatasetConfig),
    "base_calculator": ("task", CalculatorConfig),
    "base_guess_number": ("task", GuessNumberConfig),
    "base_torch": ("engine", EngineConfig),
    "base_vllm": ("engine", VLLMEngineConfig),
}


def register_configs() -> None:
    """Store the schemas in Hydra's ConfigStore (idempotent). ``conf/train.yaml`` lists ``schema: train`` first in
    its defaults, ``conf/task/<name>.yaml`` its ``base_<name>``. Called when this package is imported."""
    store = ConfigStore.instance()
    for name, (group, node) in SCHEMAS.items():
        store.store(name=name, group=group, node=node, package="_global_" if group == "schema" else None)


register_configs()


def option_schema(group: str, name: str) -> type | None:
    """The dataclass of option ``name`` of a group whose options have their own fields (``task``, ``engine``):
    the ``base_<option>`` schema its YAML file starts from (``engine=auto`` starts from ``vllm``'s), or None."""
    name = "vllm" if (group, name) == ("engine", "auto") else name
    entry = SCHEMAS.get(f"base_{name}")
    return entry[1] if entry is not None and entry[0] == group else None


def train_config(cfg) -> TrainConfig:
    """The typed config of a run: ``cfg`` (the composed ``DictConfig``, a plain mapping of some of its sections,
    or a ``TrainConfig``, returned as is) as a ``TrainConfig`` instance, built once with ``OmegaConf.to_object``
    (interpolations resolved): every section is its dataclass, ``task`` and ``engine`` their option's
    (``option_schema``), ``trainer`` a dict. What a mapping leaves out takes the schema's defaults, the same as
    ``conf/train.yaml``'s. A ``ProbeRunConfig`` (``conf/probe.yaml``) stays one.

    Raises omegaconf's ValidationError / ConfigKeyError for a value of the wrong type or a key that is no field,
    TypeError for a task or engine option without a schema of its own.
    """
    if isinstance(cfg, TrainConfig):
        return typed_options(cfg)
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.create(dict(cfg))
    cls = OmegaConf.get_type(cfg)
    if not (isinstance(cls, type) and issubclass(cls, TrainConfig)):
        cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg)
    return typed_options(OmegaConf.to_object(cfg))


def typed_options(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with a ``task`` or ``engine`` given as a mapping (a config not composed by Hydra, a ``TrainConfig``
    written in Python) as its option's dataclass, and ``trainer`` as a dict: in place, returned. Raises TypeError
    for an option without a schema of its own."""
    for group in ("task", "engine"):  # typed ``Any``: their fields depend on the option
        value = getattr(cfg, group)
        if isinstance(value, Mapping):
            schema = option_schema(group, value.get("name"))
            if schema is None:
                raise TypeError(f"{group}.name={value.get('name')!r} has no schema of its own")
            setattr(cfg, group, config_of(schema, value))
    if not isinstance(cfg.trainer, dict):
        cfg.trainer = dict(cfg.trainer)
    return cfg
