"""Shared test helpers: the test environment, paths, config composition and prompts.

Importing this package sets the environment every test and probe script runs with (threads, offline hub).
Tests import it as ``helpers`` (``tests/`` is on pytest's ``pythonpath``); the probe scripts here, launched
as subprocesses, put ``tests/`` on ``sys.path`` themselves.
"""

import os

_WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ... when scripts/test.sh runs pytest -n N
if _WORKER:
    # A worker of a parallel run takes its own share of the CPUs, pinned, and its share of the cores as OpenMP
    # threads: N workers at the machine's thread count would oversubscribe it (a step then slows 5-50x), and
    # pinned, each worker's thread governor and probes see only their own CPUs' load (the other worker is not
    # "another process" there). Its subprocesses inherit the mask and the thread count.
    from lit_rl.run.hardware import available_cores  # imports no torch

    _count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    _cpus = sorted(os.sched_getaffinity(0))
    _threads = max(1, available_cores() // _count)
    os.sched_setaffinity(0, _cpus[int(_WORKER[2:]) % len(_cpus) :: _count] or _cpus)
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    os.environ["LIT_RL_TEST_THREADS"] = str(_threads)
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never wait on the network

from lit_rl.run.hardware import set_omp_defaults  # noqa: E402  (imports no torch)

set_omp_defaults()  # as recipes/train.py does, before torch loads OpenMP

import torch  # noqa: E402

#: the suite's torch thread count (torch's own default is one per physical core; 2 on the project's machines,
#: 1 in each worker of a 2-worker run)
THREADS = int(os.environ.get("LIT_RL_TEST_THREADS", 0)) or min(2, os.cpu_count() or 1)
torch.set_num_threads(THREADS)

from .config import CONF, FAST, MOVING, ROOT, compose_config, fast_config, probe_config  # noqa: E402
from .prompts import chat_prompts  # noqa: E402
from .runs import write_run  # noqa: E402

__all__ = [
    "CONF",
    "FAST",
    "MOVING",
    "ROOT",
    "THREADS",
    "chat_prompts",
    "compose_config",
    "fast_config",
    "probe_config",
    "write_run",
]
