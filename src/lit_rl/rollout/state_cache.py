"""The embedded engine's cache for hybrid models: linear-attention layers (Gated DeltaNet: Qwen3.5, Qwen3.5-MoE,
Qwen3-Next) hold a conv state and a recurrent state per sequence beside the attention layers' keys and values.

The engine reserves its attention KV up front (``kv_cache.ReservedLayer``), copies a group's prefilled prompt to
its G rows and drops finished rows, all through ``batch_select_indices``; transformers' ``LinearAttentionLayer``
has no row selection, so ``StateLayer`` adds it. ``hybrid_cache`` builds the cache layer by layer from the model
config's ``layer_types``, and returns None for a model without linear-attention layers (the engine then keeps its
plain reserved cache).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer, LinearAttentionLayer

#: the ``layer_types`` entry of a linear-attention (conv + recurrent state) layer in transformers' configs
LINEAR_LAYER = "linear_attention"


def layer_types(model: torch.nn.Module) -> list[str]:
    """The decoder's ``layer_types`` (one string per layer) of a transformers causal LM, [] when it has none."""
    config = getattr(model, "config", None)
    if config is None:
        return []
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return list(getattr(text, "layer_types", None) or [])


def is_hybrid(model: torch.nn.Module) -> bool:
    """True when ``model`` has linear-attention layers (a Gated DeltaNet hybrid)."""
    return LINEAR_LAYER in layer_types(model)


class StateLayer(LinearAttentionLayer):
    """transformers' ``LinearAttentionLayer`` (conv states [B, C, kernel], recurrent states [B, H, K, V]) with
    the row selection the engine needs: ``batch_select_indices(indices)`` keeps (or repeats) the rows ``indices``
    [B'] int64 of every state, so a prompt prefilled once seeds its G completions and finished rows leave."""

    def batch_select_indices(self, indices: Tensor) -> None:
        for i in range(self.number_of_states):
            if self.is_conv_states_initialized[i]:
                self.conv_states[i] = self.conv_states[i][indices.to(self.conv_states[i].device)]
            if self.is_recurrent_states_initialized[i]:
                self.recurrent_states[i] = self.recurrent_states[i][indices.to(self.recurrent_states[i].device)]


def hybrid_cache(model: torch.nn.Module, attention_layer: Callable[[], DynamicLayer]) -> DynamicCache | None:
    """A ``DynamicCache`` for ``model`` with a ``StateLayer`` per linear-attention layer and ``attention_layer()``
    (e.g. the engine's reserved KV layer) per attention layer; None when the model has no linear-attention layer.

    Raises ValueError naming the layer type for a hybrid whose other layers are not full attention (sliding-window
    or other cache layouts are not served by the embedded engine's hybrid cache)."""
    types = layer_types(model)
    if LINEAR_LAYER not in types:
        return None
    other = sorted({t for t in types if t not in (LINEAR_LAYER, "full_attention")})
    if other:
        raise ValueError(
            f"{type(model).__name__}: the embedded engine's hybrid cache serves linear_attention and full_attention "
            f"layers, not {other}"
        )
    layers = [StateLayer() if t == LINEAR_LAYER else attention_layer() for t in types]
    cache = DynamicCache()  # a DynamicCache (the models check for one) holding these layers
    Cache.__init__(cache, layers=layers)
    return cache
