"""The planner's accuracy in tables: a measured percentile against a simulated one (or a second
measurement) per run, the medians of repeated measurements, the error up to the rates each system
sustained, the ranking of two systems, and the server's side of each run."""

from __future__ import annotations

import math
import statistics

from benchmarks.rate_sweep import ATTAINMENT
from loadgen.metrics import percentile

METRICS = (("TTFT", "ttft", 50), ("TTFT", "ttft", 90), ("TPOT", "tpot", 50), ("TPOT", "tpot", 90))


def _fmt(x: float | None, f: str = ".1f") -> str:
    return "-" if x is None else format(x, f)


def pct_ms(seconds: list, q: float) -> float | None:
    """The q-th percentile in ms of the values that are there (None and NaN left out)."""
    v = percentile([x for x in seconds if x is not None and not math.isnan(x)], q)
    return v * 1e3 if v is not None else None


def cell(reference_ms: float | None, other_ms: float | None) -> dict:
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
        out[f"{key}_p{q}"] = pct_ms([r.get(f"{key}_s") for r in ok], q)
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
            row[f"{key}_p{q}"] = cell(a[f"{key}_p{q}"], b[f"{key}_p{q}"])
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
            row[f"{key}_p{q}"] = cell(_median_of([c["measured_ms"] for c in cells]),
                                       _median_of([c["simulated_ms"] for c in cells]))
        for k in ("attainment_measured", "attainment_simulated"):
            if all(k in g for g in group):
                row[k] = _median_of([g[k] for g in group])
        merged.append(row)
        for i, g in enumerate(group):  # against the median of the others (with itself in, it is often the median)
            others = group[:i] + group[i + 1:]
            spread.append({**{k: g[k] for k in ("label", "rate", "completed", "sent")},
                           **{f"{key}_p{q}": cell(_median_of([o[f"{key}_p{q}"]["measured_ms"] for o in others]),
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
