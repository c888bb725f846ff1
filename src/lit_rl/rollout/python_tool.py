"""A sandboxed Python tool for multi-turn tasks: ``task.tools=[lit_rl.rollout.python_tool:python]``.

Each call runs the model's program in a fresh, isolated interpreter (``python -I``, an empty temporary working
folder) in a process of its own with a time limit (``TIME_LIMIT_S``), an address-space limit (``MEMORY_BYTES``)
and no network: the process runs in a new network namespace with no interface (``unshare -rn``, Linux user
namespaces). Where the machine cannot make one, the tool refuses to run code (its answer says why) rather than
run it with the network on. What the program printed (stdout, then stderr) is the tool's answer, cut at
``OUTPUT_CHARS`` characters. The tool runs inside a verifier worker like every tool, under ``reward_timeout_s``
too.
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import subprocess
import sys
import tempfile

__all__ = ["python", "network_isolation"]

TIME_LIMIT_S = 5.0
MEMORY_BYTES = 512 * 2**20
OUTPUT_CHARS = 4000


@functools.lru_cache(maxsize=1)
def network_isolation() -> list[str] | None:
    """The command prefix that runs a program without network (``["unshare", "-rn"]``), or None when this machine
    cannot make a network namespace (no ``unshare``, or user namespaces are off)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    try:
        ok = subprocess.run([unshare, "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return [unshare, "-rn"] if ok else None


def _limit_memory() -> None:  # in the child, before the program starts
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))


def python(code: str) -> str:
    """Run a Python program in a sandbox (no network, 512 MB of memory, 5 seconds) and return what it printed.

    Args:
        code: the program; print what you want to see
    """
    prefix = network_isolation()
    if prefix is None:
        return "error: this machine cannot run code without network (no user namespaces for unshare -rn)"
    with tempfile.TemporaryDirectory(prefix="lit_rl-python-tool-") as folder:
        try:
            done = subprocess.run(
                [*prefix, sys.executable, "-I", "-c", code],
                cwd=folder,
                capture_output=True,
                text=True,
                timeout=TIME_LIMIT_S,
                preexec_fn=_limit_memory,
                env={"PATH": os.environ.get("PATH", ""), "LANG": "C.UTF-8"},
            )
        except subprocess.TimeoutExpired:
            return f"error: the program ran past {TIME_LIMIT_S:g} s and was stopped"
    out = done.stdout + (f"\n{done.stderr}" if done.stderr else "")
    if done.returncode and not out.strip():
        out = f"error: the program exited with status {done.returncode}"
    if len(out) > OUTPUT_CHARS:
        out = out[:OUTPUT_CHARS] + f"... [cut: {len(out) - OUTPUT_CHARS} more characters]"
    return out
