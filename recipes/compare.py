"""Compare runs: one PNG per TensorBoard tag (seeds of a setting grouped) and a markdown summary table.

    python recipes/compare.py outputs/multirun/2026-11-29/10-00-00 --tags rollout/reward_mean,eval/accuracy
    python recipes/compare.py outputs/2026-11-29/10-00-00 outputs/2026-11-29/11-30-00 --tags train/loss \
        --out cmp --smoothing 0.8 --no-group-by-seed
    python recipes/compare.py outputs/drift --tags train/ref_kl --final-steps 4 --test correction=sc correction=none

Writes <out>/<tag with / replaced by _>.png and <out>/summary.md (default out: <first folder>/compare) and
prints the table; settings with >= 2 seeds get a 95% t-interval (the band, and a table of final values), and
each ``--test A B`` states from Welch's interval whether A > B, A < B or the two are indistinguishable.
The logic is in lit_rl.tools.compare; this file is only the front door.
"""

import sys

from lit_rl.tools.compare import main

if __name__ == "__main__":
    sys.exit(main())
