#!/usr/bin/env bash
# Sets up .venv if needed (scripts/setup.sh, idempotent), then runs the main job:
# GRPO on SmolLM2-135M-Instruct, arithmetic task, 30 steps. Extra arguments are Hydra overrides.
#   scripts/train.sh
#   scripts/train.sh algo=dapo trainer.max_steps=10
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TOKENIZERS_PARALLELISM=false  # threads: auto takes the cores this process may use (or an exported OMP_NUM_THREADS)
exec .venv/bin/python recipes/train.py "$@"
