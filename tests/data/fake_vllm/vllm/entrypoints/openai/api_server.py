"""A stand-in for vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`), for the
tests of scripts/exp_vs_vllm.py where vLLM is not installed: it takes the flags that script passes
and serves the checkpoint with a real colocated pdcluster (`pdcluster up`) on the given port, so
the requests, streams and timings are real; only the name is borrowed."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import yaml


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    args = ap.parse_args()
    cfg = {"model": {"path": args.model, "dtype": args.dtype, "max_model_len": args.max_model_len},
           "mode": "colocated", "router": {"host": args.host, "grpc_port": 0, "http_port": args.port},
           "engine": {"num_threads": 1}, "pools": [{"name": "workers", "role": "colocated", "replicas": 1}]}
    fd, path = tempfile.mkstemp(suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(cfg, f)
    os.execv(sys.executable, [sys.executable, "-m", "cli", "up", "-c", path, "--log-level", "warning"])


if __name__ == "__main__":
    sys.exit(main())
