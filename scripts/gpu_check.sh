#!/usr/bin/env bash
# The GPU check (docs/scale-out.md, "The GPU check"):
#   scripts/gpu_check.sh --fetch-wheels    # here, with PyPI: the carried wheels into .gpu_check/
#   scripts/gpu_check.sh --dry-run         # here, on CPU: list, wheels, configs and size; non-zero naming what is wrong
#   scripts/gpu_check.sh <report folder>   # on the GPU machine: install the wheels, run the stages (<= 5 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PY" scripts/gpu_check.py "$@"
