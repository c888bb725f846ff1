"""lit_rl's decode attention kernel (``engine.decode_attention``): values against float64 attention, the masks and
strides the engine hands it, the engine's routing, the per-dtype choice and the config refusals."""

import types

import pytest
import torch
import torch.nn.functional as F
from helpers import compose_config

from lit_rl.kernels import decode_attention as da
from lit_rl.kernels import single_query

# skipped only where the toolchain is missing (its refusal is tested below with PATH emptied); with a compiler and
# ninja a failed build fails every test here (``_built``): it is not skipped
pytestmark = pytest.mark.skipif(bool(da.toolchain_missing()), reason=f"no kernel toolchain: {da.toolchain_missing()}")


@pytest.fixture(autouse=True, scope="module")
def _built():
    assert da.build() == ""


def reference(q, k, v, mask, scale, rounded):
    """float64 attention of one query row per head; ``rounded``: the softmax numerators rounded to bf16 before
    they weigh the values (what the kernel and torch's flash kernel do in bf16), the denominator unrounded."""
    s = torch.einsum("bhgd,bhld->bhgl", q.double(), k.double()) * scale
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.where(torch.isinf(m), torch.zeros_like(s), torch.exp(s - m))
    denom = p.sum(-1, keepdim=True)
    weights = p.to(torch.bfloat16).double() if rounded else p
    out = torch.einsum("bhgl,bhld->bhgd", weights, v.double()) / denom.clamp_min(1e-300)
    return out


def operands(rows, kvh, group, dim, length, dtype, reserved=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, kvh, group, dim, generator=g).to(dtype)
    # keys and values sliced from a buffer reserved for ``length + reserved`` positions, as the engine's cache
    k, v = (torch.randn(rows, kvh, length + reserved, dim, generator=g).to(dtype)[:, :, :length] for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize(
    "kvh,group,dim",
    [(3, 3, 64), (1, 1, 32), (2, 8, 128), (1, 2, 256), (2, 9, 64), (2, 3, 48)],
    ids=["smollm2", "mha-32", "g8-128", "g2-256", "g9-portable", "d48-portable"],
)
@pytest.mark.parametrize("length", [1, 15, 16, 17, 100])
def test_values_match_float64_attention(dtype, kvh, group, dim, length):
    q, k, v = operands(5, kvh, group, dim, length, dtype, reserved=7)
    mask = torch.ones(5, length, dtype=torch.bool)
    mask[1, : length // 2] = False  # a left-padded row
    mask[2, ::3] = False
    mask[3] = False  # a row that sees no key: zeros (not NaN)
    scale = dim**-0.5
    for m in (None, mask):
        out = da.attention(q, k, v, m, scale)
        assert out.dtype == dtype and out.shape == q.shape
        want = reference(q, k, v, m, scale, rounded=dtype == torch.bfloat16)
        if dtype == torch.float32:
            torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=2e-5)
        else:  # the same numerators' rounding: within the output's own bf16 rounding (plus float32 sums)
            torch.testing.assert_close(out.double(), want.to(torch.bfloat16).double(), atol=4e-3, rtol=8e-3)
        if m is not None:
            assert out[3].abs().sum() == 0


def test_a_mask_with_strides_and_wrong_operands():
    q, k, v = operands(4, 3, 3, 64, 40, torch.float32)
    full = torch.ones(4, 1, 1, 48, dtype=torch.bool)
    full[0, ..., :10] = False
    strided = full[:, 0, 0, :40]  # a view of transformers' [B, 1, 1, >= L] mask
    assert not strided.is_contiguous() or strided.stride(0) != 40
    torch.testing.assert_close(da.attention(q, k, v, strided, 0.125), da.attention(q, k, v, strided.clone(), 0.125))
    with pytest.raises(RuntimeError, match=r"mask must be bool \[B, L\]"):
        da.attention(q, k, v, torch.ones(4, 39, dtype=torch.bool), 0.125)
    with pytest.raises(RuntimeError, match="share a dtype"):
        da.attention(q.bfloat16(), k, v, None, 0.125)


def transformers_layout(q):
    """[B, KVH, G, D] grouped query rows as transformers hands them to the attention: [B, H, 1, D]."""
    b, kvh, g, d = q.shape
    return q.reshape(b, kvh * g, 1, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_single_query_routes_decode_steps_to_the_kernel_inside_active(dtype):
    single_query.install()
    q, k, v = operands(6, 3, 3, 64, 30, dtype)
    mask = torch.ones(6, 1, 1, 30, dtype=torch.bool)
    mask[0, ..., :12] = False
    query = transformers_layout(q)
    layer = types.SimpleNamespace(num_key_value_groups=3, is_causal=True)  # what transformers' sdpa reads
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with da.active((dtype,)):
            ours, _ = single_query.attention(layer, query, k, v, mask, scaling=0.125)
        with da.active(()):
            theirs, _ = single_query.attention(layer, query, k, v, mask, scaling=0.125)
    calls = [e.count for e in prof.key_averages() if e.key == "lit_rl::decode_attention"]
    assert calls == [1]  # the first call only
    assert ours.shape == theirs.shape == (6, 1, 9, 64)
    tol = dict(atol=2e-6, rtol=2e-5) if dtype == torch.float32 else dict(atol=1.6e-2, rtol=1.6e-2)
    torch.testing.assert_close(ours.float(), theirs.float(), **tol)
    # an additive mask is not the kernel's: SDPA serves it inside the block too
    additive = torch.zeros(6, 1, 1, 30, dtype=dtype).masked_fill(~mask, float("-inf"))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with da.active((dtype,)):
            single_query.attention(layer, query, k, v, additive, scaling=0.125)
    assert not [e for e in prof.key_averages() if e.key == "lit_rl::decode_attention"]


def test_calls_the_kernel_does_not_take_fall_back_to_sdpa():
    """A value head_dim other than the key's (MLA-style), a mask shorter than the keys or of another batch: SDPA's
    path, not an error mid-rollout."""
    single_query.install()
    q, k, v = operands(2, 2, 1, 32, 10, torch.float32)
    layer = types.SimpleNamespace(num_key_value_groups=1, is_causal=True)
    query = transformers_layout(q)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with da.active((torch.float32,)):
            out, _ = single_query.attention(layer, query, k, v[..., :16], None, scaling=0.125)
            assert out.shape == (2, 1, 2, 16)
            short = torch.ones(2, 1, 1, 9, dtype=torch.bool)
            assert single_query._row_mask(short, 2, 10) is False
            assert single_query._row_mask(torch.ones(3, 1, 1, 10, dtype=torch.bool), 2, 10) is False
            assert single_query._row_mask(torch.ones(1, 1, 1, 12, dtype=torch.bool), 2, 10).shape == (2, 10)
    assert not [e for e in prof.key_averages() if e.key == "lit_rl::decode_attention"]


def test_masked_keys_weigh_nothing_even_when_not_finite():
    """A masked position's weight is exactly 0 (not exp(-103.9) = 2^-149), so a huge value there adds nothing, and
    an infinite key there is masked out before the softmax."""
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = operands(2, 1, 2, 64, 33, dtype)
        mask = torch.ones(2, 33, dtype=torch.bool)
        mask[:, [0, 3, 20, 32]] = False  # in a 16-key block and in the tail
        k2, v2 = k.clone(), v.clone()
        k2[:, :, [0, 3, 20, 32]] = float("inf")
        v2[:, :, [0, 3, 20, 32]] = 3e38 if dtype == torch.float32 else 1e38
        out = da.attention(q, k2, v2, mask, 0.125)
        assert torch.isfinite(out).all()
        assert torch.equal(out, da.attention(q, k, v, mask, 0.125))


def test_the_engine_runs_it_with_the_trainers_logprobs(tiny):
    """A rollout with the kernel on: the decode steps call it, and the rollout log-probs stay within float32
    rounding of the trainer's (as they do through SDPA)."""
    from lit_rl.logprobs import response_logprobs
    from lit_rl.rollout.torch_engine import TorchEngine
    from lit_rl.rollout.types import SamplingConfig, left_pad

    model, tok = tiny
    prompts = [[5, 17, 100, 4], [7, 8], [9, 10, 11, 12, 13, 14]]  # different lengths: a left-padded batch
    engine = TorchEngine(model, tok.pad_token_id, [], decode_attention=True)
    engine.generate(prompts[:1], SamplingConfig(max_new_tokens=2), seeds=[0])  # the Llama step's parity check, once
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        r = engine.generate(prompts, SamplingConfig(max_new_tokens=12), seeds=[0, 1, 2])
    calls = sum(e.count for e in prof.key_averages() if e.key == "lit_rl::decode_attention")
    layers = model.config.num_hidden_layers
    assert calls == 11 * layers  # every decode step after the prefill's token, every layer
    pi, pm = left_pad(r.prompt_ids, tok.pad_token_id)
    with torch.no_grad():
        s = response_logprobs(model, pi, pm, r.response_ids, r.response_mask, with_entropy=False)
    assert (s.logprobs - r.rollout_logprobs).abs()[r.response_mask].max() < 2e-5


def test_resolve_per_dtype_and_cached(tmp_path, tiny, monkeypatch):
    from lit_rl.run import hardware

    model, _ = tiny
    cache = tmp_path / "decode_attention.json"
    timed = []
    others = [0.0]  # CPU seconds other processes used while it timed (the suite's other worker: set here)
    monkeypatch.setattr(hardware, "_other_cpu_seconds", lambda start=None: (others[0] if start else 0.0, 0.0))

    def timer(kvh, group, dim, dtype):
        timed.append((kvh, group, dim, dtype))
        return (2.0, 1.0) if dtype == torch.bfloat16 else (1.0, 1.0)  # 2x in bf16, no gain in float32

    on, why = da.resolve("auto", model, cache=cache, timer=timer)
    assert on == (torch.bfloat16,) and "on for bfloat16" in why and "float32 1.00x" in why
    assert timed == [(1, 2, 32, torch.bfloat16), (1, 2, 32, torch.float32)]  # the tiny model's heads
    assert da.resolve("auto", model, cache=cache, timer=timer)[0] == (torch.bfloat16,) and len(timed) == 2
    assert da.resolve(True, model, cache=cache, timer=timer)[0] == da.DTYPES
    assert da.resolve(False, model, cache=cache, timer=timer) == ((), "engine.decode_attention=false")
    with pytest.raises(ValueError, match="engine.decode_attention='fast' is not allowed: choose auto, true or false"):
        da.resolve("fast", model)
    others[0] = 50.0  # a busy machine: timed, used, not cached
    busy = tmp_path / "busy.json"
    on, why = da.resolve("auto", model, cache=busy, timer=timer)
    assert on == (torch.bfloat16,) and "not cached: other processes used" in why and not busy.exists()


def test_measure_times_float32_as_float32_under_autocast(tiny):
    """resolve may run inside the rollout's bf16 autocast: the float32 timing must still time float32 SDPA (the
    kernel has no autocast rule), so ``measure`` leaves autocast."""
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, *args, **kwargs):
        out = sdpa(q, *args, **kwargs)
        seen.append(out.dtype)
        return out

    with torch.autocast("cpu", dtype=torch.bfloat16):
        F.scaled_dot_product_attention = spy
        try:
            da.measure(1, 2, 32, torch.float32, shapes=((2, 8),), seconds=0.0)
        finally:
            F.scaled_dot_product_attention = sdpa
    assert seen and set(seen) == {torch.float32}


def test_config_refuses_it_on_under_batch_invariant_kernels_and_bad_values():
    from lit_rl.config import ConfigError, validate

    with pytest.raises(ConfigError, match="engine.decode_attention"):
        validate(compose_config("model=tiny", "kernels=batch_invariant", "engine.decode_attention=true"))
    with pytest.raises(ConfigError, match="engine.decode_attention"):
        validate(compose_config("model=tiny", "engine.decode_attention=fast"))
    validate(compose_config("model=tiny", "kernels=batch_invariant"))  # auto: off under them, allowed


def test_no_toolchain_auto_says_why_and_true_is_refused_at_start_up(monkeypatch, tmp_path):
    from lit_rl.config import ConfigError, validate

    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler, no ninja
    monkeypatch.delenv("CXX", raising=False)
    assert da.toolchain_missing() == "no C++ compiler (c++ / g++) on PATH"
    monkeypatch.setenv("CXX", "clang-from-nowhere++")
    assert da.toolchain_missing() == "no C++ compiler ($CXX=clang-from-nowhere++) on PATH"
    with pytest.raises(ConfigError, match=r"engine.decode_attention.*needs its C\+\+ build: no C\+\+ compiler"):
        validate(compose_config("model=tiny", "engine.decode_attention=true"))
    validate(compose_config("model=tiny"))  # auto: allowed, off at the first rollout with the reason


def test_a_lock_left_by_a_killed_build_is_removed_and_a_live_one_waited_for(tmp_path, capsys):
    import os
    import threading
    import time

    stale = tmp_path / "stale.lock"
    stale.touch()
    old = time.time() - da.STALE_LOCK_S - 5
    os.utime(stale, (old, old))
    da._wait_for_lock(stale)
    assert not stale.exists() and "did not finish" in capsys.readouterr().out
    live = tmp_path / "live.lock"
    live.touch()
    threading.Timer(0.7, live.unlink).start()  # another process's build ends
    t = time.perf_counter()
    da._wait_for_lock(live)
    assert time.perf_counter() - t >= 0.6 and "waiting for another process" in capsys.readouterr().out
