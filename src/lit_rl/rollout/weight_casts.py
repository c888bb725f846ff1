"""The engine's linear-layer weights cast to the autocast dtype once per rollout, not once per decode step; the
update's once per update (``track``), not once per forward.

Under ``torch.autocast`` every ``F.linear`` casts its float32 weight (and bias) to the autocast dtype. Autocast keeps
such a cast only for a leaf tensor that requires grad, and only until its context exits, and only when the context
was entered with ``cache_enabled=True``. Lightning's ``bf16-mixed`` enters it with ``cache_enabled=False`` (so a
decode step of the shared engine re-cast every weight of the model, ~135M values for SmolLM2-135M), and an engine's
own copy of the weights (``rollout.mode=lagged|async``, the process producer) holds them with ``requires_grad``
off, so it re-cast them at every step whatever the context.

``WeightCasts.installed(model)`` routes every ``nn.Linear`` of the model, for the duration of a rollout, through a
forward that hands ``F.linear`` the weight already cast, made at its first use and reused while the weight is
unchanged. The values are autocast's own: autocast casts with ``Tensor.to(dtype)``, as here, and leaves an
argument already in its dtype alone, so ``F.linear`` receives the same tensors either way and the products, the
logits and the log-probs are the same bits (``tests/test_weight_casts.py``). Outside autocast, or where the cast
must stay in the autograd graph (grad mode on and a weight that requires grad), the forward is ``nn.Linear``'s own.
A cast is made again when its weight changes: a weight sync writes the parameters in place, which bumps their
version counters (``Tensor._version``), and moving or re-assigning a parameter changes its storage; ``clear``
drops every cast (the engine calls it at each sync too, for writes through ``.data``, which no counter sees).

The update (``RLModule.update_casts``, ``track=True``): its forwards need the cast in the autograd graph, so autocast
cast every weight at every forward (a micro-batch's shared prompt forward and each completion bucket's, ~20 times a
weight per update of the main job) and converted each use's gradient back. ``TrackedCast`` hands ``F.linear`` the
cast made once, as a graph node per use whose backward converts that use's gradient as autocast's cast does: the same
values and gradients bit for bit (``tests/test_weight_casts.py``, default and batch-invariant kernels).

``packed`` (``engine.packed_linear``: auto | true | false): under bf16 autocast on the CPU, a product of at most
``kernels.packed_linear.MAX_ROWS`` rows (a decode step's) runs from the weight's cast held in oneDNN's packed layout
as well (``kernels.packed_linear``), made once like the cast and again when the weight changes; where
``kernels.packed_linear.resolve`` turns it on for the model at the current thread count (the same bits as
``F.linear`` on the model's shapes and, for auto, measured faster), never under ``kernels=batch_invariant``. It
holds a second bf16 copy of each linear weight while a block lasts (the plain cast serves the prefill).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels import BatchInvariantMode, packed_linear


class WeightCasts:
    """Casts of linear-layer weights and biases to the autocast dtype, one per (tensor, dtype), kept while the tensor
    is unchanged (same storage, same version counter). ``enabled`` False: ``installed`` does nothing (the per-step
    casts of autocast itself, a comparison's baseline). ``packed``: auto | True | False (default), the packed bf16
    products (module docstring; the engine's follow ``engine.packed_linear``; settable between blocks; ValueError
    naming ``engine.packed_linear`` for another value). ``track``: where the cast must stay in the autograd graph (the
    update's forwards), hand ``F.linear`` the cast made once through ``TrackedCast`` (one graph node per use, whose
    backward is the cast's own) instead of leaving the cast to autocast at every forward. ``made``: casts made so
    far, ``packed_made``: packed weights
    made so far (a test's and a benchmark's counts); ``packing``: (setting, threads, id(model)) -> whether
    ``kernels.packed_linear.resolve`` turned them on."""

    def __init__(self, enabled: bool = True, packed=False, track: bool = False):
        packed_linear.check_setting(packed)
        self.enabled, self.packed, self.track = enabled, packed, track
        self.made = self.packed_made = 0
        self._casts: dict[tuple[int, torch.dtype], tuple[Tensor, int, int, Tensor]] = {}
        self._packed: dict[int, tuple[Tensor, int, int, Tensor]] = {}
        self._fused: dict[tuple, tuple[list[tuple[Tensor, int, int]], Tensor, Tensor | None]] = {}
        self.packing: dict[tuple, bool] = {}
        self.fusing: dict[tuple, bool] = {}  # (threads, shapes of a group) -> stacked product's bits equal the parts'
        self._pack_threads: int | None = None  # inside a block with packed products on: the thread count they are for

    def clear(self) -> None:
        """Drop every cast and packed weight (the next use of each weight makes them again)."""
        self._casts.clear()
        self._packed.clear()
        self._fused.clear()

    def cast(self, tensor: Tensor | None, dtype: torch.dtype) -> Tensor | None:
        """``tensor`` as autocast would hand it to a lower-precision op of dtype ``dtype``: ``tensor.to(dtype)`` for
        a floating tensor of another dtype other than float64 (autocast leaves float64 alone), else ``tensor``
        itself; the cast is made once and reused while ``tensor`` keeps its storage and version counter."""
        if tensor is None or not tensor.is_floating_point() or tensor.dtype in (dtype, torch.float64):
            return tensor
        key = (id(tensor), dtype)
        entry = self._casts.get(key)
        if entry is not None and entry[1] == tensor.data_ptr() and entry[2] == tensor._version:
            return entry[3]
        with torch.no_grad():
            cast = tensor.to(dtype)
        self._casts[key] = (tensor, tensor.data_ptr(), tensor._version, cast)  # holding ``tensor``: its id stays its
        self.made += 1
        return cast

    def params(self, module: torch.nn.Linear, track: bool = True) -> tuple[Tensor, Tensor | None]:
        """(weight, bias) as ``linear_forward`` hands them to ``F.linear`` now: the casts under autocast, the layer's
        own tensors outside it; where the cast must stay in the autograd graph (grad mode on and a weight or bias
        that requires grad), the layer's own tensors, or with ``self.track`` (and ``track``) the casts through
        ``TrackedCast``."""
        weight, bias = module.weight, module.bias
        device = weight.device.type
        if not torch.is_autocast_enabled(device):
            return weight, bias
        tracked = torch.is_grad_enabled() and (weight.requires_grad or (bias is not None and bias.requires_grad))
        dtype = torch.get_autocast_dtype(device)
        if not tracked:
            return self.cast(weight, dtype), self.cast(bias, dtype)
        if not (self.track and track):
            return weight, bias
        return self.tracked_cast(weight, dtype), self.tracked_cast(bias, dtype)

    def tracked_cast(self, tensor: Tensor | None, dtype: torch.dtype) -> Tensor | None:
        """``cast(tensor, dtype)`` as a node of the autograd graph when ``tensor`` requires grad
        (``TrackedCast``): the same values as autocast's cast at this use, and the same gradient."""
        cast = self.cast(tensor, dtype)
        if cast is tensor or not tensor.requires_grad:
            return cast
        return TrackedCast.apply(tensor, cast)

    def packed_weight(self, weight: Tensor) -> Tensor:
        """``kernels.packed_linear.pack`` of ``weight``'s bf16 cast, made once and reused while ``weight`` keeps its
        storage and version counter (as ``cast``)."""
        entry = self._packed.get(id(weight))
        if entry is not None and entry[1] == weight.data_ptr() and entry[2] == weight._version:
            return entry[3]
        with torch.no_grad():
            packed = packed_linear.pack(self.cast(weight, torch.bfloat16))
        self._packed[id(weight)] = (weight, weight.data_ptr(), weight._version, packed)
        self.packed_made += 1
        return packed

    def fused_linear(self, x: Tensor, modules: tuple[torch.nn.Linear, ...], split: bool = True):
        """The outputs of ``modules`` (linear layers that all read ``x``: a layer's q/k/v projections) from one packed
        product of their bf16 weights stacked along the output dimension, split back per layer (views of one [..., sum
        of out_features] bf16 tensor), the same bits as each layer's own packed product; None where that does not
        apply: a layer's product would not run packed (``_packs``), a layer that is not a plain ``nn.Linear`` routed
        here, some but not all with a bias, or ``kernels.packed_linear.fused_differ`` finds other bits for these
        shapes at this thread count (checked once, printed when so). ``split`` False: the one tensor, not split.
        The stacked weight is made once and again when any of its weights or biases changes (as ``packed_weight``)."""
        if self._pack_threads is None or not all(
            type(m) is torch.nn.Linear and getattr(vars(m).get("forward"), "casts", None) is self for m in modules
        ):
            return None
        params = [self.params(m) for m in modules]
        if any(not self._packs(x, w, b) for w, b in params) or len({b is None for _, b in params}) > 1:
            return None
        shapes = tuple((m.out_features, m.in_features, m.bias is not None) for m in modules)
        key = (self._pack_threads, shapes)
        if key not in self.fusing:
            differ = packed_linear.fused_differ([shapes], rows=range(1, packed_linear.MAX_ROWS + 1))
            self.fusing[key] = not differ
            if differ:
                print(f"lit_rl: stacked packed products off for {differ[0]} (other bits than the separate ones)")
        if not self.fusing[key]:
            return None
        stacked, bias = self._stacked(modules, params)
        out = packed_linear.linear(x.to(torch.bfloat16), stacked, bias)
        return list(out.split([m.out_features for m in modules], dim=-1)) if split else out

    def _stacked(self, modules, params) -> tuple[Tensor, Tensor | None]:
        """The packed stacked weight and the stacked bias of ``modules`` (``fused_linear``), made once and again when
        any of their weights or biases changes (storage or version counter)."""
        key = tuple(id(m.weight) for m in modules)
        tensors = [t for m in modules for t in (m.weight, m.bias) if t is not None]
        seen = [(t, t.data_ptr(), t._version) for t in tensors]
        entry = self._fused.get(key)
        if entry is not None and all(a[1:] == b[1:] for a, b in zip(entry[0], seen)):
            return entry[1], entry[2]
        with torch.no_grad():
            stacked = packed_linear.pack(torch.cat([w for w, _ in params]))
            bias = torch.cat([b for _, b in params]) if params[0][1] is not None else None
        self._fused[key] = (seen, stacked, bias)
        self.packed_made += 1
        return stacked, bias

    def _packs(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
        """Whether this product runs packed: on for this block at the current thread count, no batch-invariant
        kernels, a bf16 weight (and bias), a contiguous float32 or bf16 2-D/3-D input of 1 to ``MAX_ROWS`` rows
        that needs no gradient."""
        return (
            self._pack_threads is not None
            and weight.dtype == torch.bfloat16
            and (bias is None or bias.dtype == torch.bfloat16)
            and x.dtype in (torch.float32, torch.bfloat16)
            and x.dim() in (2, 3)
            and 0 < x.numel() <= packed_linear.MAX_ROWS * x.shape[-1]
            and x.is_contiguous()
            and not (x.requires_grad and torch.is_grad_enabled())
            and BatchInvariantMode._active is None
            and torch.get_num_threads() == self._pack_threads
        )

    def linear_forward(self, module: torch.nn.Linear, x: Tensor) -> Tensor:
        """``module(x)`` with the cast weight and bias under autocast (same values as ``nn.Linear.forward``); a
        decode-sized product from the packed weight where ``packed`` is on (``_packs``: the same bits)."""
        weight, bias = self.params(module)
        if weight is module.weight:
            return torch.nn.Linear.forward(module, x)
        if self._packs(x, weight, bias):
            return packed_linear.linear(x.to(torch.bfloat16), self.packed_weight(module.weight), bias)
        return F.linear(x, weight, bias)

    def _packing_threads(self, model: torch.nn.Module) -> int | None:
        """The thread count the packed products are on for in a block over ``model`` starting now (None: off):
        ``packed`` not False, bf16 autocast on the CPU, no batch-invariant kernels, and ``packed_linear.resolve``
        says on (asked once per setting, thread count and model; it prints why)."""
        if self.packed is False or BatchInvariantMode._active is not None or not torch.is_autocast_enabled("cpu"):
            return None
        if torch.get_autocast_dtype("cpu") != torch.bfloat16:
            return None
        key = (self.packed, torch.get_num_threads(), id(model))
        if key not in self.packing:
            on, why = packed_linear.resolve(self.packed, model)
            print(f"lit_rl: {why}", flush=True)
            self.packing[key] = on
        return key[1] if self.packing[key] else None

    @contextlib.contextmanager
    def installed(self, model: torch.nn.Module, keep: bool = False):
        """Inside the block every ``nn.Linear`` of ``model`` whose forward is ``nn.Linear``'s own runs through
        ``linear_forward``; on leaving (also on an exception) their forwards are restored and, unless ``keep``, the
        casts dropped, so nothing is held between rollouts. ``keep``: the casts outlive the block (a frozen model's,
        reused by every later block; each still made again if its weight changes). Layers already routed (an
        enclosing block) are left to it. Nothing changes when ``enabled`` is False. The packed products' setting
        is resolved on entering (``_packing_threads``: autocast must be entered before the block)."""
        if not self.enabled:
            yield
            return
        outer, self._pack_threads = self._pack_threads, self._packing_threads(model)
        patched = [
            m
            for m in model.modules()
            if isinstance(m, torch.nn.Linear)
            and type(m).forward is torch.nn.Linear.forward
            and "forward" not in vars(m)
        ]
        for m in patched:
            m.forward = _Bound(self, m)
        try:
            yield
        finally:
            for m in patched:
                vars(m).pop("forward", None)
            self._pack_threads = outer
            if not keep:
                self.clear()


def linear_params(module: torch.nn.Module) -> tuple[Tensor, Tensor | None]:
    """(weight, bias) of a linear layer as its forward hands them to ``F.linear`` now: the casts of the
    ``WeightCasts`` installed on it (``WeightCasts.params``), else its own tensors; with the gradient tracked, its own
    tensors (the caller casts once itself and sums the weight's gradient over its chunks in float32). For a caller
    that runs the layer's product itself (the trainer's chunked output layer, ``logprobs.response_logprobs``)."""
    bound = vars(module).get("forward")
    if isinstance(bound, _Bound):
        return bound.casts.params(module, track=False)
    return module.weight, module.bias


class TrackedCast(torch.autograd.Function):
    """``tensor.to(cast.dtype)`` for one use, its value ``cast`` (made once, outside the graph): forward returns a view
    of ``cast``, backward returns the gradient in ``tensor``'s dtype, as autocast's own cast (``aten::_to_copy``)
    does. Each use is its own node, so each use's gradient reaches ``tensor`` converted on its own and autograd sums
    them in ``tensor``'s dtype, as with autocast's cast at every use: the same values and gradients, one cast
    (``apply(tensor, cast)``)."""

    @staticmethod
    def forward(ctx, tensor: Tensor, cast: Tensor) -> Tensor:
        ctx.dtype = tensor.dtype
        return cast.view_as(cast)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.to(ctx.dtype), None


class _Bound:
    """``casts.linear_forward(module, x)`` as a module's instance ``forward``."""

    __slots__ = ("casts", "module")

    def __init__(self, casts: WeightCasts, module: torch.nn.Linear):
        self.casts, self.module = casts, module

    def __call__(self, x: Tensor) -> Tensor:
        return self.casts.linear_forward(self.module, x)
