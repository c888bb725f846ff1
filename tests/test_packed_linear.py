"""The engine's decode-step products from oneDNN-packed bf16 weights (``engine.packed_linear``): the same bits as the
cast weights' ``F.linear``, packed again after a write, off under the batch-invariant kernels, chosen by a check
and a timing that are cached."""

import pytest
import torch
import torch.nn.functional as F
from helpers import chat_prompts
from helpers import fast_config as cfg_for
from helpers.casts import lightning_autocast, linear_weights

from lit_rl.config import ConfigError, validate
from lit_rl.kernels import BatchInvariantMode, packed_linear
from lit_rl.rollout.torch_engine import TorchEngine
from lit_rl.rollout.types import SamplingConfig
from lit_rl.rollout.weight_casts import WeightCasts

QUESTIONS = ["What is 1 + 2?", "What is 7 + 5? Think step by step.", "Hi", "Add 3 and 9, then explain."] * 2

needs_ops = pytest.mark.skipif(not packed_linear.available(), reason="this torch build lacks oneDNN's packed linear")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The check's and the timing's cache in a fresh file (the user's own cache is left alone)."""
    path = tmp_path / "packed_linear.json"
    monkeypatch.setattr(packed_linear, "_cache_file", lambda: path)
    return path


def packed_or_skip(model):
    """Skip where the packed products' bits differ from F.linear's on this CPU (then the engine does not use them)."""
    on, why = packed_linear.resolve(True, model)
    if not on:
        pytest.skip(why)


@needs_ops
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_packed_products_give_the_bits_of_the_cast_weights(tiny, cache, batch):
    """Decode batches of 1, 3 and 8 rows under Lightning's bf16 autocast: the logits of one forward, and the tokens,
    log-probs and top-k head of a 10-token rollout, equal bit for bit with the packed products on and off; each
    linear weight packed once per rollout (batch 1's 20-odd-token prefill runs packed too, the larger ones' not)."""
    model, tok = tiny
    packed_or_skip(model)
    engine = TorchEngine(model, tok.pad_token_id, [tok.eos_token_id], packed_linear=True)
    engine.llama_step.enabled = False  # one packed weight per layer (its step stacks q/k/v: tests/test_llama_decode.py)
    prompts = chat_prompts(tok, QUESTIONS[:batch])
    params = SamplingConfig(max_new_tokens=10, logprobs_top_k=3)
    ids = torch.tensor([p[-4:] for p in prompts])
    out, logits = {}, {}
    for packed in (True, False):
        engine.casts.packed, engine.casts.packed_made = packed, 0
        with lightning_autocast():
            out[packed] = engine.generate(prompts, params, list(range(batch)))
            assert engine.casts.packed_made == (linear_weights(engine.model) if packed else 0)
            with torch.no_grad(), engine.casts.installed(engine.model):
                logits[packed] = engine.model(ids).logits
    a, b = out[True], out[False]
    assert torch.equal(logits[True], logits[False]) and logits[True].dtype == torch.bfloat16
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    assert torch.equal(a.topk_logprobs, b.topk_logprobs)


@needs_ops
def test_a_weight_written_in_place_is_packed_again(cache):
    """An in-place write bumps the weight's version counter: the next product packs it again and gives the new
    weight's product; unchanged, the packed weight is reused; ``clear`` drops it."""
    layer = torch.nn.Linear(64, 48, bias=True)
    packed_or_skip(layer)
    casts = WeightCasts(packed=True)
    x = torch.randn(3, 64)
    with torch.no_grad(), lightning_autocast(), casts.installed(layer, keep=True):
        first = layer(x)
        assert layer(x).equal(first) and casts.packed_made == 1
        layer.state_dict()["weight"].copy_(torch.ones(48, 64))  # a sync's write
        second = layer(x)
        expected = F.linear(
            x.to(torch.bfloat16), torch.ones(48, 64, dtype=torch.bfloat16), layer.bias.to(torch.bfloat16)
        )
        assert casts.packed_made == 2 and torch.equal(second, expected) and not torch.equal(second, first)
        big = layer(torch.randn(packed_linear.MAX_ROWS + 1, 64))  # more rows than a decode step: F.linear, not packed
        assert casts.packed_made == 2 and big.dtype == torch.bfloat16
    casts.clear()
    assert not casts._packed and not casts._casts


def test_off_under_batch_invariant_kernels(tiny, cache):
    """Under ``kernels=batch_invariant`` nothing is packed or even checked (its own kernels run every product):
    the rollout is the one with packing off, bit for bit."""
    model, tok = tiny
    engine = TorchEngine(model, tok.pad_token_id, [tok.eos_token_id], own_copy=True, packed_linear=True)
    prompts = chat_prompts(tok, QUESTIONS[:3])
    out = {}
    with BatchInvariantMode(engine.model), lightning_autocast():
        for packed in (True, False):
            engine.casts.packed = packed
            out[packed] = engine.generate(prompts, SamplingConfig(max_new_tokens=6), [1, 2, 3])
    assert engine.casts.packed_made == 0 and engine.casts.packing == {} and not cache.exists()
    assert torch.equal(out[True].rollout_logprobs, out[False].rollout_logprobs)


@needs_ops
def test_resolve_needs_the_same_bits_and_for_auto_a_faster_product(tiny, cache, monkeypatch):
    """Bits that differ turn it off whatever the speed; auto needs MIN_SPEEDUP; the check and a quiet timing are
    cached (one each), a busy timing is not."""
    from lit_rl.run import hardware

    model, _ = tiny
    monkeypatch.setattr(hardware, "cpu_facts", lambda: {"bf16_native": True})
    checks, timings = [], []

    def checker(shapes):
        checks.append(shapes)
        return ["64x64, 33 rows"] if len(checks) == 1 else []

    def timer(shapes):
        timings.append(shapes)
        return 1.0, 0.8

    monkeypatch.setattr(hardware, "_other_cpu_seconds", lambda start=None: (0.0, 0.0))
    on, why = packed_linear.resolve("auto", model, timer=timer, checker=checker)
    assert not on and "bits differ" in why and "64x64, 33 rows" in why and not timings
    assert packed_linear.resolve(True, model, timer=timer, checker=checker)[0] is False  # cached: not checked again
    cache.unlink()
    assert packed_linear.resolve(True, model, timer=timer, checker=checker)[0] is True and not timings
    on, why = packed_linear.resolve("auto", model, timer=timer, checker=checker)
    assert on and "1.25x" in why and len(checks) == 2 and len(timings) == 1
    assert packed_linear.resolve("auto", model, timer=lambda s: (1.0, 1.0), checker=checker) == (on, why.replace(
        "timed now", "cached"))  # fmt: skip
    cache.unlink()
    monkeypatch.setattr(hardware, "_other_cpu_seconds", lambda start=None: (0.0, 0.0) if start is None else (9.0, 0))
    on, why = packed_linear.resolve("auto", model, timer=lambda s: (1.0, 1.0), checker=checker)
    assert not on and "not cached" in why
    assert packed_linear.resolve(False, model) == (False, "engine.packed_linear=false")


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_bad_setting_is_refused_naming_the_field(value):
    with pytest.raises(ValueError, match=r"engine.packed_linear=.* is not allowed: choose auto, true or false"):
        WeightCasts(packed=value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["engine.packed_linear=sometimes"], r"engine.packed_linear='sometimes' is not allowed: choose auto, true or"),
        (["engine.packed_linear=2"], r"engine.packed_linear=2 is not allowed: choose auto, true or false"),
        (
            ["kernels=batch_invariant", "engine.packed_linear=true"],
            r"engine.packed_linear=true is not allowed: kernels=batch_invariant runs every product through its own",
        ),
    ],
)
def test_the_config_knob_is_checked_at_start_up(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg_for(*overrides))
    validate(cfg_for("engine.packed_linear=false"))
