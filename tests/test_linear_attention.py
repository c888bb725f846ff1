"""The Gated DeltaNet kernels of ``kernels.linear_attention`` on random tensors: the recurrent rule computes the
same thing one call or token by token and whatever the batch, it agrees with transformers' two algorithms, the
conv's two forms are one, and the recurrent-forward / chunked-backward function has the chunked algorithm's
gradient."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as stock

from lit_rl.kernels.batch_invariant import gated_rms_norm, norm_kernels
from lit_rl.kernels.linear_attention import (
    RecurrentForwardChunkedBackward,
    conv1d_sequence,
    conv1d_step,
    recurrent_rule,
    resolve_linear_attention,
)

B, T, HK, HV, K = 3, 70, 2, 4, 16  # T > 64: two chunks of the chunked algorithm


def inputs(seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, HK, K, generator=g), torch.randn(B, T, HK, K, generator=g)
    v = torch.randn(B, T, HV, K, generator=g)
    decay = -torch.rand(B, T, HV, generator=g)  # log decay <= 0
    beta = torch.rand(B, T, HV, generator=g)
    state = torch.randn(B, HV, K, K, generator=g) * 0.1
    return [x.requires_grad_(requires_grad) for x in (q, k, v, decay, beta, state)]


def test_recurrent_rule_is_one_computation_token_by_token_and_row_by_row():
    q, k, v, g, beta, state = inputs()
    out, final = recurrent_rule(q, k, v, g, beta, state, True, True)
    steps, s = [], state
    for t in range(T):  # the engine's decode: one token per call, the state carried
        o, s = recurrent_rule(
            q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1], beta[:, t : t + 1], s, True, True
        )
        steps.append(o)
    assert torch.equal(torch.cat(steps, 1), out) and torch.equal(s, final)
    alone, _ = recurrent_rule(q[1:2], k[1:2], v[1:2], g[1:2], beta[1:2], state[1:2], True, True)
    assert torch.equal(alone, out[1:2])  # a row does not depend on the others


def test_recurrent_rule_agrees_with_transformers_two_algorithms():
    q, k, v, g, beta, state = inputs()
    ours, ours_final = recurrent_rule(q, k, v, g, beta, state, True, True)
    rec, rec_final = stock.torch_recurrent_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    chunk, chunk_final = stock.torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(ours, rec, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours_final, rec_final, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours, chunk, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours_final, chunk_final, rtol=0, atol=1e-5)
    assert not torch.equal(chunk, rec)  # the stock gap: two algorithms, two roundings


def test_conv_sequence_and_step_forms_are_one_and_equal_the_depthwise_conv():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 24, 10, generator=g), torch.randn(24, 4, generator=g)
    seq = conv1d_sequence(x, w, None, "silu")
    reference = F.silu(F.conv1d(x, w.unsqueeze(1), None, padding=3, groups=24)[..., :10])
    torch.testing.assert_close(seq, reference, rtol=0, atol=1e-6)
    prefill = conv1d_sequence(x[..., :6], w, None, "silu")  # the engine: prefill 6, then token by token
    state = x[..., 2:6].clone()
    steps = [conv1d_step(x[..., t : t + 1], state, w, None, "silu") for t in range(6, 10)]
    assert torch.equal(torch.cat([prefill, *steps], -1), seq)
    assert torch.equal(state, x[..., 6:10])  # the state holds the last 4 inputs
    with pytest.raises(ValueError, match="activation 'gelu'"):
        conv1d_sequence(x, w, None, "gelu")


def test_recurrent_forward_chunked_backward_has_the_chunked_gradient():
    q, k, v, g, beta, state = inputs(requires_grad=True)
    out, final = RecurrentForwardChunkedBackward.apply(
        q, k, v, g, beta, state, True, True, stock.torch_chunk_gated_delta_rule
    )
    value, value_final = recurrent_rule(
        q.detach(), k.detach(), v.detach(), g.detach(), beta.detach(), state.detach(), True, True
    )
    assert torch.equal(out, value) and torch.equal(final, value_final)  # the forward is the recurrent one
    w = torch.randn_like(out)
    ((out * w).sum() + final.square().sum()).backward()
    ours = [x.grad.clone() for x in (q, k, v, g, beta, state)]
    for x in (q, k, v, g, beta, state):
        x.grad = None
    chunk, chunk_final = stock.torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    ((chunk * w).sum() + chunk_final.square().sum()).backward()
    for name, a, x in zip("q k v g beta state".split(), ours, (q, k, v, g, beta, state)):
        torch.testing.assert_close(a, x.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_chunked_backward_recomputes_under_the_forward_s_autocast():
    """A forward under bf16 autocast whose backward runs outside it (as a trainer may call it) gets the gradient
    of the chunked algorithm under autocast, its products in bf16, not of a float32 recomputation."""
    q, k, v, g, beta, state = inputs(requires_grad=True)
    w = torch.randn(B, T, HV, K, generator=torch.Generator().manual_seed(3))
    grads = []
    for fn in (RecurrentForwardChunkedBackward.apply, None):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if fn is None:
                out, _ = stock.torch_chunk_gated_delta_rule(
                    q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
                )
            else:
                out, _ = fn(q, k, v, g, beta, state, True, True, stock.torch_chunk_gated_delta_rule)
        grads.append(torch.autograd.grad((out * w).sum(), (q, k, v, g, beta, state)))
    float32 = torch.autograd.grad(
        (
            RecurrentForwardChunkedBackward.apply(
                q, k, v, g, beta, state, True, True, stock.torch_chunk_gated_delta_rule
            )[0]
            * w
        ).sum(),
        (q, k, v, g, beta, state),
    )
    for name, ours, autocast, plain in zip("q k v g beta state".split(), *grads, float32):
        torch.testing.assert_close(ours, autocast, rtol=1e-5, atol=1e-5, msg=name)
        assert not torch.allclose(ours, plain, rtol=1e-3, atol=1e-3), name  # bf16 products: visibly other


def test_linear_attention_setting_resolves_and_bad_values_name_the_field():
    assert resolve_linear_attention("auto", "batch_invariant") == "recurrent"
    assert resolve_linear_attention("auto", "default") == "chunked"
    assert resolve_linear_attention("recurrent", "default") == "recurrent"
    with pytest.raises(ValueError, match=r"kernels.linear_attention='fused' is not allowed: choose one of"):
        resolve_linear_attention("fused", "default")


def test_gated_norm_is_a_batch_invariant_formula():
    norm = stock.Qwen3_5RMSNormGated(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    assert norm_kernels([norm]) == {stock.Qwen3_5RMSNormGated: "gated"}
    x, gate = torch.randn(5, 8), torch.randn(5, 8)
    torch.testing.assert_close(gated_rms_norm(x, gate, norm.weight, 1e-6), norm(x, gate), rtol=1e-6, atol=1e-6)


def test_recurrent_rule_blocks_of_heads_change_no_bit(monkeypatch):
    import lit_rl.kernels.linear_attention as la

    q, k, v, g, beta, state = inputs()
    assert la.state_block(16, 128, 128) == 16  # a released Qwen3.5 row: 16 heads of 128 x 128, 1 MiB
    assert la.state_block(48, 128, 128) == 16 and la.state_block(4, 16, 16) == 4 and la.state_block(3, 512, 1024) == 1
    whole, whole_final = recurrent_rule(q, k, v, g, beta, state, True, True)
    monkeypatch.setattr(la, "STATE_BLOCK_BYTES", 2 * K * K * 4)  # two heads per block: a row in two blocks
    assert la.state_block(HV, K, K) == 2
    blocked, blocked_final = recurrent_rule(q, k, v, g, beta, state, True, True)
    assert torch.equal(blocked, whole) and torch.equal(blocked_final, whole_final)
    alone, _ = recurrent_rule(q[2:], k[2:], v[2:], g[2:], beta[2:], state[2:], True, True)
    assert torch.equal(alone, whole[2:])
    assert not torch.equal(state, whole_final)  # the caller's initial state is not updated in place


def test_lanewise_ops_give_a_row_alone_the_values_it_has_among_eight():
    """The Gated DeltaNet layer's own elementwise ops (softplus and exp of the decay, sigmoid of the write rate,
    silu) under ``LanewiseOps``: one decode row's 16 heads get exactly the values the same heads get among 8 rows.
    Without the mode, on an AVX-512 CPU, 16 floats are torch's scalar remainder and 128 its vector code: softplus,
    sigmoid and silu differed in the last bit on an Intel Xeon (the hybrid decode-batch test's failure)."""
    from lit_rl.kernels.linear_attention import LanewiseOps

    x = torch.randn(8, 1, 16, generator=torch.Generator().manual_seed(0)) * 3
    ops = {
        "softplus": lambda t: F.softplus(t + 0.5),
        "softplus beta": lambda t: F.softplus(t, beta=2.0, threshold=10.0),
        "sigmoid": lambda t: t.sigmoid(),
        "torch.sigmoid": torch.sigmoid,
        "exp": lambda t: -t.float().exp(),
        "silu": F.silu,
    }
    with LanewiseOps():
        for name, op in ops.items():
            batch = op(x)
            for row in range(8):
                assert torch.equal(op(x[row : row + 1]), batch[row : row + 1]), (name, row)
