"""The planner's accuracy: simulate the clusters a `pdcluster bench serve` run measured, compare.

    python scripts/exp_planner_accuracy.py bench_results/exp_disagg_vs_colocated/result.json
    python scripts/exp_planner_accuracy.py RESULT.json [RESULT2.json ...] --markdown out.md

Input: result.json files as `pdcluster bench serve` writes them (loadgen/report.py): per run the
system label, the rate, and per request its send time, prompt and output tokens and the measured
times. Each run's label names its cluster (`--system LABEL=MODE` overrides the guess from the
label: "coloc" in it -> colocated, "elastic" -> elastic, else disaggregated):

    disaggregated  1 prefill worker + 1 decode worker, one CPU core each
    colocated      2 colocated workers, one CPU core each
    elastic        disaggregated with local prefill of prompts up to 512 tokens

The simulator (planner/simulator.py) replays exactly the requests the run sent -- same prompt and
output lengths, arrivals at the times the client actually sent them -- through that cluster, the
runs of one system in the order they ran with the workers' prefix caches carried from one run to
the next (bench serve sends the same prompts at every rate, so a later run finds most prompt blocks
cached where the same worker prefilled them before), with
the calibrated cpu coefficients (planner/cpu_coefficients.json, `pdcluster plan calibrate`), and
the script prints, per run, TTFT and TPOT p50 and p90 measured and simulated, over the requests
that completed in the measurement, and the error (simulated - measured) / measured. Then the
ranking of the two systems per rate by each metric, by SLO attainment (the run's SLO), and by the
highest rate meeting the SLO (>= 90% attainment), measured against simulated.

    python scripts/exp_planner_accuracy.py RUN1/result.json --repeat RUN2/result.json

compares two measurements of the same experiment the same way (no simulation): how far the
measurement itself moves from one run to the next, the floor under any simulator's error.

    python scripts/exp_planner_accuracy.py RUN1/result.json RUN2/result.json RUN3/result.json --median

takes several measurements of one experiment (same requests and arrival times): the simulation is
compared with their median per run and percentile, and each measurement with the median of the
others (the spread a simulation cannot be expected to beat).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.planner_accuracy_sim import plan_for, simulate_run, system_of
from benchmarks.planner_accuracy_tables import (
    error_table,
    median_rows,
    ranking,
    repeatability,
    server_table,
    within_capacity,
)
from planner.catalog import load_catalog
from planner.cost_model import CPU_COEFFICIENTS, load_coefficients
from planner.models import from_checkpoint
from planner.plan import PlanContext, build_cluster
from planner.simulator import Simulator


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path, help="bench serve result.json file(s)")
    ap.add_argument("--coefficients", type=Path, default=CPU_COEFFICIENTS)
    ap.add_argument("--system", action="append", default=[], metavar="LABEL=MODE",
                    help="the cluster of a run label: disaggregated, colocated or elastic")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="as the clusters ran (cluster.yaml)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--no-worker-streaming", action="store_true",
                    help="a sensitivity check: no streaming cost per token in decode steps (serving.decode_token_s "
                         "= 0); all of the serving path's CPU then competes for the host's cores")
    ap.add_argument("--no-prefix-cache", action="store_true",
                    help="do not carry prefix caches from one run to the next (each run starts cold)")
    ap.add_argument("--calibrate-from", type=Path, nargs="+", default=None, metavar="RESULT.json",
                    help="first fit each cluster's step costs to these bench serve runs' worker counters "
                         "(`pdcluster plan calibrate --from-bench`, into a copy of --coefficients): runs other "
                         "than the ones compared (another --sample-seed / --seed)")
    ap.add_argument("--markdown", type=Path, default=None, help="also write the tables here")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--median", action="store_true",
                    help="the results are repeated measurements of one experiment: compare the simulation "
                         "with their median per run (and print how far each measurement is from it)")
    ap.add_argument("--repeat", type=Path, default=None, metavar="RESULT2.json",
                    help="no simulation: compare the (first) result with a second measurement of the same "
                         "experiment, run by run, as the simulation is compared (the measurement's own spread)")
    args = ap.parse_args(argv)
    if args.median and len(args.results) < 2:
        ap.error("--median compares the simulation with the median of several measurements: give two or more "
                 "result files")
    if args.repeat is not None:
        first, second = (json.loads(p.read_text()) for p in (args.results[0], args.repeat))
        rows = repeatability(first, second)
        text = "\n".join([f"Run 1: {args.results[0]}; run 2: {args.repeat}", "",
                          *error_table(rows, "run 1 / run 2 (difference)")]) + "\n"
        print(text)
        if args.markdown:
            args.markdown.write_text(text)
        return 0
    overrides = dict(s.split("=", 1) for s in args.system)
    coeffs = load_coefficients(args.coefficients)
    if args.calibrate_from:
        from planner.calibrate_bench import add_bench

        add_bench(coeffs, [json.loads(p.read_text()) for p in args.calibrate_from], [str(p) for p in args.calibrate_from])
    if args.no_worker_streaming and coeffs.get("serving"):  # a sensitivity check: all serving CPU on the host
        coeffs["serving"]["decode_token_s"] = 0.0
    ctx = PlanContext(from_checkpoint(coeffs["model"]), load_catalog(), coefficients=coeffs)
    per_file = []
    for path in args.results:
        rows: list[dict] = []
        per_file.append(rows)
        result = json.loads(path.read_text())
        runs = [r for r in result["runs"] if isinstance(r["rate"], (int, float))]
        sims: dict[str, Simulator] = {}  # one cluster per label, prefix caches kept from run to run
        for run in sorted(runs, key=lambda r: r.get("started_at") or ""):  # the order they ran in
            mode = system_of(run["label"], overrides)
            if run["label"] not in sims:
                cluster = build_cluster(plan_for(mode, args.max_num_batched_tokens, args.max_num_seqs), ctx)
                sims[run["label"]] = Simulator(cluster, keep_caches=not args.no_prefix_cache)
            rows.append(simulate_run(run, sims[run["label"]], ctx.block_size,
                                     bool(result.get("config", {}).get("fresh_prompts"))))
    spread_lines: list[str] = []
    spread: list[dict] = []
    if args.median:
        rows, spread = median_rows(per_file)
        spread_lines = ["", f"Each of the {len(per_file)} measurements against the median of the others (the "
                        "measurement's own spread):", "", *error_table(spread, "others / this run (difference)")]
    else:
        rows = [r for rs in per_file for r in rs]
    rows.sort(key=lambda r: (r["mode"], r["rate"] or 0))
    sv = coeffs.get("serving") or {}
    head = [f"Measured: {', '.join(str(p) for p in args.results)}"
            + (" (median per run; the simulation's median likewise)" if spread_lines else ""),
            (f"Simulated with {args.coefficients.name} (calibrated {coeffs.get('date')}, {coeffs['model']}; "
            f"prefill {coeffs['prefill']['a'] * 1e3:.2f} ms + {coeffs['prefill']['b'] * 1e6:.1f} us/token + "
            f"{coeffs['prefill']['c'] * 1e9:.1f} ns/pair; decode {coeffs['decode']['a'] * 1e3:.2f} ms + "
            f"{coeffs['decode']['b'] * 1e6:.2f} us/context token + "
            f"{(coeffs['decode']['c'] + sv.get('decode_token_s', 0)) * 1e3:.2f} ms/sequence incl. streaming; serving path "
            f"{(sv.get('router_in_s', 0) + sv.get('first_token_out_s', 0)) * 1e3:.1f} ms/request, "
            f"{max(0.0, sv.get('cpu_per_token_s', 0) - sv.get('decode_token_s', 0)) * 1e3:.2f} ms CPU/token "
            f"on {sv.get('host_cores')} shared cores)"), ""]
    for role, live in sorted((coeffs.get("live") or {}).items()):
        d, q = live["decode"], live.get("prefill") or {}
        where = (f"fitted to the worker counters of bench serve runs {', '.join(live.get('results') or [])}; these "
                 f"replace the above for its workers' steps, no host processor sharing on top"
                 if live.get("source") == "bench" else
                 f"measured under load {live.get('date')}; these replace the above for its workers' steps; "
                 f"the serving path's CPU still floats over the host")
        head.insert(-1, f"Live step costs of the {'colocated' if role == 'colocated' else 'disaggregated'} cluster "
                        f"({where}): decode {d['a'] * 1e3:.2f} ms + {d['b'] * 1e6:.2f} "
                        f"us/context token + {d['c'] * 1e3:.2f} ms/sequence (fit error mean "
                        f"{d['mean_abs_pct_error']:.1f}%)" + (
                            "; decode steps measured per batch (interpolated in between): " + ", ".join(
                                f"{r['batch']:.1f}: {r['seconds'] * 1e3:.1f} ms" for r in d["table"])
                            if d.get("table") else "") + (
                            f"; prefill {q['scale']:.2f}x the engine fit + {q.get('overhead_s', 0.0) * 1e3:.1f} ms, "
                            f"x (1 + {q.get('load_slope', 0.0) * 1e3:.2f}e-3 x decode tokens/s) (fit error mean "
                            f"{q.get('mean_abs_pct_error', float('nan')):.1f}%)" if q else ""))
    table = error_table(rows)
    rank_lines, summary = ranking(rows)
    limits = {m: summary["sustained"].get(f"measured/{m}") for m in ("disaggregated", "colocated")}
    mode_of = {r["label"]: r["mode"] for r in rows}
    for lines, rs, what in ((table, rows, "error"), (spread_lines, spread, "difference")):
        line = within_capacity(rs, limits, mode_of, what)
        if line:
            lines.append(line)
    server = server_table(rows)
    text = "\n".join([*head, *table, *spread_lines, "", *rank_lines, *([""] + server if server else [])]) + "\n"
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "ranking": summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
