"""float32 matrix products through oneDNN on the CPU (``kernels.fp32_gemm``): the same IEEE float32 product,
another library, picked where it is measured faster.

torch's x86 CPU wheels run a float32 ``aten::mm`` / ``aten::addmm`` through MKL, and MKL picks its kernels by
CPU vendor: on an AMD EPYC with AVX-512 it takes a generic path. oneDNN (also in the wheel, torch's bf16
kernels) picks by instruction set. Measured on SmolLM2-135M's shapes (AMD EPYC with AVX-512, 2 threads,
torch 2.13.0+cpu, ``benchmarks/fp32_gemm.py``): a forward product [M, 576] x [576, 1536] ran at 122 GFLOP/s
through MKL and 196 through oneDNN for M = 22 (a decode step), 186 and 210 for M = 392; the output layer
[M, 576] x [576, 49152] at 49 and 144 (M = 22). The weight-gradient product (``a`` transposed) was not
faster and stays on MKL. Both are IEEE float32 (no bf16 or TF32 down-conversion: torch's
``fp32_precision`` stays as it is); they sum in another order, so results differ in the last bits.

Nothing here is assumed about a CPU: ``resolve`` times both libraries on the model's own linear shapes once
per CPU model, torch version, thread count and set of shapes (``<lit_rl cache>/fp32_gemm.json``, like the
peak-FLOPs probe) and turns oneDNN on only where it is at least ``MIN_SPEEDUP`` faster.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch import Tensor

#: ``kernels.fp32_gemm`` values (torch-free there, so that config.validate checks them before torch loads)
from ..choices import FP32_GEMM_CHOICES as CHOICES

#: oneDNN is turned on by ``auto`` when the model's products take at most 1 / MIN_SPEEDUP of MKL's time
MIN_SPEEDUP = 1.05
#: rows of the products ``measure`` times: a decode step's batch and a training micro-batch's tokens
MEASURE_ROWS = (16, 128)


def available() -> bool:
    """True when this torch build has oneDNN's linear kernel (``torch.ops.mkldnn._linear_pointwise``)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


#: products go to oneDNN from this many rows and output columns on: below them its per-call cost outweighs the
#: faster kernel (``benchmarks/fp32_gemm.py``: 1 row of any layer, and k/v_proj's 192 columns up to 64 rows, were
#: slower through oneDNN)
MIN_ROWS, MIN_COLUMNS = 8, 512


def _onednn(a: Tensor, b: Tensor) -> bool:
    """Whether ``a @ b`` goes to oneDNN: float32 2-D operands of at least ``MIN_ROWS`` x ``MIN_COLUMNS`` output,
    ``a`` row-major (the forward and the input-gradient products; the weight gradient, ``a`` transposed, was
    not faster through oneDNN)."""
    return (
        a.dtype == torch.float32
        and b.dtype == torch.float32
        and a.dim() == 2
        and b.dim() == 2
        and a.shape[0] >= MIN_ROWS
        and a.shape[1] > 0
        and b.shape[1] >= MIN_COLUMNS
        and a.stride(1) == 1
    )


def mm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b``, a [M, K] and b [K, N]: float32 with a row-major ``a`` (and M, N large enough: ``_onednn``)
    through oneDNN's IEEE float32 GEMM (``torch.ops.mkldnn._linear_pointwise(a, b.T)``), anything else through
    torch's own ``aten::mm.out``.
    Returns [M, N] in the inputs' dtype."""
    if _onednn(a, b):
        return torch.ops.mkldnn._linear_pointwise(a, b.t(), None, "none", [], "")
    return torch.ops.aten.mm.out(a, b, out=a.new_empty((a.shape[0], b.shape[1])))


def addmm(bias: Tensor, a: Tensor, b: Tensor, *, beta=1, alpha=1) -> Tensor:
    """``beta * bias + alpha * (a @ b)``; oneDNN (as ``mm``) for a [N] float32 bias with beta = alpha = 1 (what
    ``nn.Linear`` calls), ``aten::addmm.out`` otherwise."""
    if beta == 1 and alpha == 1 and bias.dim() == 1 and bias.dtype == torch.float32 and _onednn(a, b):
        return torch.ops.mkldnn._linear_pointwise(a, b.t(), bias, "none", [], "")
    return torch.ops.aten.addmm.out(bias, a, b, beta=beta, alpha=alpha, out=a.new_empty((a.shape[0], b.shape[1])))


class OneDNNGemm:
    """Installs ``mm`` and ``addmm`` as the CPU kernels of ``aten::mm`` and ``aten::addmm`` (``torch.library``,
    process-wide while enabled, below autograd: backward passes use them too); ``disable()`` brings torch's own
    back. Also a context manager. Raises RuntimeError when oneDNN is not ``available``, or when the
    batch-invariant kernels (which own ``aten::mm``) are enabled. Keep a reference while it should act: the
    registration lives in a ``torch.library.Library`` that unregisters itself when garbage-collected, so
    ``OneDNNGemm().enable()`` alone ends at once. ``OneDNNGemm._active``: the enabled one, if any (a rollout process
    installs the same kernels as its trainer)."""

    _active: "OneDNNGemm | None" = None

    def __init__(self):
        self._lib = None

    @property
    def enabled(self) -> bool:
        return self._lib is not None

    def enable(self) -> "OneDNNGemm":
        if self.enabled:
            return self
        from .batch_invariant import BatchInvariantMode

        if BatchInvariantMode._active is not None:
            raise RuntimeError("kernels.fp32_gemm=onednn cannot run under the batch-invariant kernels (they own mm)")
        if not available():
            raise RuntimeError("this torch build has no oneDNN linear kernel (torch.ops.mkldnn._linear_pointwise)")
        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # torch warns that it overrides a kernel: that is the point here
            warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
            lib.impl("mm", mm, "CPU")
            lib.impl("addmm", addmm, "CPU")
        self._lib = lib
        OneDNNGemm._active = self
        return self

    def disable(self) -> None:
        if self.enabled:
            self._lib._destroy()
            self._lib = None
            if OneDNNGemm._active is self:
                OneDNNGemm._active = None

    def __enter__(self) -> "OneDNNGemm":
        return self.enable()

    def __exit__(self, *exc) -> None:
        self.disable()


def linear_shapes(model: torch.nn.Module) -> Counter:
    """(out_features, in_features) of the model's float32 CPU linear layers (the output layer included),
    counted."""
    shapes: Counter = Counter()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Linear) and weight is not None and weight.dtype == torch.float32:
            if weight.device.type == "cpu":
                shapes[tuple(weight.shape)] += 1
    return shapes


def _best_of(fn, seconds: float) -> float:
    fn()  # warm-up
    best, end = float("inf"), time.perf_counter() + seconds
    while True:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        if time.perf_counter() > end:
            return best


def measure(shapes: Counter, rows=MEASURE_ROWS, seconds: float = 0.005) -> tuple[float, float]:
    """(MKL seconds, oneDNN seconds): the best of repeated timings of each product a linear layer of each shape
    runs, the forward [M, in] x [in, out] and the input gradient [M, out] x [out, in], at each M in ``rows``,
    weighted by how many layers have the shape. Must run with oneDNN's kernels not installed."""
    aten, onednn = 0.0, 0.0
    for (out_f, in_f), count in shapes.items():
        w = torch.randn(out_f, in_f)
        for m in rows:
            x, g = torch.randn(m, in_f), torch.randn(m, out_f)
            for a, b in ((x, w.t()), (g, w)):
                aten += count * _best_of(lambda: torch.mm(a, b), seconds)
                onednn += count * _best_of(lambda: mm(a, b), seconds)
    return aten, onednn


def _cache_file() -> Path:
    from ..models import cache_dir

    return cache_dir() / "fp32_gemm.json"


def resolve(setting: str, model: torch.nn.Module, cache: Path | None = None, timer=measure) -> tuple[bool, str]:
    """(oneDNN on?, why) for ``kernels.fp32_gemm`` = ``setting`` and ``model``.

    ``aten``: off. ``onednn``: on (RuntimeError when not ``available``). ``auto``: on when the model's float32
    CPU linear layers (``linear_shapes``) take at least ``MIN_SPEEDUP`` x less time through oneDNN (``timer``,
    default ``measure``: about 0.1-1 s), at the current thread count; the result is cached in
    ``<lit_rl cache>/fp32_gemm.json`` under the CPU model, torch version, threads and shapes (delete it to
    re-measure), unless other processes used more than a tenth of a core meanwhile. Off without float32 CPU
    linear layers or without oneDNN. Raises ValueError for another ``setting``.
    """
    if setting not in CHOICES:
        raise ValueError(f"kernels.fp32_gemm={setting!r} is not allowed: choose one of {list(CHOICES)}")
    if setting == "aten":
        return False, "kernels.fp32_gemm=aten"
    if setting == "onednn":
        if not available():
            raise RuntimeError("kernels.fp32_gemm=onednn: this torch build has no oneDNN linear kernel")
        return True, "kernels.fp32_gemm=onednn"
    shapes = linear_shapes(model)
    if not shapes or not available():
        return False, "no float32 CPU linear layers" if shapes or available() else "no oneDNN in this torch build"
    from ..run.hardware import cpu_model, keep_if_alone, read_cache, timed_alone

    signature = ",".join(f"{o}x{i}*{c}" for (o, i), c in sorted(shapes.items()))
    key = "|".join([cpu_model(), f"torch {torch.__version__}", f"threads={torch.get_num_threads()}", signature])
    cache = _cache_file() if cache is None else cache
    cached = read_cache(cache)
    if key in cached:
        speedup, when = float(cached[key]["speedup"]), f"measured {cached[key]['measured']}, cached"
    else:
        (aten, onednn), others = timed_alone(timer, shapes)
        speedup = aten / max(onednn, 1e-12)
        entry = {"speedup": speedup, "measured": time.strftime("%Y-%m-%d %H:%M")}
        when = keep_if_alone(cache, cached, key, entry, others, verb="measured")
    on = speedup >= MIN_SPEEDUP
    verdict = "oneDNN" if on else "torch's BLAS"
    return on, (
        f"kernels.fp32_gemm=auto: {verdict} (oneDNN {speedup:.2f}x the speed of torch's BLAS on this model's "
        f"float32 linear shapes, {when})"
    )
