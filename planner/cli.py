"""`pdcluster plan`: the capacity planner's command line.

    pdcluster plan --workload azure-conv --model Llama-3-8B --slo-ttft-ms 1000 --slo-tpot-ms 60 \\
        --pools H100-SXM,A100-80GB,L40S [--rate 20]            search; writes the table, plot, cluster.yaml
    pdcluster plan simulate --prefill cpu:1 --decode cpu:1 --rate 1 --workload azure-conv --max-context 1024
                                                              one cluster, one rate: its latencies
    pdcluster plan calibrate                                  time the engine here, write cpu coefficients
    pdcluster plan calibrate --serving-url http://HOST:PORT   fit a running cluster's step costs under load
    pdcluster plan calibrate --from-bench RESULT.json         fit them to `bench serve` runs' worker counters
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from loadgen.arrivals import KINDS
from planner.describe import default_layout, model_lines, parallel_lines, typical_context
from planner.reuse import add_routing_args, plan_reuse, routing_of

DOC = __doc__


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def _names(s: str | None) -> list[str]:
    return [x.strip() for x in (s or "").split(",") if x.strip()]


def _pools(s: str | None, caps: dict[str, int]) -> list[str]:
    """'H100-SXM:16,A100-80GB' -> ['H100-SXM', 'A100-80GB'], caps['H100-SXM'] = 16 (devices available)."""
    names = []
    for item in _names(s):
        name, _, cap = item.partition(":")
        if cap:
            try:
                caps[name] = min(caps.get(name, 1 << 30), int(cap))
            except ValueError:
                raise ValueError(f"--pools {item!r}: expected HARDWARE or HARDWARE:DEVICES") from None
        names.append(name)
    return names


def _workload_args(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload (as `pdcluster bench serve` reads it)")
    w.add_argument("--workload", default="azure-conv", help="azure-conv, azure-code, mooncake-conv, "
                   "mooncake-synthetic, synthetic, or an Azure .csv / Mooncake .jsonl path")
    w.add_argument("--num-requests", type=int, default=1000,
                   help="requests per simulation (plan: the least; more at high rates, see --min-span-s)")
    w.add_argument("--sample-seed", type=int, default=None, help="a seeded sample of rows instead of the first")
    sc = w.add_mutually_exclusive_group()
    sc.add_argument("--max-context", type=int, default=None, help="scale lengths so every request fits in C tokens")
    sc.add_argument("--scale-lengths", type=float, default=None, help="scale prompt and output lengths by F")
    w.add_argument("--max-output", type=int, default=None, help="cap output lengths after scaling")
    w.add_argument("--synthetic-input", default="lognormal:512:0.5")
    w.add_argument("--synthetic-output", default="lognormal:128:0.5")
    w.add_argument("--arrival", choices=KINDS, default="poisson")
    w.add_argument("--burstiness", type=float, default=1.0)
    w.add_argument("--seed", type=int, default=0, help="arrival times (and synthetic lengths)")
    m = p.add_argument_group("model and hardware")
    m.add_argument("--model", default="builtin:tiny-llama",
                   help="a preset (Llama-3-8B, Llama-3-70B, Qwen2.5-7B, DeepSeek-V3, gpt-oss-120b, Qwen3-30B-A3B, "
                        "Mixtral-8x7B, ...), builtin:NAME or a checkpoint dir")
    m.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "fp8"],
                   help="weights and KV cache on GPUs (cpu pools run the calibrated float32 engine)")
    m.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8_e4m3", "fp8_e5m2"],
                   help="the workers' KV cache: the model's dtype, or quantized pages (a byte a value and a scale "
                        "a row: more tokens per device, fewer bytes per transfer); written to kv_cache.dtype")
    m.add_argument("--kv-offload-mb", type=int, default=0,
                   help="an offload tier of this many MiB for blocks evicted from the workers' prefix caches "
                        "(simulated as one tier shared by every worker; 0: none); written to kv_cache.offload_mb")
    m.add_argument("--catalog", action="append", default=[], metavar="FILE",
                   help="extra hardware entries (planner/hardware.yaml's layout); repeatable")
    m.add_argument("--price", action="append", default=[], metavar="NAME=USD", help="override a price per device-hour")
    m.add_argument("--coefficients", default=None, help="fitted cpu coefficients (default planner/cpu_coefficients.json)")


def _context(args: argparse.Namespace, hardware: list[str]):
    from planner.catalog import load_catalog, parse_prices
    from planner.cost_model import CPU_COEFFICIENTS, load_coefficients
    from planner.models import model_shape
    from planner.plan import PlanContext

    catalog = load_catalog(args.catalog, parse_prices(args.price))
    for h in hardware:
        if h not in catalog:
            raise ValueError(f"unknown hardware {h!r}; known: {', '.join(catalog)} (add more with --catalog)")
    coeffs = None
    if any(catalog[h].is_cpu for h in hardware):
        coeffs = load_coefficients(args.coefficients or CPU_COEFFICIENTS)
    if args.kv_offload_mb < 0:
        raise ValueError(f"--kv-offload-mb must be >= 0, got {args.kv_offload_mb}")
    return PlanContext(model_shape(args.model), catalog, args.dtype, coeffs, kv_cache_dtype=args.kv_cache_dtype,
                       kv_offload_mb=args.kv_offload_mb)


def _workload(args: argparse.Namespace):
    from planner.workload import load_plan_workload

    return load_plan_workload(args.workload, args.num_requests, args.max_context, args.scale_lengths, args.max_output,
                              args.sample_seed, args.arrival, args.burstiness, args.seed, args.synthetic_input,
                              args.synthetic_output)


# ---------------------------------------------------------------------------------------------- plan
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdcluster plan", description=DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _workload_args(p)
    add_routing_args(p, auto=True)
    s = p.add_argument_group("SLO and objective")
    s.add_argument("--slo-ttft-ms", type=float, required=True)
    s.add_argument("--slo-tpot-ms", type=float, required=True)
    s.add_argument("--percentile", type=float, default=90.0, help="the SLO holds for this percentile of requests")
    s.add_argument("--slo-criterion", choices=["percentile", "attainment"], default="percentile",
                   help="percentile: p-th percentile TTFT and TPOT each within its bound (DistServe); attainment: "
                        ">= p%% of requests meet both bounds (bench serve's SLO attainment)")
    s.add_argument("--rate", type=float, default=None,
                   help="target request rate: the cheapest plan meeting the SLO at it (default: best goodput per $)")
    g = p.add_argument_group("search space")
    g.add_argument("--pools", default=None,
                   help="node pools for both phases, comma separated: HARDWARE or HARDWARE:DEVICES (how many "
                        "devices of that type there are), e.g. H100-SXM:16,A100-80GB")
    g.add_argument("--prefill-pools", default=None, help="hardware for prefill (default: --pools)")
    g.add_argument("--decode-pools", default=None, help="hardware for decode (default: --pools)")
    g.add_argument("--modes", default="disaggregated,colocated")
    g.add_argument("--tp", type=_ints, default=None,
                   help="devices per worker, e.g. 1,2,4 (default 1,2,4,8; for a mixture-of-experts model also 16,32: "
                        "expert parallelism may span nodes); each in the layouts planner/parallel.py allows")
    g.add_argument("--max-num-batched-tokens", type=_ints, default=(2048,), help="token budgets per step, e.g. 2048,8192")
    g.add_argument("--max-num-seqs", type=_ints, default=(256,), help="sequences per worker, e.g. 128,256")
    g.add_argument("--max-workers", type=int, default=8, help="most workers per pool")
    g.add_argument("--verify", type=int, default=6, help="how many of the best compositions to simulate whole")
    g.add_argument("--min-span-s", type=float, default=60.0,
                   help="a simulation at rate R has at least R x this many requests (a steady state)")
    g.add_argument("--max-requests", type=int, default=20000, help="most requests per simulation")
    o = p.add_argument_group("output")
    o.add_argument("--out", default="bench_results/plan", help="directory for table.md, plan.json, pareto.png, cluster.yaml")
    o.add_argument("--cluster-yaml", default=None, help="where to write the best plan (default OUT/cluster.yaml)")
    o.add_argument("--model-path", default=None,
                   help="model.path in the cluster.yaml (default: --model when it is builtin:NAME or a directory)")
    o.add_argument("--no-progress", action="store_true")
    return p


def _plan(argv: list[str]) -> int:
    from tqdm import tqdm

    from planner.plan import build_cluster
    from planner.report import (
        markdown_table,
        pareto_plot,
        plan_json,
        table_rows,
        text_table,
        why_mode,
        write_cluster_yaml,
    )
    from planner.search import Searcher, SearchSpace, SLOTarget

    args = build_parser().parse_args(argv)
    caps: dict[str, int] = {}
    pre = _pools(args.prefill_pools or args.pools, caps)
    dec = _pools(args.decode_pools or args.pools, caps)
    if not pre or not dec:
        raise ValueError("give --pools (or --prefill-pools and --decode-pools)")
    modes = tuple(_names(args.modes))
    if not set(modes) <= {"disaggregated", "colocated"} or not modes:
        raise ValueError(f"--modes: disaggregated and/or colocated, got {args.modes!r}")
    if not 0 < args.percentile < 100:
        raise ValueError("--percentile must be in (0, 100)")
    if args.rate is not None and args.rate <= 0:
        raise ValueError("--rate must be > 0")
    ctx = _context(args, list(dict.fromkeys(pre + dec)))
    least = args.num_requests
    args.num_requests = max(least, args.max_requests)
    workload = _workload(args)
    ctx.kv_context = typical_context(workload)
    slo = SLOTarget(args.slo_ttft_ms, args.slo_tpot_ms, args.percentile, getattr(args, "slo_criterion", "percentile"))
    tps = args.tp or ((1, 2, 4, 8, 16, 32) if ctx.model.experts is not None else (1, 2, 4, 8))
    space = SearchSpace(pre, dec, modes, tps, args.max_num_batched_tokens, args.max_num_seqs, args.max_workers,
                        caps, **routing_of(args))
    command = "pdcluster plan " + shlex.join(argv)
    print("\n".join(workload.describe()))
    m = ctx.model
    print("\n".join(model_lines(m, ctx.kv_context)))
    for h in dict.fromkeys(pre + dec):
        hw = ctx.catalog[h]
        print(f"hardware   {h}: {hw.tflops_bf16:g} TFLOP/s, {hw.hbm_gbps:g} GB/s, {hw.hbm_gb:g} GB, "
              f"${hw.price_per_hour:g}/h" + (" (fitted step times)" if hw.is_cpu and ctx.coefficients else ""))
    bounds = (f">= {slo.percentile:g}% of requests with TTFT <= {slo.ttft_ms:g} ms and TPOT <= {slo.tpot_ms:g} ms"
              if slo.criterion == "attainment" else
              f"p{slo.percentile:g} TTFT <= {slo.ttft_ms:g} ms and p{slo.percentile:g} TPOT <= {slo.tpot_ms:g} ms")
    print(f"SLO        {bounds}"
          + (f"; target {args.rate:g} req/s: the cheapest plan" if args.rate else "; objective: goodput per dollar"),
          flush=True)

    searcher = Searcher(ctx, workload, slo, min_requests=least, min_span_s=args.min_span_s)
    n_units = sum(1 for _ in searcher.unit_jobs(space))
    bar = tqdm(total=n_units + args.verify, desc="plan", unit="step", disable=args.no_progress)
    searcher.progress = lambda label: (bar.set_postfix_str(f"{label[:40]}, {searcher.simulations} sims"), bar.update())
    t0 = time.perf_counter()
    result = searcher.search(space, args.rate, args.verify)
    bar.close()
    wall = time.perf_counter() - t0
    rows = table_rows(result.ranked, slo, args.rate)
    print(f"\n{result.simulations} simulations ({least} to {len(workload)} requests each) in {wall:.1f} s; "
          f"{len(result.composed)} compositions, {len(result.ranked)} simulated whole")
    print(text_table(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    why = pareto_plot(out / "pareto.png", result.composed, result.ranked)
    payload = {"command": command, "workload": workload.describe(), "slo": asdict(slo),
               "units": result.units, "simulations": result.simulations, "wall_s": wall}
    plan_json(out / "plan.json", payload, result.ranked, result.composed)
    (out / "table.md").write_text(f"Command: `{command}`\n\n" + markdown_table(rows) + "\n")
    written = [out / "table.md", out / "plan.json"] + ([] if why else [out / "pareto.png"])
    best = result.ranked[0] if result.ranked else None
    if best is None or best.goodput <= 0 or (args.rate and not best.meets_target):
        print("no plan meets the SLO" + (f" at {args.rate:g} req/s" if args.rate else "")
              + " within the search space (more --max-workers, other --pools, or a looser SLO?)")
        print("wrote " + ", ".join(map(str, written)))
        return 1
    model_path = args.model_path or (args.model if args.model.startswith("builtin:") or Path(args.model).is_dir()
                                     else f"/path/to/{m.name}")
    longest = max(p + o for p, o in zip(workload.prompts, workload.outputs))
    yaml_path = Path(args.cluster_yaml) if args.cluster_yaml else out / "cluster.yaml"
    header = [command, (f"plan: {best.plan.label()}; ${best.cost_per_hour:.2f}/h; predicted goodput "
              f"{best.goodput:.3g} req/s (p{slo.percentile:g} TTFT {best.ttft_ms:.0f} ms, TPOT {best.tpot_ms:.1f} ms "
              f"at {best.rate:.3g} req/s)")]
    if not args.model_path and not (args.model.startswith("builtin:") or Path(args.model).is_dir()):
        header.append(f"set model.path to a local checkpoint directory of {m.name}")
    header += [ep_header(pool, ctx) for pool in best.plan.pools if pool.ep]
    write_cluster_yaml(yaml_path, best, ctx, slo, model_path, longest, header)
    written.append(yaml_path)
    if why:
        print(why)
    print(why_mode(result.ranked))
    print("\n".join(parallel_lines(best.plan, ctx)))
    if searcher.block_keys is not None:  # what the workload's prefix reuse is worth to the best plan
        head = workload.head(searcher.requests_at(best.rate))
        print("\n".join(plan_reuse(build_cluster(best.plan, ctx), head, best.rate, ctx.block_size)))
    print(f"best: {best.plan.label()} -> {yaml_path}")
    print("wrote " + ", ".join(map(str, written)))
    return 0


def ep_header(pool, ctx) -> str:
    """The cluster.yaml's note on an expert-parallel pool: what the plan assumed against what
    `expert_parallel: true` runs, or why the engine cannot serve it as written."""
    from planner.parallel import engine_ep_gap

    gap = engine_ep_gap(ctx.model, ctx.hardware(pool.hardware), pool.tp)
    if gap is not None:
        return f"{pool}: planned as expert parallel; not servable as written: {gap}"
    return (f"{pool}: expert_parallel: true places the experts whole per GPU as planned, but the engine keeps "
            "attention tensor-parallel and combines with an all-reduce (the plan assumed data-parallel "
            "attention and all-to-alls): expect other timings than predicted")


# ---------------------------------------------------------------------------------------------- simulate
def _pool_arg(s: str):
    """HARDWARE[:COUNT[:DEVICES]]; DEVICES as N or tpN (tensor parallel) or epN (expert parallel)."""
    from planner.plan import Pool

    parts = s.split(":")
    try:
        layout = parts[2] if len(parts) > 2 else "1"
        ep = layout.startswith("ep")
        return Pool(parts[0], int(parts[1]) if len(parts) > 1 else 1, int(layout.removeprefix("ep").removeprefix("tp")),
                    ep=ep)
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"{s!r}: expected HARDWARE[:COUNT[:N|tpN|epN]]") from None


def _simulate(argv: list[str]) -> int:
    from loadgen.metrics import Dist
    from planner.workload import PlanWorkload, load_plan_workload
    from planner.plan import Plan, build_cluster
    from planner.reuse import reuse_lines
    from planner.simulator import Simulator

    p = argparse.ArgumentParser(prog="pdcluster plan simulate", description="simulate one cluster at one rate")
    _workload_args(p)
    p.add_argument("--prefill", type=_pool_arg, default=None,
                   help="HARDWARE[:COUNT[:N|tpN|epN]] (disaggregated; N devices per worker, epN: expert parallel)")
    p.add_argument("--decode", type=_pool_arg, default=None, help="HARDWARE[:COUNT[:N|tpN|epN]] (disaggregated)")
    p.add_argument("--colocated", type=_pool_arg, default=None, help="HARDWARE[:COUNT[:N|tpN|epN]] (colocated mode)")
    p.add_argument("--rate", type=float, default=None, help="requests/s (required but with --controller)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    add_routing_args(p, auto=False)
    p.add_argument("--compare-routing", action="store_true", help="also simulate them routed by load only")
    from planner.controlled_cli import add_args
    from planner.controlled_cli import run as run_controlled

    add_args(p)
    args = p.parse_args(argv)
    if args.rate is None and not args.controller:
        p.error("--rate is required (or --controller with --phases)")
    if args.colocated is not None:
        plan = Plan("colocated", None, args.colocated, args.max_num_batched_tokens, args.max_num_seqs, **routing_of(args))
    elif args.prefill is not None and args.decode is not None:
        plan = Plan("disaggregated", args.prefill, args.decode, args.max_num_batched_tokens, args.max_num_seqs,
                    **routing_of(args))
    else:
        raise ValueError("give --prefill and --decode, or --colocated")
    ctx = _context(args, [x.hardware for x in plan.pools])
    plan = replace(plan, prefill=default_layout(plan.prefill, ctx) if plan.prefill else None,
                   decode=default_layout(plan.decode, ctx))
    if args.controller:
        if plan.mode != "disaggregated":
            raise ValueError("--controller moves workers between prefill and decode: give --prefill and --decode")
        spec = build_cluster(plan, ctx)
        print("\n".join(model_lines(ctx.model, ctx.kv_context)))
        from loadgen.phases import synthetic_lengths

        def load(name: str, n: int) -> PlanWorkload:  # a workload, or PROMPT/OUTPUT (synthetic, fixed)
            fixed = synthetic_lengths(name)
            lengths = (f"fixed:{fixed[0]}", f"fixed:{fixed[1]}") if fixed else (args.synthetic_input,
                                                                               args.synthetic_output)
            return load_plan_workload("synthetic" if fixed else name, n, args.max_context, args.scale_lengths,
                                      args.max_output, args.sample_seed, args.arrival, args.burstiness, args.seed,
                                      *lengths)

        return run_controlled(args, spec, spec.decode[0], load)
    workload = _workload(args)
    ctx.kv_context = typical_context(workload)
    print("\n".join(workload.describe()))
    print("\n".join(model_lines(ctx.model, ctx.kv_context)))
    print("\n".join(parallel_lines(plan, ctx)))
    arrivals = workload.arrivals(args.rate)
    t0 = time.perf_counter()
    keys = workload.block_keys(ctx.block_size)
    res = Simulator(build_cluster(plan, ctx)).run(arrivals, workload.prompts, workload.outputs, block_keys=keys)
    wall = time.perf_counter() - t0
    ttft = Dist.of([x for x in res.ttft if not math.isnan(x)])
    tpot = Dist.of([x for x in res.tpot if not math.isnan(x)])
    print(f"plan       {plan.label()}, {args.rate:g} req/s, ${plan.cost_per_hour(ctx.catalog):.2f}/h")
    print(f"TTFT ms    p50 {ttft.p50:.1f}  p90 {ttft.p90:.1f}  p99 {ttft.p99:.1f}  mean {ttft.mean:.1f}")
    if tpot.n:
        print(f"TPOT ms    p50 {tpot.p50:.2f}  p90 {tpot.p90:.2f}  p99 {tpot.p99:.2f}  mean {tpot.mean:.2f}")
    print(f"served     {res.finished} requests in {res.duration_s:.1f} s simulated "
          f"({res.finished / max(res.duration_s, 1e-9):.3g} req/s); {res.prefill_steps} prefill and "
          f"{res.decode_steps} decode steps, largest decode batch {res.max_decode_batch}, {res.preemptions} preemptions")
    print(f"simulated  {len(workload)} requests ({res.events} events) in {wall:.2f} s wall time")
    if keys is not None:
        print("\n".join(reuse_lines(build_cluster(plan, ctx), arrivals, workload, keys, ctx.block_size, res,
                                   args.compare_routing)))
    return 0


# ---------------------------------------------------------------------------------------------- calibrate
def _calibrate(argv: list[str]) -> int:
    from planner.calibrate import calibrate
    from planner.cost_model import CPU_COEFFICIENTS

    p = argparse.ArgumentParser(prog="pdcluster plan calibrate",
                                description="time the engine on one CPU core and fit the cpu cost model")
    p.add_argument("--model", default="builtin:tiny-llama")
    p.add_argument("--cpu", type=int, default=None, help="the CPU id to pin to (default: the first usable)")
    p.add_argument("--repeats", type=int, default=3, help="timings per prefill shape (the fastest is kept)")
    p.add_argument("--steps", type=int, default=4, help="decode steps timed per batch shape")
    p.add_argument("--quick", action="store_true", help="a third of the shapes (a smoke test)")
    p.add_argument("--out", default=str(CPU_COEFFICIENTS))
    live = p.add_argument_group("live", "instead: fit the step costs of a running cluster under load, "
                                        "added to --out as `live` (planner/calibrate_serving.py)")
    live.add_argument("--serving-url", default=None, help="the cluster's OpenAI API, e.g. http://127.0.0.1:8000")
    live.add_argument("--api-key", default=None)
    live.add_argument("--levels", default="1,2,4,8,16,32", help="concurrent streams per sample")
    live.add_argument("--prompt-lens", default="64,256,768", help="prompt tokens per sample")
    live.add_argument("--output-tokens", type=int, default=64)
    live.add_argument("--seconds", type=float, default=8.0, help="measured window per sample (after 3 s warm-up)")
    live.add_argument("--decode-role", choices=("decode", "colocated"), default="decode",
                      help="whose decode steps to fit: decode workers, or colocated ones")
    p.add_argument("--from-bench", nargs="+", default=None, metavar="RESULT.json",
                   help="instead: fit each cluster's step costs to the worker counters of `pdcluster bench serve` "
                        "runs (one window per run), added to --out as `live` (planner/calibrate_bench.py)")
    args = p.parse_args(argv)
    if args.from_bench:
        return _calibrate_bench(args)
    if args.serving_url is None:
        calibrate(args.model, args.cpu, args.repeats, args.steps, Path(args.out), quick=args.quick)
        return 0
    return _calibrate_live(args)


def _calibrate_bench(args: argparse.Namespace) -> int:
    from planner.calibrate_bench import add_bench

    out = Path(args.out)
    if not out.is_file():
        raise SystemExit(f"{out}: no coefficients to add to; run `pdcluster plan calibrate` first")
    coeffs = json.loads(out.read_text())
    results = []
    for path in args.from_bench:
        try:
            results.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as e:
            raise SystemExit(f"--from-bench {path}: {e}") from e
    try:
        fitted = add_bench(coeffs, results, [str(p) for p in args.from_bench])
    except (RuntimeError, KeyError) as e:
        raise SystemExit(f"calibration from bench runs failed: {e}") from e
    for cluster, live in fitted.items():
        print(f"{'colocated' if cluster == 'colocated' else 'disaggregated'} cluster, {live['runs']} runs:")
        _print_live(live)
    out.write_text(json.dumps(coeffs, indent=1) + "\n")
    print(f"wrote `live` into {out}")
    return 0


def _print_live(live: dict) -> None:
    d = live["decode"]
    print(f"decode   {d['a'] * 1e3:.3f} ms + {d['b'] * 1e6:.4f} us * sum_context + {d['c'] * 1e3:.3f} ms * batch "
          f"(fit error mean {d['mean_abs_pct_error']:.1f}%, max {d['max_abs_pct_error']:.1f}%)")
    if d.get("table"):
        print("decode   measured (the simulator interpolates): " + ", ".join(
            f"batch {r['batch']:.1f}: {r['seconds'] * 1e3:.1f} ms" for r in d["table"]))
    if "prefill" in live:
        q = live["prefill"]
        print(f"prefill  ({q['a'] * 1e3:.3f} ms + {q['b'] * 1e6:.3f} us * sum_new + {q['c'] * 1e9:.4f} ns * sum_attn) "
              f"x (1 + {q.get('load_slope', 0.0) * 1e3:.3f}e-3 * decode tokens/s) "
              f"(fit error mean {q['mean_abs_pct_error']:.1f}%, max {q['max_abs_pct_error']:.1f}%)")


def _calibrate_live(args: argparse.Namespace) -> int:
    import httpx

    from planner.calibrate_serving import add_live

    out = Path(args.out)
    if not out.is_file():
        raise SystemExit(f"{out}: no coefficients to add to; run `pdcluster plan calibrate` first")
    coeffs = json.loads(out.read_text())
    ints = lambda s: tuple(int(x) for x in s.split(","))
    try:
        live = add_live(coeffs, args.serving_url, args.decode_role, levels=ints(args.levels),
                        prompt_lens=ints(args.prompt_lens), output_tokens=args.output_tokens, seconds=args.seconds,
                        api_key=args.api_key)
    except (RuntimeError, httpx.HTTPError) as e:
        raise SystemExit(f"live calibration failed: {e}") from e
    _print_live(live)
    out.write_text(json.dumps(coeffs, indent=1) + "\n")
    print(f"wrote `live` into {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["calibrate"]:
        return _calibrate(argv[1:])
    if argv[:1] == ["simulate"]:
        return _simulate(argv[1:])
    return _plan(argv)
