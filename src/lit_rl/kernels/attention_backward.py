"""The trainer's attention with torch's forward and an explicit-softmax backward (``kernels.attention_backward``).

In the update every transformer layer's attention runs transformers' ``sdpa`` path: torch's
``scaled_dot_product_attention``, on the CPU its flash kernel, forward and backward. The CPU flash backward is
built for long sequences; at the update's shapes (micro-batches of 16 rows, 40-300 positions, 9 query heads on 3
key/value heads of 64) it took 11x its forward (benchmarks/README.md, issue 34: 19% of the main job's update on an
Intel Xeon). ``ExplicitBackward`` keeps the forward exactly as it was (the same call of transformers' ``sdpa``
attention, so the same output bits: the log-probs, the loss and the engine-trainer gap do not change) and computes
the backward from the saved inputs as batched float32 products:

    S = scale * Q K^T (+ mask),  P = softmax(S),  dV = P^T dO,  dP = dO V^T,
    dS = P * (dP - rowsum(P * dP)),  dQ = scale * dS K,  dK = scale * dS^T Q

(the softmax's standard backward; Dao et al. 2022, Algorithm 2 without the tiling). The query heads that share a
key/value head are one problem of H / KVH x Lq rows, so dK and dV sum over them inside the products. Under autocast
the forward reads its inputs in the autocast dtype; the backward differentiates at those values, in float32, and
returns each gradient in its input's dtype. Its gradients are not the flash backward's bits: on bf16 inputs they
are closer to the float64 gradient (relative error ~1e-7 against the bf16 flash backward's ~3e-3,
``tests/test_attention_backward.py``). It holds a [rows, H, Lq, Lk] float32 score block per chunk of rows
(``CHUNK_BYTES``), so it wins where Lq x Lk is small and loses to the flash kernel's tiling at long sequences.

``kernels.attention_backward``: ``flash`` (the default: torch's backward everywhere), ``explicit`` (this
backward for every trainer attention call with a gradient), ``auto`` (this backward for calls with Lq x Lk at most a
threshold that ``resolve`` measures once per CPU model, torch version, thread count, compute dtype and head shape and
caches in ``<lit_rl cache>/attention_backward.json``, like ``kernels.fp32_gemm``; 0 where it never wins). Only under
``kernels=default`` (the batch-invariant attention has its own backward) and on the CPU (on CUDA torch's flash
backward is the fast one). Calls without a gradient (the engine, scoring passes), with dropout, soft-capping or a
position bias keep transformers' path unchanged.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import Tensor

from ..choices import ATTENTION_BACKWARD_CHOICES as CHOICES

#: float32 score bytes the backward holds at once: rows are taken in chunks of at most this much of S
#: (a block that stays in the CPU's caches; one batch row at least)
CHUNK_BYTES = 4 << 20
#: ``auto`` uses the explicit backward up to the largest measured Lq x Lk where it takes at most
#: 1 / MIN_SPEEDUP of the flash backward's time
MIN_SPEEDUP = 1.1
#: square lengths L (Lq = Lk = L) ``measure`` times, at ``MEASURE_ROWS`` rows of a causal, left-padded batch
MEASURE_LENGTHS = (32, 64, 96, 128, 192, 256, 384, 512)
MEASURE_ROWS = 16

_delegate = None  # the ``sdpa`` attention found in transformers' registry at ``install``
_threshold: int | None = None  # Lq x Lk up to which the explicit backward runs; None: not active


def _grouped_mask(mask: Tensor, kv_heads: int, groups: int, lq: int, lk: int) -> Tensor:
    """``mask`` ([Lq, Lk], [H or 1, Lq, Lk] or [B or 1, H or 1, Lq, >= Lk]: aligned from the right, as SDPA
    broadcasts it) as a 5-D [B or 1, KVH or 1, groups or 1, Lq, Lk] view matching the scores' grouped layout
    (query head h = kv * groups + j, as transformers' ``repeat_kv`` pairs them)."""
    mask = mask[..., :lk]
    if mask.dim() == 2:
        mask = mask[None, None]
    elif mask.dim() == 3:
        mask = mask[None]
    heads = mask.shape[1]
    if heads == 1:
        return mask[:, :, None]
    return mask.reshape(mask.shape[0], kv_heads, groups, lq, lk)


def explicit_grads(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    grad_out: Tensor,
    mask: Tensor | None,
    causal: bool,
    scale: float,
    compiled: bool | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dQ, dK, dV) in float32 of attention ``softmax(scale * Q K^T + mask) V`` at the given values.

    query [B, H, Lq, d], key/value [B, KVH, Lk, d] (H a multiple of KVH), grad_out [B, H, Lq, d] (any float
    dtype). ``mask``: None, or a boolean (True: the key is read) or float additive mask that broadcasts as SDPA's
    does ([Lq, Lk], [H or 1, Lq, Lk], [B or 1, H or 1, Lq, >= Lk]); ``causal`` (with ``mask`` None): SDPA's
    ``is_causal``, query i reads keys up to i (aligned top-left; transformers cuts the keys to Lq first, the same
    function). A query row that reads no key has output 0 and gradient 0 (the flash kernel's convention).
    ``compiled``: lit_rl's C++ kernel (``torch.ops.lit_rl.attention_backward``, ``_compiled_grads``) or torch's
    batched products over rows in chunks of at most ``CHUNK_BYTES`` of scores; None: the kernel where
    ``compiled_serves``. Returns dQ [B, H, Lq, d], dK and dV [B, KVH, Lk, d]. Raises RuntimeError for a mask that
    does not broadcast so."""
    if compiled is None:
        compiled = compiled_serves(query, key, value)
    if compiled:
        return _compiled_grads(query, key, value, grad_out, mask, causal, scale)
    b, h, lq, d = query.shape
    kvh, lk = key.shape[1], key.shape[2]
    groups = h // kvh
    step = max(1, CHUNK_BYTES // max(1, h * lq * lk * 4))
    if mask is None and causal:
        mask = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril()
    mask = _grouped_mask(mask, kvh, groups, lq, lk) if mask is not None else None
    grads = []
    for i in range(0, b, step):
        rows = slice(i, min(b, i + step))
        sub = mask if mask is None or mask.shape[0] == 1 else mask[rows]
        grads.append(_chunk_grads(query[rows], key[rows], value[rows], grad_out[rows], sub, scale, groups))
    return tuple(torch.cat(parts) for parts in zip(*grads))


def _compiled_reads(head_dim: int, dtypes) -> bool:
    """Whether the compiled backward reads a head_dim (a multiple of 16) in ``dtypes`` (float32 or bf16), the
    kernels built (``decode_attention.build``: compiled on first use when a C++ toolchain is there)."""
    if head_dim % 16 or any(dtype not in (torch.float32, torch.bfloat16) for dtype in dtypes):
        return False
    from . import decode_attention

    return decode_attention.build() == ""


def compiled_serves(query: Tensor, key: Tensor, value: Tensor) -> bool:
    """Whether lit_rl's compiled backward takes these operands: on the CPU and ``_compiled_reads``."""
    return query.device.type == "cpu" and _compiled_reads(query.shape[-1], (query.dtype, key.dtype, value.dtype))


def _additive_mask(mask: Tensor, b: int, h: int, lq: int, lk: int) -> Tensor:
    """``mask`` (boolean, True: read; or float additive; broadcasting as SDPA's, see ``explicit_grads``) as the
    kernel's contiguous float32 [B or 1, H or 1, Lq, Lk] additive mask (-inf where a boolean one is False)."""
    mask = mask[..., :lk]
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    rows = b if mask.shape[0] != 1 else 1
    heads = h if mask.shape[1] != 1 else 1
    mask = mask.expand(rows, heads, lq, lk)
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, float("-inf"))
    return mask.to(torch.float32).contiguous()


def _compiled_grads(query, key, value, grad_out, mask, causal, scale):
    """``explicit_grads`` by ``torch.ops.lit_rl.attention_backward`` (``csrc/attention_backward.cpp``): per
    (batch row, key/value head), its grouped query rows' scores, softmax and the five products in float32 inside
    the caches, rows in blocks of 256 KiB of scores. Operands of one dtype (float32 or bf16: widened exactly) go as
    they are; mixed ones are widened to float32. Raises RuntimeError when the kernels cannot be built (why)."""
    from . import decode_attention

    why = decode_attention.build()
    if why:
        raise RuntimeError(f"the compiled attention backward is not available: {why}")
    dtypes = {t.dtype for t in (query, key, value, grad_out)}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    q, k, v, go = (t.to(dtype).contiguous() for t in (query, key, value, grad_out))
    b, h, lq, _ = q.shape
    additive = _additive_mask(mask, b, h, lq, k.shape[2]) if mask is not None else None
    return torch.ops.lit_rl.attention_backward(q, k, v, go, additive, bool(causal and mask is None), float(scale))


def _chunk_grads(q, k, v, go, mask, scale, groups):
    """``explicit_grads`` on one chunk of rows (the mask grouped, ``_grouped_mask``, and sliced to it)."""
    b, h, lq, d = q.shape
    kvh, lk = k.shape[1], k.shape[2]
    qf = q.float().reshape(b, kvh, groups * lq, d)
    kf, vf = k.float(), v.float()
    dof = go.float().reshape(b, kvh, groups * lq, d)
    s = torch.matmul(qf, kf.transpose(-1, -2)).mul_(scale).view(b, kvh, groups, lq, lk)
    if mask is not None and mask.dtype == torch.bool:
        s = s.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        s = s + mask.float()
    top = s.amax(-1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    p = s.sub_(top).exp_()
    p = p.div_(p.sum(-1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny)).view(b, kvh, groups * lq, lk)
    dv = torch.matmul(p.transpose(-1, -2), dof)
    dp = torch.matmul(dof, vf.transpose(-1, -2))
    ds = dp.sub_((p * dp).sum(-1, keepdim=True)).mul_(p)
    dq = torch.matmul(ds, kf).mul_(scale)
    dk = torch.matmul(ds.transpose(-1, -2), qf).mul_(scale)
    return dq.view(b, h, lq, d), dk, dv


class ExplicitBackward(torch.autograd.Function):
    """transformers' ``sdpa`` attention forward (``_delegate``, unchanged) with ``explicit_grads`` as its
    backward. ``apply(module, query, key, value, attention_mask, scaling, is_causal, kwargs)`` returns the output
    [B, Lq, H, d] the delegate returns."""

    @staticmethod
    def forward(ctx, module, query, key, value, attention_mask, scaling, is_causal, kwargs):
        out, _ = _delegate(module, query, key, value, attention_mask, scaling=scaling, is_causal=is_causal, **kwargs)
        device = query.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        read = [t.to(dtype) if dtype is not None and t.is_floating_point() else t for t in (query, key, value)]
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        ctx.causal = bool(attention_mask is None and query.shape[2] > 1 and causal)
        ctx.scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        ctx.dtypes = (query.dtype, key.dtype, value.dtype)
        ctx.save_for_backward(*read, attention_mask)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, mask = ctx.saved_tensors
        with torch.autocast(query.device.type, enabled=False):
            dq, dk, dv = explicit_grads(query, key, value, grad_out.transpose(1, 2), mask, ctx.causal, ctx.scale)
        dq, dk, dv = (g.to(dt) for g, dt in zip((dq, dk, dv), ctx.dtypes))
        return None, dq, dk, dv, None, None, None, None


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' attention-interface contract (query [B, H, Lq, d], key/value [B, KVH, Lk, d]; returns
    ([B, Lq, H, d], None)). Inside an ``active`` block, a call that records a gradient with Lq > 1, Lq x Lk at
    most the threshold, no dropout, soft-capping, position bias or mask that needs a gradient runs
    ``ExplicitBackward``; every other call is
    the delegate's (transformers' ``sdpa``, or whatever was registered under it at ``install``)."""
    lq, lk = query.shape[2], key.shape[2]
    if (
        _threshold is None
        or lq * lk > _threshold
        or lq == 1
        or dropout
        or kwargs.get("softcap") is not None
        or kwargs.get("position_bias") is not None
        or kwargs.get("output_attentions")
        or not torch.is_grad_enabled()
        or (attention_mask is not None and attention_mask.requires_grad)
        or not any(t.requires_grad for t in (query, key, value))
    ):
        return _delegate(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                         is_causal=is_causal, **kwargs)  # fmt: skip
    return ExplicitBackward.apply(module, query, key, value, attention_mask, scaling, is_causal, kwargs), None


def install() -> None:
    """Register ``attention`` as transformers' ``sdpa`` attention, delegating to the one registered before
    (once per process, like transformers' registry; inert outside ``active``)."""
    global _delegate
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if _delegate is not None:  # registered once per process: a second wrap would make the chain a cycle
        return
    _delegate = ALL_ATTENTION_FUNCTIONS["sdpa"]
    AttentionInterface.register("sdpa", attention)


class active:
    """A context manager: the body runs with the explicit backward for trainer attention calls of
    Lq x Lk <= ``threshold`` (``install``ed first; 0: none). Re-enterable (a run enters its kernel mode more than
    once) and nestable; the innermost block still entered decides, whatever order blocks are left in."""

    def __init__(self, threshold: int):
        self.threshold = threshold

    def __enter__(self) -> "active":
        install()
        _entered.append(self)
        _refresh()
        return self

    def __exit__(self, *exc) -> None:
        for i in range(len(_entered) - 1, -1, -1):
            if _entered[i] is self:
                del _entered[i]
                break
        _refresh()


_entered: list[active] = []  # the blocks entered and not yet left, innermost last


def _refresh() -> None:
    global _threshold
    _threshold = _entered[-1].threshold if _entered else None


def _operands(length: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, rows: int = MEASURE_ROWS):
    """Seeded query/key/value/grad tensors and a causal left-padded boolean mask of a micro-batch."""
    gen = torch.Generator().manual_seed(length)
    shape = (rows, heads, length, head_dim)
    q = torch.randn(shape, generator=gen).to(dtype)
    k, v = (torch.randn(rows, kv_heads, length, head_dim, generator=gen).to(dtype) for _ in range(2))
    go = torch.randn(shape, generator=gen).to(dtype)
    pad = torch.randint(0, max(1, length // 4), (rows,), generator=gen)
    keys = torch.arange(length)[None] >= pad[:, None]
    mask = torch.ones(length, length, dtype=torch.bool).tril()[None] & keys[:, None]
    return q, k, v, go, (mask | torch.eye(length, dtype=torch.bool)[None])[:, None]


def measure(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, lengths=MEASURE_LENGTHS) -> dict:
    """{L: flash backward seconds / explicit backward seconds} at ``MEASURE_ROWS`` rows of L positions (a causal,
    left-padded boolean mask; keys and values repeated to the query heads as transformers passes them with a
    mask), best of a few timings each. Stops after two lengths in a row where the explicit one is not ``MIN_SPEEDUP``
    faster."""
    from .fp32_gemm import _best_of

    ratios, slower = {}, 0
    for length in lengths:
        q, k, v, go, mask = _operands(length, heads, kv_heads, head_dim, dtype)
        reps = heads // kv_heads
        leaves = [t.requires_grad_() for t in (q, k.repeat_interleave(reps, 1), v.repeat_interleave(reps, 1))]
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=mask)

        def flash(out=out, leaves=leaves):
            torch.autograd.grad(out, leaves, go, retain_graph=True)

        def explicit(q=q, k=k, v=v, go=go, mask=mask):
            explicit_grads(q, k, v, go, mask, False, head_dim**-0.5)

        seconds = max(0.02, 0.002 * length * length / 1024)
        ratios[length] = _best_of(flash, seconds) / max(_best_of(explicit, seconds), 1e-12)
        slower = slower + 1 if ratios[length] < MIN_SPEEDUP else 0
        if slower >= 2:
            break
    return ratios


def threshold_from(ratios: dict) -> int:
    """Lq x Lk up to which ``auto`` runs the explicit backward: L^2 of the longest L before the first one where
    it is not ``MIN_SPEEDUP`` faster (0 when the shortest is not)."""
    best = 0
    for length in sorted(ratios):
        if ratios[length] < MIN_SPEEDUP:
            break
        best = length * length
    return best


#: (cache file, key, timer) -> (ratios, why) of each timing this process took: a timing not written to the cache
#: (other processes were busy) is not taken again by the next run in the same process
_measured: dict = {}


def _cache_file() -> Path:
    from ..models import cache_dir

    return cache_dir() / "attention_backward.json"


def head_shape(model: torch.nn.Module) -> tuple[int, int, int] | None:
    """(query heads, key/value heads, head_dim) of ``model``'s attention (its text config), or None when it
    does not say."""
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        return None
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return int(heads), int(kv_heads), int(head_dim)


def implementation(model: torch.nn.Module, dtype: torch.dtype) -> str:
    """Which explicit backward serves ``model``'s attention computed in ``dtype``: "compiled <build folder>"
    (lit_rl's kernel, built for this CPU: a changed source is another folder, so ``auto`` times it again) or
    "torch's products" (head_dim not a multiple of 16, a dtype other than float32 / bf16, or no C++ toolchain:
    ``decode_attention.build``'s reason), as ``compiled_serves`` decides per call."""
    from . import decode_attention

    shape = head_shape(model)
    if shape is not None and _compiled_reads(shape[2], (dtype,)):
        return f"compiled {decode_attention.build_dir().name}"
    return "torch's products"


def _serves(model: torch.nn.Module) -> bool:
    """Whether ``model`` runs its attention through transformers' ``sdpa`` on the CPU (what ``attention`` serves)."""
    params = next(iter(model.parameters()), None)
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return params is not None and params.device.type == "cpu" and impl == "sdpa"


def resolve(
    setting: str, model: torch.nn.Module, dtype: torch.dtype, cache: Path | None = None, timer=measure
) -> tuple[int, str]:
    """(threshold on Lq x Lk, why) for ``kernels.attention_backward`` = ``setting``, ``model`` and the compute
    dtype of its attention (bf16 under bf16-mixed autocast). ``flash``: 0. ``explicit``: unbounded. ``auto``:
    ``threshold_from`` the ratios ``timer`` (default ``measure``, 2-10 s) gives on the model's head shape at the
    current thread count, cached in ``<lit_rl cache>/attention_backward.json`` under the CPU model, torch
    version, threads, dtype, head shape and implementation (delete it to measure again); a timing during which
    other processes used more than a tenth of a core is not cached there, only kept for later runs in this process
    (``_measured``). Raises ValueError for another ``setting``."""
    if setting not in CHOICES:
        raise ValueError(f"kernels.attention_backward={setting!r} is not allowed: choose one of {list(CHOICES)}")
    if setting == "flash":
        return 0, "kernels.attention_backward=flash"
    if setting == "explicit" and _serves(model):
        why = f"the explicit-softmax backward ({implementation(model, dtype)}) for every length"
        return 1 << 62, f"kernels.attention_backward=explicit: {why}"
    if not _serves(model):
        impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
        return 0, (
            f"kernels.attention_backward={setting}: not used (it serves transformers' sdpa attention on the CPU; "
            f"this model's attention is {impl!r}, model.attn_implementation)"
        )
    shape = head_shape(model)
    if shape is None:
        return 0, "kernels.attention_backward=auto: flash (the model's config gives no attention head shape)"
    from ..run.hardware import cpu_model, keep_if_alone, read_cache, timed_alone

    impl = implementation(model, dtype)
    key = "|".join([cpu_model(), f"torch {torch.__version__}", f"threads={torch.get_num_threads()}",
                    str(dtype).removeprefix("torch."), "heads={}/{}x{}".format(*shape), impl])  # fmt: skip
    cache = _cache_file() if cache is None else cache
    cached = read_cache(cache)
    if key in cached:
        ratios, when = (
            {int(k): v for k, v in cached[key]["ratios"].items()},
            f"cached, measured {cached[key]['measured']}",
        )
    elif (cache, key, timer) in _measured:  # timed on a busy machine earlier in this process (a sweep, the tests)
        ratios, when = _measured[cache, key, timer]
        when = f"{when}; kept from earlier in this process"
    else:
        ratios, others = timed_alone(timer, *shape, dtype)
        entry = {"ratios": ratios, "measured": time.strftime("%Y-%m-%d %H:%M")}
        when = keep_if_alone(cache, cached, key, entry, others, verb="measured")
        _measured[cache, key, timer] = ratios, when
    threshold = threshold_from(ratios)
    shown = ", ".join(f"L={n}: {r:.2f}x" for n, r in sorted(ratios.items()))
    where = f"Lq x Lk <= {threshold} ({int(threshold**0.5)}^2)" if threshold else "no call (flash everywhere)"
    return (
        threshold,
        f"kernels.attention_backward=auto: explicit backward ({impl}) for {where}; speed over flash {shown}; {when}",
    )
