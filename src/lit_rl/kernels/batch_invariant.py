"""Batch-invariant CPU kernels: a token's numbers do not depend on which rows share its forward pass.

Why: the rollout engine decodes one token per sequence among whichever sequences are still running, the
trainer scores whole sequences in micro-batches of its own choosing. Floating-point addition is not
associative (SPEC.md test vector 12), and a kernel whose reduction order depends on the shape of the call
gives the same token a slightly different log-prob in each. With the kernels below, every reduction that
produces a token's log-prob runs in an order fixed by that token's own sequence, so the engine's
``rollout_logprobs`` equal the trainer's ``old_logprobs`` bit for bit before the first update
(``tests/test_batch_invariant.py``). Sources: Thinking Machines, "Defeating Nondeterminism in LLM
Inference" (2025) and its ``batch_invariant_ops`` (GEMM with a fixed tiling, RMSNorm and log-softmax per
row, attention with a fixed split over keys); the seeds in ``../shared/seeds/`` (the slides' table of
batch-variant ops, the article's "bitwise consistency" section on vLLM's batch-invariant mode).

What each kernel fixes, as measured on this project's CPU (torch 2.13, MKL, 2 threads, SmolLM2-135M shapes):

* **matrix products** (``aten::mm``, ``aten::addmm`` for the CPU dispatch key): float32 products of fewer
  than 12 rows take MKL's small-matrix paths, whose rows differ from the same rows in a larger product
  (1, 2, 3, 5, 6, 7, 9, 10 and 11 rows did); from 12 rows up every row of ``x @ W.T`` equalled the same row
  of a 2048-row product. A product of fewer than ``MIN_GEMM_ROWS`` rows is computed on a zero-padded block
  of ``MIN_GEMM_ROWS`` rows, so every call runs the blocked kernel whose per-row reduction over K does not
  depend on M. (Measured equal, bit for bit, to a strict fixed partition into 16-row blocks, which costs
  up to 30% more on the update's 1600-row products.) bfloat16 products (oneDNN, AVX512-BF16) were
  invariant at every size and pass through.
* **RMSNorm**: each row's mean of squares is a float32 reduction over that row alone (never split across
  rows or threads; a single row is computed inside a block of two). Installed on the model's RMSNorm
  classes, so a fused kernel that a transformers version may swap in never replaces it.
* **log-softmax** (``aten::_log_softmax``, CPU): a contiguous [rows, V] layout, reduced per row (a lone row
  padded to two), whatever view the caller passes.
* **attention** (``attention`` + ``attention_mask``, registered in transformers' ``AttentionInterface`` and
  ``AttentionMaskInterface`` as ``"batch_invariant"``): one function for the trainer's full-sequence
  forward, the engine's prefill and its one-token decode. Keys and values are re-laid out so that each
  sequence's first real token sits at index 0 (left padding removed), cut into blocks of ``KEY_BLOCK``
  keys; the scores of a query against a block are one float32 [rows, d] x [d, KEY_BLOCK] product of at
  least ``MIN_QUERY_ROWS`` rows; softmax uses the exact row maximum, and the value sums are accumulated
  block after block in key order. A query's numbers are therefore a function of its own sequence's real
  keys only: the amount of left padding, the keys after it (masked to exact zeros) and the other queries
  of the call cannot change them.

Sampling is already per sequence (``rollout.torch_engine.sample_rows``: one seeded generator per row).

CUDA is not covered here: on GPUs the same guarantees need GPU kernels — Thinking Machines'
``batch_invariant_ops`` (``set_batch_invariant_mode()``: Triton GEMM with a fixed tiling, log-softmax and
mean per row) for the trainer and vLLM's batch-invariant mode (``VLLM_BATCH_INVARIANT=1``) for a vLLM
sampler. ``enable`` raises for a model on any device other than the CPU rather than pretend.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

NAME = "batch_invariant"
#: float32 products with fewer rows than this run on a zero-padded block of this many rows
MIN_GEMM_ROWS = 16
#: keys per attention block (the fixed split over keys; the N of every score product)
KEY_BLOCK = 64
#: query rows per attention product at least (float32 bmm of few rows takes MKL's small-matrix paths, as mm:
#: with a batch of one, 1-3, 5-7 and 9-11 rows differ from larger products; with larger batches 1-3 rows)
MIN_QUERY_ROWS = MIN_GEMM_ROWS


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    out = x.new_zeros((rows, *x.shape[1:]))
    out[: x.shape[0]] = x
    return out


# -- matrix products ---------------------------------------------------------------------------------
def mm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for a [M, K] and b [K, N] (any float dtype) whose rows do not depend on M.

    float32 with M < ``MIN_GEMM_ROWS``: computed on a zero-padded [MIN_GEMM_ROWS, K] block, the rows cut
    back out. Other dtypes and larger M: the native kernel (``aten::mm.out``, not the overridden op).
    Returns [M, N] in the inputs' dtype.
    """
    m = a.shape[0]
    if a.is_floating_point() and 0 < m < MIN_GEMM_ROWS:
        out = a.new_empty((MIN_GEMM_ROWS, b.shape[1]))
        torch.ops.aten.mm.out(_pad_rows(a, MIN_GEMM_ROWS), b, out=out)
        return out[:m].clone()
    out = a.new_empty((m, b.shape[1]))
    return torch.ops.aten.mm.out(a, b, out=out)


def addmm(bias: Tensor, a: Tensor, b: Tensor, *, beta=1, alpha=1) -> Tensor:
    """``beta * bias + alpha * (a @ b)`` with ``mm``'s row guarantee (bias broadcast to [M, N])."""
    m = a.shape[0]
    if a.is_floating_point() and 0 < m < MIN_GEMM_ROWS:
        if bias.dim() == 2 and bias.shape[0] == m and m > 1:  # a per-row bias: pad it with the rows
            bias = _pad_rows(bias, MIN_GEMM_ROWS)
        out = a.new_empty((MIN_GEMM_ROWS, b.shape[1]))
        torch.ops.aten.addmm.out(bias, _pad_rows(a, MIN_GEMM_ROWS), b, beta=beta, alpha=alpha, out=out)
        return out[:m].clone()
    out = a.new_empty((m, b.shape[1]))
    return torch.ops.aten.addmm.out(bias, a, b, beta=beta, alpha=alpha, out=out)


# -- row reductions ----------------------------------------------------------------------------------
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama's RMSNorm, row by row: ``weight * (x / sqrt(mean(x**2, -1) + eps)).to(x.dtype)``.

    x: [..., H] any float dtype; weight: [H]; returns x's shape, in the dtype of ``weight * x`` (as
    transformers' ``LlamaRMSNorm``). The mean of squares is a float32 reduction over each row's own H
    values on a contiguous [rows, H] layout; a single row is reduced inside a block of two, so torch never
    splits one row's sum across threads.
    """
    dtype = x.dtype
    h = x.to(torch.float32)
    rows = h.reshape(-1, h.shape[-1]).contiguous()
    n = rows.shape[0]
    if n == 1:
        rows = _pad_rows(rows, 2)
    variance = rows.pow(2).mean(-1, keepdim=True)[:n].reshape(*h.shape[:-1], 1)
    return weight * (h * torch.rsqrt(variance + eps)).to(dtype)


def _rms_norm_forward(self, hidden_states: Tensor) -> Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def log_softmax(x: Tensor, dim: int = -1, half_to_float: bool = False) -> Tensor:
    """log-softmax over ``dim`` computed per row on a contiguous [rows, V] layout (a lone row padded to two).

    x: any shape and float dtype; returns x's shape (float32 when ``half_to_float``). This is the CPU
    kernel behind ``F.log_softmax`` in batch-invariant mode (it calls the native ``_log_softmax.out``).
    """
    dim = dim % x.dim() if x.dim() else 0
    moved = x.movedim(dim, -1)
    rows = moved.reshape(-1, moved.shape[-1]).contiguous() if moved.dim() else moved.reshape(1, 1)
    n = rows.shape[0]
    if n == 1:
        rows = _pad_rows(rows, 2)
    out_dtype = torch.float32 if half_to_float and x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    out = rows.new_empty(rows.shape, dtype=out_dtype)
    torch.ops.aten._log_softmax.out(rows, -1, half_to_float, out=out)
    return out[:n].reshape(moved.shape).movedim(-1, dim)


# -- attention ---------------------------------------------------------------------------------------
def attention_mask(*args, **kwargs):
    """The mask function registered beside ``attention``: transformers' boolean [B, 1, Lq, Lk] mask (True =
    attend), always materialised (never None for "use is_causal"), so padding is always visible to
    ``attention``. Without a registered mask function transformers would call the attention unmasked."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


_last_ranges: list = []  # (mask, b, lq, lk, result) of the last call: every layer of a forward shares one mask


def _key_ranges(mask: Tensor | None, b: int, lq: int, lk: int, device) -> tuple[Tensor, Tensor]:
    """(shift [B], count [B, Lq]): each sequence's first real key and the number of keys each query sees.

    Raises ValueError when a query's visible keys are not one contiguous range starting at its sequence's
    first real key (left/right padding plus causal masking always are; sliding windows or packed sequences
    are not supported). The result for the mask object of the previous call is reused (all layers of one
    forward receive the same mask tensor).
    """
    if _last_ranges and _last_ranges[0][0] is mask and mask is not None and _last_ranges[0][1:4] == (b, lq, lk):
        return _last_ranges[0][4]
    result = _compute_key_ranges(mask, b, lq, lk, device)
    _last_ranges[:] = [(mask, b, lq, lk, result)]
    return result


def _compute_key_ranges(mask: Tensor | None, b: int, lq: int, lk: int, device) -> tuple[Tensor, Tensor]:
    if mask is None:  # causal, no padding: query i (at kv index lk - lq + i) sees keys 0..lk-lq+i
        count = (torch.arange(lq, device=device) + (lk - lq + 1)).expand(b, lq)
        return torch.zeros(b, dtype=torch.long, device=device), count
    if mask.dtype != torch.bool:  # an additive float mask: 0 = attend, -inf/min = masked
        mask = mask == 0
    mask = mask[:, 0].expand(b, lq, lk)
    count = mask.sum(-1)
    first = mask.to(torch.int8).argmax(-1)
    seen = count > 0
    big = torch.full_like(first, lk)
    shift = torch.where(seen, first, big).amin(-1).clamp(max=lk - 1)
    keys = torch.arange(lk, device=device)
    rebuilt = (keys >= shift[:, None, None]) & (keys < (shift[:, None] + count)[..., None])
    if not torch.equal(rebuilt, mask):
        raise ValueError("batch-invariant attention needs causal masks with left/right padding: each query must "
                         "see one contiguous range of keys starting at its sequence's first real token "
                         "(sliding windows and packed sequences are not supported)")
    return shift, count


def attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
              scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """Scaled dot-product attention whose output for a query depends only on its own sequence's real keys.

    query: [B, H, Lq, d]; key, value: [B, KVH, Lk, d] (H a multiple of KVH: grouped-query attention);
    attention_mask: the boolean [B, 1, Lq, Lk] mask of ``attention_mask`` (or an additive float mask, or
    None for plain causal). Any float dtype; computed in float32 with autocast off, returned in query's
    dtype as [B, Lq, H, d] (transformers' attention-interface contract), with None for the weights.
    ``dropout`` must be 0 (RL scoring and sampling use none). Fully masked queries (left padding) get 0.

    The same call serves the trainer (Lq = Lk, causal), the engine's prefill, and its decode (Lq = 1
    against the KV cache), and gives a query bit-identical outputs in all three: see the module docstring.
    Raises ValueError for masks that are not causal-with-padding and for dropout > 0.
    """
    if dropout:
        raise ValueError("batch-invariant attention has no dropout; got dropout > 0")
    b, h, lq, d = query.shape
    kvh, lk = key.shape[1], key.shape[2]
    rep = h // kvh
    scale = scaling if scaling is not None else 1.0 / math.sqrt(d)
    device = query.device
    with torch.autocast(device_type=device.type, enabled=False):
        shift, count = _key_ranges(attention_mask, b, lq, lk, device)
        nblk = -(-max(int(count.max()), 1) // KEY_BLOCK)
        width = nblk * KEY_BLOCK
        bh = b * kvh
        # keys/values re-laid out from each sequence's first real token (index j = real position j), as
        # [B*KVH * width, d] rows picked from the cache. Positions past the cache's end repeat its last key:
        # they lie beyond every query's visible count, so their scores are masked to -inf and their
        # probabilities are exactly 0 (times a finite value: exactly 0)
        pos = (shift[:, None] + torch.arange(width, device=device)).clamp(max=lk - 1)  # [B, width]
        rows = ((torch.arange(bh, device=device) * lk)[:, None] + pos.repeat_interleave(kvh, dim=0)).reshape(-1)
        k = key.reshape(bh * lk, d).index_select(0, rows).view(bh, nblk, KEY_BLOCK, d).float()
        v = value.reshape(bh * lk, d).index_select(0, rows).view(bh, nblk, KEY_BLOCK, d).float()
        # the query heads sharing a key/value head are rows of one product: [B*KVH, rows, d], padded to
        # MIN_QUERY_ROWS rows; one [rows, d] x [d, KEY_BLOCK] product per key block (batched over blocks)
        n_rows = rep * lq
        m = max(n_rows, MIN_QUERY_ROWS)
        q = query.float().reshape(bh, n_rows, d)
        visible = count[:, None, None, :].expand(b, kvh, rep, lq).reshape(bh, n_rows)
        if m > n_rows:
            q = torch.cat([q, q.new_zeros(bh, m - n_rows, d)], dim=1)
            visible = torch.cat([visible, visible.new_zeros(bh, m - n_rows)], dim=1)
        qb = q.unsqueeze(1).expand(bh, nblk, m, d).reshape(bh * nblk, m, d)
        scores = torch.bmm(qb, k.view(bh * nblk, KEY_BLOCK, d).transpose(1, 2)).view(bh, nblk, m, KEY_BLOCK)
        scores.mul_(scale)
        key_pos = torch.arange(width, device=device).view(1, nblk, 1, KEY_BLOCK)
        scores.masked_fill_(key_pos >= visible[:, None, :, None], float("-inf"))
        # the exact row maximum (order-free); softmax does not depend on the shift, so no gradient through it
        peak = scores.detach().amax(dim=(1, 3), keepdim=True)
        peak = torch.where(torch.isfinite(peak), peak, 0.0)
        p = scores.sub_(peak).exp_()  # masked keys: exactly 0
        parts = torch.bmm(p.view(bh * nblk, m, KEY_BLOCK), v.view(bh * nblk, KEY_BLOCK, d)).view(bh, nblk, m, d)
        sums = p.sum(-1)  # [B*KVH, nblk, m]: each block's row sums
        acc, total = parts[:, 0], sums[:, 0]
        for j in range(1, nblk):  # fixed order over key blocks; blocks past a query's keys add exact zeros
            acc = acc + parts[:, j]
            total = total + sums[:, j]
        # a query without keys (left padding) has acc = 0 and total = 0: 0 / tiny = 0
        out = acc / total.unsqueeze(-1).clamp(min=torch.finfo(torch.float32).tiny)
        out = out[:, :n_rows].reshape(b, kvh, rep, lq, d).reshape(b, h, lq, d)
    return out.transpose(1, 2).contiguous().to(query.dtype), None


# -- installing and removing the mode ----------------------------------------------------------------
def _rms_norm_classes(models) -> set[type]:
    classes = set()
    for model in models:
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
                classes.add(type(module))
    return classes


class BatchInvariantMode:
    """Installs the batch-invariant kernels for the CPU dispatch key and ``models``; removes them cleanly.

    ``enable()``: registers ``mm``/``addmm``/``log_softmax`` as the CPU kernels of ``aten::mm``,
    ``aten::addmm`` and ``aten::_log_softmax`` (``torch.library``; process-wide while enabled), registers
    ``attention`` and ``attention_mask`` as ``"batch_invariant"`` in transformers' attention and mask
    registries, switches every ``model.config._attn_implementation`` to it, and replaces the forward of
    the models' RMSNorm classes by ``rms_norm``. ``disable()`` undoes all of it (the previous kernels, the
    models' attention implementations and the classes' forwards come back). Also a context manager.

    Models copied (``copy.deepcopy``) while enabled inherit the attention setting. Raises ValueError for a
    model with parameters off the CPU (see the module docstring for CUDA) and RuntimeError when another
    ``BatchInvariantMode`` is already enabled.
    """

    _active: "BatchInvariantMode | None" = None

    def __init__(self, *models: torch.nn.Module):
        self.models = [m for m in models if m is not None]
        self._lib = None
        self._saved_attn: list[tuple[object, str]] = []
        self._saved_forward: dict[type, object] = {}

    @property
    def enabled(self) -> bool:
        return self._lib is not None

    def enable(self) -> "BatchInvariantMode":
        if self.enabled:
            return self
        if BatchInvariantMode._active is not None:
            raise RuntimeError("another BatchInvariantMode is already enabled; disable it first")
        for model in self.models:
            devices = {p.device.type for p in model.parameters()}
            if devices - {"cpu"}:
                raise ValueError(
                    f"kernels=batch_invariant covers the CPU only; this model has parameters on {sorted(devices)}. "
                    "On CUDA use Thinking Machines' batch_invariant_ops (set_batch_invariant_mode) for the trainer "
                    "and vLLM's VLLM_BATCH_INVARIANT=1 for a vLLM sampler; lit_rl does not wire them in this version")
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(NAME, attention)
        AttentionMaskInterface.register(NAME, attention_mask)
        for model in self.models:
            for config in _configs(model):
                self._saved_attn.append((config, config._attn_implementation))
                config._attn_implementation = NAME
        for cls in _rms_norm_classes(self.models):
            self._saved_forward[cls] = cls.__dict__.get("forward")
            cls.forward = _rms_norm_forward
        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # torch warns that it overrides a kernel: that is the point here
            warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
            lib.impl("mm", mm, "CPU")
            lib.impl("addmm", addmm, "CPU")
            lib.impl("_log_softmax", log_softmax, "CPU")
        self._lib = lib
        BatchInvariantMode._active = self
        return self

    def disable(self) -> None:
        if not self.enabled:
            return
        self._lib._destroy()
        self._lib = None
        for cls, forward in self._saved_forward.items():
            if forward is None:
                del cls.forward
            else:
                cls.forward = forward
        self._saved_forward.clear()
        for config, impl in reversed(self._saved_attn):
            config._attn_implementation = impl
        self._saved_attn.clear()
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface._global_mapping.pop(NAME, None)
        AttentionMaskInterface._global_mapping.pop(NAME, None)
        BatchInvariantMode._active = None
        _last_ranges.clear()

    def __enter__(self) -> "BatchInvariantMode":
        return self.enable()

    def __exit__(self, *exc) -> None:
        self.disable()


def _configs(model: torch.nn.Module):
    """The model's config and its sub-configs that carry an attention implementation."""
    config = getattr(model, "config", None)
    if config is None:
        return []
    out = [config]
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            out.append(sub)
    return out
