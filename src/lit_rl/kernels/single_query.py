"""A decode step's grouped-query attention as one query row per query head of a key/value head.

In a cached decode step every sequence has one query position. transformers' ``sdpa`` attention passes it to
torch's ``scaled_dot_product_attention`` as [B, H, 1, d] against keys [B, KVH, L, d] (``enable_gqa``, or keys
repeated to H heads when a padding mask is given), so the CPU flash kernel runs B·H problems of one query row,
each paying the kernel's per-problem setup (blocking, and for bf16 the packing of that head's keys and values)
for one row of work. The H / KVH query heads that share a key/value head ask the same keys, so the same call
can take them as H / KVH query rows of one problem: [B, KVH, H / KVH, d] with no causal mask (every row sees
all of the cache) and the padding mask broadcast over the rows. Each output row is the same sum over the same
keys, in the same kernel; the results were bit-identical to the one-row form in the engine's rollouts (tiny
model and SmolLM2-135M, float32 and bf16 autocast, torch 2.13 on an AMD EPYC, ``tests/test_engine.py``).

``install()`` puts ``attention`` in transformers' ``AttentionInterface`` under ``sdpa``, where it hands every
call but a single-query grouped one (prefill and the trainer's forwards, q_len > 1; dropout; soft-capping; a
float mask; H == KVH) to transformers' own ``sdpa`` unchanged. The batch-invariant attention has its own name
(``batch_invariant.NAME``) and is not touched.
"""

from __future__ import annotations

import torch
from torch import Tensor

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
    multiple of KVH), attention_mask the boolean [B, 1, Lq, >= Lk] mask (True: attend) or None; returns the output
    [B, Lq, H, d] in the dtype torch's SDPA returns (the autocast dtype under autocast) and None for the weights.
    Lq == 1 with H > KVH, no dropout, no soft-capping and a boolean or no mask: one SDPA call on the query heads
    grouped by key/value head; anything else: transformers' ``sdpa`` attention (install first)."""
    b, h, lq, d = query.shape
    kvh, lk = key.shape[1], key.shape[2]
    float_mask = attention_mask is not None and attention_mask.dtype != torch.bool
    if lq != 1 or h == kvh or h % kvh or dropout or kwargs.get("softcap") or float_mask:
        return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                     is_causal=is_causal, **kwargs)  # fmt: skip
    mask = None if attention_mask is None else attention_mask[:, :, :, :lk]  # [B, 1, 1, Lk]: over the rows
    grouped = query.reshape(b, kvh, h // kvh, d)
    out = torch.nn.functional.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, h, 1, d).transpose(1, 2).contiguous(), None


def install() -> None:
    """Serve transformers' ``sdpa`` attention through ``attention`` (idempotent; process-wide, like transformers'
    own registry: only single-query grouped calls change path)."""
    global _sdpa
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    current = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if current is attention:
        return
    _sdpa = current
    AttentionInterface.register("sdpa", attention)
