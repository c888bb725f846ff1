"""The typed config (``lit_rl.schema``): a typo in a preset fails naming the file and the key, and the
dataclasses' defaults are the YAML files' (so a module built from Python runs as the recipe does)."""

import dataclasses
import inspect
import shutil

import pytest
from helpers import CONF, compose_config
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from lit_rl.algorithms import ALGORITHMS, RLModule
from lit_rl.logprobs import response_logprobs
from lit_rl.schema import (
    ArithmeticConfig,
    EngineConfig,
    Gsm8kConfig,
    TensorBoardLoggerConfig,
    TrainConfig,
    VLLMEngineConfig,
    config_of,
)


@pytest.mark.parametrize(
    "relative, text, key",
    [
        ("experiment/typo.yaml", "# @package _global_\nalgo:\n  ppo_epoch: 4\n", "ppo_epoch"),
        ("experiment/typo.yaml", "# @package _global_\noptim:\n  max_nonfinite_update: 0\n", "max_nonfinite_update"),
        ("task/typo.yaml", "defaults:\n  - base_arithmetic\n  - _self_\nname: arithmetic\ndigit: 3\n", "digit"),
        ("correction/typo.yaml", "defaults:\n  - none\n  - _self_\nname: tis\ntis:\n  enable: true\n", "enable"),
    ],
)
def test_a_typo_in_a_config_file_fails_at_compose_naming_the_file_and_the_key(tmp_path, relative, text, key):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / relative).write_text(text)
    group, name = relative.removesuffix(".yaml").split("/")
    with pytest.raises(ConfigCompositionException) as err:
        compose_config(f"{group}={name}", conf_dir=conf)
    message = str(err.value)
    assert f"In '{group}/{name}'" in message and f"Key '{key}' not in" in message, message


def _plain(cfg) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)


def test_the_default_config_is_the_schema_defaults():
    """``TrainConfig()`` equals ``conf/train.yaml`` composed with its default groups, field for field."""
    composed = _plain(compose_config())
    defaults = dataclasses.asdict(TrainConfig())
    defaults["task"] = dataclasses.asdict(ArithmeticConfig())
    defaults["engine"] = dataclasses.asdict(EngineConfig())
    # the logger group's default option sets its field (the schema leaves every logger unset, so that
    # logger=csv or logger=[csv,wandb] adds exactly those)
    defaults["logger"]["tensorboard"] = dataclasses.asdict(TensorBoardLoggerConfig())
    assert composed == defaults


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_each_algorithm_built_from_python_gets_its_yaml_defaults(name):
    composed = _plain(compose_config(f"algo={name}").algo)
    assert dataclasses.asdict(config_of(ALGORITHMS[name].algo_config, {})) == composed


@pytest.mark.parametrize(
    "option, schema", [("torch", EngineConfig), ("vllm", VLLMEngineConfig), ("auto", VLLMEngineConfig)]
)
def test_each_engine_file_holds_its_schema_defaults(option, schema):
    composed = _plain(compose_config(f"engine={option}").engine)
    assert composed == dict(dataclasses.asdict(schema()), name=option)


def test_each_task_file_holds_its_schema_defaults():
    assert _plain(compose_config("task=gsm8k").task) == dataclasses.asdict(Gsm8kConfig())
    assert _plain(compose_config("task=arithmetic", "seed=3").task) == dataclasses.asdict(ArithmeticConfig(seed=3))


def test_the_three_defaults_that_disagreed_now_agree(tiny):
    """The bug class: a module built from Python stopped never on NaN (max_nonfinite_updates 0 vs 3) and kept 4x
    the logits (logprob_chunk_tokens 1024 vs 256); the precision fallback read "32" where the YAML says bf16."""
    module = RLModule(*tiny, sampling={}, eval_sampling={}, group_size=2, micro_batch_size=2, optim={"lr": 1e-3})
    assert module.optim_cfg.max_nonfinite_updates == 3 == compose_config().optim.max_nonfinite_updates
    chunk = compose_config().logprob_chunk_tokens
    assert module.chunk_tokens == chunk == TrainConfig.logprob_chunk_tokens
    assert inspect.signature(response_logprobs).parameters["chunk_tokens"].default == chunk
    assert inspect.signature(RLModule.__init__).parameters["logprob_chunk_tokens"].default == chunk
    assert TrainConfig().trainer["precision"] == compose_config().trainer.precision


def test_a_mapping_with_an_unknown_key_is_refused_naming_it():
    from lit_rl.schema import OptimConfig

    with pytest.raises(TypeError, match="OptimConfig has no field 'max_nonfinite_update'"):
        config_of(OptimConfig, {"lr": 1e-3, "max_nonfinite_update": 0})
    assert config_of(OptimConfig, {"lr": 1e-3, "max_nonfinite_update": 0}, ignore_unknown=True).lr == 1e-3


def test_the_constructors_built_from_a_config_default_to_the_schema():
    """The model and the sampler are the schema's own classes (no mirrors to drift), and the task classes take a
    config group's fields as keyword arguments: their defaults are the schema's, so leaving a field out means the
    same thing everywhere."""
    from lit_rl import models
    from lit_rl.rollout import types
    from lit_rl.schema import LoraConfig, ModelConfig, SamplingConfig
    from lit_rl.tasks import ArithmeticTask, Gsm8kTask

    def defaults(fn):
        return {
            n: p.default
            for n, p in inspect.signature(fn).parameters.items()
            if p.default is not inspect.Parameter.empty
        }

    assert (models.ModelConfig, models.LoraConfig, types.SamplingConfig) == (ModelConfig, LoraConfig, SamplingConfig)
    assert not hasattr(models, "ModelSpec") and not hasattr(types, "SamplingParams")
    assert ModelConfig("x", lora={"r": 4}).lora == LoraConfig(r=4)  # a mapping of the adapter's fields is typed
    for cls, schema in ((ArithmeticTask, ArithmeticConfig), (Gsm8kTask, Gsm8kConfig)):
        fields = dataclasses.asdict(schema())
        for name, value in defaults(cls.__init__).items():
            if name in fields:
                want = fields[name]
                assert (list(value) if isinstance(value, tuple) else value) == want, (cls.__name__, name)
