#!/usr/bin/env bash
# The product's GPU paths in one go (scripts/gpu_check.py; docs/gpu_check.md): the engine on CUDA
# against transformers for every architecture, offline colocated and disaggregated; a disaggregated
# cluster on one GPU through `pdcluster up --detach` / `down` (KV backend auto); with two GPUs or
# more, KV over NCCL between prefill and decode workers and tensor parallelism 2. One line per check,
# exit status 1 if one fails. `--device cpu --quick` runs the same checks on CPU (no GPU needed).
# Needs the project installed (bash scripts/install.sh installs the CUDA torch where nvidia-smi sees a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
exec python scripts/gpu_check.py "$@"
