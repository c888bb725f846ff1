"""One decode step's attention on the CPU from a kernel of lit_rl's own (``engine.decode_attention``).

In a cached decode step each sequence has one query row per head; the H / KVH query heads of a key/value head
read the same cached keys and values. torch's CPU flash kernel (what ``sdpa`` runs) sets up blocking and, in
bf16, packs each problem's keys and values before two small matrix products; for one to a few query rows
against ~100 keys that setup is most of the time: 0.90 ms a layer for [64 rows, 3 KV heads, 3 grouped query
heads, 107 keys, head_dim 64] in bf16 at 2 threads, where streaming the 5.3 MB of keys and values takes ~0.1 ms
(AMD EPYC with AVX512-BF16, ``benchmarks/decode_roofline.py``; the issue-34 sections of benchmarks/README.md).

``csrc/decode_attention.cpp`` (``torch.ops.lit_rl.decode_attention``) reads each (row, key/value head)'s cache
once: scores s = scale * q . k in float32 from the cache's dtype (bf16 widens exactly), masked positions -inf,
p = exp(s - max s) with its float32 sum, p rounded to the cache's dtype (as torch's flash kernel rounds the
weights of its second product), out = sum_l p_l v_l / sum in float32, stored in the query's dtype; a row that sees
no key gets zeros. On a CPU with AVX-512 (head_dim 32 / 64 / 128 / 256, up to 8 query heads per key/value head)
the query rows and accumulators stay in registers; elsewhere portable loops run (slow: ``auto`` then measures
torch's SDPA faster and keeps it). The values are not SDPA's bits (another summation order): the engine's
log-probs move by rounding, as between any two attention kernels; the default-kernel gap is measured against the
trainer in benchmarks/README.md. Never under ``kernels=batch_invariant`` (its attention is its own).

The kernel is compiled for the machine at hand (``-march=native``) with torch's C++ extension builder (ninja) on
first use (``build``, with ``csrc/attention_backward.cpp``; about 20 s on 2 cores, once per CPU, torch and source:
``<lit_rl cache>/ext/``;
``scripts/setup.sh`` builds it). Without a C++ compiler ``auto`` is off with a message and ``true`` is refused at
start-up (``schema.rollout``: ``toolchain_missing``).
``resolve`` decides for a model: ``auto`` times both kernels on the model's decode shapes (``measure``) and
caches the result per CPU model, torch, threads, dtype and shape like ``kernels.fp32_gemm``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention_backward import head_shape
from .fp32_gemm import _best_of

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cpp"
#: built into one extension: this kernel, the trainer's attention backward (``kernels.attention_backward``) and the
#: decode step's sampler (``kernels.sampling``)
SOURCES = (SOURCE, SOURCE.with_name("attention_backward.cpp"), SOURCE.with_name("sampling.cpp"))
#: included by ``SOURCES`` (part of the build's key)
HEADERS = (SOURCE.with_name("vec.h"),)
FLAGS = ("-O3", "-march=native", "-fopenmp")
#: rows and context lengths ``measure`` times (a full and a small decode batch; a short and a long context)
MEASURE = ((64, 64), (64, 256), (8, 128))
#: ``auto`` uses the kernel when it takes at most 1 / MIN_SPEEDUP of SDPA's time over ``MEASURE``
MIN_SPEEDUP = 1.1
#: the dtypes the kernel reads (the cache's and the query's)
DTYPES = (torch.bfloat16, torch.float32)

_built: str | None = None  # None: not tried; "": loaded; else why it cannot be
#: per thread (a rollout producer thread and the trainer's own rollouts enter and leave ``active`` apart): the
#: dtypes the kernel serves there
_state = threading.local()
#: a build lock (torch's ``FileBaton``) older than this was left by a killed build (a build takes ~15 s): removed, not
#: waited on forever
STALE_LOCK_S = 120


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_dir() -> Path:
    """Where the kernels are built: ``<lit_rl cache>/ext/decode_attention-<key>``, the key a hash of the sources
    (``SOURCES``, ``HEADERS``), the flags, the CPU's instruction-set flags and torch's version (another machine or
    torch builds its own)."""
    from ..models import cache_dir

    key = hashlib.sha1(
        "|".join(
            [*(path.read_text() for path in (*SOURCES, *HEADERS)), " ".join(FLAGS), _cpu_flags(), torch.__version__]
        ).encode()
    ).hexdigest()[:12]
    return cache_dir() / "ext" / f"decode_attention-{key}"


def toolchain_missing() -> str:
    """ "" when a C++ compiler (``$CXX``, else ``c++`` / ``g++``) and ninja (torch's extension builder runs it; the
    ``ninja`` package is a lit_rl dependency) are found, else what is missing."""
    from torch.utils.cpp_extension import is_ninja_available

    cxx = os.environ.get("CXX")
    if not (shutil.which(cxx) if cxx else shutil.which("c++") or shutil.which("g++")):
        return f"no C++ compiler ({'$CXX=' + cxx if cxx else 'c++ / g++'}) on PATH"
    if not is_ninja_available():
        return "no ninja on PATH (pip install ninja)"
    return ""


def _wait_for_lock(lock: Path) -> None:
    """Wait while another process builds (torch's builder holds ``lock``); a lock older than ``STALE_LOCK_S`` was
    left by a build that was killed: removed (torch's builder would otherwise wait on it forever)."""
    said = False
    while lock.exists():
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > STALE_LOCK_S:
            lock.unlink(missing_ok=True)
            print(f"lit_rl: removed {lock}, left {age:.0f} s ago by a decode attention build that did not finish")
            return
        if not said:
            print(f"lit_rl: waiting for another process's decode attention build ({lock}; at most {STALE_LOCK_S} s)",
                  flush=True)  # fmt: skip
            said = True
        time.sleep(0.5)


def build(verbose: bool = False) -> str:
    """Compile (first time: ~20 s on 2 cores, with a line saying so) and load the kernels of ``SOURCES``; returns ""
    when ``torch.ops.lit_rl.decode_attention`` and ``torch.ops.lit_rl.attention_backward`` are usable, else why not
    (``toolchain_missing``, a failed build: the compiler's last line). Once per process."""
    global _built
    if _built is not None:
        return _built
    if hasattr(torch.ops.lit_rl, "decode_attention"):
        _built = ""
        return _built
    _built = toolchain_missing()
    if _built:
        return _built
    from torch.utils.cpp_extension import load

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    _wait_for_lock(directory / "lock")
    if not (directory / "lit_rl_decode_attention.so").exists():
        print(f"lit_rl: compiling lit_rl's CPU kernels for this CPU (once, ~20 s) in {directory}",
              flush=True)  # fmt: skip
    try:
        load("lit_rl_decode_attention", [str(path) for path in SOURCES], extra_cflags=list(FLAGS),
             extra_ldflags=["-fopenmp"], build_directory=str(directory), is_python_module=False,
             verbose=verbose)  # fmt: skip
        _built = ""
    except (RuntimeError, OSError, ImportError) as err:  # a compiler or loader error: keep SDPA, say why
        last = (str(err).strip().splitlines() or [type(err).__name__])[-1]
        _built = f"the build in {directory} failed: {last[:200]}"
    return _built


def attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """The kernel (module docstring): query [B, KVH, G, D], key and value [B, KVH, L, D] (head_dim contiguous;
    other strides free, e.g. slices of a reserved cache), all bf16 or all float32; mask None or bool [B, L]
    (True = attend; any strides); returns [B, KVH, G, D] in the query's dtype. ``build`` first. Raises
    RuntimeError for other shapes or dtypes (naming the operand)."""
    return torch.ops.lit_rl.decode_attention(query, key, value, mask, float(scale))


def serves(dtype: torch.dtype) -> bool:
    """Inside an ``active`` block of this thread that turned the kernel on for ``dtype`` (the dtype the attention
    computes in)."""
    return dtype in getattr(_state, "on", ())


@contextlib.contextmanager
def active(dtypes: tuple[torch.dtype, ...]):
    """Decode steps inside the block, in this thread, whose attention computes in one of ``dtypes`` run the
    kernel (``single_query.attention`` asks ``serves``); () = none. Re-entrant: the innermost block decides."""
    before = getattr(_state, "on", ())
    _state.on = tuple(dtypes)
    try:
        yield
    finally:
        _state.on = before


def _operands(rows: int, kvh: int, group: int, dim: int, length: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(rows, kvh, group, dim, generator=g).to(dtype)
    k, v = (torch.randn(rows, kvh, length, dim, generator=g).to(dtype) for _ in range(2))
    return q, k, v


def measure(kvh: int, group: int, dim: int, dtype: torch.dtype, shapes=MEASURE, seconds: float = 0.01):
    """(SDPA seconds, kernel seconds): the best of repeated timings of one layer's decode attention at each
    (rows, context) of ``shapes``, summed; SDPA as ``single_query`` calls it (grouped query heads, no mask)."""
    sdpa = kernel = 0.0
    scale = dim**-0.5
    # outside autocast: under the rollout's bf16 autocast SDPA would time bf16 where the kernel (no autocast rule)
    # times ``dtype``
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        for rows, length in shapes:
            q, k, v = _operands(rows, kvh, group, dim, length, dtype)
            sdpa += _best_of(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale), seconds)
            kernel += _best_of(lambda: attention(q, k, v, None, scale), seconds)
    return sdpa, kernel


def check_setting(setting) -> None:
    """Raise ValueError naming ``engine.decode_attention`` for a value other than auto, true or false."""
    if not (setting == "auto" or isinstance(setting, bool)):
        raise ValueError(f"engine.decode_attention={setting!r} is not allowed: choose auto, true or false")


def resolve(setting, model: torch.nn.Module, cache: Path | None = None, timer=measure) -> tuple[tuple, str]:
    """(the dtypes the kernel serves, why) for ``engine.decode_attention`` = ``setting`` and ``model`` at the
    current thread count.

    ``False``: none. ``True``: bf16 and float32; RuntimeError when the kernel cannot be built (``build``'s
    reason). ``auto``: each dtype where the kernel is measured at least ``MIN_SPEEDUP`` x faster than SDPA on the
    model's head shape (``timer``, default ``measure``); none without a compiler. The timing (under a second) is
    cached in ``<lit_rl cache>/decode_attention.json`` under the CPU model, torch, threads, head shape and the
    build (delete it to measure again); a timing during which other processes used more than a tenth of a core is
    not cached. Raises ValueError for another ``setting``."""
    check_setting(setting)
    if setting is False:
        return (), "engine.decode_attention=false"
    why = build()
    if why:
        if setting is True:
            raise RuntimeError(f"engine.decode_attention=true: the kernel is not available: {why}")
        return (), f"engine.decode_attention=auto: off ({why})"
    if setting is True:
        return DTYPES, "engine.decode_attention=true: on (bf16 and float32 decode steps)"
    heads = head_shape(model)  # (query heads, key/value heads, head_dim)
    if heads is None:
        return (), "engine.decode_attention=auto: off (the model's config names no attention heads)"
    shape = (heads[1], heads[0] // heads[1], heads[2])  # key/value heads, query heads per one, head_dim
    from ..models import cache_dir
    from ..run.hardware import cpu_model, keep_if_alone, read_cache, timed_alone

    cache = cache_dir() / "decode_attention.json" if cache is None else cache
    cached = read_cache(cache)
    on, parts, when = [], [], "cached"
    for dtype in DTYPES:
        key = "|".join(
            [
                cpu_model(),
                f"torch {torch.__version__}",
                f"threads={torch.get_num_threads()}",
                str(dtype).removeprefix("torch."),
                "kvh={} group={} dim={}".format(*shape),
                build_dir().name,
            ]
        )  # the build's name: another kernel source is timed again
        if key not in cached:
            (sdpa, kernel), others = timed_alone(timer, *shape, dtype)
            entry = {"speedup": sdpa / max(kernel, 1e-12), "measured": time.strftime("%Y-%m-%d %H:%M")}
            when = keep_if_alone(cache, cached, key, entry, others)
        else:
            entry = cached[key]
        if entry["speedup"] >= MIN_SPEEDUP:
            on.append(dtype)
        parts.append(f"{str(dtype).removeprefix('torch.')} {entry['speedup']:.2f}x")
    state = "on for " + " and ".join(str(d).removeprefix("torch.") for d in on) if on else "off"
    return tuple(on), (
        f"engine.decode_attention=auto: {state} (the kernel's speed against torch's SDPA on this model's decode "
        f"attention: {', '.join(parts)}; {when})"
    )
