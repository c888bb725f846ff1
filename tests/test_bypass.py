"""``correction.bypass`` (issue 38): under ``kernels=batch_invariant`` the rollout log-probs μ equal the trainer's
π_old bit for bit, so taking μ as π_old skips the snapshot pass and changes nothing: every logged value and the
final weights are bitwise those of the run with the pass, and ``time/old_logprob_s`` is 0. Where bypass cannot be
exact or safe the config refuses it, naming the reason."""

import importlib.util
import sys

import pytest
import torch
from helpers import ROOT, compose_config
from safetensors.torch import load_file

from lit_rl.config import ConfigError, validate
from lit_rl.run.train import run

_spec = importlib.util.spec_from_file_location("bit_identity", f"{ROOT}/benchmarks/bit_identity.py")
bit_identity = importlib.util.module_from_spec(_spec)
sys.modules["bit_identity"] = bit_identity  # dataclasses look their module up by name
_spec.loader.exec_module(bit_identity)

BITWISE = [
    "model=tiny",
    "kernels=batch_invariant",
    "trainer.enable_progress_bar=false",
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "rollout.micro_batch_size=3",
    "eval.num_examples=0",
    "checkpoint.every_n_steps=10",
    "trainer.max_steps=1",
    "algo=grpo",
    "algo.ppo_epochs=2",
    "algo.num_minibatches=2",
    "optim.lr=1e-3",
    "sampling.max_new_tokens=6",
]
#: a reward that differs between the tiny model's random completions (so the group advantages are not 0)
TEXT_REWARD = "def by_text(prompt, completion, example):\n    return float(sum(map(ord, completion)) % 5) / 4\n"


@pytest.mark.slow  # two runs of the recipe: 23 s on 2 cores
def test_bypass_under_batch_invariant_kernels_is_bitwise_the_snapshot(tmp_path):
    (tmp_path / "reward.py").write_text(TEXT_REWARD)
    reward = f"reward.functions=[{tmp_path}/reward.py:by_text]"
    for name, bypass in (("off", "false"), ("on", "true")):
        run(compose_config(*BITWISE, reward, f"correction.bypass={bypass}"), tmp_path / name)
    off, on = (bit_identity.read_scalars(tmp_path / name) for name in ("off", "on"))
    c = bit_identity.compare_scalars(off, on)
    assert c.identical, c.first
    assert c.tags > 20 and c.steps == 1  # train/*, rollout/*, the FLOP counts: every logged value but wall clock
    assert [v for _, v in on["time/old_logprob_s"]] == [0.0]
    assert all(v > 0 for _, v in off["time/old_logprob_s"])  # the pass bypass skips
    assert all(v == 0.0 for _, v in off["train/logprob_abs_diff"])  # mu = pi_old bit for bit: why it is exact
    assert all(v > 0 for _, v in off["train/grad_norm"])  # non-zero advantages: the weights moved
    w_off, w_on = (load_file(str(tmp_path / name / "policy" / "model.safetensors")) for name in ("off", "on"))
    assert w_off.keys() == w_on.keys() and all(torch.equal(w_off[k], w_on[k]) for k in w_off)


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (["rollout.mode=async"], "rollout.mode=async: its rows come from older weights"),
        (["correction=tis"], "correction=tis: its tis weighs each token by pi_old/mu"),
        (["algo=reinforce"], "algo=reinforce under kernels=default"),
    ],
)
def test_bypass_is_refused_where_it_cannot_be_exact_or_safe(overrides, reason):
    with pytest.raises(ConfigError, match="correction.bypass") as err:
        validate(compose_config("model=tiny", "correction.bypass=true", *overrides))
    assert reason in str(err.value)


def test_bypass_is_allowed_for_a_clipped_ratio_under_default_kernels_and_exactly_under_batch_invariant():
    validate(compose_config("model=tiny", "correction=sc", "correction.bypass=true", "algo=dapo"))
    validate(compose_config("model=tiny", "correction=opsm", "correction.bypass=true", "kernels=batch_invariant"))
