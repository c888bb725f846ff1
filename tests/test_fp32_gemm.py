"""kernels.fp32_gemm: float32 products through oneDNN (``lit_rl.kernels.fp32_gemm``).

The products must be IEEE float32 products (errors of float32 size against float64, never bf16-sized), route
only what they claim (row-major float32; the rest is torch's own, bit for bit), keep autograd exact, leave
autocast's bf16 products alone, and ``auto`` must follow the measurement and its cache."""

import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from lit_rl.kernels import BatchInvariantMode, OneDNNGemm, kernel_mode
from lit_rl.kernels import fp32_gemm as fg

pytestmark = pytest.mark.skipif(not fg.available(), reason="this torch build has no oneDNN linear kernel")


def onednn_calls(fn) -> int:
    """How many oneDNN linear calls ``fn()`` makes."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "mkldnn::_linear_pointwise")


def operands(layout: str, m=37, k=300, n=600):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    if layout == "b_transposed":  # nn.Linear's forward: x @ W.T
        b = torch.randn(n, k, generator=g).t()
    elif layout == "a_row_slice":  # rows of a wider matrix (a view with row stride > K)
        a = torch.randn(m, k + 13, generator=g)[:, :k]
    return a, b


@pytest.mark.parametrize("layout", ["contiguous", "b_transposed", "a_row_slice"])
def test_products_are_float32_products_through_onednn(layout):
    a, b = operands(layout)
    exact = a.double() @ b.double()
    native = torch.mm(a, b)
    with OneDNNGemm():
        calls = onednn_calls(lambda: torch.mm(a, b))
        out = torch.mm(a, b)
    assert calls == 1
    assert out.dtype == torch.float32 and out.shape == native.shape
    # float32 accumulation over K=300 of unit normals: both libraries are within ~1e-5 of float64; bf16 or TF32
    # inputs would be ~1e-2 off
    tol = 30 * torch.finfo(torch.float32).eps * float(exact.abs().max())
    assert float((out.double() - exact).abs().max()) < tol
    assert float((native.double() - exact).abs().max()) < tol


def test_transposed_a_other_dtypes_and_empty_products_stay_torchs_own_bit_for_bit():
    a, b = operands("contiguous")
    cases = [
        (a.t().contiguous().t(), b),  # a column-major: the weight-gradient product
        (a.to(torch.bfloat16), b.to(torch.bfloat16)),
        (a.double(), b.double()),
        (a[:0], b),
        (a[: fg.MIN_ROWS - 1], b),  # a few rows, or a narrow output: oneDNN's per-call cost outweighs its kernel
        (a, b[:, : fg.MIN_COLUMNS - 1]),
        (a.round().long(), b.round().long()),
    ]
    for x, y in cases:
        native = torch.mm(x, y)
        with OneDNNGemm():
            assert onednn_calls(lambda: torch.mm(x, y)) == 0
            assert torch.equal(torch.mm(x, y), native)


def test_addmm_takes_the_bias_and_falls_back_for_beta_alpha():
    a, b = operands("b_transposed")
    bias = torch.randn(b.shape[1])
    with OneDNNGemm():
        assert onednn_calls(lambda: torch.addmm(bias, a, b)) == 1
        with_bias = torch.addmm(bias, a, b)
        assert onednn_calls(lambda: torch.addmm(bias, a, b, beta=0.5, alpha=2.0)) == 0
        scaled = torch.addmm(bias, a, b, beta=0.5, alpha=2.0)
    torch.testing.assert_close(with_bias, bias + a @ b, rtol=1e-5, atol=1e-4)
    assert torch.equal(scaled, torch.addmm(bias, a, b, beta=0.5, alpha=2.0))


def test_linear_forward_and_backward_match_torchs_own(tiny):
    model, _ = tiny
    ids = torch.randint(0, model.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(1))

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits
        loss = logits.log_softmax(-1).gather(-1, ids[..., None]).mean()
        loss.backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    logits, grads = loss_and_grads()
    with OneDNNGemm():
        calls = onednn_calls(loss_and_grads)
        logits_on, grads_on = loss_and_grads()
    assert calls > 0
    torch.testing.assert_close(logits_on, logits, rtol=1e-5, atol=1e-5)
    for name, g in grads.items():
        scale = float(g.abs().max()) or 1.0
        torch.testing.assert_close(grads_on[name], g, rtol=1e-5, atol=1e-6 * scale, msg=name)
    model.zero_grad(set_to_none=True)


def test_bf16_autocast_products_are_left_alone(tiny):
    model, _ = tiny
    ids = torch.arange(10)[None]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        native = model(input_ids=ids).logits
        with OneDNNGemm():
            assert onednn_calls(lambda: model(input_ids=ids)) == 0
            assert torch.equal(model(input_ids=ids).logits, native)


def test_disable_restores_torchs_kernels_and_batch_invariant_mode_excludes_it(tiny):
    a, b = operands("contiguous")
    mode = OneDNNGemm().enable()
    mode.disable()
    assert onednn_calls(lambda: torch.mm(a, b)) == 0
    with BatchInvariantMode(tiny[0]):
        with pytest.raises(RuntimeError, match="batch-invariant"):
            OneDNNGemm().enable()


def test_resolve_aten_onednn_and_bad_values(tiny):
    assert fg.resolve("aten", tiny[0])[0] is False
    assert fg.resolve("onednn", tiny[0])[0] is True
    with pytest.raises(ValueError, match=r"kernels.fp32_gemm='mkl' is not allowed: choose one of"):
        fg.resolve("mkl", tiny[0])


def test_auto_follows_the_measurement_and_caches_it(tiny, tmp_path, monkeypatch):
    import lit_rl.run.hardware as hw

    model, cache = tiny[0], tmp_path / "fp32_gemm.json"
    monkeypatch.setattr(hw, "_other_cpu_seconds", lambda start=None: (0.0, 0.0))
    on, why = fg.resolve("auto", model, cache=cache, timer=lambda shapes: (1.30, 1.0))
    assert on and "oneDNN (oneDNN 1.30x the speed" in why and "measured now" in why
    (entry,) = json.loads(cache.read_text()).values()
    assert entry["speedup"] == pytest.approx(1.30)

    def must_not_measure(shapes):
        raise AssertionError("the cached result must be used")

    on, why = fg.resolve("auto", model, cache=cache, timer=must_not_measure)
    assert on and "cached" in why
    slow = tmp_path / "slow.json"  # below MIN_SPEEDUP: torch's own
    on, why = fg.resolve("auto", model, cache=slow, timer=lambda shapes: (1.0, 1.0))
    assert not on and "torch's BLAS (oneDNN 1.00x" in why


def test_auto_does_not_cache_a_measurement_taken_on_a_busy_machine(tiny, tmp_path, monkeypatch):
    import lit_rl.run.hardware as hw

    monkeypatch.setattr(hw, "_other_cpu_seconds", lambda start=None: (0.0, 0.0) if start is None else (50.0, 0.0))
    cache = tmp_path / "fp32_gemm.json"
    on, why = fg.resolve("auto", tiny[0], cache=cache, timer=lambda shapes: (2.0, 1.0))
    assert on and "not cached: other processes used" in why
    assert not cache.exists()


def test_measure_times_every_shape_the_model_has(tiny):
    shapes = fg.linear_shapes(tiny[0])
    cfg = tiny[0].config
    assert shapes[(cfg.vocab_size, cfg.hidden_size)] == 1  # the output layer
    assert shapes[(cfg.intermediate_size, cfg.hidden_size)] == 2 * cfg.num_hidden_layers  # gate and up
    aten, onednn = fg.measure({(8, 16): 1}, rows=(4,), seconds=0.0)
    assert aten > 0 and onednn > 0


def test_kernel_mode_default_installs_it_only_when_resolved_on(tiny, capsys):
    a, b = operands("contiguous")
    with kernel_mode("default", tiny[0], fp32_gemm="onednn"):
        assert onednn_calls(lambda: torch.mm(a, b)) == 1
    assert "lit_rl: kernels.fp32_gemm=onednn" in capsys.readouterr().out
    with kernel_mode("default", tiny[0], fp32_gemm="aten"):
        assert onednn_calls(lambda: torch.mm(a, b)) == 0
    with pytest.raises(ValueError, match="kernels=batch_invariant"):
        kernel_mode("batch_invariant", tiny[0], fp32_gemm="onednn")
