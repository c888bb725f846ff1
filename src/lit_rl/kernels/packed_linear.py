"""bf16 linear products from weights held in oneDNN's packed layout (``engine.packed_linear``): the embedded
engine's decode steps under bf16 autocast on the CPU, where each product has few rows and streams its whole weight.

Under bf16 autocast ``F.linear`` hands a bf16 weight to oneDNN in torch's plain [out, in] layout, and oneDNN
re-arranges it into the blocked layout its kernel reads at every call. ``pack`` does that once
(``torch.ops.mkldnn._reorder_linear_weight``, for a batch of ``PACK_ROWS`` rows) and ``linear`` runs the product
from the packed weight (``torch.ops.mkldnn._linear_pointwise``). Measured on SmolLM2-135M's shapes, the products
alone at 1 thread: 1.85x at 1 row and 1.23x at 64 rows on an AMD EPYC with AVX512-BF16; 2.09x and 1.67x on an
Intel Xeon with AMX, a shared machine (``benchmarks/README.md``, issue 34).

Nothing here is assumed about a CPU. Whether the engine uses it is ``resolve``'s call, once per CPU model, torch
version, thread count and set of shapes (``<lit_rl cache>/packed_linear.json``, like ``kernels.fp32_gemm``):
on only where the packed product gives **the same bits** as ``F.linear`` for every checked row count
(``CHECK_ROWS``) of each of the model's linear shapes, and (``auto``) is at least ``MIN_SPEEDUP`` faster
(``measure``). The packed layout a batch-size hint picks decides the kernel: on an Intel Xeon with AMX (torch
2.13) a weight packed for 1 row gave other bits than ``F.linear`` from 33 rows on, one packed for 8 or more rows
the same bits up to 1,024 rows; a CPU where it differs keeps ``F.linear``, so the default-kernel gap is unchanged.
Used only for products of at most ``MAX_ROWS`` rows (decode steps; a prefill's products use ``F.linear``), never
under ``kernels=batch_invariant`` (its own kernels run every product: ``rollout.weight_casts`` checks).
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from .fp32_gemm import _best_of

#: the batch-size hint a weight is packed for (oneDNN picks the blocked layout, and with it the kernel, from it)
PACK_ROWS = 16
#: the packed product serves inputs of at most this many rows (a decode step's batch); larger ones use F.linear
MAX_ROWS = 64
#: row counts at which ``check_bits`` compares the packed product with ``F.linear``: every count up to 16, then
#: around each power of two up to ``MAX_ROWS`` (oneDNN picks its kernels by size ranges; a sample, not every count)
CHECK_ROWS = (*range(1, 17), 23, 24, 31, 32, 33, 40, 47, 48, 56, 63, 64)
#: rows ``measure`` times: one row, a small and a full decode batch
MEASURE_ROWS = (1, 8, 64)
#: ``auto`` uses the packed product when the model's products take at most 1 / MIN_SPEEDUP of F.linear's time
MIN_SPEEDUP = 1.05


def available() -> bool:
    """True when this torch build has oneDNN's weight packing and packed linear kernel."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def pack(weight: Tensor) -> Tensor:
    """``weight`` [out, in] bf16 (CPU) in oneDNN's packed layout for ``PACK_ROWS`` rows: an opaque tensor of the
    same shape that only ``linear`` reads."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)


def linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear(x, weight, bias)`` from ``pack(weight)``: x [..., in] bf16, bias [out] bf16 or None; returns
    [..., out] bf16. No autograd (the engine's products run without gradients)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear_shapes(model: torch.nn.Module) -> Counter:
    """(out_features, in_features, has a bias) of the model's CPU ``nn.Linear`` layers with floating weights,
    counted (a tied output layer once per module that uses it)."""
    shapes: Counter = Counter()
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and m.weight.is_floating_point() and m.weight.device.type == "cpu":
            shapes[(m.out_features, m.in_features, m.bias is not None)] += 1
    return shapes


def _operands(out_f: int, in_f: int, has_bias: bool, rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g).to(torch.bfloat16)
    b = torch.randn(out_f, generator=g).to(torch.bfloat16) if has_bias else None
    return w, b, torch.randn(rows, in_f, generator=g).to(torch.bfloat16)


def check_bits(shapes: Counter, rows=CHECK_ROWS) -> list[str]:
    """The (shape, rows) pairs at which the packed product's bits differ from ``F.linear``'s on random bf16
    operands (``"576x1536, 33 rows"``); [] when all match. Runs under whatever kernels are installed now."""
    differ = []
    with torch.no_grad():
        for out_f, in_f, has_bias in shapes:
            w, b, x = _operands(out_f, in_f, has_bias, max(rows))
            packed = pack(w)
            for m in rows:
                if not torch.equal(F.linear(x[:m], w, b), linear(x[:m], packed, b)):
                    differ.append(f"{out_f}x{in_f}{' with bias' if has_bias else ''}, {m} rows")
    return differ


def fused_differ(groups, rows=CHECK_ROWS) -> list[str]:
    """The (group, rows) pairs at which one packed product of a group's weights stacked along the output dimension
    (``WeightCasts.fused_linear``: a layer's q/k/v projections, its gate/up projections) gives other bits than the
    group's separate packed products, on random bf16 operands (``"576x576+192x576+192x576, 33 rows"``); [] when all
    match. ``groups``: tuples of (out_features, in_features, has a bias), one input size per group."""
    differ = []
    with torch.no_grad():
        for i, group in enumerate(groups):
            parts = [_operands(out_f, in_f, has_bias, max(rows), seed=i * 31 + j) for j, (out_f, in_f, has_bias) in
                     enumerate(group)]  # fmt: skip
            x = parts[0][2]
            separate = [(pack(w), b) for w, b, _ in parts]
            biases = [b for _, b, _ in parts]
            stacked = pack(torch.cat([w for w, _, _ in parts]))
            bias = torch.cat(biases) if all(b is not None for b in biases) else None
            for m in rows:
                one = linear(x[:m], stacked, bias)
                if not torch.equal(one, torch.cat([linear(x[:m], w, b) for w, b in separate], dim=-1)):
                    name = "+".join(f"{o}x{n}" for o, n, _ in group)
                    differ.append(f"{name}, {m} rows")
    return differ


def measure(shapes: Counter, rows=MEASURE_ROWS, seconds: float = 0.005) -> tuple[float, float]:
    """(F.linear seconds, packed seconds): the best of repeated timings of each shape's bf16 product at each row
    count in ``rows``, weighted by how many layers have the shape."""
    plain, packed_s = 0.0, 0.0
    with torch.no_grad():
        for (out_f, in_f, has_bias), count in shapes.items():
            w, b, x = _operands(out_f, in_f, has_bias, max(rows))
            packed = pack(w)
            for m in rows:
                xm = x[:m]
                plain += count * _best_of(lambda: F.linear(xm, w, b), seconds)
                packed_s += count * _best_of(lambda: linear(xm, packed, b), seconds)
    return plain, packed_s


def _cache_file() -> Path:
    from ..models import cache_dir

    return cache_dir() / "packed_linear.json"


def check_setting(setting) -> None:
    """Raise ValueError naming ``engine.packed_linear`` for a value other than auto, true or false."""
    if not (setting == "auto" or isinstance(setting, bool)):
        raise ValueError(f"engine.packed_linear={setting!r} is not allowed: choose auto, true or false")


def resolve(
    setting, model: torch.nn.Module, cache: Path | None = None, timer=measure, checker=check_bits
) -> tuple[bool, str]:
    """(packed products on?, why) for ``engine.packed_linear`` = ``setting`` and ``model``, at the current thread
    count, for bf16 products on the CPU.

    ``False``: off. ``True``: on where the bits match (``checker``, default ``check_bits``); RuntimeError where
    torch lacks the ops (``available``). ``auto``: on where the bits match and the model's products take at least
    ``MIN_SPEEDUP`` x less time packed (``timer``, default ``measure``); off without oneDNN's ops or on a CPU
    without native bf16 (``run.hardware.cpu_facts``: there both paths are emulated). The check and the timing (6 s
    for SmolLM2-135M at 1 thread on a loaded 2-core Xeon) are cached in ``<lit_rl cache>/packed_linear.json`` under
    the CPU model, torch version, threads, the oneDNN cap and the shapes (delete it to measure again); a timing
    during which other processes used more than a tenth of a core is not cached (the bits are: they do not depend
    on load).
    Raises ValueError for another ``setting``."""
    check_setting(setting)
    if setting is False:
        return False, "engine.packed_linear=false"
    if not available():
        if setting is True:
            raise RuntimeError("engine.packed_linear=true: this torch build lacks oneDNN's packed linear kernel")
        return False, "engine.packed_linear=auto: off (no oneDNN packed linear kernel in this torch build)"
    from ..run.hardware import cpu_facts, cpu_model, keep_if_alone, onednn_isa_cap, read_cache, timed_alone, write_cache

    if setting == "auto" and not cpu_facts()["bf16_native"]:
        return False, "engine.packed_linear=auto: off (bf16 products are emulated on this CPU)"
    shapes = linear_shapes(model)
    if not shapes:
        return False, f"engine.packed_linear={setting}: off (no CPU linear layers)"
    signature = ",".join(f"{o}x{i}{'b' if b else ''}*{c}" for (o, i, b), c in sorted(shapes.items()))
    key = "|".join(
        [cpu_model(), f"torch {torch.__version__}", f"threads={torch.get_num_threads()}",
         f"onednn_cap={onednn_isa_cap() or 'none'}", f"rows<={MAX_ROWS} packed for {PACK_ROWS}", signature]
    )  # fmt: skip
    cache = _cache_file() if cache is None else cache
    cached = read_cache(cache)
    entry, when = cached.get(key, {}), "cached"
    if "differ" not in entry:
        entry, when = {"differ": checker(shapes)[:3], "measured": time.strftime("%Y-%m-%d %H:%M")}, "measured now"
        cached[key] = entry
        write_cache(cache, cached)
    if entry["differ"]:
        return False, (
            f"engine.packed_linear={setting}: off (its bits differ from F.linear's: {'; '.join(entry['differ'])}; "
            f"{when})"
        )
    if setting is True:
        return True, f"engine.packed_linear=true: on (the same bits as F.linear on this model's shapes, {when})"
    if "speedup" not in entry:
        (plain, packed), others = timed_alone(timer, shapes)
        entry = dict(entry, speedup=plain / max(packed, 1e-12))
        when = keep_if_alone(cache, cached, key, entry, others)
    on = entry["speedup"] >= MIN_SPEEDUP
    return on, (
        f"engine.packed_linear=auto: {'on' if on else 'off'} (packed bf16 products {entry['speedup']:.2f}x the "
        f"speed of F.linear on this model's shapes at {'/'.join(map(str, MEASURE_ROWS))} rows, the same bits; "
        f"{when})"
    )
