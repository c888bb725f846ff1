"""Compare runs: one PNG per TensorBoard tag (seeds of a setting grouped) and a markdown summary table.

    python recipes/compare.py outputs/multirun/2026-11-29/10-00-00 --tags rollout/reward_mean,eval/accuracy
    python recipes/compare.py outputs/2026-11-29/10-00-00 outputs/2026-11-29/11-30-00 --tags train/loss \
        --out cmp --smoothing 0.8 --no-group-by-seed

Writes <out>/<tag with / replaced by _>.png and <out>/summary.md (default out: <first folder>/compare) and
prints the table. The logic is in lit_rl.compare; this file is only the front door.
"""

import sys

from lit_rl.compare import main

if __name__ == "__main__":
    sys.exit(main())
