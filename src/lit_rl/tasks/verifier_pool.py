"""Verifiers in worker processes that cannot hang the run: a persistent pool, a time limit per call, kill and replace.

A verifier (``math_verify`` handing ``\\boxed{99999999!}`` to sympy, a user's reward function stuck in a loop)
can compute for minutes. A thread cannot be stopped, and an abandoned one keeps the interpreter's lock busy
(measured in issue 17: the trainer's Python ran 611x slower). Here each call runs in a worker process
(a fresh interpreter, as ``multiprocessing``'s *spawn* starts: no copy of the trainer's threads, locks or
CUDA state), and a worker still busy when its call's time limit passes is killed (SIGKILL) and replaced by a
fresh one; the call reports ``"timeout"``. Workers are persistent: started once per process on first use
(``shared_pool``), they keep what they loaded (the functions and, through them, the task) from call to call
and from run to run, and get it again only when it changes (a new ``key``). Each runs one OpenMP / torch
thread.

Protocol, over one socket pair per worker (``multiprocessing.connection.Connection``): the parent sends
``("setup", key, file, log)`` (the functions pickled into ``file``, so a large task never fills the socket) and
the worker answers ``("ready", key)`` or ``("setup_error", line)``; then ``("call", index, args, kwargs)``,
answered with ``("ok", value)`` or ``("error", line)``. The limit starts when a call is sent to a worker that
is ready, so starting a worker and loading the functions do not count against it.

What the functions print. ``log`` names a file (a run's ``reward_output.log``) that the worker's stdout and
stderr (file descriptors 1 and 2: ``print``, warnings, tracebacks of a crash, C extensions, subprocesses) are
appended to from that setup on, line-buffered: each line is one ``write`` to a file opened with ``O_APPEND``, so
the workers' lines never interleave mid-line (a function printing 2,000 lines per call once wrote 31 MB to the
console, cut mid-line between workers). None: the trainer's own stdout and stderr, as the worker started with.
The file is chosen per ``key``, i.e. per run: a pool shared by several runs in one process writes each run's
output to its own file.
"""

from __future__ import annotations

import atexit
import math
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["Outcome", "VerifierPool", "shared_pool", "close_shared_pool"]

#: seconds a fresh worker may take to start and load its functions (importing a user's module, torch, ...)
SETUP_TIMEOUT_S = 120.0
#: set to "1" in the workers' environment: ``lit_rl.train`` refuses to start there (a worker importing a user's
#: script for its reward functions reached a call that the script does not guard with ``__name__``)
IN_VERIFIER_WORKER = "LIT_RL_VERIFIER_WORKER"
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS")


@dataclass(frozen=True)
class Outcome:
    """What one call gave: ``status`` "ok" (``value`` the function's converted return), "error" (``message``:
    the exception's type and first line) or "timeout" (the worker was killed and replaced)."""

    status: str
    value: Any = None
    message: str = ""


def first_line(err: BaseException) -> str:
    """``"TypeName: first line of the message"``."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def convert(value: Any, batched: bool) -> Any:
    """A reward function's return value as plain data: a float or None (not applicable), or, verl's convention,
    a dict ``{"score": float | None, "correct": bool}`` (``correct`` may be left out or None: not said; other
    keys are ignored), returned as ``{"score": float | None, "correct": bool | None}``; for a batched function
    a list of them. Raises TypeError for anything else (a string, a non-finite number, a dict without
    ``score``, a ``correct`` that is not a bool or 0/1)."""
    if batched:
        if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__len__"):
            raise TypeError(
                f"a batched reward function must return a list of float | None | dict, got {type(value).__name__}"
            )
        return [convert(v, False) for v in value]
    if isinstance(value, Mapping):
        if "score" not in value:
            raise TypeError(f"a reward dict needs a 'score' (and may give 'correct'), got keys {sorted(value)}")
        correct = value.get("correct")
        if correct is not None and (isinstance(correct, (str, bytes)) or not _is_zero_or_one(correct)):
            raise TypeError(f"a reward dict's 'correct' must be a bool (or 0 / 1), got {correct!r}")
        return {"score": convert(value["score"], False), "correct": None if correct is None else bool(correct)}
    if value is None:
        return None
    if isinstance(value, (int, float)) or hasattr(value, "__float__"):
        out = float(value)
        if not math.isfinite(out):
            raise TypeError(f"reward {out} is not finite")
        return out
    raise TypeError(f"a reward must be a number, None or a dict with 'score', got {type(value).__name__}")


def _is_zero_or_one(value: Any) -> bool:
    """``value`` is a bool, numpy bool or a number equal to 0 or 1."""
    try:
        return bool(value == 0 or value == 1) and hasattr(value, "__float__")
    except Exception:  # noqa: BLE001 - an array or an object whose comparison fails: not a truth value
        return False


def _worker_entry(fd: int) -> None:
    """The worker process's entry point (``_Worker`` starts ``python -c`` with it): serve the socket ``fd``.

    SIGINT, SIGTERM and SIGUSR1 are ignored: the trainer owns the workers' lives (it closes their sockets, or kills
    one past its time limit). A signal sent to the whole process group (Ctrl-C, ``timeout``, SLURM's ``scancel``,
    or its ``--signal=USR1@<s>`` pre-emption warning, which killed the workers and failed the step with
    BrokenPipeError) is then the trainer's alone to act on: it finishes its step, scoring with these workers,
    checkpoints and exits, and the workers leave when their sockets close."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)
    _worker_main(Connection(fd))


def _redirect_output(log: str | None, console: tuple[int, int]) -> None:
    """Point this process's stdout and stderr (file descriptors 1 and 2) at the file ``log``, appended to and
    line-buffered, or back at ``console`` (the descriptors it started with) when ``log`` is None. Raises OSError
    when ``log`` cannot be opened."""
    streams = [s for s in (sys.stdout, sys.stderr) if s is not None]
    for stream in streams:  # what is buffered goes where it was meant to
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if log is None:
        os.dup2(console[0], 1)
        os.dup2(console[1], 2)
        return
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)
    for stream in streams:  # one write per line (PYTHONUNBUFFERED writes a print's text and its newline apart)
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True, write_through=False)


def _worker_main(conn) -> None:
    """A worker's loop: load functions on "setup" (its output sent to the setup's log), run them on "call", until
    the socket closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it closes the socket
    console = (os.dup(1), os.dup(2))  # the trainer's stdout and stderr, for a setup without a log
    functions: list = []
    batched: list[bool] = []
    raw: list[bool] = []  # entries whose return is sent back as it is (an environment's step), not a reward
    setup_error = ""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the parent closed the socket or died
        if msg[0] == "setup":
            try:
                _redirect_output(msg[3] if len(msg) > 3 else None, console)
                with open(msg[2], "rb") as f:
                    entries = pickle.load(f)
                functions, batched, raw = [], [], []
                for entry in entries:
                    functions.append(entry.load() if hasattr(entry, "load") else entry)
                    batched.append(bool(getattr(entry, "batched", False)))
                    raw.append(bool(getattr(entry, "raw", False)))
                setup_error = ""
                if "torch" in sys.modules:  # a user's module brought torch in: one thread
                    sys.modules["torch"].set_num_threads(1)
                conn.send(("ready", msg[1]))
            except Exception as err:  # noqa: BLE001 - reported to the parent, which names it
                setup_error = first_line(err)
                conn.send(("setup_error", setup_error))
        elif msg[0] == "call":
            index, args, kwargs = msg[1], msg[2], msg[3]
            try:
                if setup_error:
                    raise RuntimeError(f"the reward functions could not be loaded ({setup_error})")
                value = functions[index](*args, **kwargs)
                value = value if raw[index] else convert(value, batched[index])
                reply = ("ok", value)
            except Exception as err:  # noqa: BLE001 - a user's bug scores 0; the parent logs it once
                reply = ("error", first_line(err))
            conn.send(reply)


class _Worker:
    """One worker process and the parent's end of its socket; ``key``: what it has loaded (None: nothing yet).

    The worker is a fresh interpreter (``python -c``: what multiprocessing's *spawn* gives, without re-running
    the caller's main script, so a script or notebook without an ``if __name__ == "__main__"`` guard works),
    with this process's ``sys.path`` and one OpenMP / MKL thread, talking over a socket pair wrapped in
    ``multiprocessing.connection.Connection``."""

    def __init__(self):
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        env.update({var: "1" for var in (*_THREAD_VARS, IN_VERIFIER_WORKER)})
        code = f"from lit_rl.tasks.verifier_pool import _worker_entry; _worker_entry({theirs.fileno()})"
        self.process = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()], env=env)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.key: str | None = None
        self.loading: str | None = None  # the key a setup was sent for
        self.job: int | None = None
        self.deadline = 0.0  # when the running call's time is up
        self.setup_deadline = 0.0  # when the pending setup's time is up

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def holds(self) -> str | None:
        """The key the worker holds once the messages sent to it are through: the pending setup's, else its
        own. A worker whose answer to another key's setup is still on its way holds that key, not ``key``: a
        call sent now would run the other key's functions."""
        return self.loading if self.loading is not None else self.key

    def kill(self) -> None:
        """SIGKILL the process and reap it (nothing of it is left computing)."""
        try:
            self.process.kill()
        except OSError:
            pass
        self.process.wait()
        self.conn.close()

    def stop(self) -> None:
        """Close the socket (the worker exits at once when idle); kill it if it does not."""
        self.conn.close()
        try:
            self.process.wait(1)
        except subprocess.TimeoutExpired:
            self.kill()


class VerifierPool:
    """``num_workers`` persistent worker processes running reward functions with a time limit per call.

    ``run(key, functions, jobs, timeout_s)`` runs ``functions[index](*args, **kwargs)`` for each job ``(index,
    args, kwargs)`` and returns one ``Outcome`` per job, in order. A call past ``timeout_s`` seconds: its worker
    is killed and replaced, the outcome is "timeout". Thread-safe (calls from several threads take turns).
    Workers start on the first ``run``.

    Args:
        num_workers: worker processes (>= 1).
    """

    def __init__(self, num_workers: int):
        if int(num_workers) < 1:
            raise ValueError(f"reward.num_workers={num_workers!r} must be >= 1")
        self.num_workers = int(num_workers)
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._folder: str | None = None  # the function files' folder, made at the first file, removed by ``close``
        self._files: dict[str, str] = {}
        self.replaced = 0  # workers killed and replaced so far (timeouts, crashes)

    @property
    def pids(self) -> list[int]:
        """Process ids of the live workers."""
        return [w.pid for w in self._workers]

    def _file_for(self, key: str, functions: list) -> str:
        if key not in self._files:
            if self._folder is None:
                self._folder = tempfile.mkdtemp(prefix="lit_rl-verifiers-")
            path = os.path.join(self._folder, f"{len(self._files)}.pkl")
            with open(path, "wb") as f:
                pickle.dump(list(functions), f)
            self._files[key] = path
        return self._files[key]

    def run(
        self,
        key: str,
        functions: list,
        jobs: list[tuple[int, tuple, dict]],
        timeout_s: float,
        log: str | None = None,
    ) -> list[Outcome]:
        """Run ``jobs`` on the workers (see the class docstring). ``key`` names ``functions``: workers that
        loaded the same key reuse what they loaded. ``log``: the file a worker that loads them (a fresh
        replacement included) sends its output to (the module docstring), None the trainer's console; give
        the same for one ``key`` as ``prepare`` did. Raises RuntimeError when no worker can load the functions
        (the first worker's error), since every call would fail alike."""
        with self._lock:
            if not jobs:
                return []
            file = self._file_for(key, functions)
            while len(self._workers) < self.num_workers:
                self._workers.append(_Worker())
            pending = deque(range(len(jobs)))
            results: list[Outcome | None] = [None] * len(jobs)
            while pending or any(w.job is not None for w in self._workers):
                now = time.monotonic()
                for w in self._workers:
                    if w.job is not None:
                        continue
                    if w.holds != key:  # also a fresh replacement: it loads while others work
                        w.conn.send(("setup", key, file, log))
                        w.loading, w.setup_deadline = key, now + SETUP_TIMEOUT_S
                    elif w.key == key and w.loading is None and pending:
                        w.job = pending.popleft()
                        index, args, kwargs = jobs[w.job]
                        w.conn.send(("call", index, args, kwargs))
                        w.deadline = time.monotonic() + timeout_s
                if not pending and all(w.job is None for w in self._workers):
                    break
                waiting = [w for w in self._workers if w.job is not None or w.loading is not None]
                ends = [w.deadline if w.job is not None else w.setup_deadline for w in waiting]
                ready = wait([w.conn for w in waiting], timeout=max(0.0, min(ends) - time.monotonic()))
                for w in waiting:
                    if w.conn in ready:
                        try:
                            msg = w.conn.recv()
                        except (EOFError, OSError):  # the worker died (e.g. killed by the OOM killer)
                            self._finish(w, results, Outcome("error", message="the verifier process died"))
                            self._replace(w)
                            continue
                        if msg[0] == "ready":  # (a late answer to an earlier run's setup sets only the key)
                            w.key = msg[1]
                            if w.loading == msg[1]:
                                w.loading = None
                        elif msg[0] == "setup_error":
                            self._replace(w)
                            raise RuntimeError(f"the reward functions cannot be loaded in a worker: {msg[1]}")
                        else:
                            self._finish(
                                w,
                                results,
                                Outcome(
                                    msg[0],
                                    value=msg[1] if msg[0] == "ok" else None,
                                    message=msg[1] if msg[0] == "error" else "",
                                ),
                            )
                    elif w.job is not None and time.monotonic() >= w.deadline:
                        self._finish(w, results, Outcome("timeout"))
                        self._replace(w)
                    elif w.job is None and time.monotonic() >= w.setup_deadline:
                        self._replace(w)
                        raise RuntimeError(
                            f"a verifier worker did not load the reward functions in {SETUP_TIMEOUT_S} s"
                        )
            return results  # type: ignore[return-value]

    def prepare(self, key: str, functions: list, timeout_s: float = SETUP_TIMEOUT_S, log: str | None = None) -> None:
        """Start the workers and have every one load ``functions`` (under ``key``, their output to ``log``: see
        ``run``) now, waiting until all have: at start-up, so that a function that cannot be loaded in a worker
        fails before the model loads and the first step's time holds no start-up. Raises RuntimeError naming
        the worker's error, or when a worker takes longer than ``timeout_s``."""
        with self._lock:
            file = self._file_for(key, functions)
            while len(self._workers) < self.num_workers:
                self._workers.append(_Worker())
            deadline = time.monotonic() + timeout_s
            while any(w.key != key or w.loading is not None for w in self._workers):
                for w in self._workers:
                    if w.holds != key:
                        w.conn.send(("setup", key, file, log))
                        w.loading = key
                loading = [w for w in self._workers if w.key != key or w.loading is not None]
                ready = wait([w.conn for w in loading], timeout=max(0.0, deadline - time.monotonic()))
                for w in loading:
                    if w.conn not in ready:
                        continue
                    try:
                        msg = w.conn.recv()
                    except (EOFError, OSError):
                        self._replace(w)
                        raise RuntimeError("a verifier worker died while loading the reward functions") from None
                    if msg[0] == "setup_error":
                        self._replace(w)
                        raise RuntimeError(f"the reward functions cannot be loaded in a worker: {msg[1]}")
                    if msg[0] == "ready":
                        w.key = msg[1]
                        if w.loading == msg[1]:
                            w.loading = None
                if not ready and time.monotonic() >= deadline:
                    raise RuntimeError(f"the verifier workers did not load the reward functions in {timeout_s:g} s")

    @staticmethod
    def _finish(w: _Worker, results: list, outcome: Outcome) -> None:
        if w.job is not None:
            results[w.job] = outcome
        w.job = None

    def _replace(self, w: _Worker) -> None:
        """Kill ``w`` and start a fresh worker in its place (it loads the functions when next needed)."""
        w.kill()
        self.replaced += 1
        self._workers[self._workers.index(w)] = _Worker()

    def close(self) -> None:
        """Stop every worker and remove the function files and their folder; the pool starts new workers (and a new
        folder) if used again."""
        with self._lock:
            for w in self._workers:
                w.stop()
            self._workers = []
            self._files = {}
            if self._folder is not None:
                shutil.rmtree(self._folder, ignore_errors=True)
                self._folder = None


_SHARED: dict[str, VerifierPool] = {}
_SHARED_LOCK = threading.Lock()


def shared_pool(num_workers: int) -> VerifierPool:
    """This process's pool of ``num_workers`` workers, made on first use and kept for later runs (a test suite
    or a sweep in one process starts its workers once); a different count replaces it."""
    with _SHARED_LOCK:
        pool = _SHARED.get("pool")
        if pool is None or pool.num_workers != int(num_workers):
            if pool is not None:
                pool.close()
            pool = _SHARED["pool"] = VerifierPool(num_workers)
        return pool


@atexit.register
def close_shared_pool() -> None:
    """Stop the shared pool's workers (at exit; safe to call any time)."""
    pool = _SHARED.pop("pool", None)
    if pool is not None:
        pool.close()
