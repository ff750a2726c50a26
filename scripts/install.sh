#!/usr/bin/env bash
# Install pdcluster (editable) into the active Python environment.
#   bash scripts/install.sh          # the package
#   bash scripts/install.sh test     # plus the test dependencies
# torch is put in place first: without a GPU the CPU build (torch==2.13.0; set
# PDCLUSTER_TORCH_INDEX=https://download.pytorch.org/whl/cpu where PyPI would hand out a CUDA
# build), with one the default build. A torch that is already installed is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    python -m pip install torch
  else
    python -m pip install "torch==2.13.0" ${PDCLUSTER_TORCH_INDEX:+--index-url "$PDCLUSTER_TORCH_INDEX"}
  fi
fi
python -m pip install -e ".${1:+[$1]}"
