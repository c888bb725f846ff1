"""FLOP counts (verl's FlopsCounter convention) and the perf/* tags a run logs from them, against hand counts."""

import pytest
from helpers import fast_config as cfg_for
from transformers import LlamaConfig

from lit_rl.models import ModelConfig, load_policy, tiny_config
from lit_rl.rollout.datamodule import RolloutDataModule
from lit_rl.run.flops import FlopModel
from lit_rl.run.train import build_task_from_cfg, run
from lit_rl.tools.compare import read_scalars

# the tiny model: hidden 64, intermediate 128, 2 layers, 2 heads and 1 KV head of head_dim 32, vocab 49152.
# per layer: MLP 3*64*128 = 24576; attention projections 64*(q 64 + k 32 + v 32 + o 64) = 12288;
# embedding + LM head 2*49152*64 = 6291456 -> N = 2*(24576 + 12288) + 6291456 = 6365184
TINY_N = 6_365_184
TINY_ATTENTION_UNIT = 2 * 2 * 32  # layers * heads * head_dim


def test_dense_parameters_by_hand():
    tiny = FlopModel.from_config(tiny_config(49152))
    assert tiny == FlopModel(dense_params=TINY_N, layers=2, heads=2, head_dim=32)
    # SmolLM2-135M: hidden 576, intermediate 1536, 30 layers, 9 heads / 3 KV heads of 64, vocab 49152:
    # 30*(3*576*1536 + 576*(576 + 192 + 192 + 576)) + 2*49152*576 = 30*3538944 + 56623104 = 162791424
    smollm2 = LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
    )
    assert FlopModel.from_config(smollm2).dense_params == 162_791_424
    with pytest.raises(ValueError, match="intermediate_size"):
        FlopModel.from_config(type("C", (), {"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2})())


def test_update_and_rollout_flops_by_hand():
    m = FlopModel(dense_params=1000, layers=2, heads=3, head_dim=4)  # attention unit 24
    # two sequences of 5 and 10 tokens: 6*1000*15 + 12*24*(25 + 100)
    assert m.update_flops([5, 10]) == 90_000 + 36_000
    # prompt 3, 2 generated tokens at positions 4 and 5: 2*1000*2 + 4*24*(4 + 5); a second sequence generates 0
    assert m.rollout_flops([3, 7], [2, 0]) == 4000 + 864


def test_a_tiny_run_logs_flops_rates_and_mfu_on_every_step(tmp_path):
    """perf/update_flops and perf/rollout_flops of a 2-step run equal the hand count from the step's prompts
    (re-tokenised here) and 8 generated tokens per completion; the rates are those counts over the logged
    times, and perf/mfu is the update's rate over the logged peak."""
    cfg = cfg_for("trainer.max_steps=2", "eval.num_examples=0")  # 2 prompts x G=4, 8 new tokens, float32
    run(cfg, tmp_path / "r")
    s = read_scalars(tmp_path / "r")
    _, tok = load_policy(ModelConfig("tiny"))
    dm = RolloutDataModule(build_task_from_cfg(cfg), tok, 2, 4, seed=cfg.seed, eval_examples=0)
    for step in (0, 1):
        assert s["rollout/truncation_rate"][step][1] == 1.0  # the random tiny model never stops: T_i = 8
        prompts = [len(dm.encode(ex)) for ex in dm.prompts_for(step) for _ in range(4)]
        update = sum(6 * TINY_N * (p + 8) + 12 * TINY_ATTENTION_UNIT * (p + 8) ** 2 for p in prompts)
        rollout = sum(2 * TINY_N * 8 + 4 * TINY_ATTENTION_UNIT * sum(range(p + 1, p + 9)) for p in prompts)
        value = lambda tag: dict(s[tag])[step + 1]  # noqa: E731  (the first step is logged as step 1)
        assert value("perf/update_flops") == pytest.approx(update, rel=1e-6)
        assert value("perf/rollout_flops") == pytest.approx(rollout, rel=1e-6)
        assert value("perf/update_tflops") == pytest.approx(update / value("time/train_s") / 1e12, rel=1e-5)
        assert value("perf/rollout_tflops") == pytest.approx(rollout / value("time/rollout_s") / 1e12, rel=1e-5)
        assert value("perf/peak_tflops") > 0
        assert value("perf/mfu") == pytest.approx(value("perf/update_tflops") / value("perf/peak_tflops"), rel=1e-5)
