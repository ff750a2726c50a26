"""Experiment: the KV offload tier on the Mooncake conversation trace, against the same cluster without it.

    python -m benchmarks.kv_tier_serving --repeats 3 --rates 2,4
    python -m benchmarks.kv_tier_serving --analyse-only        # the tables from OUT's result.json files

Two clusters of the built-in model side by side on this machine, each a foreground `pdcluster up`
with its own embedded Ray, each 2 prefill workers + 1 decode worker (one torch thread per engine,
all on the same two cores), prefix-aware routing, and a per-worker KV cache small enough to evict
(`--memory-mb`, default 40 MiB: the least that holds one sequence of the longest prompt):

  no-tier   kv_cache.offload_mb: 0: a block evicted from a worker's prefix cache is gone.
  tier      kv_cache.offload_mb: --tier-mb: evicted blocks go to the node's offload tier, shared by
            the three workers, and come back on a prefix hit (engine/kv_tier.py).

The workload is benchmarks.kv_aware_serving's mooncake part: a seeded sample of whole conversations of
the Mooncake conversation trace (real hash_ids), cut at --num-requests rows, lengths scaled to fit
--max-context, Poisson arrivals at each rate, fresh prompts per repeat and rate (so nothing carries
over), the two endpoints interleaved per rate. Reported per system and rate (medians of the repeats):
TTFT p50, prompt tokens not computed (prefix-cache hits, the tier's included) against the bound of an
infinite cache shared by every worker on the same requests, the tier's share of them, SLO attainment.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.kv_aware_serving import analyse, part_args, prefix_bound, workload_prompts
from benchmarks.local_clusters import REPO, cell, experiment_setup, sweep_clusters, two_cpus, write_cluster_files
from pdcluster.cluster_config import PoolConfig, load_cluster_config

SYSTEMS = ("no-tier", "tier")
BASELINE = "no-tier"


def cluster_files(out: Path, model: str, max_model_len: int, memory_mb: int, tier_mb: int) -> dict[str, Path]:
    """The two deployments, derived from cluster.yaml (SLO, timeouts, KV backend as there)."""
    base = load_cluster_config(REPO / "cluster.yaml")
    cpus = two_cpus()
    half = {"num_cpus": 0.5}  # three workers on two cores
    common = {
        "mode": "disaggregated",
        "model": dataclasses.replace(base.model, path=model, max_model_len=max_model_len),
        "engine": dataclasses.replace(base.engine, num_threads=1),
        "pools": (PoolConfig("prefill", "prefill", 2, "cpu", half, cpus),
                  PoolConfig("decode", "decode", 1, "cpu", half, cpus)),
        "router": dataclasses.replace(base.router, grpc_port=0, http_port=0, prefix_aware=True,
                                      local_prefill_uncached_tokens=0, local_prefill_max_tokens=0),
    }
    kv = dataclasses.replace(base.kv_cache, memory_mb=memory_mb, num_blocks="auto")
    return write_cluster_files(out, {
        "no-tier": dataclasses.replace(base, **common, kv_cache=dataclasses.replace(kv, offload_mb=0)),
        "tier": dataclasses.replace(base, **common, kv_cache=dataclasses.replace(kv, offload_mb=tier_mb)),
    })


def report(a: dict[str, Any]) -> str:
    lines = [f"bound (infinite cache shared by every worker): {a['bound_tokens']} prompt tokens", "",
             "| rate | system | TTFT p50 ms | TPOT p50 ms | SLO att. | hit tokens | of bound | from the tier |",
             "|---|---|---|---|---|---|---|---|"]
    for rate in a["rates"]:
        for name in SYSTEMS:
            m = a["table"].get(name, {}).get(rate)
            if m is not None:
                lines.append(f"| {rate:g} | {name} | {cell(m['ttft_p50'])} | {cell(m['tpot_p50'])} | "
                             f"{cell(m['attainment'], '.0%')} | {cell(m['hit_tokens'])} | "
                             f"{cell(m.get('hit_of_bound'), '.0%')} "
                             f"| {cell(m.get('tier_hit_tokens'))} |")
    for rate, v in (a.get("ttft_p50_ratio") or {}).get("tier", {}).items():
        lines.append(f"\nTTFT p50 at {rate:g}/s, no-tier / tier: {cell(v, '.2f')}x")
    lines.append(f"\nhighest rate meeting the SLO: {a.get('highest_rate_meeting_slo')}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="the sweep this many times (medians reported)")
    p.add_argument("--model", default="builtin:tiny-llama")
    p.add_argument("--rates", default="2,4", help="Poisson rates, requests/s")
    p.add_argument("--num-requests", type=int, default=200, help="trace rows per run")
    p.add_argument("--sample-seed", type=int, default=0, help="the conversation sample's seed")
    p.add_argument("--max-context", type=int, default=4000, help="trace lengths scaled to fit this")
    p.add_argument("--max-output", type=int, default=32)
    p.add_argument("--memory-mb", type=int, default=40, help="each worker's KV cache, MiB (small: it evicts)")
    p.add_argument("--tier-mb", type=int, default=512, help="the tier system's offload tier, MiB")
    p.add_argument("--time-limit-s", type=float, default=300.0, help="per run")
    p.add_argument("--out", default="bench_results/exp_kv_tier_serving")
    p.add_argument("--analyse-only", action="store_true",
                   help="start nothing: summarise the result.json files already in OUT (same workload options)")
    args = p.parse_args(argv)
    args.mooncake_sample = "conversations"
    out, slo, slo_args = experiment_setup(args.out)
    files = cluster_files(out, args.model, args.max_context + args.max_output + 64, args.memory_mb, args.tier_mb)
    if not args.analyse_only:
        rc = sweep_clusters(files, out, [(out / f"repeat{r}", [*part_args("mooncake", args, r), *slo_args])
                                         for r in range(args.repeats)])
        if rc != 0:
            return rc
    block = load_cluster_config(REPO / "cluster.yaml").kv_cache.block_size
    results = [json.loads(f.read_text()) for f in sorted(out.glob("repeat*/result.json"))]
    if not results:
        print(f"no result.json under {out}")
        return 1
    a = analyse(results, prefix_bound(workload_prompts(args), block), block, SYSTEMS, BASELINE)
    text = (f"# The KV offload tier on the Mooncake conversation trace\n\nSLO: TTFT <= {slo.ttft_ms:g} ms, "
            f"TPOT <= {slo.tpot_ms:g} ms; each worker's KV cache {args.memory_mb} MiB, tier {args.tier_mb} MiB\n\n"
            + report(a))
    (out / "summary.json").write_text(json.dumps({"args": vars(args), "mooncake": a}, indent=2, default=str))
    (out / "summary.md").write_text(text)
    print(text + f"wrote {out / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
