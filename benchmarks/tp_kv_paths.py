"""KV between tensor-parallel workers: the direct path against the fallback through rank 0.

    python -m benchmarks.tp_kv_paths                       # builtin:llama-200m, P(TP=2) -> D(TP=2), tcp
    python -m benchmarks.tp_kv_paths --backend shm --prompt-tokens 1024 --repeats 3 --out bench_results/tp_kv.json

Two local clusters of gRPC workers run side by side (prefill TP 2 -> decode TP 2, one rank thread
each): one whose ranks each send and receive their own KV heads (direct_kv, the default), one
whose KV goes through rank 0 (direct_kv=False: gathered on prefill rank 0, scattered by decode rank
0). Per repeat, in alternating order, each serves `--requests` prompts of `--prompt-tokens` tokens one
at a time with max_tokens=2 (the KV moves and commits); what is reported: the router's TTFT and its KV-transfer phase (the
commit: the part of the transfer not hidden behind the forward pass), and the KV bytes prefill rank 0
sent per request. Medians over repeats; ratios direct / fallback (< 1: direct faster or lighter).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path

from benchmarks.tensor_parallel import write_runs
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from pdcluster.local_cluster import LocalCluster

PATHS = ("direct", "fallback")


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + 31 * j) % 8000 + 10 for j in range(n)]


def _cluster(args: argparse.Namespace, direct: bool) -> LocalCluster:
    base = EngineConfig(model=args.model, dtype="float32", max_model_len=args.prompt_tokens + 16, num_threads=1,
                        enable_prefix_caching=False, max_num_batched_tokens=max(2048, args.prompt_tokens))
    tp = dataclasses.replace(base, tensor_parallel_size=2)
    kv = {"kv_backend": args.backend, "direct_kv": direct}
    return LocalCluster(base, 1, 1, prefill=kv, decode=kv, router={"request_timeout_s": 300},
                        prefill_engine=tp, decode_engine=tp)


def _serve(c: LocalCluster, args: argparse.Namespace, seed: int) -> dict[str, float]:
    sender = c.prefill_workers[0].prefill.sender
    before = sum(sender.bytes_sent.values())
    ttft, kv = [], []
    with c.client() as client:
        for i in range(args.requests):
            out = client.complete(_prompt(args.prompt_tokens, seed * 1000 + i), SamplingParams(max_tokens=2, ignore_eos=True))
            ttft.append(out.timing.get("ttft_ms", 0.0))
            kv.append(out.timing.get("kv_transfer_ms", 0.0))
    sent = (sum(sender.bytes_sent.values()) - before) / args.requests
    return {"ttft_ms": statistics.median(ttft), "kv_transfer_ms": statistics.median(kv), "rank0_kv_mb": sent / 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:llama-200m")
    ap.add_argument("--backend", default="tcp", choices=["grpc", "tcp", "shm"])
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    clusters: dict[str, LocalCluster] = {}
    rows: dict[str, dict[str, list[float]]] = {p: {} for p in PATHS}
    try:
        for path in PATHS:
            clusters[path] = _cluster(args, path == "direct")
            _serve(clusters[path], argparse.Namespace(**{**vars(args), "requests": 1}), 999)  # warm-up
        for r in range(args.repeats):
            for path in (PATHS if r % 2 == 0 else PATHS[::-1]):
                for key, value in _serve(clusters[path], args, r).items():
                    rows[path].setdefault(key, []).append(value)
    finally:
        for c in clusters.values():
            c.stop()
    med = {p: {k: statistics.median(v) for k, v in m.items()} for p, m in rows.items()}
    print(f"{args.model}: P(TP=2) -> D(TP=2) over {args.backend}, prompts of {args.prompt_tokens} tokens, "
          f"{args.requests} per repeat; medians of {args.repeats}")
    print(f"{'':<16}{'direct':>10}{'fallback':>10}{'ratio':>8}   repeats direct / fallback")
    for key in rows["direct"]:
        d, f = med["direct"][key], med["fallback"][key]
        runs = " ".join(f"{v:.1f}" for v in rows["direct"][key]) + " / " + " ".join(f"{v:.1f}" for v in rows["fallback"][key])
        print(f"{key:<16}{d:>10.1f}{f:>10.1f}{d / f if f else float('nan'):>8.2f}   {runs}")
    write_runs(args, rows, med)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
