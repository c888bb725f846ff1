"""One algorithm for Gated DeltaNet layers on both sides (``kernels.linear_attention``: auto | chunked | recurrent).

Qwen3.5, Qwen3.5-MoE and Qwen3-Next mix full-attention layers with Gated DeltaNet layers (Yang et al. 2024,
arXiv 2412.06464): per head a state S [K, V] that decays by exp(g_t), is corrected toward v_t along k_t with
rate beta_t (the delta rule) and read by q_t:

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - S'_t^T k_t))^T,   S'_t = exp(g_t) S_{t-1},   o_t = S_t^T q_t

transformers computes it two ways: a full forward (the trainer, the engine's prefill) runs the chunked algorithm
(64-token chunks, triangular solves, matrix products), a cached decode step the recurrent one (one token at a
time); the causal conv1d before it likewise has a sequence form and a decode form. Same function, other rounding:
the engine's log-probs differ from the trainer's by ~1e-6 in float32 with identical weights, under any kernels
(the documents' fix table, Qwen3.5 row). ``recurrent`` mode runs the recurrent algorithm and the conv's
shift-and-add form on every forward (trainer, engine prefill, engine decode); the trainer's backward is the
chunked algorithm's vector-Jacobian product (``RecurrentForwardChunkedBackward``), so the forward matches the
engine bit for bit and the backward stays the fast one. ``auto`` is recurrent under ``kernels=batch_invariant``,
chunked otherwise. The mode replaces the four functions in the modeling module of each Gated DeltaNet class it
finds (``LinearAttentionKernels``) and puts them back on exit.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F
from torch import Tensor

from ..choices import LINEAR_ATTENTION_CHOICES

#: the modeling-module functions the recurrent mode replaces
PATCHED = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)


#: float32 lanes of the widest CPU vector (AVX-512): torch computes an elementwise op's trailing elements beyond
#: a whole number of vectors with its scalar code, whose exp/log may differ from the vector code in the last bit
VECTOR_FLOATS = 16


def resolve_linear_attention(setting: str, kernels: str) -> str:
    """``kernels.linear_attention`` under kernel mode ``kernels`` -> chunked | recurrent (auto: recurrent under
    batch_invariant, else chunked). Raises ValueError naming the field for another value."""
    if setting not in LINEAR_ATTENTION_CHOICES:
        raise ValueError(
            f"kernels.linear_attention={setting!r} is not allowed: choose one of {list(LINEAR_ATTENTION_CHOICES)}"
        )
    if setting == "auto":
        return "recurrent" if kernels == "batch_invariant" else "chunked"
    return setting


def lanewise(fn, x: Tensor) -> Tensor:
    """``fn`` (an elementwise op such as exp, rsqrt, silu) of ``x`` computed so each element takes torch's vector
    code whatever x's shape: on x flattened, contiguous and zero-padded to a multiple of 2 x ``VECTOR_FLOATS`` x
    the thread count (torch's loops step two vectors at a time, split across threads, and finish a remainder with
    scalar code whose exp/log may differ in the last bit). Returns x's shape."""
    flat = x.reshape(-1)
    n = flat.numel()
    pad = -n % (2 * VECTOR_FLOATS * torch.get_num_threads())
    return fn(F.pad(flat, (0, pad)) if pad else flat.contiguous())[:n].view(x.shape)


class LanewiseOps(torch.overrides.TorchFunctionMode):
    """Torch-function mode: the elementwise ops transformers' Gated DeltaNet layers compute outside the replaced
    functions (softplus and exp of the decay, sigmoid of the write rate, silu) run ``lanewise``, so each value takes
    torch's vector code whatever the batch. Without it a decode step's [1, 1, heads] values fell in the scalar
    remainder (on an AVX-512 CPU torch steps 32 floats at a time, so 16 heads were all remainder) while the same
    row among 8 was vectorised: softplus, sigmoid and silu differ there in the last bit (exp happened not to)."""

    OPS = frozenset({torch.sigmoid, torch.Tensor.sigmoid, torch.exp, torch.Tensor.exp, F.silu, F.softplus})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        if (
            func in self.OPS
            and isinstance(x, Tensor)
            and x.device.type == "cpu"
            and x.is_floating_point()
            and not kwargs.get("inplace", False)
            and not any(isinstance(a, Tensor) for a in (*args[1:], *kwargs.values()))
        ):
            return lanewise(lambda t: func(t, *args[1:], **kwargs), x)
        return func(*args, **kwargs)


def _lanewise_forward(forward):
    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        with LanewiseOps():
            return forward(*args, **kwargs)

    wrapper.lanewise_of = forward
    return wrapper


def _shift_add_conv(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None, out_len: int) -> Tensor:
    """Depthwise causal conv1d of ``x`` [B, C, L] (L >= out_len + W - 1) with ``weight`` [C, W] for the last
    ``out_len`` positions, as W shifted multiply-adds in a fixed order (tap 0 first): each output is the same
    float operations whatever B, L or out_len (F.conv1d picks its algorithm by shape). Computed in the weight's
    dtype; returns [B, C, out_len] in x's dtype, SiLU applied when ``activation`` is silu/swish."""
    width, length = weight.shape[-1], x.shape[-1]
    h = x.to(weight.dtype)
    start = length - out_len - (width - 1)
    out = h[..., start : start + out_len] * weight[:, 0, None]
    for j in range(1, width):
        out = out + h[..., start + j : start + j + out_len] * weight[:, j, None]
    if bias is not None:
        out = out + bias[:, None]
    if activation in ("silu", "swish"):
        out = lanewise(F.silu, out)
    elif activation is not None:
        raise ValueError(f"linear-attention conv activation {activation!r}: the recurrent mode serves silu")
    return out.to(x.dtype)


def conv1d_sequence(hidden_states: Tensor, weight: Tensor, bias: Tensor | None = None, activation=None, **_) -> Tensor:
    """The conv over a whole sequence (transformers' ``causal_conv1d_fn``), in ``_shift_add_conv``'s form:
    hidden_states [B, C, T] left-padded with W - 1 zeros, weight [C, W]; returns [B, C, T]."""
    t = hidden_states.shape[-1]
    return _shift_add_conv(F.pad(hidden_states, (weight.shape[-1] - 1, 0)), weight, bias, activation, t)


def conv1d_step(hidden_states: Tensor, conv_state: Tensor, weight: Tensor, bias=None, activation=None) -> Tensor:
    """The conv's decode form (transformers' ``causal_conv1d_update``): hidden_states [B, C, T] continue
    ``conv_state`` [B, C, S] (updated in place to the last S inputs); returns [B, C, T]."""
    full = torch.cat([conv_state, hidden_states], dim=-1).to(weight.dtype)
    conv_state.copy_(full[..., -conv_state.shape[-1] :])
    return _shift_add_conv(full, weight, bias, activation, hidden_states.shape[-1]).to(hidden_states.dtype)


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * lanewise(torch.rsqrt, (x * x).sum(dim=-1, keepdim=True) + eps)


#: bytes of float32 recurrent state one block of the token loop updates (``recurrent_rule``): one row of a released
#: Qwen3.5 (16 value heads of 128 x 128) is 1 MiB, which stays in a core's L2/L3 across the token's five passes
STATE_BLOCK_BYTES = 1 << 20


def state_block(heads: int, key_dim: int, value_dim: int) -> int:
    """Heads per block of ``recurrent_rule``'s token loop: the largest divisor of ``heads`` whose float32 state
    (block x key_dim x value_dim x 4 bytes) fits ``STATE_BLOCK_BYTES``, at least 1. A function of the model's
    shape only, so the engine's decode, its prefill and the trainer run the same block shapes."""
    per_head = key_dim * value_dim * 4
    return max(g for g in range(1, heads + 1) if heads % g == 0 and (g == 1 or g * per_head <= STATE_BLOCK_BYTES))


def recurrent_rule(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **_,
) -> tuple[Tensor, Tensor | None]:
    """The gated delta rule one token at a time (the recurrent algorithm), with transformers' arguments.

    query/key [B, T, Hk, K], value [B, T, Hv, V], g (log decay, <= 0) and beta [B, T, Hv], initial_state
    [B, Hv, K, V] or None (zeros). Returns (output [B, T, Hv, V] in query's dtype, final state [B, Hv, K, V]
    float32 or None). Float32 throughout. The B x Hv heads are walked in blocks of ``state_block`` heads of one
    row, each block through all T tokens before the next (its state stays in cache; one preallocated scratch
    buffer, no allocation of state size per token); each token's step is elementwise products and sums over K
    of the block's [G, K, V] state (no matrix product, no reduction across heads or rows), every call of the
    same [G, K, V] shape. So a row's values do not depend on B, and a T-token call computes exactly what T
    one-token calls (the engine's decode) compute.
    """
    dtype = query.dtype
    hk, hv = key.shape[2], value.shape[2]
    if hk != hv:
        query, key = query.repeat_interleave(hv // hk, dim=2), key.repeat_interleave(hv // hk, dim=2)
    query, key, value, beta, g = (x.to(torch.float32) for x in (query, key, value, beta, g))  # [B, T, H, ...]
    if use_qk_l2norm_in_kernel:
        query, key = _l2norm(query), _l2norm(key)
    query = query / (query.shape[-1] ** 0.5)
    b, t, h, k = key.shape
    v_dim = value.shape[-1]
    block = state_block(h, k, v_dim)
    n = b * h // block

    def blocks(x: Tensor) -> Tensor:  # [B, T, H, ...] -> [n, T, block, ...], a row's heads in h // block blocks
        return x.transpose(0, 1).reshape(t, n, block, *x.shape[3:]).transpose(0, 1).contiguous()

    query, key, value = blocks(query), blocks(key)[..., None], blocks(value)
    decay, beta = blocks(lanewise(torch.exp, g))[..., None, None], blocks(beta)[..., None]
    shape = (b, h, k, v_dim)
    state = value.new_zeros(shape) if initial_state is None else initial_state.to(value, copy=True).reshape(shape)
    state = state.contiguous().view(n, block, k, v_dim)
    out, scratch, read = (
        value.new_empty(n, t, block, v_dim),
        value.new_empty(block, k, v_dim),
        value.new_empty(block, v_dim),
    )
    for j in range(n):
        s, q_j, k_j, v_j, decay_j, beta_j, out_j = (
            state[j],
            query[j, ..., None],
            key[j],
            value[j],
            decay[j],
            beta[j],
            out[j],
        )
        for i in range(t):
            s.mul_(decay_j[i])
            torch.sum(torch.mul(s, k_j[i], out=scratch), dim=-2, out=read)  # S^T k
            delta = (v_j[i] - read).mul_(beta_j[i])
            s.addcmul_(k_j[i], delta[:, None, :])  # S += k delta^T, without a [G, K, V] temporary
            torch.sum(torch.mul(s, q_j[i], out=scratch), dim=-2, out=out_j[i])  # S^T q
    out = out.transpose(0, 1).reshape(t, b, h, v_dim).transpose(0, 1)
    return out.to(dtype).contiguous(), (state.view(shape) if output_final_state else None)


class RecurrentForwardChunkedBackward(torch.autograd.Function):
    """Value of the recurrent algorithm (``recurrent_rule``), vector-Jacobian product of the chunked one: the
    backward recomputes ``chunked`` (transformers' chunked gated delta rule, same arguments) with gradients and
    differentiates it. Both compute the same function, so the gradient is the chunked algorithm's autograd
    gradient up to float32 rounding; the forward is bit for bit the engine's. The recomputation runs under the
    autocast state of the forward (a backward called outside ``torch.autocast`` still differentiates the bf16
    products the chunked forward would have run). Inputs as ``recurrent_rule``."""

    @staticmethod
    def forward(ctx, query, key, value, g, beta, initial_state, output_final_state, l2norm, chunked):
        ctx.chunked, ctx.l2norm, ctx.output_final_state = chunked, l2norm, output_final_state
        device = query.device.type  # the backward recomputes under the forward's autocast, as a checkpoint does
        ctx.autocast = device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
        ctx.save_for_backward(query, key, value, g, beta, initial_state)
        out, final = recurrent_rule(query, key, value, g, beta, initial_state, output_final_state, l2norm)
        return out, final

    @staticmethod
    def backward(ctx, grad_out, grad_final):
        inputs = [x.detach().requires_grad_(x.requires_grad) if x is not None else None for x in ctx.saved_tensors]
        device, enabled, dtype = ctx.autocast
        with torch.enable_grad():
            with torch.autocast(device, dtype=dtype, enabled=enabled):  # the forward's, the backward's own after
                out, final = ctx.chunked(
                    *inputs[:5],
                    initial_state=inputs[5],
                    output_final_state=ctx.output_final_state,
                    use_qk_l2norm_in_kernel=ctx.l2norm,
                )
            outputs, grads = [out], [grad_out]
            if final is not None and grad_final is not None:
                outputs.append(final)
                grads.append(grad_final)
            wanted = [x for x in inputs if x is not None and x.requires_grad]
            found = iter(torch.autograd.grad(outputs, wanted, grads, allow_unused=True) if wanted else [])
        result = [next(found) if x is not None and x.requires_grad else None for x in inputs]
        return (*result, None, None, None)


def _recurrent_with_chunked_backward(chunked):
    """The function installed as the modeling module's chunked rule in recurrent mode (``chunked``: the stock
    one, for the backward)."""

    def rule(query, key, value, g, beta, initial_state=None, output_final_state=False, **kwargs):
        use_qk_l2norm_in_kernel = kwargs.get("use_qk_l2norm_in_kernel", False)
        tensors = (query, key, value, g, beta, initial_state)
        if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors):
            return RecurrentForwardChunkedBackward.apply(*tensors, output_final_state, use_qk_l2norm_in_kernel, chunked)
        return recurrent_rule(*tensors, output_final_state, use_qk_l2norm_in_kernel)

    return rule


def check_vector_width(*models: torch.nn.Module) -> None:
    """ValueError naming ``linear_num_value_heads`` when a Gated DeltaNet model's value-head count is not a
    multiple of ``VECTOR_FLOATS``. The first cause found, the decay and write rate (softplus, exp, sigmoid on
    [B, T, heads], computed by transformers outside the kernels) ending in torch's scalar tail, is removed by
    ``LanewiseOps``; a tiny Qwen3.5 with 4 value heads still gave engine log-probs unequal to the trainer's in
    float32 with it (Intel Xeon, AVX-512, 2026-12-03; 16 heads equal), cause not found, so the refusal stays.
    Every released Qwen3.5 / Qwen3-Next has 16-64."""
    for model in models:
        config = getattr(model, "config", None)
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        heads = getattr(text, "linear_num_value_heads", None)
        if gated_deltanet_modules(model) and heads and heads % VECTOR_FLOATS:
            raise ValueError(
                f"kernels=batch_invariant with linear_attention=recurrent needs linear_num_value_heads to be a "
                f"multiple of {VECTOR_FLOATS} ({type(model).__name__} has {heads}): the decay and write rate of a "
                "decode step would take torch's scalar path; use kernels=default for this model"
            )


def _layer_classes(source) -> list[type]:
    """The Gated DeltaNet layer classes defined in the modeling module ``source`` (their forward is wrapped in
    ``LanewiseOps`` by the recurrent mode)."""
    return [
        cls
        for name, cls in vars(source).items()
        if isinstance(cls, type) and name.endswith("GatedDeltaNet") and issubclass(cls, torch.nn.Module)
    ]


def gated_deltanet_modules(*models: torch.nn.Module) -> list:
    """The Python modules that define the Gated DeltaNet layer classes of ``models`` (classes named
    ``*GatedDeltaNet`` whose module has the four ``PATCHED`` functions), in order, without repeats."""
    found = []
    for model in models:
        for module in model.modules():
            name = type(module).__name__
            source = sys.modules.get(type(module).__module__)
            if name.endswith("GatedDeltaNet") and source not in found and all(hasattr(source, f) for f in PATCHED):
                found.append(source)
    return found


class LinearAttentionKernels:
    """Context manager: ``mode`` (chunked | recurrent, ``resolve_linear_attention``) for the Gated DeltaNet
    layers of ``models``. chunked changes nothing; recurrent installs, in each defining module
    (``gated_deltanet_modules``), the recurrent rule for both rules (with the chunked backward where a gradient
    is needed) and the conv's shift-and-add form for both conv forms, and runs the layer classes' forward under
    ``LanewiseOps``. Every model of the run shares the
    classes, so an engine's own copy follows. Raises ValueError for another mode."""

    def __init__(self, mode: str, *models: torch.nn.Module):
        if mode not in ("chunked", "recurrent"):
            raise ValueError(f"linear-attention mode {mode!r}: choose chunked or recurrent")
        self.mode, self.modules = mode, gated_deltanet_modules(*models) if mode == "recurrent" else []
        self._saved: list[tuple[object, dict]] = []
        self._classes: list[tuple[type, object]] = []

    def __enter__(self) -> "LinearAttentionKernels":
        for source in self.modules:
            saved = {name: getattr(source, name) for name in PATCHED}
            self._saved.append((source, saved))
            rule = _recurrent_with_chunked_backward(saved["torch_chunk_gated_delta_rule"])
            source.torch_chunk_gated_delta_rule = rule
            source.torch_recurrent_gated_delta_rule = rule
            source.causal_conv1d_fn = conv1d_sequence
            source.causal_conv1d_update = conv1d_step
            for cls in _layer_classes(source):
                self._classes.append((cls, cls.forward))
                cls.forward = _lanewise_forward(cls.forward)
        return self

    def __exit__(self, *exc) -> None:
        for source, saved in reversed(self._saved):
            for name, value in saved.items():
                setattr(source, name, value)
        for cls, forward in reversed(self._classes):
            cls.forward = forward
        self._saved.clear()
        self._classes.clear()
