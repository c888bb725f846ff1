#!/usr/bin/env bash
# The GPU check (docs/scale-out.md, "The GPU check"):
#   scripts/gpu_check.sh --fetch-wheels    # here, with PyPI: the carried wheels into .gpu_check/
#   scripts/gpu_check.sh --dry-run         # here, on CPU: list, wheels, configs and size; non-zero naming what is wrong
#   scripts/gpu_check.sh <report folder>   # on the GPU machine: install the wheels, run the stages (<= 5 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
# $PYTHON if set, else the project's .venv, else the machine's python3 (the GPU machine's torch lives there)
PY="${PYTHON:-}"
[ -z "$PY" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
[ -z "$PY" ] && PY="$(command -v python3 || command -v python)"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PY" scripts/gpu_check.py "$@"
