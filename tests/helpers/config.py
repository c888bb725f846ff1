"""The one way tests compose the recipe's config: Hydra's compose API over ``conf/``, as ``recipes/train.py``."""

from __future__ import annotations

import copy
import functools
import os

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import lit_rl  # noqa: F401  (importing it stores the typed schemas conf/ starts from in Hydra's ConfigStore)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONF = os.path.join(ROOT, "conf")

#: a few-second run: the tiny model, float32, 2 prompts x 4 completions of 8 tokens, eval and checkpoint every 2 steps
FAST = [
    "model=tiny",
    "trainer.precision=32-true",
    "trainer.enable_progress_bar=false",
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "sampling.max_new_tokens=8",
    "eval.num_examples=4",
    "eval.every_n_steps=2",
    "checkpoint.every_n_steps=2",
]

#: a run whose weights move every step: REINFORCE without baseline on a constant reward of 1 (A = 1), lr 1e-3
MOVING = ["algo=reinforce", "algo.baseline=none", "task.constant_reward=1", "optim.lr=1e-3"]


def compose_config(*overrides: str, config_name: str = "train", conf_dir: str = CONF) -> DictConfig:
    """``conf/<config_name>.yaml`` composed with the command-line ``overrides``, exactly as the recipe sees it
    (``conf_dir``: another config folder, e.g. a copy of ``conf/`` a test edits).

    Over the repository's own ``conf/`` (which no test edits) the composed config is remembered per override list
    and each call gets its own deep copy: the suite composes about a third of its configs more than once, at
    ~0.3 s a compose (Hydra parses every override anew), and the expectation tests compose hundreds."""
    if os.path.abspath(str(conf_dir)) == CONF:
        return copy.deepcopy(_compose_repo_config(config_name, tuple(overrides)))
    return _compose(config_name, overrides, conf_dir)


def _compose(config_name: str, overrides, conf_dir: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))


@functools.lru_cache(maxsize=None)
def _compose_repo_config(config_name: str, overrides: tuple[str, ...]) -> DictConfig:
    return _compose(config_name, overrides, CONF)


#: a probe of seconds on the tiny model: 2 prompts x 4 completions of 6 tokens, 4 batches and 4 reference batches
PROBE_FAST = [
    "model=tiny",
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "sampling.max_new_tokens=6",
    "probe.batches=4",
    "probe.reference_batches=4",
    "probe.sketch_dim=16384",
]


def probe_config(*overrides: str, conf_dir: str = CONF) -> DictConfig:
    """``conf/probe.yaml`` composed with ``PROBE_FAST`` plus ``overrides`` (later ones win)."""
    return compose_config(*PROBE_FAST, *overrides, config_name="probe", conf_dir=conf_dir)


def fast_config(*overrides: str) -> DictConfig:
    """``compose_config`` of ``FAST`` plus ``overrides`` (later ones win)."""
    return compose_config(*FAST, *overrides)
