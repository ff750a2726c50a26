"""Experiment: quantized KV pages when serving is bound by KV memory, against the model's dtype.

    python -m benchmarks.kv_pages_serving --repeats 3
    python -m benchmarks.kv_pages_serving --analyse-only      # the tables from OUT's result.json files

Two clusters of the built-in model side by side on this machine, each a foreground `pdcluster up`
with its own embedded Ray, each 1 prefill + 1 decode worker (one core each, as cluster.yaml), the
same small KV budget per worker (`--memory-mb`), differing only in `kv_cache.dtype`:

  auto   the model's dtype (float32 on a CPU without bf16 hardware)
  int8   quantized pages: a byte a value and a float32 scale a row (docs/kv_cache.md)

The workload keeps many long sequences alive at once (synthetic prompts of --input tokens, answers of
--output tokens, ignore_eos), so the decode worker's cache, not its compute, decides how many run:
a request that finds no room waits for a reservation, and its TTFT grows. A sweep of Poisson rates,
the two endpoints interleaved per rate, fresh prompts per repeat; reported per system and rate (medians
of the repeats): TTFT p50 / p90, TPOT p50, SLO attainment, and the highest rate at which at least 90%
of requests meet the SLO (cluster.yaml's), int8's against auto's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import httpx

from benchmarks.kv_aware_serving import analyse
from benchmarks.local_clusters import REPO, cell, experiment_setup, sweep_clusters, two_cpus, write_cluster_files
from pdcluster.cluster_config import PoolConfig, load_cluster_config

SYSTEMS = ("auto", "int8")
BASELINE = "auto"


def cluster_files(out: Path, model: str, max_model_len: int, memory_mb: int) -> dict[str, Path]:
    """The two deployments, derived from cluster.yaml (SLO, timeouts, KV backend as there)."""
    base = load_cluster_config(REPO / "cluster.yaml")
    a, b = two_cpus()
    common = {
        "mode": "disaggregated",
        "model": dataclasses.replace(base.model, path=model, max_model_len=max_model_len),
        "engine": dataclasses.replace(base.engine, num_threads=1),
        "pools": (PoolConfig("prefill", "prefill", 1, "cpu", {"num_cpus": 1}, (a,)),
                  PoolConfig("decode", "decode", 1, "cpu", {"num_cpus": 1}, (b,))),
        "router": dataclasses.replace(base.router, grpc_port=0, http_port=0),
    }
    kv = dataclasses.replace(base.kv_cache, memory_mb=memory_mb, num_blocks="auto", offload_mb=0)
    return write_cluster_files(out, {name: dataclasses.replace(base, **common, kv_cache=dataclasses.replace(kv, dtype=name))
                                     for name in SYSTEMS})


def workload_args(args: argparse.Namespace, repeat: int) -> list[str]:
    return ["--workload", "synthetic", "--num-requests", str(args.num_requests), "--rates", args.rates,
            "--synthetic-input", f"uniform:{args.input // 2}:{args.input * 3 // 2}",
            "--synthetic-output", f"fixed:{args.output}", "--tokenizer", args.model, "--ignore-eos",
            "--seed", str(100 * repeat + 1), "--fresh-prompts", "--time-limit-s", str(args.time_limit_s)]


def report(a: dict[str, Any], capacity: dict[str, int]) -> str:
    lines = ["| rate | system | TTFT p50 ms | TPOT p50 ms | SLO att. |", "|---|---|---|---|---|"]
    for rate in a["rates"]:
        for name in SYSTEMS:
            m = a["table"].get(name, {}).get(rate)
            if m is not None:
                lines.append(f"| {rate:g} | {name} | {cell(m['ttft_p50'])} | {cell(m['tpot_p50'])} | "
                             f"{cell(m['attainment'], '.0%')} |")
    best = a.get("highest_rate_meeting_slo") or {}
    lines.append(f"\nhighest rate meeting the SLO: {best}; int8 / auto: "
                 f"{cell((a.get('highest_rate_ratio') or {}).get('int8'), '.2f')}x")
    if capacity:
        lines.append(f"\nKV blocks per decode worker: {capacity}")
    return "\n".join(lines) + "\n"


def decode_blocks(url: str) -> int | None:
    """The decode worker's KV blocks (used + free), from the router's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        if family.name in ("pdcluster_worker_kv_blocks_used", "pdcluster_worker_kv_blocks_free"):
            total += sum(s.value for s in family.samples if s.labels.get("role") == "decode")
    return int(total) or None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="the sweep this many times (medians reported)")
    p.add_argument("--model", default="builtin:tiny-llama")
    p.add_argument("--rates", default="0.25,0.5,0.75,1,1.5", help="Poisson rates, requests/s")
    p.add_argument("--num-requests", type=int, default=20, help="requests per rate")
    p.add_argument("--input", type=int, default=512, help="prompt tokens: uniform from half to 1.5x this")
    p.add_argument("--output", type=int, default=512, help="answer tokens")
    p.add_argument("--memory-mb", type=int, default=40, help="each worker's KV cache, MiB (small: it binds)")
    p.add_argument("--time-limit-s", type=float, default=300.0, help="per run")
    p.add_argument("--out", default="bench_results/exp_kv_pages_serving")
    p.add_argument("--analyse-only", action="store_true",
                   help="start nothing: summarise the result.json files already in OUT")
    args = p.parse_args(argv)
    out, slo, slo_args = experiment_setup(args.out)
    files = cluster_files(out, args.model, args.input * 3 // 2 + args.output + 64, args.memory_mb)
    capacity: dict[str, int] = {}
    if not args.analyse_only:
        def measure_capacity(urls: dict[str, str]) -> None:
            capacity.update({name: decode_blocks(url) for name, url in urls.items()})
            (out / "capacity.json").write_text(json.dumps(capacity))

        rc = sweep_clusters(files, out, [(out / f"repeat{r}", [*workload_args(args, r), *slo_args])
                                         for r in range(args.repeats)], measure_capacity)
        if rc != 0:
            return rc
    elif (out / "capacity.json").exists():
        capacity = json.loads((out / "capacity.json").read_text())
    results = [json.loads(f.read_text()) for f in sorted(out.glob("repeat*/result.json"))]
    if not results:
        print(f"no result.json under {out}")
        return 1
    a = analyse(results, None, 16, SYSTEMS, BASELINE)
    text = (f"# Quantized KV pages when serving is bound by KV memory\n\nSLO: TTFT <= {slo.ttft_ms:g} ms, "
            f"TPOT <= {slo.tpot_ms:g} ms; each worker's KV cache {args.memory_mb} MiB; prompts "
            f"{args.input // 2}-{args.input * 3 // 2} tokens, answers {args.output}\n\n" + report(a, capacity))
    (out / "summary.json").write_text(json.dumps({"args": vars(args), "capacity": capacity, "analysis": a},
                                                 indent=2, default=str))
    (out / "summary.md").write_text(text)
    print(text + f"wrote {out / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
