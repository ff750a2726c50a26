#!/usr/bin/env bash
# GPU paths in one go (CUDA parity, GPU decode throughput, GPU KV hand-off between processes).
# Needs an NVIDIA GPU and the project installed (bash scripts/install.sh installs the CUDA torch there).
set -euo pipefail
cd "$(dirname "$0")/.."
exec python scripts/gpu_check.py "$@"
