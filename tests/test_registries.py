"""Every named choice is defined once (``lit_rl.registry``): the config files, the checks and the code agree.

Each registry must match its config group folder file for file, every preset and every group option must
compose and validate, and both rollout engines and the learner must implement the interfaces the rest of the
code relies on (``RolloutEngine``, ``rollout.staleness.Learner``).
"""

import os
from pathlib import Path

import pytest
import yaml
from helpers import CONF, ROOT, compose_config

from lit_rl.algorithms import ALGORITHMS, RLModule
from lit_rl.choices import ALGO_CONFIGS
from lit_rl.config import validate
from lit_rl.corrections import CORRECTIONS
from lit_rl.kernels import KERNELS
from lit_rl.registry import Registry, UnknownChoice
from lit_rl.rollout.engines import ENGINE_CHOICES, ENGINES, build_engine
from lit_rl.rollout.staleness import Learner
from lit_rl.rollout.types import RolloutEngine
from lit_rl.schema import config_of
from lit_rl.tasks import TASKS


def options(group: str) -> list[str]:
    """The options of a config group: the names of ``conf/<group>/*.yaml``."""
    return sorted(p.stem for p in Path(CONF, group).glob("*.yaml"))


@pytest.mark.parametrize(
    "group, names",
    [
        ("algo", list(ALGORITHMS)),
        ("task", list(TASKS)),
        ("engine", list(ENGINE_CHOICES)),
        ("correction", list(CORRECTIONS)),
        ("kernels", list(KERNELS)),
    ],
)
def test_each_registry_matches_its_config_group_file_for_file(group, names):
    assert options(group) == sorted(names)
    for name in names:  # and each file names its own choice
        cfg = compose_config("model=tiny", f"{group}={name}")
        assert cfg[group].name == name


@pytest.mark.parametrize("name", list(CORRECTIONS))
def test_each_correction_file_turns_on_exactly_its_registered_parts(name):
    cfg = compose_config(f"correction={name}").correction
    assert {part for part in ("tis", "mis", "sc", "opsm", "rs", "m2po") if cfg[part].enabled} == CORRECTIONS[name]


def test_a_registry_names_the_field_and_the_choices_on_a_bad_name_and_refuses_a_second_definition():
    reg = Registry("algo", {"grpo": 1, "ppo": 2})
    assert reg.choices == ["grpo", "ppo"] and reg["ppo"] == 2 and "grpo" in reg and len(reg) == 2
    with pytest.raises(UnknownChoice, match=r"algo='grpp' is not allowed: choose one of \['grpo', 'ppo'\]"):
        reg["grpp"]
    with pytest.raises(ValueError, match="algo='grpo' is registered twice"):
        reg.register("grpo", 3)
    reg.register("cispo")(dict)
    assert reg["cispo"] is dict and reg.names_where(lambda e: e == 2) == ["ppo"]


def test_a_lazy_entry_is_imported_on_its_first_lookup_only():
    import json

    reg = Registry("algo", {"grpo": 1}, lazy={"dumps": "json:dumps", "missing": "no_such_module_lit_rl:thing"})
    assert reg.choices == ["grpo", "dumps", "missing"] and "missing" in reg and len(reg) == 3
    assert "ppo" not in reg and ["a"] not in reg  # an unhashable value is no name, not a TypeError
    assert reg["dumps"] is json.dumps and reg.get("grpo") == 1
    with pytest.raises(ModuleNotFoundError, match="no_such_module_lit_rl"):  # looked up: imported, and it fails
        reg["missing"]
    with pytest.raises(ValueError, match="algo='dumps' is registered twice"):
        reg.register_lazy("dumps", "json:loads")
    with pytest.raises(ValueError, match="'module:attribute'"):
        reg.register_lazy("loads", "json.loads")


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_each_algorithm_class_agrees_with_the_config_dataclass_validation_reads(name):
    """``config.validate`` reads the algorithm's answers from its config dataclass (torch-free); the class that
    runs it is built on that dataclass and answers ``group_baseline`` from it."""
    cls, algo = ALGORITHMS[name], ALGO_CONFIGS[name]
    assert cls.algo_config is algo
    for flag in ("ppo_clip", "uses_clip", "group_normalised", "kl_in_reward"):
        assert flag not in vars(cls), f"{name}: {flag} is its config dataclass's, not the class's"
    for baseline in ("none", "batch_mean", "rloo", "group"):
        assert cls.group_baseline({"baseline": baseline}) == config_of(algo, {"baseline": baseline}).group_baseline()


def test_the_engine_choices_are_the_engines_and_auto():
    assert ENGINE_CHOICES == (*ENGINES.choices, "auto")


def test_the_group_baseline_rule_comes_from_the_algorithm_classes():
    needs_groups = [n for n in ALGORITHMS if ALGORITHMS[n].group_baseline(compose_config(f"algo={n}").algo)]
    assert needs_groups == ["reinforce", "grpo", "dapo", "dr_grpo", "gspo", "cispo", "sapo"]  # reinforce: rloo
    assert ALGORITHMS["reinforce"].group_baseline({"baseline": "rloo"})
    assert not ALGORITHMS["reinforce"].group_baseline({"baseline": "batch_mean"})
    assert ALGORITHMS["reinforce_pp"].group_baseline({"baseline": "group"})  # REINFORCE++-baseline
    assert not ALGORITHMS["reinforce_pp"].group_baseline({"baseline": "none"})


def _presets() -> list[str]:
    return options("experiment")


@pytest.mark.parametrize("preset", _presets())
def test_every_preset_composes_and_validates_with_each_swept_value(preset):
    cfg = compose_config(f"experiment={preset}")
    validate(cfg)
    raw = yaml.safe_load(Path(CONF, "experiment", f"{preset}.yaml").read_text())
    swept = ((raw.get("hydra") or {}).get("sweeper") or {}).get("params") or {}
    for key, values in swept.items():
        for value in str(values).split(","):
            validate(compose_config(f"experiment={preset}", f"{key}={value.strip()}"))


@pytest.mark.parametrize(
    "group, option",
    [
        (g, o)
        for g in sorted(os.listdir(CONF))
        if os.path.isdir(os.path.join(CONF, g)) and g != "experiment"
        for o in options(g)
    ],
)
def test_every_group_option_composes_and_validates(group, option, tmp_path):
    overrides = [f"{group}={option}"] + ([] if group == "model" else ["model=tiny"])
    if (group, option) == ("task", "dataset"):  # the example file of docs/data.md
        overrides += [f"task.path={ROOT}/docs/examples/sums.jsonl", "task.eval_fraction=0.25"]
    if (group, option) == ("task", "gsm8k"):  # a local folder: offline, the hub dataset is refused at start-up
        for name in ("train.jsonl", "test.jsonl"):
            (tmp_path / name).write_text('{"question": "What is 1 + 1?", "answer": "#### 2"}\n')
        overrides += [f"task.path={tmp_path}"]
    if (group, option) == ("engine", "vllm"):
        pytest.importorskip("vllm")
    validate(compose_config(*overrides))


def test_both_engines_implement_the_rollout_engine_protocol(tiny):
    """Checked by ``isinstance`` against the runtime-checkable Protocol and method by method (the signature
    of each method, so an engine that renames an argument fails here, not in a run)."""
    import inspect

    from lit_rl.rollout.torch_engine import TorchEngine
    from lit_rl.rollout.vllm_engine import VLLMEngine

    model, tok = tiny
    engine = build_engine({"name": "torch"}, model, tok.pad_token_id, [tok.eos_token_id])
    assert isinstance(engine, RolloutEngine) and isinstance(engine, TorchEngine)
    assert list(ENGINES) == ["torch", "vllm"]
    for cls in (TorchEngine, VLLMEngine):
        for name in ("generate", "sync_weights", "sleep", "close"):
            want = inspect.signature(getattr(RolloutEngine, name)).parameters
            got = inspect.signature(getattr(cls, name)).parameters
            assert list(got) == list(want), (cls.__name__, name)
    attributes = {"version", "own_copy", "cancel"}
    assert attributes <= set(vars(engine))


def test_the_learner_implements_what_stale_rollouts_need(tiny):
    from lit_rl.run.train import build_module

    module = build_module(compose_config("model=tiny", "rollout.mode=lagged", "rollout.lag=1"), *tiny)
    assert isinstance(module, Learner) and module.policy_version == 0
    for name in ("collect", "prompt_batch", "precision_context", "score_rows"):
        assert callable(getattr(RLModule, name)), name
    for name in ("policy_version", "updates_per_step"):
        assert isinstance(getattr(RLModule, name), property), name
    members = {n for n in vars(Learner) if not n.startswith("_")} | set(Learner.__annotations__)
    assert members == {
        "policy",
        "engine",
        "policy_version",
        "updates_per_step",
        "collect",
        "prompt_batch",
        "precision_context",
        "score_rows",
    }
