"""Experiment: KV-cache-centric serving against routing by load only, same cluster, same workload.

    python -m benchmarks.kv_aware_serving                       # all three parts
    python -m benchmarks.kv_aware_serving --parts chat --repeats 3

Three clusters of the built-in model run side by side on this machine, each a foreground
`pdcluster up` with its own embedded Ray, each 2 prefill workers + 1 decode worker (one torch
thread per engine, all on the same two cores):

  by-load    router.prefix_aware: false. Workers picked by load only, and every prompt's whole KV
             moves to the decode worker (the cluster as it was before prefix-aware serving).
  prefix     router.prefix_aware: true. Prefill worker by expected cost (uncached + queued prompt
             tokens), decode worker by the longest prefix it holds, only the blocks it lacks move.
  kv-aware   the same, and router.local_prefill_uncached_tokens: T (conditional disaggregation: a
             prompt whose uncached part is at most T tokens is prefilled on its decode worker, no KV
             moves; a short prompt with nothing cached too).

--local-prefill-max-tokens N sets router.local_prefill_max_tokens on all three alike (the queue
rule: a prompt whose part its decode worker would compute is at most N tokens goes there when it
would queue behind more at the prefill workers).

Each part is one `pdcluster bench serve` run over both endpoints, interleaved per rate, repeated
`--repeats` times with fresh prompts (no cache carries from one repeat or rate to the next):

  mooncake  the Mooncake conversation trace (real hash_ids: requests that share leading blocks
            share prompt text): a seeded sample of whole conversations cut at --num-requests rows
            (`--mooncake-sample conversations`, the default; the trace's first rows hold few
            continued conversations), lengths scaled to fit, a sweep of Poisson rates.
            Prefix-cache hit tokens (prompt tokens a worker did not compute: the prefill workers',
            and the decode worker's own prefills') against the bound of an infinite cache shared by
            every worker on the same requests; TTFT p50; the highest rate meeting the SLO.
  chat      multi-turn conversations (bench serve --workload multiturn): TTFT p50 of the turns
            after the first, KV bytes moved per later turn.
  azure     the Azure conversation trace (no reuse): within noise of routing by load.

Writes OUT/<part>/ (bench serve's result.json, summary.md per repeat) and OUT/summary.json / .md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any


from benchmarks import rate_sweep as sweep
from benchmarks.local_clusters import REPO, cell, experiment_setup, sweep_clusters, two_cpus, write_cluster_files
from pdcluster.cluster_config import PoolConfig, load_cluster_config

SYSTEMS = ("by-load", "prefix", "kv-aware")
BASELINE = "by-load"
PARTS = ("mooncake", "chat", "azure")


def cluster_files(out: Path, model: str, max_model_len: int, uncached: int, elastic: int = 0) -> dict[str, Path]:
    """The deployments, derived from cluster.yaml (SLO, timeouts, KV backend as there); `elastic`:
    every system's router.local_prefill_max_tokens (the queue rule of local prefill)."""
    base = load_cluster_config(REPO / "cluster.yaml")
    cpus = two_cpus()
    half = {"num_cpus": 0.5}  # three workers on two cores
    common = {
        "model": dataclasses.replace(base.model, path=model, max_model_len=max_model_len),
        "engine": dataclasses.replace(base.engine, num_threads=1),
        "pools": (PoolConfig("prefill", "prefill", 2, "cpu", half, cpus),
               PoolConfig("decode", "decode", 1, "cpu", half, cpus)),
    }
    router = dataclasses.replace(base.router, grpc_port=0, http_port=0, local_prefill_max_tokens=elastic)
    systems = {
        "by-load": dataclasses.replace(base, mode="disaggregated", **common, router=dataclasses.replace(
            router, prefix_aware=False, local_prefill_uncached_tokens=0)),
        "prefix": dataclasses.replace(base, mode="disaggregated", **common, router=dataclasses.replace(
            router, prefix_aware=True, local_prefill_uncached_tokens=0)),
        "kv-aware": dataclasses.replace(base, mode="disaggregated", **common, router=dataclasses.replace(
            router, prefix_aware=True, local_prefill_uncached_tokens=uncached)),
    }
    return write_cluster_files(out, systems)


def part_args(part: str, args: argparse.Namespace, repeat: int) -> list[str]:
    """bench serve's workload flags for one repeat of a part (each repeat its own prompts)."""
    common = ["--tokenizer", args.model, "--ignore-eos", "--seed", str(100 * repeat + 1), "--fresh-prompts",
              "--time-limit-s", str(args.time_limit_s)]
    if part == "chat":
        return ["--workload", "multiturn", "--conversations", str(args.conversations), "--turns",
                f"fixed:{args.turns}", "--first-prompt-len", f"fixed:{args.first_prompt}", "--message-len",
                f"fixed:{args.message}", "--output-len", f"fixed:{args.output}", "--think-time",
                f"fixed:{args.think_s}", "--rates", args.chat_rates, *common]
    trace = "mooncake-conv" if part == "mooncake" else "azure-conv"
    sample = (["--sample-seed", str(args.sample_seed), "--sample-unit", "conversations"]
              if part == "mooncake" and args.mooncake_sample == "conversations" else [])
    return ["--workload", trace, "--num-requests", str(args.num_requests), "--rates", args.rates,
            "--max-context", str(args.max_context), "--max-output", str(args.max_output), *sample, *common]


# ------------------------------------------------------------------------------------- analysis
def prefix_bound(prompts: list[list[int]], block_size: int) -> int:
    """Prompt tokens an infinite prefix cache shared by every worker would serve on these requests
    in this order (the planner's `reuse_bound`, over the prompts' own block hashes)."""
    from engine.prefix_hash import block_hashes
    from planner.sim_cache import reuse_bound

    return reuse_bound(range(len(prompts)), [len(ids) for ids in prompts],
                       [block_hashes(ids, block_size) for ids in prompts], block_size)


def _counter(run: dict, role: str, field: str) -> float:
    return ((run.get("server_counters") or {}).get(f"{role}/prefix") or {}).get(field, 0.0)


def run_figures(run: dict, block_size: int = 16) -> dict[str, Any]:
    """One system's run: latency, SLO and what the workers' caches saved."""
    s = run["summary"]
    later = s.get("ttft_later_turns_ms") or {}
    records = run.get("records", [])
    later_turns = sum(1 for r in records if (r.get("turn") or 0) > 0)
    blocks = [(-(-(r.get("prompt_tokens") or 0) // block_size), (r.get("turn") or 0) == 0) for r in records]
    return {
        "ttft_p50": s["ttft_ms"]["p50"], "ttft_later_p50": later.get("p50"), "tpot_p50": s["tpot_ms"]["p50"],
        "attainment": s.get("slo_attainment"), "failed": s.get("failed", 0),
        "hit_tokens": _counter(run, "prefill", "prefix_cache_hit_tokens") + _counter(run, "decode",
                                                                                      "prefix_cache_hit_tokens"),
        "prompt_tokens": sum(r.get("prompt_tokens") or 0 for r in records),
        "kv_bytes": _counter(run, "prefill", "kv_transfer_bytes"),
        "local_prefills": _counter(run, "decode", "local_prefills"),
        "tier_hit_tokens": block_size * sum(_counter(run, role, "kv_tier_hits") for role in ("prefill", "decode")),
        "later_turns": later_turns, "blocks": sum(b for b, _ in blocks),
        "first_turn_blocks": sum(b for b, first in blocks if first),
    }


def analyse(results: list[dict], bound: int | None = None, block_size: int = 16,
            systems: tuple[str, ...] = SYSTEMS, baseline: str = BASELINE) -> dict[str, Any]:
    """Per system and rate, the medians over the repeats' results; the goals' ratios. KV bytes per
    later turn: what moved less the first turns' whole prompts (nothing is cached for those), at
    routing by load's bytes per block (it moves every block of every prompt)."""
    cells: dict[str, dict[float, list[dict]]] = {}
    for result in results:
        for run in result["runs"]:
            cells.setdefault(run["label"], {}).setdefault(run["rate"], []).append(run_figures(run, block_size))
    per_block = _median([f["kv_bytes"] / f["blocks"] for f in (x for r in cells.get(baseline, {}).values() for x in r)
                         if f["blocks"]])
    for rows in (x for by_rate in cells.values() for x in by_rate.values()):
        for f in rows:
            f["kv_bytes_later_turn"] = ((f["kv_bytes"] - f["first_turn_blocks"] * per_block) / f["later_turns"]
                                        if per_block and f["later_turns"] else None)
    table: dict[str, dict[float, dict]] = {}
    for name, by_rate in cells.items():
        for rate, rows in by_rate.items():
            med = {k: _median([r[k] for r in rows]) for k in rows[0]}
            med["repeats"] = len(rows)
            if bound:
                med["hit_of_bound"] = med["hit_tokens"] / bound
            table.setdefault(name, {})[rate] = med
    rates = sorted({r for t in table.values() for r in t})
    out: dict[str, Any] = {"bound_tokens": bound, "rates": rates, "table": table}
    best = {n: max([r for r in rates if (table[n][r]["attainment"] or 0) >= sweep.ATTAINMENT], default=None)
            for n in table}
    out["highest_rate_meeting_slo"] = best
    if baseline in table:  # each system against the baseline (routing by load): > 1 is better
        base = table[baseline]
        for n in (n for n in systems if n in table and n != baseline):
            t = table[n]
            out.setdefault("ttft_p50_ratio", {})[n] = {r: _ratio(base[r]["ttft_p50"], t[r]["ttft_p50"]) for r in rates}
            out.setdefault("ttft_later_p50_ratio", {})[n] = {
                r: _ratio(base[r]["ttft_later_p50"], t[r]["ttft_later_p50"]) for r in rates}
            out.setdefault("kv_bytes_ratio", {})[n] = {r: _ratio(base[r]["kv_bytes"], t[r]["kv_bytes"]) for r in rates}
            out.setdefault("kv_later_turn_ratio", {})[n] = {
                r: _ratio(base[r]["kv_bytes_later_turn"], max(t[r]["kv_bytes_later_turn"] or 0, 1.0)
                          if t[r]["kv_bytes_later_turn"] is not None else None) for r in rates}
            out.setdefault("highest_rate_ratio", {})[n] = _ratio(best[n], best[baseline])
    return out


def _median(values: list) -> Any:
    nums = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(nums) if nums else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def report(part: str, a: dict[str, Any], systems: tuple[str, ...] = SYSTEMS, baseline: str = BASELINE) -> str:
    lines = [f"## {part}", ""]
    if a.get("bound_tokens"):
        lines.append(f"bound (infinite cache shared by every worker): {a['bound_tokens']} prompt tokens")
    head = ("| rate | system | TTFT p50 ms | later turns TTFT p50 ms | TPOT p50 ms | SLO att. | hit tokens "
            "| of bound | KV MiB moved | KV MiB per later turn | local prefills |")
    lines += ["", head, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for rate in a["rates"]:
        for name in systems:
            m = a["table"].get(name, {}).get(rate)
            if m is None:
                continue
            lines.append(f"| {rate:g} | {name} | {cell(m['ttft_p50'])} | {cell(m['ttft_later_p50'])} | "
                         f"{cell(m['tpot_p50'])} | {cell(m['attainment'], '.0%')} | {cell(m['hit_tokens'], '.0f')} | "
                         f"{cell(m.get('hit_of_bound'), '.0%')} | {cell((m['kv_bytes'] or 0) / 2**20, '.1f')} | "
                         f"{cell(_mib(m['kv_bytes_later_turn']), '.2f')} | {cell(m['local_prefills'], '.0f')} |")
    for key, label in (("ttft_p50_ratio", "TTFT p50"), ("ttft_later_p50_ratio", "later turns' TTFT p50"),
                       ("kv_bytes_ratio", "KV bytes moved"),
                       ("kv_later_turn_ratio", "KV bytes per later turn (>= 1 byte)")):
        for n, by_rate in (a.get(key) or {}).items():
            if any(by_rate.values()):
                lines.append(f"\n{label}, {baseline} / {n}: " + ", ".join(f"{r:g}/s {_times(v)}"
                                                                        for r, v in by_rate.items()))
    if a.get("highest_rate_meeting_slo"):
        lines.append(f"\nhighest rate meeting the SLO: {a['highest_rate_meeting_slo']}")
    return "\n".join(lines) + "\n"


def _times(v: float | None) -> str:
    return "-" if v is None else "> 1000x (none moved)" if v > 1000 else f"{v:.2f}x"


def _mib(v: float | None) -> float | None:
    return None if v is None else max(v, 0.0) / 2**20


def workload_prompts(args: argparse.Namespace) -> list[list[int]]:
    """The token ids of the mooncake part's prompts (first repeat, first rate), as the router tokenizes them."""
    from loadgen.cli import load_tokenizer
    from loadgen.workload import WorkloadConfig, load_workload

    tok = load_tokenizer(args.model)
    by_conv = args.mooncake_sample == "conversations"
    w = load_workload(WorkloadConfig("mooncake-conv", args.num_requests, args.sample_seed if by_conv else None,
                                     "conversations" if by_conv else "rows", max_context=args.max_context,
                                     max_output=args.max_output, seed=1), tok)
    return [tok.encode(r.prompt) for r in w.requests]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    p.add_argument("--repeats", type=int, default=3, help="each part this many times (medians reported)")
    p.add_argument("--model", default="builtin:tiny-llama")
    p.add_argument("--local-prefill-uncached-tokens", type=int, default=256, help="kv-aware's threshold")
    p.add_argument("--local-prefill-max-tokens", type=int, default=0,
                   help="every system's router.local_prefill_max_tokens (0: off; the same for all, so the "
                        "comparison is of prefix awareness alone)")
    p.add_argument("--rates", default="2,4,6", help="mooncake and azure: Poisson rates, requests/s")
    p.add_argument("--num-requests", type=int, default=300, help="mooncake and azure: trace rows per run")
    p.add_argument("--mooncake-sample", choices=("conversations", "first-rows"), default="conversations",
                   help="mooncake: a seeded sample of whole conversations (keeps their reuse) or the first rows")
    p.add_argument("--sample-seed", type=int, default=0, help="mooncake: the conversation sample's seed")
    p.add_argument("--max-context", type=int, default=4000,
                   help="trace lengths scaled to fit this (Mooncake's 512-token block becomes ~17 tokens: one "
                        "16-token KV block, so shared leading blocks stay shared)")
    p.add_argument("--max-output", type=int, default=32)
    p.add_argument("--conversations", type=int, default=16, help="chat: conversations per repeat")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first-prompt", type=int, default=1024, help="chat: first turn's prompt tokens")
    p.add_argument("--message", type=int, default=64, help="chat: each later turn's new message, tokens")
    p.add_argument("--output", type=int, default=64, help="chat: answer tokens")
    p.add_argument("--think-s", type=float, default=1.0, help="chat: think time between turns, seconds")
    p.add_argument("--chat-rates", default="1,2", help="chat: conversations started per second (a sweep)")
    p.add_argument("--time-limit-s", type=float, default=300.0, help="per run")
    p.add_argument("--out", default="bench_results/exp_kv_aware_serving")
    p.add_argument("--analyse-only", action="store_true",
                   help="start nothing: summarise the result.json files already in OUT (same workload options)")
    args = p.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    if bad := [x for x in parts if x not in PARTS]:
        p.error(f"--parts: unknown {bad}; allowed: {', '.join(PARTS)}")
    out, slo, slo_args = experiment_setup(args.out)
    max_len = max(args.max_context + args.max_output, args.first_prompt + args.turns * (args.message + args.output)) + 64
    systems = [x for x in args.systems.split(",") if x]
    if bad := [x for x in systems if x not in SYSTEMS]:
        p.error(f"--systems: unknown {bad}; allowed: {', '.join(SYSTEMS)}")
    files = {n: f for n, f in cluster_files(out, args.model, max_len, args.local_prefill_uncached_tokens,
                                                 args.local_prefill_max_tokens).items()
             if n in systems}
    if not args.analyse_only:
        rc = sweep_clusters(files, out, [(out / part / f"repeat{repeat}", [*part_args(part, args, repeat), *slo_args])
                                         for part in parts for repeat in range(args.repeats)])
        if rc != 0:
            return rc
    return write_summary(out, parts, args, slo)


def write_summary(out: Path, parts: list[str], args: argparse.Namespace, slo: Any) -> int:
    """Every repeat's result.json under OUT/<part>/ -> OUT/summary.json and summary.md, printed too."""
    block = load_cluster_config(REPO / "cluster.yaml").kv_cache.block_size
    summary: dict[str, Any] = {"args": vars(args)}
    text = f"# KV-aware serving against routing by load\n\nSLO: TTFT <= {slo.ttft_ms:g} ms, TPOT <= {slo.tpot_ms:g} ms\n\n"
    for part in parts:
        results = [json.loads(f.read_text()) for f in sorted((out / part).glob("repeat*/result.json"))]
        if not results:
            continue
        bound = prefix_bound(workload_prompts(args), block) if part == "mooncake" else None
        a = analyse(results, bound, block)
        summary[part] = a
        text += report(part, a) + "\n"
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "summary.md").write_text(text)
    print(text + f"wrote {out / 'summary.md'}")
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
