"""Run the recipe in this process with a barrier in the async producer's in-flight hook, so that every batch after
the first takes a newer version mid-sequence, whatever the machine's speed.

    python tests/helpers/in_flight_barrier.py <step> <out_dir> [hydra overrides...]

Before decode step ``step`` of every batch after the first, the producer's in-flight hook
(``RolloutProducer._newer_weights``) waits until the trainer has published a version newer than the one the engine
holds (at most 120 s, or until the producer is stopped), then runs as always: it loads that version, and the batch's
tokens from ``step`` on record it. With ``rollout.on_stale=block rollout.max_staleness=1`` batch s starts with
version s - 1 and the trainer publishes version s before it takes batch s, so the wait ends there. Without the
barrier timing decides: where decoding outruns the update (the tiny model in vLLM on a CPU) each batch is finished
before the next version is published, and no batch swaps.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for helpers
from helpers import compose_config  # noqa: E402  (and the same thread and offline settings as the tests)

from lit_rl.rollout.staleness import RolloutProducer  # noqa: E402
from lit_rl.run.train import run  # noqa: E402

WAIT_S = 120.0


def main() -> None:
    at, out, *overrides = sys.argv[1:]
    at = int(at)
    original = RolloutProducer._newer_weights

    def after_a_newer_version(self, step: int) -> bool:
        if step == at and self.generated > 0:  # not the first batch: the trainer waits for that one
            deadline = time.monotonic() + WAIT_S
            with self.cond:
                while (
                    (self.published is None or self.published[0] <= self.engine.version)
                    and not self.stop_event.is_set()
                    and time.monotonic() < deadline
                ):
                    self.cond.wait(timeout=1.0)
        return original(self, step)

    RolloutProducer._newer_weights = after_a_newer_version
    run(compose_config(*overrides), out)


if __name__ == "__main__":
    main()
