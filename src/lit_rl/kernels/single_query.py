"""A decode step's grouped-query attention as one query row per query head of a key/value head.

In a cached decode step every sequence has one query position. When no padding mask is given (every row's
context unpadded: prompts of one length), transformers' ``sdpa`` attention passes it to torch's
``scaled_dot_product_attention`` as [B, H, 1, d] against keys [B, KVH, L, d] with ``enable_gqa``, so the CPU
flash kernel runs B·H problems of one query row, each paying the kernel's per-problem setup (blocking, and for
bf16 the packing of that head's keys and values) for one row of work. The H / KVH query heads that share a
key/value head ask the same keys, so the same call can take them as H / KVH query rows of one problem
[B, KVH, H / KVH, d] with no causal mask (every row sees all of the cache): what transformers itself does
(``pack_gqa``) when a padding mask is given. Each output row is the same sum over the same keys in the same
kernel. Only where SDPA computes in a reduced precision (bf16/fp16 inputs, or float32 ones under autocast):
there the per-problem packing is what the grouping saves (5x less attention time for [64, 9, 1, 64] against 70
bf16 keys in isolation), while float32 has no packing to save and its several-row inner products sum in another
order (a few ulp from the one-row form, torch 2.13 on an AMD EPYC: float32 calls keep transformers' path).

Inside ``decode_attention.active`` (the embedded engine's rollouts, ``engine.decode_attention``), a single-query
step computed in a dtype the decode kernel serves, with no mask or a boolean one, runs that kernel instead
(``kernels/decode_attention.py``), grouped the same way.

``install()`` puts ``attention`` in transformers' ``AttentionInterface`` under ``sdpa``, where it hands every
call but an unmasked reduced-precision single-query grouped one (prefill and the trainer's forwards, q_len > 1;
float32; a mask, which transformers packs itself; dropout; soft-capping; a position bias; H == KVH) to
transformers' own ``sdpa`` unchanged. The batch-invariant attention has its own name (``batch_invariant.NAME``)
and is not touched.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import decode_attention

_sdpa = None  # transformers' own ``sdpa`` attention, kept by ``install``


def attention(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention-interface contract: query [B, H, Lq, d], key and value [B, KVH, Lk, d] (H a
    multiple of KVH), attention_mask a [B, 1, Lq, >= Lk] mask or None; returns the output [B, Lq, H, d] in the
    dtype torch's SDPA returns (the autocast dtype under autocast) and None for the weights. Lq == 1 with
    H > KVH, computed in a reduced precision, no mask, no dropout, no soft-capping and no position bias: one SDPA
    call on the query heads grouped by key/value head; anything else: transformers' ``sdpa`` attention
    (``install`` first)."""
    b, h, lq, d = query.shape
    kvh = key.shape[1]
    device = query.device.type
    computed = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
    reduced = computed in (torch.bfloat16, torch.float16)
    extras = dropout or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None
    same_dims = value.shape == key.shape and key.shape[-1] == d
    if lq == 1 and not h % kvh and same_dims and not extras and device == "cpu" and decode_attention.serves(computed):
        rows = _row_mask(attention_mask, b, key.shape[2])
        if rows is not False:  # lit_rl's decode kernel (``engine.decode_attention``)
            grouped = query.reshape(b, kvh, h // kvh, d).to(computed)
            scale = d**-0.5 if scaling is None else scaling
            out = decode_attention.attention(grouped, key.to(computed), value.to(computed), rows, scale)
            return out.reshape(b, h, 1, d).transpose(1, 2).contiguous(), None
    plain = attention_mask is None and not dropout and kwargs.get("softcap") is None
    if lq != 1 or h == kvh or h % kvh or not (plain and reduced) or kwargs.get("position_bias") is not None:
        return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                     is_causal=is_causal, **kwargs)  # fmt: skip
    grouped = query.reshape(b, kvh, h // kvh, d)
    out = torch.nn.functional.scaled_dot_product_attention(grouped, key, value, scale=scaling)
    return out.reshape(b, h, 1, d).transpose(1, 2).contiguous(), None


def _row_mask(attention_mask: Tensor | None, rows: int, length: int) -> Tensor | None | bool:
    """A single-query step's mask as the decode kernel reads it: None (no mask), a bool [rows, length] view
    (True = attend), or False for a mask it does not take (additive, one per head, shorter than the keys, or of
    another batch than ``rows`` or 1)."""
    if attention_mask is None:
        return None
    shape = attention_mask.shape
    if attention_mask.dtype != torch.bool or attention_mask.dim() != 4 or shape[1] != 1 or shape[-1] < length:
        return False
    if shape[0] not in (1, rows):
        return False
    mask = attention_mask[:, 0, -1, :length]
    return mask.expand(rows, length) if mask.shape[0] != rows else mask


def install() -> None:
    """Serve transformers' ``sdpa`` attention through ``attention``, delegating to what was registered under it
    (once per process; like transformers' own registry: only single-query grouped calls change path; other
    wrappers, ``attention_backward``, may be registered before or after it)."""
    global _sdpa
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if _sdpa is not None:  # registered once per process: a second wrap would make the chain a cycle
        return
    _sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    AttentionInterface.register("sdpa", attention)
