"""Run a preset's sweep one job per command, e.g. each under its own CPU lock (lit_rl.tools.study has the logic).

python recipes/study.py experiment=mismatch_dose_response --out outputs/dose_response --wrap "cpulock shared"
python recipes/study.py experiment=staleness_sweep seed=0,1,2 --out outputs/staleness --dry-run
"""

import sys

from lit_rl.tools.study import main

if __name__ == "__main__":
    sys.exit(main())
