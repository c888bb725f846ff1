"""The trainer's attention with torch's forward and an explicit-softmax float32 backward
(``kernels.attention_backward``): the gradients against float64 autograd for every mask transformers passes, the
model's forward bits unchanged, the choice by Lq x Lk, the measured threshold cached, and the config checks."""

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import fast_config as cfg_for

from lit_rl.config import ConfigError, validate
from lit_rl.kernels import attention_backward as ab
from lit_rl.kernels import decode_attention, kernel_mode
from lit_rl.logprobs import response_logprobs

#: both implementations of the explicit backward: torch's batched products and lit_rl's compiled kernel (skipped only
#: without a C++ toolchain; with one, a failed build fails these tests)
PATHS = [
    pytest.param(False, id="torch-ops"),
    pytest.param(
        True,
        id="compiled",
        marks=pytest.mark.skipif(bool(decode_attention.toolchain_missing()), reason="no C++ toolchain"),
    ),
]


def reference_grads(q, k, v, go, mask, causal, scale):
    """float64 autograd of the attention at the same values (keys and values repeated to the query heads)."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    reps = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(reps, 1) for t in leaves[1:])
    s = leaves[0] @ kk.transpose(-1, -2) * scale
    lq, lk = q.shape[2], k.shape[2]
    if mask is not None and mask.dtype == torch.bool:
        s = s.masked_fill(~mask[..., :lk], float("-inf"))
    elif mask is not None:
        s = s + mask[..., :lk].double()
    elif causal:  # SDPA's is_causal: aligned top-left (transformers cuts the keys to Lq first: the same function)
        s = s.masked_fill(~torch.ones(lq, lk, dtype=torch.bool).tril(), float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # a row that reads no key: output 0
    (p @ vv).backward(go.double())
    return [t.grad for t in leaves]


def operands(b=3, h=4, kvh=2, lq=5, lk=7, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=gen)
    k, v = (torch.randn(b, kvh, lk, d, generator=gen) for _ in range(2))
    return q, k, v, torch.randn(b, h, lq, d, generator=gen)


def padded_mask(b, lq, lk, pad):
    """transformers' boolean mask of left-padded rows: causal (the queries are the last lq positions) and no key
    before each row's first real token."""
    causal = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
    real = torch.arange(lk)[None] >= torch.tensor(pad)[:, None]
    return (causal[None] & real[:, None])[:, None]


def assert_close_to(grads, ref, tol=1e-5):
    for g, r in zip(grads, ref):
        assert g.dtype == torch.float32 and g.shape == r.shape
        assert ((g.double() - r).norm() / r.norm().clamp_min(1e-30)).item() < tol


@pytest.mark.parametrize("compiled", PATHS)
@pytest.mark.parametrize("lq,lk", [(6, 6), (3, 9)])
def test_causal_grads_equal_float64_autograd(lq, lk, compiled):
    q, k, v, go = operands(lq=lq, lk=lk)
    ref = reference_grads(q, k, v, go, None, True, 0.3)
    assert_close_to(ab.explicit_grads(q, k, v, go, None, True, 0.3, compiled=compiled), ref)


@pytest.mark.parametrize("compiled", PATHS)
def test_padded_boolean_mask_grads_equal_float64_autograd_and_a_row_reading_nothing_gets_zero(compiled):
    q, k, v, go = operands(lq=4, lk=9)
    mask = padded_mask(3, 4, 9, [0, 3, 2])
    mask[2, :, 0] = False  # the first query row of row 2 reads no key at all
    ref = reference_grads(q, k, v, go, mask, False, 16**-0.5)
    grads = ab.explicit_grads(q, k, v, go, mask, False, 16**-0.5, compiled=compiled)
    assert_close_to(grads, ref)
    assert torch.equal(grads[0][2, :, 0], torch.zeros(4, 16))


@pytest.mark.parametrize("compiled", PATHS)
def test_additive_mask_grads_equal_float64_autograd_and_chunks_do_not_change_them(monkeypatch, compiled):
    q, k, v, go = operands(b=5)
    mask = torch.where(padded_mask(5, 5, 7, [0, 1, 2, 0, 3]), 0.0, torch.finfo(torch.float32).min)
    ref = reference_grads(q, k, v, go, mask, False, 0.25)
    whole = ab.explicit_grads(q, k, v, go, mask, False, 0.25, compiled=compiled)
    assert_close_to(whole, ref)
    monkeypatch.setattr(ab, "CHUNK_BYTES", 1)  # one batch row per chunk (torch's products)
    for a, b in zip(ab.explicit_grads(q, k, v, go, mask, False, 0.25, compiled=compiled), whole):
        assert torch.equal(a, b)


@pytest.mark.skipif(bool(decode_attention.toolchain_missing()), reason="no C++ toolchain")
@pytest.mark.parametrize("dtypes", ["bf16", "float32", "bf16 with a float32 grad_out"])
def test_compiled_kernel_over_several_row_blocks_in_every_dtype(dtypes):
    """3 grouped heads x 200 query rows against 240 keys: 600 rows of 240 float32 scores (562 KiB) pass in three row
    blocks of 256 KiB, dK and dV summed over them; bf16 operands are read exactly (the reference differentiates at
    the same bf16 values), a float32 grad_out beside bf16 ones widens all to float32."""
    q, k, v, go = operands(b=2, h=6, kvh=2, lq=200, lk=240, d=32, seed=3)
    if dtypes.startswith("bf16"):
        q, k, v = (t.bfloat16() for t in (q, k, v))
        go = go if "float32 grad_out" in dtypes else go.bfloat16()
    mask = padded_mask(2, 200, 240, [0, 17])
    ref = reference_grads(q, k, v, go, mask, False, 32**-0.5)
    grads = ab.explicit_grads(q, k, v, go, mask, False, 32**-0.5, compiled=True)
    assert_close_to(grads, ref)


@pytest.mark.parametrize("compiled", PATHS)
def test_no_query_rows_or_no_keys_give_zero_gradients(compiled):
    """Lq = 0 (dK, dV were the kernel's uninitialised buffers) and Lk = 0 (its row blocks divided by zero): zeros,
    as a row that reads no key gets."""
    q, k, v, go = operands(lq=0, lk=5)
    for g in ab.explicit_grads(q, k, v, go, None, False, 0.25, compiled=compiled):
        assert not g.any()
    if compiled:  # torch's products have no row to take a max over at Lk = 0
        q, k, v, go = operands(lq=3, lk=0)
        grads = ab.explicit_grads(q, k, v, go, None, False, 0.25, compiled=True)
        assert [tuple(g.shape) for g in grads] == [(3, 4, 3, 16), (3, 2, 0, 16), (3, 2, 0, 16)]
        assert not grads[0].any()


def test_the_start_up_line_names_the_implementation_that_runs(tiny):
    model, _ = tiny  # head_dim 32
    built = not decode_attention.toolchain_missing()
    for dtype in (torch.float32, torch.bfloat16):
        assert ab.implementation(model, dtype).startswith("compiled" if built else "torch's")
    assert ab.implementation(model, torch.float16) == "torch's products"  # compiled_serves refuses float16


def test_the_compiled_kernel_serves_what_it_can_read():
    q, k, v, _ = operands(d=16)
    toolchain = not decode_attention.toolchain_missing()
    assert ab.compiled_serves(q, k, v) is toolchain
    assert ab.compiled_serves(q.bfloat16(), k.bfloat16(), v.bfloat16()) is toolchain
    q8, k8, v8, _ = operands(d=8)  # head_dim not a multiple of 16, float16: torch's products
    assert not ab.compiled_serves(q8, k8, v8)
    assert not ab.compiled_serves(q.half(), k.half(), v.half())


def batch(tokenizer):
    prompts = tokenizer(["What is 1 + 2?", "Hi", "What is 1 + 2?", "Hi"], return_tensors="pt", padding=True)
    gen = torch.Generator().manual_seed(0)
    response = torch.randint(5, 200, (4, 6), generator=gen)
    response_mask = torch.ones(4, 6, dtype=torch.long)
    response_mask[1, 4:] = 0
    response_mask[3, 2:] = 0
    return prompts.input_ids, prompts.attention_mask, response, response_mask


def scored(model, tokenizer, threshold, shared_prefix, autocast):
    """(log-probs, gradients of their masked sum) with the explicit backward up to ``threshold``."""
    model.zero_grad(set_to_none=True)
    p_ids, p_mask, r_ids, r_mask = batch(tokenizer)
    with ab.active(threshold), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        scores = response_logprobs(model, p_ids, p_mask, r_ids, r_mask, shared_prefix=shared_prefix)
        (scores.logprobs * r_mask).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return scores.logprobs.detach(), grads


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("shared_prefix", [False, True])
def test_model_forward_bits_unchanged_and_gradients_match_flash(tiny, monkeypatch, shared_prefix, autocast):
    model, tokenizer = tiny
    calls = []
    real = ab.explicit_grads
    monkeypatch.setattr(ab, "explicit_grads", lambda *a: calls.append(a[0].shape) or real(*a))
    flash_lp, flash_g = scored(model, tokenizer, 0, shared_prefix, autocast)
    assert calls == []
    lp, g = scored(model, tokenizer, 1 << 62, shared_prefix, autocast)
    assert len(calls) >= 2 * model.config.num_hidden_layers if shared_prefix else model.config.num_hidden_layers
    assert torch.equal(lp, flash_lp)  # the forward is the same call: the log-probs keep their bits
    rel = ((g - flash_g).norm() / flash_g.norm()).item()
    assert rel < (2e-2 if autocast else 1e-5), rel


def test_threshold_chooses_by_query_times_key_length(tiny, monkeypatch):
    model, tokenizer = tiny
    seen = []
    real = ab.explicit_grads
    monkeypatch.setattr(ab, "explicit_grads", lambda *a: seen.append(a[0].shape[2] * a[1].shape[2]) or real(*a))
    p_ids = batch(tokenizer)[0]
    scored(model, tokenizer, p_ids.shape[1] ** 2 - 1, False, False)  # the whole row is P + T long: above
    assert seen == []
    scored(model, tokenizer, (p_ids.shape[1] + 6) ** 2, False, False)
    assert seen and set(seen) == {(p_ids.shape[1] + 6) ** 2}


def test_calls_without_a_gradient_take_the_delegate(tiny, monkeypatch):
    model, tokenizer = tiny
    monkeypatch.setattr(ab, "explicit_grads", lambda *a: pytest.fail("no backward without a gradient"))
    p_ids, p_mask, r_ids, r_mask = batch(tokenizer)
    before = ab._threshold
    with ab.active(1 << 62), torch.no_grad():
        response_logprobs(model, p_ids, p_mask, r_ids, r_mask)
    assert ab._threshold == before  # left: as it was


def test_threshold_from_stops_at_the_first_length_not_faster():
    assert ab.threshold_from({32: 3.0, 64: 1.5, 96: 1.05, 128: 1.3}) == 64 * 64
    assert ab.threshold_from({32: 1.0, 64: 2.0}) == 0
    assert ab.threshold_from({32: 2.0, 64: 2.0}) == 64 * 64


def test_resolve_measures_once_per_key_and_caches(tiny, tmp_path, monkeypatch):
    model, _ = tiny
    from lit_rl.run import hardware

    cache, timed = tmp_path / "attention_backward.json", []
    others = [0.0]  # CPU seconds other processes used during the timing
    monkeypatch.setattr(hardware, "_other_cpu_seconds", lambda start=None: (others[0], 0.0))

    def timer(heads, kv_heads, head_dim, dtype):
        timed.append((heads, kv_heads, head_dim, dtype))
        return {32: 2.0, 64: 1.2, 96: 0.9}

    threshold, why = ab.resolve("auto", model, torch.bfloat16, cache=cache, timer=timer)
    assert threshold == 64 * 64 and "Lq x Lk <= 4096" in why and "measured now" in why
    assert timed == [(2, 1, 32, torch.bfloat16)]
    assert ab.resolve("auto", model, torch.bfloat16, cache=cache, timer=timer)[0] == 64 * 64
    assert len(timed) == 1  # cached
    ab.resolve("auto", model, torch.float32, cache=cache, timer=timer)
    assert len(timed) == 2  # another dtype, another measurement
    others[0] = 5.0  # a busy machine: measured, used, not cached
    threshold, why = ab.resolve("auto", model, torch.float16, cache=cache, timer=timer)
    assert threshold == 64 * 64 and "not cached" in why
    threshold, why = ab.resolve("auto", model, torch.float16, cache=cache, timer=timer)
    assert len(timed) == 3 and threshold == 64 * 64  # the next run in this process: not timed again
    assert "not cached" in why and "kept from earlier in this process" in why
    assert not any("|float16|" in key for key in json.loads(cache.read_text()))  # and still not in the file
    assert ab.resolve("flash", model, torch.float32, cache=cache, timer=timer)[0] == 0
    assert ab.resolve("explicit", model, torch.float32, cache=cache, timer=timer)[0] > 10**12
    with pytest.raises(ValueError, match="kernels.attention_backward='fast'"):
        ab.resolve("fast", model, torch.float32, cache=cache, timer=timer)


def test_measure_times_both_backwards_on_a_small_head_shape():
    ratios = ab.measure(2, 1, 16, torch.float32, lengths=(8, 16))
    assert set(ratios) <= {8, 16} and all(r > 0 for r in ratios.values())


def test_kernel_mode_enters_and_leaves_the_explicit_backward(tiny, tmp_path, monkeypatch):
    model, _ = tiny
    monkeypatch.setattr(ab, "_cache_file", lambda: tmp_path / "attention_backward.json")
    monkeypatch.setattr(ab, "_threshold", None)
    monkeypatch.setattr(ab, "_entered", [])
    mode = kernel_mode("default", model, attention_backward="explicit")
    for _ in range(2):  # a run enters its mode more than once
        with mode:
            assert ab._threshold > 10**12
        assert ab._threshold is None
    with kernel_mode("default", model, attention_backward="flash"):
        assert ab._threshold is None
    with kernel_mode("batch_invariant", model, attention_backward="auto"):  # its own attention: auto is flash there
        assert ab._threshold is None


def test_auto_is_the_default_and_batch_invariant_kernels_accept_it():
    assert cfg_for().kernels.attention_backward == "auto"
    validate(cfg_for("kernels=batch_invariant"))
    validate(cfg_for("kernels=batch_invariant", "kernels.attention_backward=auto"))


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["kernels.attention_backward=fast"], "kernels.attention_backward"),
        (
            ["kernels=batch_invariant", "kernels.attention_backward=explicit"],
            r"attention_backward.*leave it at auto \(which means flash there\) or flash",
        ),
    ],
)
def test_config_refuses_bad_values_by_name(overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate(cfg_for(*overrides))


def test_sdpa_flash_forward_is_what_the_wrapper_returns():
    """The wrapped forward is transformers' own call: on plain operands the output equals F.sdpa's."""
    ab.install()
    q, k, v, _ = operands(b=2, h=2, kvh=2, lq=4, lk=4)
    module = torch.nn.Module()
    module.is_causal = True
    with ab.active(1 << 62):
        out, _ = ab.attention(module, q.requires_grad_(), k, v, None, scaling=0.5)
    want = F.scaled_dot_product_attention(q.detach(), k, v, is_causal=True, scale=0.5).transpose(1, 2)
    assert torch.equal(out.detach(), want)


def transformers_module(groups: int, causal: bool = True) -> torch.nn.Module:
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = groups, causal
    return module


@pytest.mark.parametrize("d", [8, 16], ids=["torch-ops", "compiled where built"])
@pytest.mark.parametrize(
    "case", ["causal, no mask, Lq < Lk", "per-head boolean", "2-D boolean", "3-D boolean", "additive needing grad"]
)
def test_the_wrapped_attention_gives_the_gradients_of_transformers_own(case, d):
    """Through ``attention`` (the explicit backward on) and through transformers' ``sdpa`` attention itself, on the
    same float32 inputs: the same outputs bit for bit and the same gradients (a mask that needs a gradient falls back
    to transformers' path). The first case is the continuation transformers cuts to a square causal block."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, h, kvh, lq, lk = 2, 4, 2, 5, 5
    if case.startswith("causal"):
        lk = 9
    gen = torch.Generator().manual_seed(1)
    base = [torch.randn(b, h, lq, d, generator=gen)] + [torch.randn(b, kvh, lk, d, generator=gen) for _ in range(2)]
    go = torch.randn(b, lq, h, d, generator=gen)
    keep = torch.rand(b, h, lq, lk, generator=gen) > 0.3
    keep[..., 0] = True
    mask = {
        "causal, no mask, Lq < Lk": None,
        "per-head boolean": keep,
        "2-D boolean": keep[0, 0],
        "3-D boolean": keep[0],  # [H, Lq, Lk]: SDPA aligns a mask's dimensions from the right
        "additive needing grad": torch.randn(b, 1, lq, lk, generator=gen).requires_grad_(),
    }[case]
    module = transformers_module(h // kvh)
    results = []
    for wrapped in (True, False):
        leaves = [t.clone().requires_grad_() for t in base]
        m = mask.detach().clone().requires_grad_() if mask is not None and mask.requires_grad else mask
        if wrapped:
            ab.install()
            with ab.active(1 << 62):
                out, _ = ab.attention(module, *leaves, m, scaling=0.3)
        else:
            out, _ = sdpa_attention_forward(module, *leaves, m, scaling=0.3)
        out.backward(go)
        results.append((out.detach(), [t.grad for t in leaves], m.grad if m is not None and m.requires_grad else None))
    (out, grads, mask_grad), (want, want_grads, want_mask_grad) = results
    assert torch.equal(out, want)
    for g, w in zip(grads, want_grads):
        assert ((g - w).norm() / w.norm()).item() < 1e-5
    assert (mask_grad is None) == (want_mask_grad is None)
    if mask_grad is not None:
        assert torch.equal(mask_grad, want_mask_grad)


def test_blocks_left_out_of_order_leave_the_innermost_still_entered():
    a, b = ab.active(100), ab.active(200)
    before = ab._threshold
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert ab._threshold == 200
    b.__exit__(None, None, None)
    assert ab._threshold == before
