"""What ``auto`` makes of the machine (lit_rl.run.hardware): the precision from the hardware's bf16 facts (mocked
for the kinds this machine is not, real for the kind it is), threads from the affinity mask and quota, the
cached peak probe, and start-up validation of both fields."""

import json
import os

import pytest
import torch
from helpers import fast_config as cfg_for

from lit_rl.config import ConfigError, validate
from lit_rl.run import hardware
from lit_rl.run.resolve import resolve_engine, resolve_hardware
from lit_rl.run.train import precision_plugins


def mock_cpu(monkeypatch, avx512_bf16: bool, amx: bool = False, arch: str = "x86_64", model: str = "Test CPU"):
    """A CPU without CUDA whose facts are ``avx512_bf16``, ``amx``, ``arch``, ``model``."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(hardware.platform, "machine", lambda: arch)
    monkeypatch.setattr(hardware, "cpu_model", lambda: model)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)


def mock_cuda(monkeypatch, name: str, bf16: bool):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)


def test_auto_precision_on_cpus_follows_native_bf16(monkeypatch):
    """Intel Xeon with AVX-512 but no AVX512-BF16 (the issue's machine) -> 32-true; AVX512-BF16 (this AMD EPYC)
    or AMX (Sapphire Rapids) -> bf16-mixed; an ISA cap that keeps oneDNN off its bf16 kernels -> 32-true."""
    mock_cpu(monkeypatch, avx512_bf16=False, model="Intel(R) Xeon(R) CPU @ 2.20GHz")
    precision, why = hardware.resolve_precision("auto", "cpu")
    assert precision == "32-true"
    assert "no AVX512-BF16 or AMX" in why and "Intel(R) Xeon(R)" in why
    mock_cpu(monkeypatch, avx512_bf16=True, model="AMD EPYC")
    assert hardware.resolve_precision("auto", "cpu") == (
        "bf16-mixed",
        "the CPU multiplies bfloat16 natively (AVX512-BF16; AMD EPYC)",
    )
    mock_cpu(monkeypatch, avx512_bf16=False, amx=True)
    assert hardware.resolve_precision("auto", "auto")[0] == "bf16-mixed"
    mock_cpu(monkeypatch, avx512_bf16=True)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx512_core")
    precision, why = hardware.resolve_precision("auto", "cpu")
    assert precision == "32-true" and "oneDNN is capped at AVX512_CORE" in why
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert hardware.resolve_precision("auto", "cpu")[0] == "bf16-mixed"


def test_auto_precision_on_cuda_follows_bf16_support(monkeypatch):
    mock_cuda(monkeypatch, "NVIDIA H100 80GB HBM3", bf16=True)
    assert hardware.resolve_precision("auto", "gpu") == (
        "bf16-mixed",
        "CUDA device NVIDIA H100 80GB HBM3 multiplies bfloat16 natively",
    )
    assert hardware.resolve_precision("auto", "auto")[0] == "bf16-mixed"
    assert (
        hardware.resolve_precision("auto", "cpu")[0] != "bf16-mixed"
        or torch.cpu._is_avx512_bf16_supported()
        or torch.cpu._is_amx_tile_supported()
    )  # accelerator=cpu asks the CPU, not the GPU
    mock_cuda(monkeypatch, "Tesla T4", bf16=False)
    precision, why = hardware.resolve_precision("auto", "gpu")
    assert precision == "32-true" and "16-mixed" in why


def test_an_explicit_precision_is_always_honoured(monkeypatch):
    """Honoured as given; bf16 on a CPU that would emulate it (measured ~100x slower products on an AVX2-only
    AMD EPYC) carries a warning, printed at start-up and written to config.yaml's header."""
    mock_cpu(monkeypatch, avx512_bf16=True)
    for explicit in ("bf16-mixed", "32-true", "16-mixed"):
        assert hardware.resolve_precision(explicit, "cpu") == (explicit, "set explicitly")
    mock_cpu(monkeypatch, avx512_bf16=False, model="AMD EPYC 7B12")
    for explicit in ("32-true", "16-mixed"):
        assert hardware.resolve_precision(explicit, "cpu") == (explicit, "set explicitly")
    for explicit in ("bf16-mixed", "bf16-true"):
        precision, why = hardware.resolve_precision(explicit, "cpu")
        assert precision == explicit
        assert why.startswith("set explicitly; WARNING: this CPU has no native bfloat16") and "AMD EPYC 7B12" in why
    mock_cuda(monkeypatch, "Tesla T4", bf16=False)
    assert hardware.resolve_precision("bf16-mixed", "gpu") == ("bf16-mixed", "set explicitly")  # not a CPU matter
    mock_cpu(monkeypatch, avx512_bf16=False, arch="aarch64")
    assert hardware.resolve_precision("bf16-mixed", "cpu") == ("bf16-mixed", "set explicitly")  # no x86 facts
    mock_cpu(monkeypatch, avx512_bf16=False)
    cfg = cfg_for("trainer.precision=bf16-mixed")
    lines = resolve_hardware(cfg)
    assert cfg.trainer.precision == "bf16-mixed"
    assert lines[0].startswith("trainer.precision=bf16-mixed (set explicitly; WARNING: ")
    cfg = cfg_for("trainer.precision=32-true")
    assert resolve_hardware(cfg)[0] == "trainer.precision=32-true"


def test_other_cpus_decide_by_the_probe(monkeypatch):
    """An ARM CPU: torch reports no bf16 fact, so both dtypes are timed; bf16 must be 1.2x faster."""
    mock_cpu(monkeypatch, avx512_bf16=False, arch="aarch64")
    fast = {"bf16-mixed": 300e9, "32-true": 100e9}
    assert hardware.resolve_precision("auto", "cpu", probe=lambda p, t: fast[p])[0] == "bf16-mixed"
    slow = {"bf16-mixed": 110e9, "32-true": 100e9}
    precision, why = hardware.resolve_precision("auto", "cpu", probe=lambda p, t: slow[p])
    assert precision == "32-true" and "1.10x" in why


def test_auto_precision_with_the_real_probe_here():
    """This machine's own facts: bf16-mixed exactly where torch reports AVX512-BF16 or AMX."""
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in hardware.NO_BF16_ISA_CAPS:
        native = False
    precision, why = hardware.resolve_precision("auto", "cpu")
    assert precision == ("bf16-mixed" if native else "32-true"), why
    assert hardware.cpu_model() in why


@pytest.mark.parametrize("bf16, expected", [(True, "bf16-mixed"), (False, "32-true")])
def test_config_yaml_records_the_choice_and_vllm_dtype_follows(monkeypatch, tmp_path, bf16, expected):
    """resolve_hardware fills trainer.precision (the reason goes to config.yaml's header) and the vLLM
    engine's dtype: null follows it: bfloat16 only where bf16-mixed was chosen."""
    mock_cpu(monkeypatch, avx512_bf16=bf16)
    cfg = cfg_for("trainer.precision=auto", "engine=vllm")
    assert cfg.trainer.precision == "auto"
    lines = resolve_hardware(cfg)
    assert cfg.trainer.precision == expected
    assert lines[0].startswith(f"trainer.precision={expected} (auto: ")
    resolve_engine(cfg)
    assert cfg.engine.dtype == ("bfloat16" if bf16 else "float32")


def test_the_default_precision_and_threads_are_auto():
    from helpers import compose_config

    for trainer in ("cpu", "gpu", "ddp", "fsdp"):
        cfg = compose_config(f"trainer={trainer}")
        assert cfg.trainer.precision == "auto" and cfg.threads == "auto", trainer


def test_sixteen_mixed_on_cpu_is_float16_with_a_scaler():
    kwargs = {"precision": "16-mixed", "accelerator": "cpu"}
    (plugin,) = precision_plugins(kwargs)
    assert "precision" not in kwargs and plugin.precision == "16-mixed" and plugin.device == "cpu"
    assert isinstance(plugin.scaler, torch.amp.GradScaler)
    assert precision_plugins({"precision": "bf16-mixed", "accelerator": "cpu"}) == []


# -- threads -------------------------------------------------------------------------------------------------
def fake_topology(root, cores_of_cpu: dict[int, tuple[int, int]]):
    for cpu, (package, core) in cores_of_cpu.items():
        t = root / f"cpu{cpu}" / "topology"
        t.mkdir(parents=True)
        (t / "physical_package_id").write_text(f"{package}\n")
        (t / "core_id").write_text(f"{core}\n")
    return str(root)


def test_available_cores_counts_physical_cores_of_the_affinity_mask_within_the_quota(tmp_path):
    # 4 CPUs = 2 cores with 2 hyperthreads each; the process may run on CPUs 0, 1, 2
    sysfs = fake_topology(tmp_path, {0: (0, 0), 1: (0, 0), 2: (0, 1), 3: (0, 1)})
    assert hardware.available_cores(cpus={0, 1, 2, 3}, sys_root=sysfs, quota=None) == 2
    assert hardware.available_cores(cpus={0, 1}, sys_root=sysfs, quota=None) == 1
    assert hardware.available_cores(cpus={0, 2}, sys_root=sysfs, quota=None) == 2
    assert hardware.available_cores(cpus={0, 2}, sys_root=sysfs, quota=1.5) == 2  # a 1.5-core quota: rounded up
    assert hardware.available_cores(cpus={0, 2}, sys_root=sysfs, quota=0.5) == 1
    assert hardware.available_cores(cpus={5, 6, 7}, sys_root=str(tmp_path / "none"), quota=None) == 3  # no sysfs
    # this process: at most what its affinity mask allows
    assert 1 <= hardware.available_cores() <= len(os.sched_getaffinity(0))


def test_cgroup_quota_is_read_from_cpu_max(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert hardware.cgroup_cpu_limit(str(tmp_path)) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert hardware.cgroup_cpu_limit(str(tmp_path)) is None


def test_auto_threads_honours_omp_num_threads_and_shares_cores_among_ranks(monkeypatch):
    monkeypatch.setattr(hardware, "available_cores", lambda: 8)
    assert hardware.auto_threads(environ={"OMP_NUM_THREADS": "3"}) == (3, "OMP_NUM_THREADS=3 from the environment")
    assert hardware.auto_threads(environ={})[0] == 8
    assert hardware.auto_threads(processes=2, environ={}) == (
        4,
        "8 cores available to this process, shared by 2 workers",
    )
    assert hardware.auto_threads(processes=16, environ={})[0] == 1
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = cfg_for("trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu")
    previous = torch.get_num_threads()
    try:
        lines = resolve_hardware(cfg)
        assert cfg.threads == 4 and torch.get_num_threads() == 4
        assert "shared by 2 workers" in lines[1]
        cfg = cfg_for("rollout.mode=async")  # the producer thread and the trainer: half the cores each
        resolve_hardware(cfg)
        assert cfg.threads == 4
        cfg = cfg_for("threads=1")
        assert len(resolve_hardware(cfg)) == 2  # no warning at or below the cores
        assert cfg.threads == 1 and torch.get_num_threads() == 1
        assert resolve_hardware(cfg_for("threads=8"))[2:] == []
        # above the cores: one start-up line says so (threads=999 on 2 cores ran 6.5x slower than threads=2)
        assert resolve_hardware(cfg_for("threads=9"))[2:] == [
            "warning: threads=9 is more than the 8 cores available to this process: its threads take turns and "
            "every step runs slower (threads=auto uses 8)"
        ]
    finally:
        torch.set_num_threads(previous)


def test_omp_defaults_keep_what_the_user_exported():
    # an exported policy alone must win: libgomp lets GOMP_SPINCOUNT override OMP_WAIT_POLICY, so none is added
    for exported in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "0"}):
        env = dict(exported)
        assert hardware.set_omp_defaults(env) == {} and env == exported
    env = {"OMP_NUM_THREADS": "2"}
    assert hardware.set_omp_defaults(env) == {"GOMP_SPINCOUNT": "1000"}
    assert env == {"OMP_NUM_THREADS": "2", "GOMP_SPINCOUNT": "1000"}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["threads=0"], r"threads=0 is not allowed: choose auto, adaptive or an integer >= 1"),
        (["threads=many"], r"threads='many' is not allowed"),
        (
            ["trainer.precision=fp8"],
            r"trainer.precision='fp8' is not allowed: choose auto \(bf16-mixed where the "
            r"hardware multiplies bfloat16 natively, else 32-true\) or one of",
        ),
    ],
)
def test_bad_threads_and_precision_fail_at_start_up(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg_for(*overrides))


# -- the peak probe ------------------------------------------------------------------------------------------
def test_the_peak_is_the_best_probe_seen(tmp_path, monkeypatch):
    """Each call probes until three quiet probes are kept; the cache keeps the highest probe per CPU, torch, dtype,
    threads and oneDNN cap, and a low probe (a busy machine) neither lowers it nor is returned."""
    rates = iter([123e9, 100e9, 150e9, 7e9, 8e9])
    calls = []

    def probe(precision, threads):
        calls.append((precision, threads))
        return next(rates)

    monkeypatch.setattr(hardware, "_other_cpu_seconds", lambda start=None: (0.0, 0.0))
    cache = tmp_path / "peak_flops.json"
    flops, source = hardware.peak_flops("bf16-mixed", "cpu", threads=2, probe=probe, cache=cache)
    assert flops == 123e9 and source == "matmul probe: 0.123 TFLOP/s now, the best seen (cached)"
    flops, source = hardware.peak_flops("bf16-mixed", "cpu", threads=2, probe=probe, cache=cache)
    assert flops == 123e9 and source.startswith("matmul probe: 0.1 TFLOP/s now, best seen 0.123 (cached ")
    flops, source = hardware.peak_flops("bf16-mixed", "cpu", threads=2, probe=probe, cache=cache)
    assert flops == 150e9 and source.endswith("replacing a lower cached one")
    (key,) = json.loads(cache.read_text())
    assert json.loads(cache.read_text())[key]["flops"] == 150e9
    assert (
        key == f"{hardware.cpu_model()}|torch {torch.__version__}|bfloat16|threads=2|onednn_cap=none"
        or os.environ.get("ONEDNN_MAX_CPU_ISA")
    )
    assert hardware.peak_flops("32-true", "cpu", threads=2, probe=probe, cache=cache)[0] == 7e9  # another dtype
    assert hardware.peak_flops("bf16-mixed", "cpu", threads=1, probe=probe, cache=cache)[0] == 8e9  # other threads
    assert len(calls) == 5 and len(json.loads(cache.read_text())) == 3
    # three quiet probes at bf16 / 2 threads: the next start reads the cache and probes no more
    flops, source = hardware.peak_flops("bf16-mixed", "cpu", threads=2, probe=probe, cache=cache)
    assert flops == 150e9 and len(calls) == 5 and source.endswith("3 quiet probes)")
    assert json.loads(cache.read_text())[key]["quiet_probes"] == 3


def test_a_low_cached_peak_is_replaced_by_a_higher_measurement(tmp_path, monkeypatch):
    """A cache entry written low (a probe while the machine was busy) gives way to the next higher probe, busy or
    not; a busy probe is said so in the source."""
    monkeypatch.setattr(hardware, "_other_cpu_seconds", lambda start=None: (0.0, 0.0) if start is None else (5.0, 0.0))
    cache = tmp_path / "peak_flops.json"
    assert hardware.record_peak("32-true", 0.5e9, threads=1, cache=cache) == (0.5e9, "the best seen (cached)")
    flops, source = hardware.peak_flops("32-true", "cpu", threads=1, probe=lambda p, t: 1e9, cache=cache)
    assert flops == 1e9 and "other processes used" in source and "replacing a lower cached one" in source
    assert [e["flops"] for e in json.loads(cache.read_text()).values()] == [1e9]
    assert hardware.record_peak("32-true", 0.9e9, threads=1, cache=cache)[0] == 1e9
    # busy probes never count as quiet ones: a machine always busy keeps probing at each start
    for _ in range(4):
        hardware.peak_flops("32-true", "cpu", threads=1, probe=lambda p, t: 1e9, cache=cache)
    assert [e["quiet_probes"] for e in json.loads(cache.read_text()).values()] == [0]


def test_cuda_peak_is_the_nominal_one(monkeypatch):
    mock_cuda(monkeypatch, "NVIDIA A100-SXM4-80GB", bf16=True)
    assert hardware.peak_flops("bf16-mixed", "gpu") == (312e12, "nominal peak of NVIDIA A100-SXM4-80GB (bfloat16)")
    assert hardware.peak_flops("32-true", "gpu")[0] == 19.5e12


def test_real_probe_is_quick_and_plausible():
    """The probe on this CPU: well under 2 s, and a rate a CPU core can reach (0.1-10,000 GFLOP/s)."""
    import time

    t0 = time.perf_counter()
    flops = hardware.probe_flops("32-true", threads=1)
    assert time.perf_counter() - t0 < 2.0
    assert 1e8 < flops < 1e13
    assert "torch CPU capability" in hardware.describe_cpu()


def test_thread_governor_follows_other_processes_load(monkeypatch):
    """Between two calls, other processes' load = (busy time of our CPUs - our own CPU time) / wall time:
    a competitor on one of two cores -> 1 thread; when it leaves -> 2 again."""
    samples = iter(
        [
            (0.0, 0.0, 0.0),  # (machine busy s, own s, clock s)
            (2.0, 2.0, 1.0),  # we used both cores alone: 0 others -> 2 threads
            (4.0, 3.0, 2.0),  # 1 core of others -> 1 thread
            (5.9, 3.9, 3.0),  # 1.0 core of others -> still 1
            (7.9, 5.9, 4.0),
        ]
    )  # alone again -> 2
    monkeypatch.setattr(hardware, "cpu_busy_seconds", lambda cpus=None: next(samples))
    previous = torch.get_num_threads()
    try:
        gov = hardware.ThreadGovernor(2)
        assert [gov.update() for _ in range(5)] == [2, 2, 1, 1, 2]
        assert torch.get_num_threads() == 2 and gov.others == 0.0
    finally:
        torch.set_num_threads(previous)


def test_thread_governor_reads_this_machine():
    busy, own, clock = hardware.cpu_busy_seconds()
    assert busy >= own >= 0 and clock > 0
    previous = torch.get_num_threads()
    try:
        gov = hardware.ThreadGovernor(previous)
        assert gov.update() == previous  # the first call only takes a sample
        assert 1 <= gov.update() <= previous
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer=ddp", "trainer.devices=2"], "2 data-parallel ranks share the cores"),
        (["kernels=batch_invariant"], "kernels=batch_invariant keeps its own thread count"),
        (["kernels=batch_invariant", "rollout.mode=async"], "kernels=batch_invariant keeps its own thread count"),
        (["engine=vllm", "engine.in_process=false"], "the vLLM engine's worker processes would count as another"),
    ],
)
def test_adaptive_threads_is_refused_where_something_else_owns_the_thread_count(overrides, message):
    """Refused by ``validate``: at start-up, before any model loads, and for every job of a sweep."""
    from lit_rl.config import validate
    from lit_rl.run.callbacks import adaptive_threads

    with pytest.raises(ConfigError, match=f"threads=adaptive is not allowed here: {message}"):
        validate(cfg_for("threads=adaptive", *overrides))
    for ok in (["threads=adaptive"], ["threads=auto", *overrides]):
        validate(cfg_for(*ok))
    assert adaptive_threads(cfg_for("threads=adaptive"), "auto") is None


def test_adaptive_threads_run_logs_its_thread_count(tmp_path):
    from lit_rl.run.train import run
    from lit_rl.tools.compare import read_scalars

    previous = torch.get_num_threads()
    try:
        run(cfg_for("threads=adaptive", "trainer.max_steps=2", "eval.num_examples=0"), tmp_path / "r")
    finally:
        torch.set_num_threads(previous)
    config = (tmp_path / "r" / "config.yaml").read_text()
    assert "adapted per step to the cores other processes leave free" in config.splitlines()[1]
    threads = [v for _, v in read_scalars(tmp_path / "r")["perf/threads"]]
    assert len(threads) == 2 and all(1 <= t <= hardware.auto_threads()[0] for t in threads)


FAULTS_SCRIPT = """
import ctypes, ctypes.util, resource, torch
from lit_rl.run.hardware import keep_freed_memory

# glibc's default mmap threshold (128 KiB), pinned: glibc raises it by itself after the first large free, by an
# amount that depends on what ran before, so unpinned the baseline below ranged from ~600 to ~13,000 faults per call
ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt(-3, 128 * 1024)

logits = torch.randn(64, 49152).to(torch.bfloat16)  # a decode step's logits at 64 rows, SmolLM2's vocabulary


# the tied output layer's weight of SmolLM2 as the update's bf16 products leave its gradient: [49152, 576], 113 MB
# in float32 once cast back (and the [512, 49152] float32 logits of a scoring chunk, 100 MB, alike)
head_grad = torch.randn(49152, 576).to(torch.bfloat16)


def decode_step():
    torch.log_softmax(logits.float() / 0.7, -1)  # the sampler's log-probs (``logprobs.process_logits``)


def update_chunk():
    head_grad.float().mul_(2)


def faults_per_call(pick, call, calls=5, rounds=3):
    # `pick` (max or min) of the minor page faults per call over `rounds` rounds of `calls` calls, after a warm-up
    for _ in range(2):  # warm-up: the heap grows to what a call needs
        call()
    counts = []
    for _ in range(rounds):
        start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(calls):
            call()
        counts.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start) / calls)
    return pick(counts)


before = faults_per_call(max, decode_step)  # glibc's default threshold: the pages come back round after round
big_before = faults_per_call(max, update_chunk)  # a fresh mmap every call (above any threshold glibc sets itself)
line = keep_freed_memory({})
# kept: a round without a fault once the heap holds a call's buffers
print(before, faults_per_call(min, decode_step), big_before, faults_per_call(min, update_chunk), line)
"""


@pytest.mark.skipif(
    not (os.uname().sysname == "Linux" and __import__("platform").libc_ver()[0] == "glibc")
    or any(key in os.environ for key in hardware.MALLOC_VARIABLES),
    reason="glibc's own defaults only",
)
def test_keep_freed_memory_ends_the_page_faults_of_each_decode_steps_buffers():
    """The sampler's log-probs of [64, 49152] logits free and take again three 12.6 MB float32 buffers per call:
    with glibc's defaults their pages (3,072 of 4 KiB each) are faulted in again call after call; with
    ``keep_freed_memory`` they stay with the process. Counted in a fresh process (the setting is process-wide)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", FAULTS_SCRIPT], capture_output=True, text=True, check=True, env={**os.environ}
    )
    before, after, big_before, big_after, line = out.stdout.split(" ", 4)
    assert float(before) > 1000, out.stdout  # a 12.6 MB buffer is 3,072 pages: faulted in again, call after call
    assert float(after) < float(before) / 10, out.stdout
    assert float(big_before) > 20000, out.stdout  # 113 MB: 27,648 pages
    assert float(big_after) < 1000, out.stdout
    assert line.startswith("malloc: freed memory kept (mmap threshold 1024 MiB, trim threshold 2048 MiB)")


def test_keep_freed_memory_leaves_a_users_malloc_settings_alone():
    assert hardware.keep_freed_memory({"MALLOC_TRIM_THRESHOLD_": "0"}) == "malloc: left as the environment sets it"
