"""The embedded engine's cache for hybrid models: linear-attention layers (Gated DeltaNet: Qwen3.5, Qwen3.5-MoE,
Qwen3-Next) hold a conv state and a recurrent state per sequence beside the attention layers' keys and values.

The engine reserves its attention KV up front (``kv_cache.ReservedLayer``), copies a group's prefilled prompt to
its G rows and drops finished rows, all through ``batch_select_indices``; transformers' ``LinearAttentionLayer``
has no row selection, so ``StateLayer`` adds it. ``hybrid_cache`` builds the cache layer by layer from the model
config's ``layer_types``, and returns None for a model without linear-attention layers (the engine then keeps its
plain reserved cache). The trainer's shared-prefix update continues each prompt's states the same way
(``continuation_cache``), with autograd through them. ``float32_names`` resolves ``engine.keep_float32``.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer, LinearAttentionLayer

from ..config import ConfigError

#: the Gated DeltaNet decay/gate parameters transformers uses in float32 (``-A_log.float().exp()``, ``dt_bias``
#: added to a float32 ``a``): an engine copy in another dtype keeps them float32 by default (``engine.keep_float32``)
DECAY_PARAMETERS = ("A_log", "dt_bias")

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


class PrefixStateLayer(LinearAttentionLayer):
    """A prompt's final states seeding a continuation forward under autograd (``continuation_cache``): conv state
    [N, C, W] and recurrent state [N, H, K, V] of the prompt each row continues, so the layer starts with a
    previous state. Its updates assign the new states rather than copy them into the old tensors as transformers'
    layer does: the continuation's rule saved the old recurrent state for its backward, which an in-place copy
    would invalidate."""

    def __init__(self, conv_state: Tensor, recurrent_state: Tensor):
        super().__init__()
        self.conv_states[0], self.recurrent_states[0] = conv_state, recurrent_state
        self.is_conv_states_initialized[0] = self.is_recurrent_states_initialized[0] = True
        self.has_previous_state[0] = True
        self.conv_kernel_size[0] = conv_state.shape[-1]
        self.dtype, self.device = conv_state.dtype, conv_state.device

    def lazy_initialization(self, *args, **kwargs) -> None:  # the states are given
        return None

    def update_conv_state(self, conv_states: Tensor, state_idx: int = 0, **kwargs) -> Tensor:
        """The previous inputs followed by ``conv_states`` [N, C, T] (what the conv reads); keeps the last W."""
        full = torch.cat([self.conv_states[state_idx], conv_states], dim=-1)
        self.conv_states[state_idx] = full[..., -self.conv_kernel_size[state_idx] :]
        return full

    def update_recurrent_state(self, recurrent_states: Tensor, state_idx: int = 0, **kwargs) -> Tensor:
        self.recurrent_states[state_idx] = recurrent_states
        return recurrent_states


class _GatherRows(torch.autograd.Function):
    """``x.index_select(0, rows)`` whose backward sums each source row's gradients one row after another, in the
    order of ``rows``, in ``x``'s dtype: the bits torch's deterministic ``x[rows]`` backward gives, at every run
    (``gather_rows``)."""

    @staticmethod
    def forward(ctx, x: Tensor, rows: Tensor) -> Tensor:
        sorted_rows, order = rows.sort(stable=True)
        _, counts = torch.unique_consecutive(sorted_rows, return_counts=True)
        rank = torch.empty_like(rows)  # how many earlier entries of ``rows`` name the same source row
        rank[order] = torch.arange(len(rows), device=rows.device) - torch.repeat_interleave(
            counts.cumsum(0) - counts, counts
        )
        ctx.save_for_backward(rows, rank)
        ctx.shape = x.shape
        return x.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad: Tensor):
        rows, rank = ctx.saved_tensors
        out = grad.new_zeros(ctx.shape)
        for r in range(int(rank.max()) + 1 if len(rank) else 0):  # round r adds each source's r-th row: no repeats
            sel = (rank == r).nonzero().squeeze(-1)
            out.index_add_(0, rows[sel], grad[sel])
        return out, None


def gather_rows(x: Tensor, rows: Tensor) -> Tensor:
    """``x[rows]`` (x [K, ...], rows [N] int64 in [0, K)): the same values, and a backward that sums each row of x's
    gradients over the entries of ``rows`` naming it one after another in their order, in x's dtype. ``x[rows]``'s
    CPU backward (``index_put_`` accumulating) adds them from several threads in a varying order when the rows of
    two sources interleave: two runs of one update differed in their last bits (``index_select``'s backward is
    ordered but sums bf16 rows otherwise than the deterministic ``x[rows]``, which batch-invariant runs compared
    against 752006f reproduce). Cost: one ``index_add_`` per repeat of the most repeated source."""
    return _GatherRows.apply(x, rows)


def continuation_cache(prompt_cache: DynamicCache, rows: Tensor) -> DynamicCache:
    """A cache for a forward that continues the prompts of ``prompt_cache`` (filled by a prompt forward, e.g.
    ``hybrid_cache(model, DynamicLayer)``), row i continuing prompt ``rows[i]`` ([N] int64): attention layers get
    the prompts' keys and values at ``rows``, linear-attention layers a ``PrefixStateLayer`` of their final conv
    and recurrent states at ``rows``. Indexing is differentiable: the backward sums each prompt's gradients over
    the rows that continue it, one after another in the rows' order (``gather_rows``: the same bits at every run)."""
    layers = []
    for layer in prompt_cache.layers:
        if isinstance(layer, LinearAttentionLayer):
            conv, recurrent = layer.conv_states[0], layer.recurrent_states[0]
            layers.append(PrefixStateLayer(gather_rows(conv, rows), gather_rows(recurrent, rows)))
        else:
            new = DynamicLayer()
            new.update(gather_rows(layer.keys, rows), gather_rows(layer.values, rows))
            layers.append(new)
    cache = DynamicCache()
    Cache.__init__(cache, layers=layers)
    return cache


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


def float32_names(model: torch.nn.Module, names: Iterable[str] | None) -> tuple[str, ...]:
    """The parameter names (the last part of the dotted name) an engine copy of ``model`` keeps in float32
    (``engine.keep_float32``): None = the family's defaults, ``DECAY_PARAMETERS`` that ``model`` has (none for a
    model without Gated DeltaNet layers); a list is taken as given, [] keeping none (the A_log trap).

    Raises ConfigError (a ValueError: the recipe prints it as a start-up error, exit 2, no traceback) naming every
    listed name that matches no parameter of ``model`` (a misspelt ``dt_bias``
    would otherwise be rounded silently), with the model's candidates: its parameter-name ends close to it, or
    else those of its vector parameters (gates, biases, norms)."""
    ends = {name.rsplit(".", 1)[-1]: p for name, p in model.named_parameters()}
    if names is None:
        return tuple(n for n in DECAY_PARAMETERS if n in ends)
    names = tuple(names)
    missing = [n for n in names if n not in ends]
    if missing:
        vectors = sorted(e for e, p in ends.items() if p.dim() <= 1)
        hints = []
        for n in missing:
            close = difflib.get_close_matches(n, list(ends), n=3, cutoff=0.6)
            hints.append(f"{n!r}: close to {close}" if close else f"{n!r}: no close name")
        raise ConfigError(
            f"engine.keep_float32: {missing} match no parameter of {type(model).__name__} (matched against the last "
            f"part of each parameter's dotted name; {'; '.join(hints)}; the model's vector parameters: {vectors}). "
            "Fix the names, or leave engine.keep_float32 at null for the family's defaults"
        )
    return names
