"""The drift monitor (``log.drift_prompts``, ``run.drift_monitor``): the KL from the first weights' sampler to the
policy on fixed prefixes, logged every step. Its sums by hand; zero at the first weights when the sampler is the
trainer (the record's ids, positions, temperature and masks line up with the trainer's scoring); one record per
seed whatever the correction. Whether the drift moves it on a real model is a study's question
(docs/results/constant_reward_drift_metric), not a test's: on the random tiny model a constant-advantage run's
drift does not carry over from the trained prefixes to the record's (none and exact SC move D alike)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.config import MOVING, fast_config

from lit_rl.config import ConfigError, validate
from lit_rl.run.drift_monitor import sampler_drift
from lit_rl.run.train import run
from lit_rl.tools.compare.runs import read_scalars

TAGS = ("drift/sampler_kl", "drift/sampler_kl_change", "drift/entropy")


def test_sums_by_hand_with_a_token_outside_the_samplers_support():
    """Two tokens of a 3-token vocabulary, the second masked out: KL(μ‖π) and H(π) of the first alone; an entry
    with μ = 0 (log μ = -inf) adds nothing to the KL and its π still counts in the entropy."""
    pi = torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]], dtype=torch.float64)
    mu = torch.tensor([[[0.75, 0.25, 0.0], [0.3, 0.3, 0.4]]], dtype=torch.float64)
    kl, entropy, n = sampler_drift(pi.log(), mu.log(), torch.tensor([[True, False]]))
    assert n == 1
    assert float(kl) == pytest.approx(0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.25), abs=1e-12)
    assert float(entropy) == pytest.approx(-(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25)), abs=1e-12)
    with pytest.raises(ValueError, match="differ"):
        sampler_drift(pi.log(), mu.log()[..., :2], torch.tensor([[True, True]]))


def test_a_negative_prompt_count_is_refused_by_name():
    with pytest.raises(ConfigError, match="log.drift_prompts"):
        validate(fast_config("log.drift_prompts=-1"))


def drift(tmp_path, name: str, *overrides: str) -> dict[str, dict[int, float]]:
    args = (*MOVING, "trainer.max_steps=3", "eval.num_examples=0", "log.samples_every_n_steps=0")
    run(fast_config(*args, "log.drift_prompts=2", "sampling.max_new_tokens=16", *overrides), tmp_path / name)
    scalars = read_scalars(tmp_path / name)
    return {tag: dict(scalars[tag]) for tag in TAGS}


def test_on_policy_the_first_weights_measure_zero_and_every_step_is_logged(tmp_path):
    """The sampler is the trainer (float32, no dial): D(θ₀) is 0 up to float32 rounding; steps 0-3 logged; the
    policy moved (lr 1e-3 on A = 1), so D > 0 after it; the entropy is a real entropy (0 < H ≤ log V, V = 49152:
    SmolLM2's tokenizer)."""
    d = drift(tmp_path, "on_policy")
    for tag in TAGS:
        assert sorted(d[tag]) == [0, 1, 2, 3]
    assert abs(d["drift/sampler_kl"][0]) < 1e-5
    assert d["drift/sampler_kl_change"][0] == 0.0
    assert d["drift/sampler_kl"][3] > 1e-4
    assert all(0 < h < math.log(49152) for h in d["drift/entropy"].values())


def test_a_mismatched_sampler_measures_its_distance_from_one_record_whatever_the_correction(tmp_path):
    """engine.temperature_offset=-0.8 (the sampler at T = 0.2, the trainer at 1): D(θ₀) is the KL between the two
    temperatures' distributions, > 0; the record is drawn before step 1 with seeds of its own, so runs that differ
    only in their correction start from the same record and the same D(θ₀), and part from step 1 on."""
    none = drift(tmp_path, "none", "engine.temperature_offset=-0.8")
    sc = drift(tmp_path, "sc", "engine.temperature_offset=-0.8", "correction=sc", "correction.sc.mode=exact")
    assert none["drift/sampler_kl"][0] == sc["drift/sampler_kl"][0] > 0.1
    assert none["drift/sampler_kl"][3] != sc["drift/sampler_kl"][3]
