"""lit_rl's Llama decode step (``rollout.llama_decode``): transformers' logits bit for bit through fewer calls, the
q/k/v and gate/up projections one packed product each where the packed products run, transformers' forward wherever
it cannot vouch for the bits (another model, a hook, the batch-invariant kernels)."""

import pytest
import torch
from helpers import chat_prompts
from helpers.casts import lightning_autocast

from lit_rl.kernels import BatchInvariantMode, packed_linear
from lit_rl.rollout import llama_decode
from lit_rl.rollout.torch_engine import TorchEngine
from lit_rl.rollout.types import SamplingConfig
from lit_rl.rollout.weight_casts import WeightCasts

QUESTIONS = ["What is 1 + 2?", "What is 7 + 5? Think step by step.", "Hi", "Add 3 and 9, then explain."] * 2


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """packed_linear's check and timing cache in a fresh file (the user's own cache is left alone)."""
    path = tmp_path / "packed_linear.json"
    monkeypatch.setattr(packed_linear, "_cache_file", lambda: path)
    return path


def both_ways(engine, prompts, params, autocast: bool):
    """The rollouts of ``prompts`` with lit_rl's Llama step on and with transformers' forward (same seeds)."""
    out = {}
    for on in (True, False):
        engine.llama_step.enabled = on
        with lightning_autocast() if autocast else torch.autocast("cpu", enabled=False):
            out[on] = engine.generate(prompts, params, list(range(len(prompts))))
    return out[True], out[False]


@pytest.mark.parametrize("setting", ["float32", "bf16", "bf16 packed"])
def test_rollouts_equal_transformers_forward_bit_for_bit(tiny, cache, setting, capsys):
    """Batches of 1, 3 and 8 rows of different prompt lengths (left padding), 12 tokens, top-k head recorded: the
    tokens, log-probs and head equal bit for bit with the step on and off, in float32, under bf16 autocast, and
    under bf16 autocast with the packed (and stacked) products; the parity check ran and said so."""
    model, tok = tiny
    packed = setting == "bf16 packed"
    if packed and not packed_linear.resolve(True, model)[0]:
        pytest.skip("the packed products are off on this CPU")
    engine = TorchEngine(model, tok.pad_token_id, [tok.eos_token_id], packed_linear=packed)
    params = SamplingConfig(max_new_tokens=12, logprobs_top_k=3)
    for batch in (1, 3, 8):
        a, b = both_ways(engine, chat_prompts(tok, QUESTIONS[:batch]), params, autocast=setting != "float32")
        assert torch.equal(a.response_ids, b.response_ids)
        assert torch.equal(a.rollout_logprobs, b.rollout_logprobs)
        assert torch.equal(a.topk_ids, b.topk_ids) and torch.equal(a.topk_logprobs, b.topk_logprobs)
    assert "through lit_rl's Llama step (the same logits bits" in capsys.readouterr().out
    assert all(engine.llama_step._checked.values())
    if packed:  # the stacked q/k/v and gate/up products ran (their bits checked at every row count first)
        assert len(engine.casts.fusing) == 2 and all(engine.casts.fusing.values())


def test_stacked_products_are_the_separate_products(tiny, cache):
    """``WeightCasts.fused_linear`` of a layer's q/k/v projections: three views equal bit for bit to the layers' own
    packed products (checked by ``fused_differ`` first); None outside a block with packed products on, for more rows
    than a decode step, and for a layer the block does not route."""
    model, _ = tiny
    if not packed_linear.resolve(True, model)[0]:
        pytest.skip("the packed products are off on this CPU")
    attn = model.model.layers[0].self_attn
    layers = (attn.q_proj, attn.k_proj, attn.v_proj)
    shapes = tuple((m.out_features, m.in_features, m.bias is not None) for m in layers)
    assert packed_linear.fused_differ([shapes], rows=(1, 7, 64)) == []
    casts = WeightCasts(packed=True)
    x = torch.randn(5, 1, model.config.hidden_size)
    assert casts.fused_linear(x, layers) is None  # no block: nothing routed
    with torch.no_grad(), lightning_autocast(), casts.installed(model):
        made = casts.packed_made
        parts = casts.fused_linear(x, layers)
        assert casts.packed_made == made + 1 and casts.fusing == {(casts._pack_threads, shapes): True}
        for part, layer in zip(parts, layers):
            assert part.dtype == torch.bfloat16 and torch.equal(part, layer(x))
        assert casts.fused_linear(torch.randn(packed_linear.MAX_ROWS + 1, x.shape[-1]), layers) is None
        assert casts.fused_linear(x, (attn.q_proj, torch.nn.Linear(x.shape[-1], 4))) is None
        made = casts.packed_made  # + the three layers' own packed weights
        again = casts.fused_linear(x, layers)
        assert casts.packed_made == made and all(torch.equal(p, q) for p, q in zip(again, parts))


def test_a_stacked_product_follows_a_write_to_any_weight_or_bias(cache):
    """Three linear layers with biases reading one input: after an in-place write to one bias (a version bump), and
    after one to a weight, the stacked product is made again and equals each layer's own product."""
    layers = torch.nn.ModuleList(torch.nn.Linear(64, n, bias=True) for n in (64, 32, 32))
    if not packed_linear.resolve(True, layers)[0]:
        pytest.skip("the packed products are off on this CPU")
    casts = WeightCasts(packed=True)
    x = torch.randn(4, 64)
    with torch.no_grad(), lightning_autocast(), casts.installed(layers):
        before = casts.fused_linear(x, tuple(layers))
        layers[1].bias.add_(1.0)
        after = casts.fused_linear(x, tuple(layers))
        assert not torch.equal(before[1], after[1]) and torch.equal(before[0], after[0])
        assert all(torch.equal(part, layer(x)) for part, layer in zip(after, layers))
        layers[2].weight.mul_(2.0)
        again = casts.fused_linear(x, tuple(layers))
        assert torch.equal(again[2], layers[2](x)) and not torch.equal(again[2], after[2])


def test_other_models_and_hooks_keep_transformers_forward(tiny, capsys):
    """A model of another class, or one with a forward hook, decodes through transformers' forward (the hook runs at
    every decode step) and says why once; under the batch-invariant kernels the step is not even checked."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model, tok = tiny
    qwen = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, vocab_size=64))  # fmt: skip
    assert "Qwen2ForCausalLM is not transformers' LlamaForCausalLM" in llama_decode.unsupported(qwen)
    assert llama_decode.unsupported(model) == ""
    engine = TorchEngine(model, tok.pad_token_id, [tok.eos_token_id], own_copy=True)
    calls = []
    handle = engine.model.model.layers[0].register_forward_hook(lambda *args: calls.append(1))
    try:
        out = engine.generate(chat_prompts(tok, QUESTIONS[:2]), SamplingConfig(max_new_tokens=5), [1, 2])
    finally:
        handle.remove()
    steps = int(out.response_mask.sum(-1).max())
    assert len(calls) == steps  # the prefill and every decode step but the last token's
    assert "transformers' forward (model.layers.0 has a forward hook)" in capsys.readouterr().out
    # a hook registered after a rollout ran the short path: the next rollout asks again and runs it
    engine.generate(chat_prompts(tok, QUESTIONS[:2]), SamplingConfig(max_new_tokens=5), [1, 2])
    assert "lit_rl's Llama step (the same logits bits" in capsys.readouterr().out
    calls.clear()
    handle = engine.model.model.layers[1].register_forward_hook(lambda *args: calls.append(1))
    try:
        out = engine.generate(chat_prompts(tok, QUESTIONS[:2]), SamplingConfig(max_new_tokens=5), [1, 2])
    finally:
        handle.remove()
    assert len(calls) == int(out.response_mask.sum(-1).max())
    engine = TorchEngine(model, tok.pad_token_id, [tok.eos_token_id], own_copy=True)
    with BatchInvariantMode(engine.model):
        engine.generate(chat_prompts(tok, QUESTIONS[:2]), SamplingConfig(max_new_tokens=4), [1, 2])
    assert engine.llama_step._checked == {} and engine.llama_step._why == {}
