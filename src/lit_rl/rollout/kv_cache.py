"""The embedded engine's attention KV cache: room reserved along the sequence and the batch, rows dropped in place.

A decode step writes one position per row and per layer; a row that finishes leaves the batch. transformers'
``DynamicLayer`` concatenates (a copy of the whole cache per step) and selects rows by indexing (another whole
copy). ``ReservedLayer`` writes into a buffer reserved up front and, when rows leave, moves only the filled
positions of the rows that must move (those after the first dropped one) to the front of the same buffer.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def _is_selection(indices: Tensor, rows: int) -> bool:
    """True when ``indices`` [B'] keeps distinct rows of [0, rows) (any order): a selection the buffer can hold in
    place. A repeat (a prefilled prompt copied to its G rows) is not one."""
    if indices.numel() == 0 or indices.numel() > rows:
        return False
    if bool(indices.min() < 0) or bool(indices.max() >= rows):
        return False
    return int(torch.unique(indices).numel()) == indices.numel()


def keep_rows(done: Tensor) -> Tensor:
    """The rows to keep when the rows ``done`` [B] bool finish, ordered so that the fewest rows move: a kept row
    below the new batch size stays where it is, and each hole a finished row leaves there is filled by a kept row
    from above it. Returns int64 [number kept], on ``done``'s device; ``batch_select_indices`` of it moves as many
    rows as finished below the new size, where keeping the order moves every row after the first finished one."""
    kept = (~done).nonzero().squeeze(-1)
    n = kept.numel()
    stay = kept[kept < n]
    holes = done[:n].nonzero().squeeze(-1)
    out = torch.empty_like(kept)
    out[stay] = stay
    out[holes] = kept[kept >= n]
    return out


class ReservedLayer(DynamicLayer):
    """transformers' ``DynamicLayer`` with room reserved: ``update`` writes the new keys and values
    ([B, kv_heads, T, head_dim], any float dtype) into a buffer of ``capacity`` positions (grown, with its
    filled part copied, if ever exceeded) and ``keys``/``values`` are views [B, kv_heads, filled, head_dim] of
    its filled part, instead of a ``torch.cat`` that copies the whole cache at every decode step (0.75 s of a
    10-12 s rollout of 8 prompts x G=8 x 64 tokens, SmolLM2-135M float32, 2 threads). The attention reads the
    same keys and values either way.

    ``batch_select_indices(indices)`` (int64 [B'], on any device): when ``indices`` keeps distinct rows (finished
    rows leaving), the selection happens inside the same buffer and only the rows whose place changes are copied
    (their filled positions; none when the last rows leave; ``keep_rows`` orders a drop so that only the holes
    below the new size are filled); any other selection (a prefilled prompt repeated to its G rows) allocates a
    buffer of B' rows and copies the filled positions into it.

    ``dtype``: the buffers' dtype (None: that of the first keys and values written). The engine passes the dtype
    its attention reads keys and values in (``kernels.attention_kv_dtype``: bf16 under autocast with torch's
    SDPA, whose keys come out of float32 rotary embeddings): written values are cast once, as ``Tensor.to``
    rounds them, instead of the attention casting the whole cache again at every decode step.
    """

    def __init__(self, capacity: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.capacity = int(capacity)
        self.dtype_stored = dtype
        self._keys: Tensor | None = None
        self._values: Tensor | None = None
        self._length = 0
        self._rows = 0

    def _views(self) -> None:
        self.keys = self._keys[: self._rows, :, : self._length]
        self.values = self._values[: self._rows, :, : self._length]

    def _allocate(self, rows: int, size: int, like_keys: Tensor, like_values: Tensor, source: Tensor | None) -> None:
        """New buffers of ``rows`` x ``size`` positions; the filled part of rows ``source`` (None: rows 0..rows-1)
        of the old ones copied in."""
        k_dtype, v_dtype = self.dtype_stored or like_keys.dtype, self.dtype_stored or like_values.dtype
        keys = like_keys.new_empty(rows, *like_keys.shape[1:-2], size, like_keys.shape[-1], dtype=k_dtype)
        values = like_values.new_empty(rows, *like_values.shape[1:-2], size, like_values.shape[-1], dtype=v_dtype)
        if self._length and self._keys is not None:
            old_k, old_v = self._keys[: self._rows, :, : self._length], self._values[: self._rows, :, : self._length]
            if source is not None:
                old_k, old_v = old_k[source], old_v[source]
            keys[:, :, : self._length] = old_k
            values[:, :, : self._length] = old_v
        self._keys, self._values, self._rows = keys, values, rows

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows, end = key_states.shape[0], self._length + key_states.shape[-2]
        if self._keys is not None and self._length and rows != self._rows:
            raise ValueError(f"ReservedLayer holds {self._rows} rows but update got {rows}")
        if self._keys is None or end > self._keys.shape[-2] or rows > self._keys.shape[0]:
            self._allocate(rows, max(self.capacity, end), key_states, value_states, None)
        self._rows = rows
        self._keys[:rows, :, self._length : end] = key_states
        self._values[:rows, :, self._length : end] = value_states
        self._length = end
        self._views()
        return self.keys, self.values

    def batch_select_indices(self, indices: Tensor) -> None:
        if not self._length:
            return
        indices = indices.to(self._keys.device)
        if not _is_selection(indices, self._rows):
            self._allocate(indices.numel(), self._keys.shape[-2], self._keys, self._values, indices)
            self._views()
            return
        moved = (indices != torch.arange(indices.numel(), device=indices.device)).nonzero().squeeze(-1)
        if moved.numel():  # rows already in place stay; the others are gathered first, then written
            length, source = self._length, indices[moved]
            self._keys[moved, :, :length] = self._keys[source, :, :length]
            self._values[moved, :, :length] = self._values[source, :, :length]
        self._rows = indices.numel()
        self._views()


def reserved_cache(capacity: int, dtype: torch.dtype | None = None) -> DynamicCache:
    """A ``DynamicCache`` whose layers (``ReservedLayer``) hold ``capacity`` positions without re-allocating, in
    ``dtype`` (None: the dtype of the keys and values written)."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = functools.partial(ReservedLayer, capacity, dtype=dtype)
    return cache


def merge_rows(engine, live: DynamicCache, live_mask: Tensor, joining: DynamicCache, joining_mask: Tensor, room: int):
    """One cache of the ``live`` rows (attention mask ``live_mask`` [B, L] int64, right-aligned: every row's last
    position in column L - 1) and, after them, the ``joining`` rows (``joining_mask`` [J, Lj]), both right-aligned
    in a new cache of ``engine._new_cache`` with ``room`` more positions reserved: ``stack_rows`` of the two.
    Returns (the cache, attention mask [B + J, width] int64). Raises ValueError when the two caches' layer counts
    differ."""
    return stack_rows(engine, [(live, live_mask), (joining, joining_mask)], room)


def stack_rows(engine, parts: list[tuple[DynamicCache, Tensor]], room: int):
    """One cache of the rows of every part, part after part: each part a cache and its attention mask [B_i, L_i]
    int64, right-aligned (every row's last position in its last column). The rows are right-aligned in a new cache
    of ``engine._new_cache`` with ``room`` more positions reserved. Columns that are padding in every row of a part
    are left out (rows that left keep no columns alive), so the width is the widest part's span; the columns left of
    a row's span hold zeros. No position is recomputed: keys and values are copied. Under
    ``kernels=batch_invariant`` the attention does not depend on the amount of left padding, so each row decodes on
    exactly as in a cache of its own. Returns (the cache, attention mask [sum B_i, width] int64). Raises ValueError
    when the parts' layer counts differ or there is no part."""
    if not parts:
        raise ValueError("stack_rows needs at least one cache")
    layer_counts = sorted({len(cache.layers) for cache, _ in parts})
    if len(layer_counts) != 1:
        raise ValueError(f"cannot merge caches of {' and '.join(map(str, layer_counts))} layers")
    trimmed = []
    for cache, mask in parts:
        used = mask.bool().any(0).nonzero()
        first = int(used[0]) if used.numel() else mask.shape[1]
        trimmed.append((cache, mask[:, first:], first))
    width = max(mask.shape[1] for _, mask, _ in trimmed)
    total = sum(mask.shape[0] for _, mask, _ in trimmed)
    out_mask = trimmed[0][1].new_zeros(total, width)
    row = 0
    for _, mask, _ in trimmed:
        out_mask[row : row + mask.shape[0], width - mask.shape[1] :] = mask
        row += mask.shape[0]
    cache = engine._new_cache(width + room)
    for index in range(layer_counts[0]):
        ref = parts[0][0].layers[index]
        keys = ref.keys.new_zeros(total, *ref.keys.shape[1:-2], width, ref.keys.shape[-1])
        values = ref.values.new_zeros(total, *ref.values.shape[1:-2], width, ref.values.shape[-1])
        row = 0
        for part, mask, first in trimmed:
            layer, (b, w) = part.layers[index], mask.shape
            keys[row : row + b, ..., width - w :, :] = layer.keys[..., first:, :]
            values[row : row + b, ..., width - w :, :] = layer.values[..., first:, :]
            row += b
        cache.update(keys, values, index)
    return cache, out_mask
