"""logprobs.FusedChunkLogprobs: the output layer, log-softmax, gather and entropy with a written-out backward must
give the values and gradients of the checkpointed generic path (``_chunk_logprobs``) it replaces."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from lit_rl.kernels import BatchInvariantMode
from lit_rl.logprobs import FusedChunkLogprobs, _chunk_logprobs, fused_head_applies, head_transform, response_logprobs

R, H, V, K = 23, 32, 301, 3


def inputs(seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(R, H, generator=g, requires_grad=True)
    weight = (torch.randn(V, H, generator=g) * 0.3).requires_grad_()
    b = (torch.randn(V, generator=g) * 0.1).requires_grad_() if bias else None
    targets = torch.randint(0, V, (R,), generator=g)
    head = torch.randint(0, V, (R, K), generator=g)
    head[:, 0] = targets  # the sampled token among the head ids: the gather's gradients add up
    weights = [torch.randn(R, generator=g), torch.randn(R, generator=g), torch.randn(R, K, generator=g)]
    return hidden, weight, b, targets, head, weights


def run(fused: bool, temperature: float, with_head: bool, entropy_grad: bool, autocast: bool = False, seed=0):
    hidden, weight, bias, targets, head, (w_lp, w_en, w_hd) = inputs(seed)
    head = head if with_head else None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if fused:
            lp, en, hd = FusedChunkLogprobs.apply(hidden, weight, bias, targets, head, temperature, True, entropy_grad)
        else:
            args = (hidden, weight, bias, targets, temperature, True, head, 0, 1.0, None, entropy_grad)
            lp, en, hd = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
    loss = (lp * w_lp).sum() + (hd * w_hd[:, : hd.shape[1]]).sum()
    if entropy_grad:
        loss = loss + (en * w_en).sum()
    loss.backward()
    return [lp, en, hd], [hidden.grad, weight.grad, bias.grad]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_head", [False, True])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_values_and_gradients_equal_the_generic_path(temperature, with_head, entropy_grad):
    values, grads = run(False, temperature, with_head, entropy_grad)
    values_f, grads_f = run(True, temperature, with_head, entropy_grad)
    for a, b in zip(values, values_f):
        torch.testing.assert_close(b, a.detach(), rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, grads_f):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6 * float(a.abs().max()))


def chunked(chunk_tokens, autocast, entropy_grad=True):
    """Values and gradients of one call over every row in chunks of ``chunk_tokens`` (None: one call per chunk of
    5 rows, as the caller ran before), with the [V, H] weight casts counted."""
    from torch.profiler import ProfilerActivity, profile

    hidden, weight, bias, targets, head, (w_lp, w_en, w_hd) = inputs()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast, cache_enabled=False):
            if chunk_tokens is None:
                parts = [
                    FusedChunkLogprobs.apply(
                        hidden[s : s + 5], weight, bias, targets[s : s + 5], head[s : s + 5], 0.7, True, entropy_grad
                    )  # fmt: skip
                    for s in range(0, R, 5)
                ]
                lp, en, hd = (torch.cat(p) for p in zip(*parts))
            else:
                lp, en, hd = FusedChunkLogprobs.apply(hidden, weight, bias, targets, head, 0.7, True, entropy_grad,
                                                      chunk_tokens)  # fmt: skip
        ((lp * w_lp).sum() + (hd * w_hd).sum() + (en * w_en).sum()).backward()
    casts = sum(e.count for e in prof.key_averages(group_by_input_shape=True)
                if e.key == "aten::_to_copy" and e.input_shapes and e.input_shapes[0] == [V, H])  # fmt: skip
    return [lp, en, hd], [hidden.grad, weight.grad, bias.grad], casts


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_chunks_in_one_call_give_the_values_of_one_call_per_chunk_with_the_weight_cast_once_each_way(autocast):
    values, grads, casts = chunked(None, autocast)
    values_1, grads_1, casts_1 = chunked(5, autocast)
    for a, b in zip(values, values_1):
        assert torch.equal(a, b)  # each chunk's forward is the same computation
    for a, b in zip(grads, grads_1):  # the weight's gradient summed over chunks in another order
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7 * float(a.abs().max()))
    assert torch.equal(grads[0], grads_1[0])  # the hidden states' gradients are per row: the same bits
    chunks = -(-R // 5)
    # bf16 autocast: a call per chunk cast the [V, H] weight three times a chunk (the forward's product, the
    # backward's input gradient, its gradient back to float32; the backward's recomputed product hits custom_bwd's
    # cast cache); one call casts the weight once each way and converts each chunk's gradient once as it adds it
    assert (casts, casts_1) == ((3 * chunks, 2 + chunks) if autocast else (0, 0))


def test_entropy_is_a_detached_diagnostic_unless_asked():
    hidden, weight, bias, targets, _, _ = inputs()
    _, entropy, _ = FusedChunkLogprobs.apply(hidden, weight, bias, targets, None, 1.0, True, False)
    assert not entropy.requires_grad
    _, entropy, _ = FusedChunkLogprobs.apply(hidden, weight, bias, targets, None, 1.0, True, True)
    assert entropy.requires_grad


def test_under_bf16_autocast_it_follows_the_generic_path():
    values, grads = run(False, 1.0, True, False, autocast=True)
    values_f, grads_f = run(True, 1.0, True, False, autocast=True)
    for a, b in zip(values, values_f):  # the same bf16 product; the reductions differ in float32 rounding only
        torch.testing.assert_close(b, a.detach(), rtol=1e-4, atol=1e-4)
    for a, b in zip(grads, grads_f):  # gradient products in bf16 on both paths
        torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-2 * float(a.abs().max()))
    assert grads_f[1].dtype == torch.float32  # the float32 master weight gets a float32 gradient


def test_the_fused_path_is_taken_only_where_it_computes_the_same_thing(tiny):
    model = tiny[0]
    plain = head_transform(model)
    assert fused_head_applies(0, 1.0, plain)
    assert not fused_head_applies(5, 1.0, plain)  # top-k truncation: the generic path masks the support
    assert not fused_head_applies(0, 0.9, plain)
    with BatchInvariantMode(model):  # the batch-invariant log-softmax must match the engine's bit for bit
        assert not fused_head_applies(0, 1.0, plain)


def test_response_logprobs_gradients_unchanged_by_the_fused_head(tiny, monkeypatch):
    import lit_rl.logprobs as lp_mod

    model = tiny[0]
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, model.config.vocab_size, (4, 6), generator=g)
    response = torch.randint(0, model.config.vocab_size, (4, 9), generator=g)
    pmask, rmask = torch.ones_like(prompt), torch.ones_like(response)
    rmask[1, 5:] = 0

    def grads():
        model.zero_grad(set_to_none=True)
        scores = response_logprobs(model, prompt, pmask, response, rmask, temperature=0.8, chunk_tokens=7)
        (scores.logprobs * torch.linspace(-1, 1, 9)).sum().backward()
        return scores.logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    lp_fused, g_fused = grads()
    monkeypatch.setattr(lp_mod, "fused_head_applies", lambda *a: False)
    lp_generic, g_generic = grads()
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(lp_fused, lp_generic, rtol=1e-5, atol=1e-5)
    for name, a in g_generic.items():
        torch.testing.assert_close(g_fused[name], a, rtol=1e-5, atol=1e-6 * float(a.abs().max()), msg=name)
