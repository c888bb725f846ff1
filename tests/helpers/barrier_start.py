"""Start ``recipes/train.py`` at a moment shared with other processes: two runs started together for real.

    python tests/helpers/barrier_start.py <barrier file> [recipes/train.py arguments...]

Imports everything first (the slow part), then writes ``<barrier file>.ready-<pid>`` and waits until
``<barrier file>`` exists; the test creates it once every process is ready, so all of them resolve their run
folder (Hydra's ``${now:...}``) and claim it within a few milliseconds of each other.
"""

import os
import runpy
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(ROOT, "recipes", "train.py")


def main() -> None:
    barrier, *args = sys.argv[1:]
    import lit_rl.run.train  # noqa: F401  (torch, Lightning, transformers: loaded before the barrier)

    open(f"{barrier}.ready-{os.getpid()}", "w").close()
    deadline = time.monotonic() + 300
    while not os.path.exists(barrier):
        if time.monotonic() > deadline:
            raise SystemExit("barrier_start: the barrier never opened")
        time.sleep(0.001)
    sys.argv = [RECIPE, *args]
    runpy.run_path(RECIPE, run_name="__main__")


if __name__ == "__main__":
    main()
