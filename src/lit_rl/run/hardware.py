"""The machine a run lands on, and what the ``auto`` settings make of it.

    set_omp_defaults()                      # before torch is imported: OpenMP threads that spin briefly, then sleep
    precision, reason = resolve_precision("auto", "cpu")   # bf16-mixed where bfloat16 is native, else 32-true
    threads = configure_threads("auto")     # the cores this process may run on
    peak = peak_flops(precision, "cpu")     # FLOP/s a matrix product reaches here (best probe seen)

Every decision reads facts about the hardware (what torch reports about the CPU's instruction sets, CUDA's
bf16 support, the process's CPU affinity and cgroup quota), never a figure measured on one machine. The
matmul probe measures the peak that ``perf/mfu`` divides by; on CPUs that are neither x86 nor CUDA (where
torch does not report a bf16 fact) it also decides the precision, by comparing the two dtypes.

Nothing here imports torch at module level, so ``set_omp_defaults`` can run before torch loads its OpenMP
runtime (libgomp reads ``GOMP_SPINCOUNT`` and ``OMP_WAIT_POLICY`` once, when it is loaded).
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from pathlib import Path

#: OpenMP settings lit_rl's entry points set before torch loads, unless the environment already says how OpenMP
#: should wait (``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` exported: nothing is added, since libgomp lets
#: GOMP_SPINCOUNT override the policy). GOMP_SPINCOUNT=1000: a thread waiting at a barrier spins ~1000 times
#: (microseconds), then sleeps. libgomp's default spins ~3 ms; beside a competing process those spinning threads
#: burn the time slices the thread they wait for needs (a step lost 2.9-4.8x). Measured by
#: benchmarks/contention.py (benchmarks/README.md, AMD EPYC with AVX512-BF16, 2 cores): alone 1.03-1.06x
#: the default's step time (the main job's first steps ~1.2x ACTIVE's, in decoding), beside a competitor
#: 1.8-1.9x; OMP_WAIT_POLICY=PASSIVE (sleep at once, the default until 2026-12-01) costs 1.10-1.24x alone
#: (the real main job 1.3-1.4x: decoding's many small products wait for a sleeping thread to wake) for
#: 1.25-2.0x under contention. Torch's Linux CPU wheels use libgomp; other
#: OpenMP runtimes ignore the variable.
OMP_DEFAULTS = {"GOMP_SPINCOUNT": "1000"}

#: variables that already say how OpenMP waits: when one is exported, set_omp_defaults adds nothing
OMP_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

#: oneDNN CPU ISA caps (``ONEDNN_MAX_CPU_ISA`` / ``DNNL_MAX_CPU_ISA``) that leave out bfloat16 dot products:
#: under them torch's bf16 matrix products run emulated, slower than float32.
NO_BF16_ISA_CAPS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")

#: ``platform.machine()`` names of x86 CPUs, whose bf16 facts torch reports (AVX512-BF16, AMX)
X86_ARCHES = ("x86_64", "amd64", "i386", "i686")

#: bf16 wins the probe-based choice only when it is at least this much faster than float32
PROBE_BF16_MARGIN = 1.2

#: nominal dense peaks of CUDA devices, TFLOP/s, by a substring of ``torch.cuda.get_device_name()`` (first
#: match wins, so specific names come first): (bf16, fp16, fp32 without TF32). Vendor data sheets, no sparsity.
CUDA_PEAK_TFLOPS = (
    ("H200", (989.0, 989.0, 67.0)),
    ("H100 PCIe", (756.0, 756.0, 51.0)),
    ("H100", (989.0, 989.0, 67.0)),
    ("H800", (989.0, 989.0, 67.0)),
    ("GH200", (989.0, 989.0, 67.0)),
    ("B200", (2250.0, 2250.0, 80.0)),
    ("A100", (312.0, 312.0, 19.5)),
    ("A800", (312.0, 312.0, 19.5)),
    ("L40S", (362.0, 362.0, 91.6)),
    ("L40", (181.0, 181.0, 90.5)),
    ("L4", (121.0, 121.0, 30.3)),
    ("A10G", (70.0, 70.0, 31.2)),
    ("A10", (125.0, 125.0, 31.2)),
    ("RTX 4090", (165.0, 165.0, 82.6)),
    ("RTX 3090", (71.0, 71.0, 35.6)),
    ("V100", (None, 125.0, 15.7)),
    ("T4", (None, 65.0, 8.1)),
)


# -- OpenMP and threads ------------------------------------------------------------------------------------
def set_omp_defaults(environ=None) -> dict[str, str]:
    """Put ``OMP_DEFAULTS`` into ``environ`` (default ``os.environ``) where it does not set them already.

    Must run before torch is imported: the OpenMP runtime reads its environment once, when it loads. Returns
    the variables it set. A user who exported ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` gets nothing added."""
    environ = os.environ if environ is None else environ
    if any(key in environ for key in OMP_WAIT_VARIABLES):
        return {}
    added = {key: value for key, value in OMP_DEFAULTS.items() if key not in environ}
    environ.update(added)
    return added


#: glibc malloc settings ``keep_freed_memory`` applies at start-up: allocations up to MALLOC_MMAP_THRESHOLD come
#: from the heap (not a fresh mmap each), and up to MALLOC_TRIM_THRESHOLD of freed memory at the heap's top stays
#: with the process. A decode step of SmolLM2-135M at 64 rows allocates and frees its [64, 49152] float32 logit
#: work (12.6 MB each: the float copy, / T, log-softmax, exp, cumsum); with glibc's defaults those pages go back
#: to the kernel and every step faults them in again: 2,930 minor page faults per decode step under bf16
#: autocast, 120 with these settings; the sampler's log-probs of [64, 49152] bf16 logits took 54 ms with 9,184
#: faults per call, 3.5 ms with 614 (AMD EPYC, 1 thread, a shared machine: the counts are the robust figures).
#: The update's largest buffers are bigger: the tied output layer's float32 gradient ([49152, 576], 113 MB, cast
#: back from each chunk's bf16 product) and the [512, 49152] float32 logits of a ``logprob_chunk_tokens`` chunk
#: (100 MB). At a 64 MiB threshold each was a fresh mmap: 480,000-800,000 minor page faults and 14.2-14.6 s for
#: one GRPO update of the main job's shape under bf16 autocast as Lightning enters it; at 1 GiB / 2 GiB, 0 faults
#: and 9.4 s after the first update (AMD EPYC with AVX512-BF16, 2 threads, alone; benchmarks/README.md, issue 34).
MALLOC_MMAP_THRESHOLD = 1 << 30
MALLOC_TRIM_THRESHOLD = 2 << 30
#: exported variables that already say how glibc returns memory: when one is set, keep_freed_memory changes nothing
MALLOC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_memory(environ=None) -> str:
    """Keep freed memory in the process (glibc's ``mallopt``: ``MALLOC_MMAP_THRESHOLD``, ``MALLOC_TRIM_THRESHOLD``)
    so that buffers freed and allocated again every decode step or micro-batch are not faulted in page by page
    each time. Takes effect at once, for the whole process; numerics are unchanged. Returns one line saying what it
    did: nothing where the C library is not glibc or where ``environ`` (default ``os.environ``) exports one of
    ``MALLOC_VARIABLES`` (the user's own settings win)."""
    import ctypes
    import ctypes.util

    environ = os.environ if environ is None else environ
    if any(key in environ for key in MALLOC_VARIABLES):
        return "malloc: left as the environment sets it"
    if platform.system() != "Linux" or not platform.libc_ver()[0] == "glibc":
        return "malloc: not glibc, left as it is"
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    ok = libc.mallopt(m_mmap_threshold, MALLOC_MMAP_THRESHOLD) and libc.mallopt(m_trim_threshold, MALLOC_TRIM_THRESHOLD)
    if not ok:
        return "malloc: glibc refused the thresholds, left as it is"
    return (
        f"malloc: freed memory kept (mmap threshold {MALLOC_MMAP_THRESHOLD >> 20} MiB, trim threshold "
        f"{MALLOC_TRIM_THRESHOLD >> 20} MiB): no page faults for the buffers each decode step and micro-batch "
        "frees and takes again"
    )


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup") -> float | None:
    """The CPU quota of this process's cgroup, in cores (cgroup v2 ``cpu.max``, else v1 ``cpu.cfs_quota_us``);
    None when unlimited or unreadable."""
    try:
        quota, period = Path(root, "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path(root, "cpu", "cpu.cfs_quota_us").read_text())
        period = int(Path(root, "cpu", "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def available_cores(cpus=None, sys_root: str = "/sys/devices/system/cpu", quota: float | None = -1.0) -> int:
    """Physical cores this process may run on: the CPUs of its affinity mask (``os.sched_getaffinity``),
    hyperthread siblings counted once (two threads of matrix products on one core only get in each other's
    way), capped by the cgroup CPU quota (rounded up). At least 1.

    ``cpus``, ``sys_root`` and ``quota`` replace the process's affinity, the sysfs topology folder and the
    cgroup quota (-1.0: read it; None: no quota), for tests."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    cores = set()
    for cpu in cpus:
        topology = Path(sys_root, f"cpu{cpu}", "topology")
        try:
            cores.add(
                (
                    topology.joinpath("physical_package_id").read_text().strip(),
                    topology.joinpath("core_id").read_text().strip(),
                )
            )
        except OSError:
            cores.add(("cpu", str(cpu)))  # no topology: count the CPU itself
    n = len(cores)
    quota = cgroup_cpu_limit() if quota == -1.0 else quota
    if quota is not None:
        n = min(n, math.ceil(quota))
    return max(1, n)


def auto_threads(processes: int = 1, environ=None) -> tuple[int, str]:
    """(threads, reason) for ``threads: auto``: ``OMP_NUM_THREADS`` when the environment sets it (the user's
    explicit choice), else ``available_cores()`` shared among ``processes`` workers of this run on this
    machine (CPU data-parallel ranks, an async rollout producer), at least 1."""
    environ = os.environ if environ is None else environ
    env = str(environ.get("OMP_NUM_THREADS", "")).strip()
    if env.isdigit() and int(env) >= 1:
        return int(env), f"OMP_NUM_THREADS={env} from the environment"
    cores = available_cores()
    shared = f", shared by {processes} workers" if processes > 1 else ""
    return max(1, cores // max(1, processes)), f"{cores} cores available to this process{shared}"


def oversubscribed(threads: int) -> list[str]:
    """[a warning] for an explicit ``threads`` above the cores this process may run on (``available_cores``), else
    []: more threads than cores take turns, and every product waits for the slowest (issue 33: threads=999 on 2
    cores ran 6.5x slower than threads=2)."""
    cores = available_cores()
    if threads <= cores:
        return []
    return [
        f"warning: threads={threads} is more than the {cores} cores available to this process: its threads take "
        f"turns and every step runs slower (threads=auto uses {cores})"
    ]


def resolve_threads(threads) -> int:
    """``threads`` as a count: ``auto`` (or null) -> ``auto_threads()``; a positive integer as is.
    Raises ValueError for anything else."""
    if threads in (None, "auto"):
        return auto_threads()[0]
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads={threads!r} is not allowed: choose auto or an integer >= 1")
    return threads


def configure_threads(threads="auto") -> int:
    """Set torch's intra-op thread count from ``threads`` (``resolve_threads``) and return it. The one place
    the run sets its thread count at start-up."""
    import torch

    n = resolve_threads(threads)
    torch.set_num_threads(n)
    return n


def cpu_busy_seconds(cpus=None) -> tuple[float, float, float]:
    """(busy CPU seconds of the CPUs ``cpus`` (default: this process's affinity mask) since boot, busy CPU
    seconds of this process, a monotonic clock) from /proc/stat and /proc/self/stat. Busy = everything but
    idle and iowait. Raises OSError where /proc is not Linux's."""
    cpus = os.sched_getaffinity(0) if cpus is None else set(cpus)
    tick = os.sysconf("SC_CLK_TCK")
    busy = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                values = [int(x) for x in fields]
                busy += sum(values) - values[3] - (values[4] if len(values) > 4 else 0)
    with open("/proc/self/stat") as f:
        own = f.read().rsplit(")", 1)[1].split()
    return busy / tick, (int(own[11]) + int(own[12])) / tick, time.monotonic()


class ThreadGovernor:
    """``threads: auto`` during a run: before each RL step, as many intra-op threads as the cores that other
    processes left free during the previous step, between 1 and ``max_threads``.

    Other processes' load = (busy time of this process's CPUs - this process's own CPU time) / wall time,
    from /proc (no sampling thread). On a quiet machine that is ~0 and the run keeps all its threads; when
    another CPU-bound process takes a core, the next step runs on the cores left, instead of every parallel
    region waiting for a thread whose core is taken (benchmarks/contention.py). Where /proc cannot be read
    the thread count stays at ``max_threads``.
    """

    def __init__(self, max_threads: int):
        self.max_threads = max(1, int(max_threads))
        self.threads = self.max_threads
        self.others = 0.0  # cores other processes used during the last step
        self._last = None

    def update(self) -> int:
        """Measure the load since the last call, set torch's thread count from it and return the count."""
        import torch

        try:
            now = cpu_busy_seconds()
        except (OSError, ValueError, IndexError):
            return self.threads
        if self._last is not None and now[2] - self._last[2] > 0.05:
            busy, own, wall = (now[i] - self._last[i] for i in range(3))
            self.others = max(0.0, (busy - own) / wall)
            self.threads = max(1, min(self.max_threads, round(self.max_threads - self.others)))
            if torch.get_num_threads() != self.threads:
                torch.set_num_threads(self.threads)
        self._last = now
        return self.threads


def omp_summary() -> str:
    """How OpenMP waits in this process, e.g. ``GOMP_SPINCOUNT=1000``, for start-up lines."""
    policy = os.environ.get("OMP_WAIT_POLICY")
    spin = os.environ.get("GOMP_SPINCOUNT")
    parts = [f"OMP_WAIT_POLICY={policy}"] if policy is not None else []
    if spin is not None:
        parts.append(f"GOMP_SPINCOUNT={spin}")
    return ", ".join(parts) or "OMP_WAIT_POLICY=unset (spin ~3 ms, then sleep)"


# -- what the hardware multiplies natively ----------------------------------------------------------------
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def onednn_isa_cap() -> str | None:
    """The oneDNN ISA cap the environment sets (``ONEDNN_MAX_CPU_ISA``, or its old name ``DNNL_MAX_CPU_ISA``),
    upper-cased; None when unset."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    return cap.strip().upper() if cap else None


def cpu_facts() -> dict:
    """What torch reports about this CPU: ``model``, ``arch`` (platform.machine()), ``capability`` (torch's
    CPU dispatch level, e.g. AVX512), ``avx512_bf16``, ``amx`` (AMX tiles: bf16 matrix units),
    ``onednn_isa_cap`` (None or the cap) and ``bf16_native``: bfloat16 dot products in hardware, usable by
    oneDNN (AVX512-BF16 or AMX, and no ISA cap that excludes them)."""
    import torch

    cap = onednn_isa_cap()
    avx512_bf16 = bool(torch.cpu._is_avx512_bf16_supported())
    amx = bool(torch.cpu._is_amx_tile_supported())
    return {
        "model": cpu_model(),
        "arch": platform.machine(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "avx512_bf16": avx512_bf16,
        "amx": amx,
        "onednn_isa_cap": cap,
        "bf16_native": (avx512_bf16 or amx) and cap not in NO_BF16_ISA_CAPS,
    }


def describe_cpu() -> str:
    """One line naming the CPU for benchmark and run headers: model, torch's CPU capability, bf16 support."""
    f = cpu_facts()
    bf16 = "AVX512-BF16" if f["avx512_bf16"] else "no AVX512-BF16"
    if f["amx"]:
        bf16 += ", AMX"
    if f["onednn_isa_cap"]:
        bf16 += f", oneDNN capped at {f['onednn_isa_cap']}" + (" (bf16 emulated)" if not f["bf16_native"] else "")
    return f"{f['model']} ({f['arch']}), torch CPU capability {f['capability']}, {bf16}"


def describe_machine() -> str:
    """The line beside every figure: the CPU (``describe_cpu``), its core count, torch and its thread count,
    the OpenMP wait policy, python and the date."""
    import torch

    return (
        f"{describe_cpu()}; {os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} "
        f"threads, {omp_summary()}), python {platform.python_version()}, {time.strftime('%Y-%m-%d')}"
    )


def uses_cuda(accelerator) -> bool:
    """Whether a Lightning ``accelerator`` value runs on CUDA here (``gpu``/``cuda``, or ``auto`` with one)."""
    import torch

    accelerator = str(accelerator or "auto").lower()
    if accelerator in ("gpu", "cuda"):
        return True
    return accelerator == "auto" and torch.cuda.is_available()


def resolve_precision(requested, accelerator="cpu", probe=None) -> tuple[str, str]:
    """``trainer.precision``: ``auto`` -> (``bf16-mixed`` or ``32-true``, the reason); anything else is
    returned as given (an explicit precision is always honoured), with the reason "set explicitly" — followed,
    for a bf16 precision on an x86 CPU without native bfloat16, by the warning of ``emulated_bf16_warning``.

    The rule: bf16-mixed where the hardware multiplies bfloat16 natively — a CUDA device with bf16 support
    (``torch.cuda.is_bf16_supported(including_emulation=False)``: Ampere and later), or a CPU with AVX512-BF16
    or AMX that oneDNN may use (``cpu_facts``) — else 32-true: without those instructions a bf16 product is
    converted to float32 and back, slower than float32 itself (issue 16: an AVX-512 Xeon without BF16 ran
    the main job 3.7-4.6x slower in bf16-mixed). On a CPU that is not x86 torch reports no bf16 fact; there
    ``probe`` (default ``probe_flops``) times both dtypes and bf16 must be ``PROBE_BF16_MARGIN`` faster.
    """
    if requested not in (None, "auto"):
        warning = emulated_bf16_warning(str(requested), accelerator)
        return str(requested), "set explicitly" + (f"; {warning}" if warning else "")
    import torch

    if uses_cuda(accelerator):
        if not torch.cuda.is_available():  # Lightning reports the missing device when the trainer starts
            return "32-true", "no CUDA device found"
        name = torch.cuda.get_device_name()
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return "bf16-mixed", f"CUDA device {name} multiplies bfloat16 natively"
        return "32-true", f"CUDA device {name} has no native bfloat16 (fp16 autocast: trainer.precision=16-mixed)"
    facts = cpu_facts()
    if facts["arch"].lower() in X86_ARCHES:
        if facts["bf16_native"]:
            unit = "AMX" if facts["amx"] else "AVX512-BF16"
            return "bf16-mixed", f"the CPU multiplies bfloat16 natively ({unit}; {facts['model']})"
        why = (
            f"oneDNN is capped at {facts['onednn_isa_cap']}"
            if facts["avx512_bf16"] or facts["amx"]
            else "no AVX512-BF16 or AMX"
        )
        return "32-true", (
            f"the CPU has no native bfloat16 matrix products ({why}; {facts['model']}): "
            f"bf16 would be emulated, slower than float32"
        )
    probe = probe_flops if probe is None else probe
    threads = torch.get_num_threads()
    bf16, fp32 = probe("bf16-mixed", threads), probe("32-true", threads)
    if bf16 >= PROBE_BF16_MARGIN * fp32:
        return "bf16-mixed", f"bf16 matrix products measured {bf16 / fp32:.2f}x float32's on this {facts['arch']} CPU"
    return "32-true", f"bf16 matrix products measured only {bf16 / fp32:.2f}x float32's on this {facts['arch']} CPU"


def emulated_bf16_warning(precision: str, accelerator="cpu") -> str | None:
    """A warning for an explicit bf16 ``precision`` (``bf16-mixed``, ``bf16-true``, ...) on an x86 CPU whose
    bfloat16 matrix products are emulated (``cpu_facts()["bf16_native"]`` false), else None. Emulated bf16 is
    slower than float32 by a factor that depends on the CPU: the main job's step 3.7-4.6x on an AVX-512 Xeon
    without AVX512-BF16 (issue 16's report), the products themselves about 90-110x on an AVX2-only AMD EPYC
    (torch 2.13, benchmarks/README.md). The precision is still honoured; ``auto`` would pick 32-true."""
    on_cpu = str(accelerator or "auto").lower() in ("cpu", "auto") and not uses_cuda(accelerator)
    if not (str(precision).startswith("bf16") and on_cpu):
        return None
    facts = cpu_facts()
    if facts["arch"].lower() not in X86_ARCHES or facts["bf16_native"]:
        return None
    return (
        f"WARNING: this CPU has no native bfloat16 matrix products ({facts['model']}, torch CPU capability "
        f"{facts['capability']}): every bf16 product is emulated and runs slower than float32, on AVX2-only "
        f"CPUs about 100x slower; trainer.precision=auto (or 32-true) runs float32"
    )


# -- the peak that perf/mfu divides by ----------------------------------------------------------------------
PROBE_SIZE = 1024  # [n, n] x [n, n]: 2.1 GFLOP per product, large enough for full speed
PROBE_SECONDS = 0.6
QUIET_PROBES = 3  # peak_flops probes at each start until the cache holds this many quiet probes


def precision_dtype(precision: str):
    """The dtype a Lightning precision multiplies in: bf16* -> bfloat16, 16* -> float16, else float32."""
    import torch

    precision = str(precision)
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return torch.float32


def _other_cpu_seconds(start: tuple[float, float] | None = None) -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, of this process) from /proc; with ``start``, the seconds other
    processes used since it. Linux only; (0, 0) elsewhere."""
    try:
        tick = os.sysconf("SC_CLK_TCK")
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        busy = (sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)) / tick  # minus idle, iowait
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
        mine = (int(own[11]) + int(own[12])) / tick
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0
    if start is None:
        return busy, mine
    return (busy - start[0]) - (mine - start[1]), 0.0


#: a timing during which other processes used more than this many cores on average is used but not cached
BUSY_CORES = 0.1


def timed_alone(timer, *args):
    """(``timer(*args)``, the cores other processes used on average meanwhile): a start-up timing that picks a
    kernel (``kernels.*.resolve``) is cached only when that is at most ``BUSY_CORES`` (``keep_if_alone``)."""
    start, t0 = _other_cpu_seconds(), time.perf_counter()
    result = timer(*args)
    return result, _other_cpu_seconds(start)[0] / max(time.perf_counter() - t0, 1e-9)


def keep_if_alone(cache: Path, cached: dict, key: str, entry: dict, others: float, verb: str = "timed") -> str:
    """Store ``entry`` under ``key`` in ``cached`` and write it to ``cache`` unless other processes used more than
    ``BUSY_CORES`` cores during the timing (``others``, from ``timed_alone``); returns what the start-up line says:
    "<verb> now", or why it was not cached."""
    if others > BUSY_CORES:
        return f"{verb} now; not cached: other processes used {others:.1f} cores meanwhile"
    cached[key] = entry
    write_cache(cache, cached)
    return f"{verb} now"


def probe_flops(
    precision: str, threads: int, seconds: float = PROBE_SECONDS, size: int = PROBE_SIZE, device: str = "cpu"
) -> float:
    """Achievable FLOP/s of a square matrix product in ``precision``'s dtype on ``threads`` threads: the
    best rate of repeated [n, n] x [n, n] products (2·n³ FLOPs each) over ``seconds``. n is ``size``, or
    smaller where one product of that size would take more than a tenth of ``seconds`` (a dtype the
    hardware emulates slowly: float16 on most CPUs), judged from one [256, 256] product first; at most
    about 2 s in all. Uncached; ``peak_flops`` caches it."""
    import torch

    dtype = precision_dtype(precision)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)

    def timed(a, b) -> float:
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync()
        return time.perf_counter() - t0

    try:
        with torch.no_grad():
            small = torch.randn(256, 256, device=device).to(dtype)
            timed(small, small)
            rate = 2.0 * 256**3 / max(timed(small, small), 1e-9)
            n = int(min(size, max(64, (rate * seconds / 10 / 2.0) ** (1 / 3))) // 64 * 64)
            a = torch.randn(n, n, device=device).to(dtype)
            b = torch.randn(n, n, device=device).to(dtype)
            timed(a, b)  # warm-up
            best, t_end = rate, time.perf_counter() + seconds
            while time.perf_counter() < t_end:
                best = max(best, 2.0 * n**3 / max(timed(a, b), 1e-9))
        return best
    finally:
        torch.set_num_threads(previous)


def _cache_file() -> Path:
    from ..models import cache_dir

    return cache_dir() / "peak_flops.json"


def read_cache(cache: Path) -> dict:
    """The measurements in a JSON cache file (``peak_flops.json``, ``fp32_gemm.json``), {} when absent or unreadable."""
    try:
        return json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}


def write_cache(cache: Path, cached: dict) -> None:
    """Write ``cached`` to ``cache`` atomically (a partial file renamed over it, so concurrent runs never read half a
    file); a read-only location is skipped (it costs a measurement per run, nothing else)."""
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f"{cache.name}.partial-{os.getpid()}")
        tmp.write_text(json.dumps(cached, indent=1, sort_keys=True))
        os.replace(tmp, cache)
    except OSError:
        pass


def peak_flops(
    precision: str, accelerator="cpu", threads: int | None = None, probe=None, cache: Path | None = None
) -> tuple[float, str]:
    """(peak FLOP/s, where it comes from) that ``perf/mfu`` divides the update's FLOP rate by.

    CUDA: the device's nominal dense peak for the precision's dtype (``CUDA_PEAK_TFLOPS``), else a probe on
    the device. CPU: the best probe seen at the run's dtype and thread count, kept in
    ``<lit_rl cache>/peak_flops.json`` under the CPU model, torch version, dtype, threads and oneDNN cap
    (``record_peak``). Other processes' load only ever lowers a probe (a probe on a busy machine read ~30% low, so
    perf/mfu read high, while it stayed the cached figure), so the highest one seen is the estimate that load cannot
    have inflated. A call probes (``probe_flops``, about 0.6 s) until the entry holds ``QUIET_PROBES`` probes during
    which other processes used at most a tenth of a core; after that it reads the cache (a test suite or a sweep
    starts many runs: 0.6 s each otherwise). A busy probe is said so in the source and still counts toward the
    best, not toward the quiet ones. Delete the file to forget the best and probe again.
    """
    import torch

    dtype = precision_dtype(precision)
    probe = probe_flops if probe is None else probe
    if uses_cuda(accelerator) and torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        column = {torch.bfloat16: 0, torch.float16: 1}.get(dtype, 2)
        for key, peaks in CUDA_PEAK_TFLOPS:
            if key in name and peaks[column] is not None:
                return peaks[column] * 1e12, f"nominal peak of {name} ({str(dtype).removeprefix('torch.')})"
        return probe(precision, torch.get_num_threads(), device="cuda"), f"matmul probe on {name}"
    threads = torch.get_num_threads() if threads is None else threads
    entry = read_cache(_cache_file() if cache is None else cache).get(_peak_key(dtype, threads), {})
    if int(entry.get("quiet_probes", 0)) >= QUIET_PROBES:
        return float(entry["flops"]), (
            f"best matmul probe seen {float(entry['flops']) / 1e12:.3g} TFLOP/s (cached {entry['measured']}, "
            f"{entry['quiet_probes']} quiet probes)"
        )
    start = _other_cpu_seconds()
    t0 = time.perf_counter()
    flops = probe(precision, threads)
    others = _other_cpu_seconds(start)[0] / max(time.perf_counter() - t0, 1e-9)
    best, source = record_peak(precision, flops, threads, cache, quiet=others <= 0.1)
    busy = f"; other processes used {others:.1f} cores meanwhile" if others > 0.1 else ""
    return best, f"matmul probe: {flops / 1e12:.3g} TFLOP/s now{busy}, {source}"


def _peak_key(dtype, threads: int) -> str:
    import torch

    return "|".join(
        [
            cpu_model(),
            f"torch {torch.__version__}",
            str(dtype).removeprefix("torch."),
            f"threads={threads}",
            f"onednn_cap={onednn_isa_cap() or 'none'}",
        ]
    )


def record_peak(
    precision: str, flops: float, threads: int, cache: Path | None = None, quiet: bool = False
) -> tuple[float, str]:
    """Keep ``flops`` (FLOP/s of a matrix product measured at ``precision``'s dtype on ``threads`` CPU threads) in
    the peak cache (``peak_flops``) when it beats the best seen there, and count it among the entry's
    ``quiet_probes`` when ``quiet`` (no other process busy meanwhile); returns (the best now, where it comes from:
    this measurement, or the cached one and when it was measured). A read-only cache keeps nothing."""
    key = _peak_key(precision_dtype(precision), threads)
    cache = _cache_file() if cache is None else cache
    cached = read_cache(cache)
    entry = cached.get(key)
    quiet_probes = int((entry or {}).get("quiet_probes", 0)) + int(quiet)
    if entry is not None and float(entry["flops"]) >= flops:
        cached[key] = dict(entry, quiet_probes=quiet_probes)
        write_cache(cache, cached)
        return float(entry["flops"]), f"best seen {float(entry['flops']) / 1e12:.3g} (cached {entry['measured']})"
    cached[key] = {"flops": flops, "measured": time.strftime("%Y-%m-%d %H:%M"), "quiet_probes": quiet_probes}
    write_cache(cache, cached)
    return flops, "the best seen (cached)" if entry is None else "the best seen, replacing a lower cached one"
