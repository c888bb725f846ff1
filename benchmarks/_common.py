"""Shared by the benchmark scripts: make sure nothing else competes for the cores while timing."""

from __future__ import annotations

import os
import sys
import time


def _cpu_times() -> dict[int, float]:
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[int(pid)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
    return out


def busy_processes(window_s: float = 2.0, threshold: float = 0.2) -> list[tuple[int, float, str]]:
    """Other processes that used more than ``threshold`` of a core over ``window_s`` seconds."""
    me = {os.getpid(), os.getppid()}
    a = _cpu_times()
    time.sleep(window_s)
    b = _cpu_times()
    busy = []
    for pid, t in b.items():
        share = (t - a.get(pid, t)) / window_s
        if pid not in me and share > threshold:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
            except OSError:
                cmd = "?"
            busy.append((pid, share, cmd))
    return busy


def ensure_quiet(force: bool = False) -> None:
    """Exit with a message if other processes are using the CPU (timings would be 7-30x off)."""
    busy = busy_processes()
    if busy and not force:
        print("benchmark: other processes are using the CPU; timings would be meaningless:", file=sys.stderr)
        for pid, share, cmd in busy:
            print(f"  pid {pid}: {share:.0%} of a core: {cmd}", file=sys.stderr)
        print("stop them, or pass --force to time anyway", file=sys.stderr)
        sys.exit(3)


def machine() -> str:
    import platform

    import torch

    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{model}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"python {platform.python_version()}, {time.strftime('%Y-%m-%d')}")
