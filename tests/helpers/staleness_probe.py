"""Run the recipe in this process, interrupt it with SIGINT (Ctrl-C) mid-step, then list the live threads.

    python tests/helpers/staleness_probe.py <call> <out_dir> [hydra overrides...]

SIGINT is sent to this process from inside its ``call``-th optimizer step (1-based), so it lands mid-step
while an async producer is generating or waiting. The run finishes that step, checkpoints it and exits 130 (as
on SIGTERM: ``lit_rl.run.preemption``); on the way out this script prints ``live threads: [...]`` (the names of
every thread still alive) and ``exit`` markers the test reads.
"""

import os
import signal
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for helpers
from helpers import compose_config  # noqa: E402  (and the same thread and offline settings as the tests)

from lit_rl.algorithms import RLModule  # noqa: E402
from lit_rl.run.train import run  # noqa: E402


def main() -> None:
    call, out, *overrides = sys.argv[1:]
    call, count = int(call), {"n": 0}
    original = RLModule.optimizer_step

    def interrupted(self, *args, **kwargs):
        count["n"] += 1
        if count["n"] == call:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, handled in this (the main) thread
        return original(self, *args, **kwargs)

    RLModule.optimizer_step = interrupted
    # Ctrl-C in a terminal raises KeyboardInterrupt; a process started in the background by a non-interactive
    # shell (as CI may start the suite) inherits SIGINT ignored, and the signal below would then do nothing
    signal.signal(signal.SIGINT, signal.default_int_handler)
    cfg = compose_config(*overrides)
    try:
        run(cfg, out)
    finally:
        print("live threads:", sorted(t.name for t in threading.enumerate() if t.is_alive()), flush=True)


if __name__ == "__main__":
    main()
