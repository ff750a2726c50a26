#!/usr/bin/env python
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
import math
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadgen.metrics import SLO, percentile
from planner.catalog import load_catalog
from planner.cost_model import CPU_COEFFICIENTS, load_coefficients
from planner.models import from_checkpoint
from planner.plan import Plan, PlanContext, Pool, build_cluster
from planner.search import RequestTimes
from planner.simulator import Simulator

METRICS = (("TTFT", "ttft", 50), ("TTFT", "ttft", 90), ("TPOT", "tpot", 50), ("TPOT", "tpot", 90))
ATTAINMENT = 0.9


def system_of(label: str, overrides: dict[str, str]) -> str:
    if label in overrides:
        return overrides[label]
    low = label.lower()
    return "colocated" if "coloc" in low else "elastic" if "elastic" in low else "disaggregated"


def plan_for(mode: str, mnbt: int, mns: int, local_prefill_max_tokens: int = 512) -> Plan:
    """elastic: disaggregated with local prefill (router.local_prefill_max_tokens)."""
    if mode == "colocated":
        return Plan("colocated", None, Pool("cpu", 2), mnbt, mns)
    local = local_prefill_max_tokens if mode == "elastic" else 0
    return Plan("disaggregated", Pool("cpu", 1), Pool("cpu", 1), mnbt, mns, local)


def simulate_run(run: dict, sim: Simulator, block_size: int, fresh_prompts: bool = False) -> dict:
    """One measured run through `sim` (its caches carry over from the system's earlier runs).
    `fresh_prompts`: the run's prompts were its own (bench serve --fresh-prompts), not the sweep's."""
    recs = [r for r in run["records"] if r["outcome"] != "not_sent" and r.get("start_s") is not None]
    recs.sort(key=lambda r: r["start_s"])
    arrivals = [r["start_s"] for r in recs]
    prompts = [r["prompt_tokens"] or r["expected_prompt_tokens"] for r in recs]
    outputs = [r["expected_output_tokens"] for r in recs]
    # request i's prompt is the same text in every run (bench serve replays one workload per rate),
    # unless each rate had prompts of its own
    run_key = (run["rate"],) if fresh_prompts else ()
    keys = [[(*run_key, r["index"], j) for j in range(p // block_size)] for r, p in zip(recs, prompts)]
    res = sim.run(arrivals, prompts, outputs, block_keys=keys)
    mode = sim.c.mode
    ok = [i for i, r in enumerate(recs) if r["outcome"] == "ok"]
    measured = {"ttft": [recs[i]["ttft_s"] for i in ok], "tpot": [recs[i]["tpot_s"] for i in ok]}
    simulated = {"ttft": [res.ttft[i] for i in ok], "tpot": [res.tpot[i] for i in ok]}
    out = {"label": run["label"], "rate": run["rate"], "mode": mode, "sent": len(recs), "completed": len(ok)}
    for _, key, q in METRICS:
        out[f"{key}_p{q}"] = _cell(_pct_ms(measured[key], q), _pct_ms(simulated[key], q))
    out["server"] = server_view(run.get("server_counters"), res, mode)
    slo = run["summary"].get("slo") or {}
    bound = SLO(slo.get("ttft_ms"), slo.get("tpot_ms"))
    if bound.set:
        out["slo"] = str(bound)
        out["attainment_measured"] = run["summary"].get("slo_attainment")
        sim_met = sum(bound.met(RequestTimes(res.ttft[i], res.tpot[i])) for i in range(len(recs)))
        out["attainment_simulated"] = sim_met / len(recs) if recs else None
    return out


def server_view(counters: dict | None, res, mode: str) -> dict:
    """The server's side of a run, measured (its workers' counters during the run, when bench serve
    recorded them) and simulated: mean decode step and batch, mean prefill step, prefix-cache hits."""
    decode_role = "colocated" if mode == "colocated" else "decode"
    prefill_role = "colocated" if mode == "colocated" else "prefill"
    sim = res.stats
    simulated = {
        "decode_step_ms": sim["decode_step_s"] / res.decode_steps * 1e3 if res.decode_steps else None,
        "decode_batch": sim["decode_seqs"] / res.decode_steps if res.decode_steps else None,
        "prefill_step_ms": sim["prefill_step_s"] / res.prefill_steps * 1e3 if res.prefill_steps else None,
        "prefill_steps": res.prefill_steps, "decode_steps": res.decode_steps,
        "prefix_hit_tokens": sum(sim["cached_tokens"]),
    }
    measured = None
    if counters:
        d, p = counters.get(f"{decode_role}/decode") or {}, counters.get(f"{prefill_role}/prefill") or {}
        x = counters.get(f"{prefill_role}/prefix") or {}
        measured = {
            "decode_step_ms": d["step_seconds"] / d["steps"] * 1e3 if d.get("steps") else None,
            "decode_batch": d["step_seqs"] / d["steps"] if d.get("steps") else None,
            "prefill_step_ms": p["step_seconds"] / p["steps"] * 1e3 if p.get("steps") else None,
            "prefill_steps": p.get("steps"), "decode_steps": d.get("steps"),
            "prefix_hit_tokens": x.get("prefix_cache_hit_tokens"), "prompt_tokens": x.get("prompt_tokens"),
        }
    return {"measured": measured, "simulated": simulated}


def server_table(rows: list[dict]) -> list[str]:
    """Per run, the server's side measured / simulated (runs whose result.json has server counters)."""
    rows = [r for r in rows if r["server"]["measured"]]
    if not rows:
        return []
    head = ("| system | rate (req/s) | decode step ms | decode batch | decode steps | prefill step ms | "
            "prefill steps | prefix-cache hit tokens |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m, s = r["server"]["measured"], r["server"]["simulated"]
        cells = [f"{_fmt(m[k], f)} / {_fmt(s[k], f)}" for k, f in
                 (("decode_step_ms", ".1f"), ("decode_batch", ".1f"), ("decode_steps", ".0f"),
                  ("prefill_step_ms", ".1f"), ("prefill_steps", ".0f"), ("prefix_hit_tokens", ".0f"))]
        lines.append(f"| {r['label']} | {r['rate']:g} | " + " | ".join(cells) + " |")
    return ["Server side, measured (the workers' counters during the run) / simulated:", "", *lines]


def _fmt(x: float | None, f: str = ".1f") -> str:
    return "-" if x is None else format(x, f)


def _pct_ms(seconds: list, q: float) -> float | None:
    """The q-th percentile in ms of the values that are there (None and NaN left out)."""
    v = percentile([x for x in seconds if x is not None and not math.isnan(x)], q)
    return v * 1e3 if v is not None else None


def _cell(reference_ms: float | None, other_ms: float | None) -> dict:
    """One table cell: a measured percentile, the one compared with it, and the relative error."""
    return {"measured_ms": reference_ms, "simulated_ms": other_ms,
            "error_pct": (other_ms - reference_ms) / reference_ms * 100 if reference_ms and other_ms is not None
            else None}


def measured_percentiles(run: dict) -> dict:
    """A measured run's TTFT / TPOT percentiles (ms) over its completed requests."""
    ok = [r for r in run["records"] if r["outcome"] == "ok"]
    out = {"label": run["label"], "rate": run["rate"], "completed": len(ok),
           "sent": sum(r["outcome"] != "not_sent" for r in run["records"])}
    for _, key, q in METRICS:
        out[f"{key}_p{q}"] = _pct_ms([r.get(f"{key}_s") for r in ok], q)
    return out


def repeatability(first: dict, second: dict) -> list[dict]:
    """Rows for `error_table`: the same experiment measured twice; per (system, rate) run present in
    both, the second measurement against the first, as a simulation is compared with a measurement."""
    by_key = {(r["label"], r["rate"]): measured_percentiles(r) for r in second["runs"]}
    rows = []
    for run in first["runs"]:
        a, b = measured_percentiles(run), by_key.get((run["label"], run["rate"]))
        if b is None:
            continue
        row = {k: a[k] for k in ("label", "rate", "completed", "sent")}
        for _, key, q in METRICS:
            row[f"{key}_p{q}"] = _cell(a[f"{key}_p{q}"], b[f"{key}_p{q}"])
        rows.append(row)
    return sorted(rows, key=lambda r: (r["label"], r["rate"]))


def _median_of(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def median_rows(per_file: list[list[dict]]) -> tuple[list[dict], list[dict]]:
    """Several measurements of one experiment, each with its simulation (rows of `simulate_run`):
    rows whose measured cells are the median over the measurements of each (system, rate) run
    measured in all of them, simulated cells the median of their simulations; and rows comparing
    each measurement with the median of the others (how far a run strays: the spread)."""
    groups: dict[tuple, list[dict]] = {}
    for rows in per_file:
        for r in rows:
            groups.setdefault((r["label"], r["rate"]), []).append(r)
    merged, spread = [], []
    for (label, rate), group in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        if len(group) < len(per_file):
            continue
        row = {"label": label, "rate": rate, "mode": group[0]["mode"], "sent": group[0]["sent"],
               "completed": int(_median_of([g["completed"] for g in group])),
               "server": {"measured": None, "simulated": group[0]["server"]["simulated"]}}
        for _, key, q in METRICS:
            cells = [g[f"{key}_p{q}"] for g in group]
            row[f"{key}_p{q}"] = _cell(_median_of([c["measured_ms"] for c in cells]),
                                       _median_of([c["simulated_ms"] for c in cells]))
        for k in ("attainment_measured", "attainment_simulated"):
            if all(k in g for g in group):
                row[k] = _median_of([g[k] for g in group])
        merged.append(row)
        for i, g in enumerate(group):  # against the median of the others (with itself in, it is often the median)
            others = group[:i] + group[i + 1:]
            spread.append({**{k: g[k] for k in ("label", "rate", "completed", "sent")},
                           **{f"{key}_p{q}": _cell(_median_of([o[f"{key}_p{q}"]["measured_ms"] for o in others]),
                                                   g[f"{key}_p{q}"]["measured_ms"]) for _, key, q in METRICS}})
    return merged, spread


def error_table(rows: list[dict], compared: str = "measured / simulated (error)") -> list[str]:
    head = "| system | rate (req/s) | completed | " + " | ".join(
        f"{n} p{q} ms {compared}" for n, _, q in METRICS) + " |"
    lines = [head, "|" + "---|" * (3 + len(METRICS))]
    for r in rows:
        cells = []
        for _, key, q in METRICS:
            c = r[f"{key}_p{q}"]
            err = "-" if c["error_pct"] is None else f"{c['error_pct']:+.1f}%"
            cells.append(f"{_fmt(c['measured_ms'])} / {_fmt(c['simulated_ms'])} ({err})")
        lines.append(f"| {r['label']} | {r['rate']:g} | {r['completed']}/{r['sent']} | " + " | ".join(cells) + " |")
    errs = [abs(r[f"{k}_p{q}"]["error_pct"]) for r in rows for _, k, q in METRICS
            if r[f"{k}_p{q}"]["error_pct"] is not None]
    if errs:
        within = sum(e <= 10 for e in errs)
        what = "error" if compared.endswith("(error)") else "difference"
        lines += ["", (f"{within} of {len(errs)} percentiles within 10%; mean absolute {what} "
                      f"{sum(errs) / len(errs):.1f}%, largest {max(errs):.1f}%")]
    return lines


def within_capacity(rows: list[dict], limits: dict[str, float | None], mode_of: dict[str, str],
                    what: str = "error") -> str | None:
    """One line: the cells of `rows` at rates up to the highest each system sustained as measured
    (`limits`: mode -> rate with >= ATTAINMENT SLO attainment). Past it a cluster is overloaded and
    its queues grow for as long as the run lasts: a latency there follows the run's length and a
    few percent of capacity, not the model (Vidur checks its simulator up to ~85% of capacity)."""
    kept = [r for r in rows if (limit := limits.get(mode_of.get(r["label"], ""))) is not None
            and (r["rate"] or 0) <= limit]
    errs = [abs(r[f"{k}_p{q}"]["error_pct"]) for r in kept for _, k, q in METRICS
            if r[f"{k}_p{q}"]["error_pct"] is not None]
    if not errs:
        return None
    bounds = ", ".join(f"{m} {v:g}" for m, v in sorted(limits.items()) if v is not None)
    return (f"Up to the highest rate each system sustained as measured ({bounds} req/s): "
            f"{sum(e <= 10 for e in errs)} of {len(errs)} within 10%; mean absolute {what} "
            f"{sum(errs) / len(errs):.1f}%, largest {max(errs):.1f}%")


def _better(disagg: float, coloc: float, lower_is_better: bool) -> str:
    if disagg == coloc:
        return "tie"
    return "disaggregated" if (disagg < coloc) == lower_is_better else "colocated"


def ranking(rows: list[dict]) -> tuple[list[str], dict]:
    """Per rate with both systems: which one is better by each metric, measured and simulated."""
    by_rate: dict[float, dict[str, dict]] = {}
    for r in rows:
        by_rate.setdefault(r["rate"], {})[r["mode"]] = r
    lines = ["| rate (req/s) | criterion | measured: better | simulated: better | same? |", "|---|---|---|---|---|"]
    agree = total = 0
    for rate in sorted(by_rate):
        pair = by_rate[rate]
        if set(pair) != {"disaggregated", "colocated"}:
            continue
        d, c = pair["disaggregated"], pair["colocated"]
        checks = []
        for n, k, q in METRICS:
            checks.append((f"{n} p{q} (lower is better)",
                           d[f"{k}_p{q}"]["measured_ms"], c[f"{k}_p{q}"]["measured_ms"],
                           d[f"{k}_p{q}"]["simulated_ms"], c[f"{k}_p{q}"]["simulated_ms"], True))
        if "attainment_measured" in d:
            checks.append(("SLO attainment (higher is better)", d["attainment_measured"], c["attainment_measured"],
                           d["attainment_simulated"], c["attainment_simulated"], False))
        for label, dm, cm, ds, cs, lower in checks:
            if None in (dm, cm, ds, cs):
                continue
            m, s = _better(dm, cm, lower), _better(ds, cs, lower)
            total += 1
            agree += m == s
            lines.append(f"| {rate:g} | {label} | {m} | {s} | {'yes' if m == s else 'NO'} |")
    sustained = {}
    for src in ("measured", "simulated"):
        for mode in ("disaggregated", "colocated"):
            ok = [rate for rate, pair in by_rate.items() if mode in pair
                  and (pair[mode].get(f"attainment_{src}") or 0) >= ATTAINMENT]
            sustained[(src, mode)] = max(ok, default=None)
    lines += ["", f"{agree} of {total} comparisons rank the two systems the same way."]
    if any(v is not None for v in sustained.values()):
        lines.append(
            f"Highest rate with >= {ATTAINMENT:.0%} SLO attainment: measured disaggregated "
            f"{sustained[('measured', 'disaggregated')]}, colocated {sustained[('measured', 'colocated')]}; "
            f"simulated disaggregated {sustained[('simulated', 'disaggregated')]}, "
            f"colocated {sustained[('simulated', 'colocated')]}.")
    return lines, {"agree": agree, "total": total, "sustained": {f"{a}/{b}": v for (a, b), v in sustained.items()}}


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
    sys.exit(main())
