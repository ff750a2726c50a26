"""`pdcluster plan calibrate --from-bench RESULT.json`: step costs fitted to a `bench serve` run's counters.

The closed-loop probe (calibrate_serving.py) holds B streams of one prompt length busy: every
window is a steady state, but not the one a trace makes. Under a trace's Poisson arrivals the decode
batch comes and goes, prefills of many lengths meet decode steps of any size, and the serving path
(router, HTTP API, client) asks the host's cores for a share that moves with them. `bench serve`
stores, per run (one rate, one endpoint), the difference of the workers' step counters over the
run (`server_counters`, loadgen/server_counters.py). Each such run is one window here, its decode
steps one window per batch-size bucket (1, 2-3, 4-7, ...: `decode_windows`) where the workers
counted them so:

    decode   mean step = a + b * mean sum(context) + c * mean batch, and per bucket pooled over
             the runs a table of mean step against mean batch (`decode_table`)
    prefill  mean step = (r + s x T) x E + o, E = the engine's fit (`calibrate`) over the run's
             prompts: a + (b * tokens + c * sum n^2) / steps, sum n^2 from the prompts sent
             (scaled to the tokens the workers prefilled); T = the run's decode tokens per second.
             A disaggregated prefill worker's steps include each commit's wait for the decode
             worker's engine lock, which a decode step holds: that wait (`commit_wait`, from the
             run's decode steps) is taken out of them, and the simulator makes it itself
             (ClusterSpec.commit_waits_lock): it is a share of a decode step, not of the prompt.

Where the coefficients have a closed-loop probe's fits for the cluster, what one trace's runs cannot
tell apart is taken from them (every run mixes the same lengths: context per sequence and prompt
lengths are the same in every window, bucket or run): decode a + k x (b x context + c x batch) with its b : c, and
prefill k x (r E + o) x (1 + s x T) with its r : o; the rest is fitted here. Fitted as
calibrate_serving.fit_live fits its windows (least squares on relative error, coefficients >= 0).
The cluster of a run is read from its counters: `colocated/decode` -> the
colocated cluster, `decode/decode` -> the disaggregated one. Several result files pool their runs.

The serving path's fixed share of TTFT comes, as the probe's single stream gives it, from the
requests of the lowest-rate run that arrived with none other in flight (`idle_ttft_s`: their median
TTFT per prompt length; PlanContext.idle_ttft_overhead takes the intercept).

What goes into the coefficients file is `live` as the probe writes it, with `source: "bench"`:
these step costs were measured under a trace's load with the serving path running, so the
simulator adds no processor sharing of its own on top (planner/plan.py build_cluster). The runs
fitted here should not be the runs the planner is then checked against (scripts/exp_planner_accuracy.py):
use a different sample of the trace and different arrivals (`bench serve --sample-seed S --seed S`).
"""

from __future__ import annotations

import statistics
from datetime import datetime, timezone
from typing import Any

from loadgen.server_counters import buckets
from planner.calibrate_serving import fit_decode, fit_prefill

MIN_BUCKET_STEPS = 20  # a batch-size bucket with fewer steps in a run is too noisy a window
ROLES = {"decode": ("decode", "prefill"), "colocated": ("colocated", "colocated")}  # cluster -> (decode, prefill) worker role


def cluster_of(counters: dict[str, dict]) -> str | None:
    """"colocated" or "decode" (the disaggregated cluster, by its decode role), from a run's counters."""
    if (counters.get("colocated/decode") or {}).get("steps"):
        return "colocated"
    if (counters.get("decode/decode") or {}).get("steps"):
        return "decode"
    return None


def decode_windows(counters: dict[str, dict], decode_role: str) -> list[tuple[str, dict]]:
    """A run's decode step counters as windows: one per batch-size bucket that ran at least
    MIN_BUCKET_STEPS steps ("decode[4-7]"; workers count them since they export `*_by_batch`), else
    the run's total (bucket "all"). Buckets give each run several mean batches, from 1 to the
    largest its bursts reached, where its total gives one."""
    kept = [(label, v) for label, v in buckets(counters, decode_role, "decode") if v.get("steps", 0) >= MIN_BUCKET_STEPS]
    return kept or [("all", counters[f"{decode_role}/decode"])]


def commit_wait(counters: dict[str, dict], decode_role: str, window_s: float) -> float:
    """The mean wait of a KV commit for the decode worker's engine lock, which each decode step
    holds: at a random moment the worker is in a step with probability (busy time / window) and
    then waits out the rest of it, E[step^2] / (2 E[step]) on average; so sum(step^2) / (2 window),
    each bucket's steps taken at their mean (the run's total when it has no buckets)."""
    rows = [v for _, v in buckets(counters, decode_role, "decode")] or [counters[f"{decode_role}/decode"]]
    return sum(v["step_seconds"] ** 2 / v["steps"] for v in rows if v.get("steps")) / (2 * window_s)


def run_samples(run: dict[str, Any], engine_prefill: dict[str, float]) -> tuple[str, list[dict[str, Any]]] | None:
    """One bench serve run as windows of step counters: (cluster, [decode sample, prefill sample])."""
    counters = run.get("server_counters") or {}
    cluster = cluster_of(counters)
    if cluster is None or not run.get("duration_s"):
        return None
    decode_role, prefill_role = ROLES[cluster]
    window = float(run["duration_s"])
    base = {"label": run.get("label"), "rate": run.get("rate"), "window_s": window}
    d = counters[f"{decode_role}/decode"]
    samples = [{**base, "role": decode_role, "phase": "decode", "batch": bucket, **counts}
               for bucket, counts in decode_windows(counters, decode_role)]
    p = counters.get(f"{prefill_role}/prefill") or {}
    prompts = [r.get("prompt_tokens") or r.get("expected_prompt_tokens") or 0 for r in run.get("records", [])
               if r.get("outcome") != "not_sent"]
    if p.get("steps") and sum(prompts):
        a, b, c = (engine_prefill[k] for k in "abc")
        squares = sum(n * n for n in prompts) * p["step_tokens"] / sum(prompts)  # prefix hits scale it down
        if cluster == "decode":  # the commit's wait for the decode worker's lock, out (the simulator makes it)
            wait = commit_wait(counters, decode_role, window)
            p = {**p, "step_seconds": max(0.0, p["step_seconds"] - p["steps"] * wait), "commit_wait_s": wait}
        samples.append({**base, "role": prefill_role, "phase": "prefill", **p,
                        "engine_s": a + (b * p["step_tokens"] + c * squares) / p["steps"],
                        "decode_tokens_per_s": d["step_tokens"] / window})
    return cluster, samples


def fit_bench(results: list[dict[str, Any]], engine_prefill: dict[str, float],
              sources: list[str] | None = None,
              shapes: dict[str, dict[str, float]] | None = None) -> dict[str, dict[str, Any]]:
    """{cluster: live entry} for each cluster the results' runs measured ("decode": the
    disaggregated one, "colocated"), as calibrate_serving.probe_live writes it plus `source`.
    `shapes[cluster]` (`shapes_of`: a closed-loop probe's fits) fixes how a step grows with its
    batch against its context, and a prefill step with its prompt (`shape` of fit_decode / fit_prefill)."""
    by_cluster: dict[str, list[dict[str, Any]]] = {}
    slowest: dict[str, dict[str, Any]] = {}  # per cluster, its run at the lowest rate
    runs: dict[str, int] = {}
    for result in results:
        for run in result.get("runs", []):
            got = run_samples(run, engine_prefill)
            if got is not None:
                by_cluster.setdefault(got[0], []).extend(got[1])
                runs[got[0]] = runs.get(got[0], 0) + 1
                if got[0] not in slowest or (run.get("rate") or 0) < (slowest[got[0]].get("rate") or 0):
                    slowest[got[0]] = run
    if not by_cluster:
        raise RuntimeError("no run with worker step counters (server_counters): was it a pdcluster endpoint?")
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    out = {}
    for cluster, samples in sorted(by_cluster.items()):
        decode_role = ROLES[cluster][0]
        decode = [s for s in samples if s["phase"] == "decode"]
        prefill = [s for s in samples if s["phase"] == "prefill"]
        shape = (shapes or {}).get(cluster) or {}
        entry: dict[str, Any] = {"source": "bench", "decode_role": decode_role,
                                 "decode": fit_decode(decode, shape.get("decode"))}
        table = decode_table(decode)
        if len(table) >= 2:
            entry["decode"]["table"] = table
        if len(prefill) >= 3:
            entry["prefill"] = fit_prefill(prefill, [s["engine_s"] for s in prefill],
                                           [s["decode_tokens_per_s"] for s in prefill], engine_prefill,
                                           shape.get("prefill"))
            if all("commit_wait_s" in s for s in prefill):  # the simulator is to make that wait
                entry["prefill"]["commit_wait_out"] = True
        idle, alone = idle_ttft(slowest[cluster])
        if len(idle) >= 2:
            entry["idle_ttft_s"] = idle
            entry["idle_ttft_from"] = (f"{alone} requests of the {slowest[cluster].get('rate')} req/s run that "
                                       "arrived with none in flight")
        entry.update({"results": sources or [], "runs": runs[cluster],
                      "decode_windows": len(decode), "date": date,
                      "method": "one window per bench serve run (rate, endpoint) and, for decode, batch-size "
                                "bucket: the workers' step counters over the run; fitted on relative error, coefficients >= 0 "
                                "(planner/calibrate_bench.py)",
                      "samples": samples})
        out[cluster] = entry
    return out


def decode_table(decode: list[dict[str, Any]]) -> list[dict[str, float]]:
    """The decode step as measured per batch-size bucket, pooled over the runs: rows of mean batch,
    mean step seconds and context per sequence, by batch (empty without bucket windows). Under a
    trace a step does not grow with its batch as one line: here a batch of 2-3 took 5-8 ms more
    than one of 1 and each sequence past 4 about 1-2 ms; the simulator interpolates between the
    rows (cost_model.FittedCostModel.decode_table) and goes on past the last with the fit's slope."""
    pooled: dict[str, dict[str, float]] = {}
    for s in decode:
        if s.get("batch", "all") == "all":
            continue
        p = pooled.setdefault(s["batch"], dict.fromkeys(("steps", "step_seconds", "step_seqs", "step_context_tokens"), 0.0))
        for k in p:
            p[k] += s[k]
    rows = [{"batch": p["step_seqs"] / p["steps"], "seconds": p["step_seconds"] / p["steps"],
             "context_per_seq": p["step_context_tokens"] / p["step_seqs"], "steps": p["steps"]}
            for p in pooled.values() if p["steps"] > 0 and p["step_seqs"] > 0]
    return sorted(rows, key=lambda r: r["batch"])


def _isolated(run: dict[str, Any]) -> dict[int, list[float]]:
    """{prompt tokens: TTFTs} of the run's requests that arrived while no other was in flight (the
    one before had its last token already)."""
    recs = sorted((r for r in run.get("records", []) if r.get("start_s") is not None), key=lambda r: r["start_s"])
    out: dict[int, list[float]] = {}
    busy_until = float("-inf")
    for r in recs:
        if r.get("outcome") == "ok" and r.get("ttft_s") and r["start_s"] > busy_until:
            out.setdefault(int(r.get("prompt_tokens") or r.get("expected_prompt_tokens") or 0), []).append(r["ttft_s"])
        end = r.get("end_s")
        busy_until = max(busy_until, end if end is not None else float("inf"))
    return out


def idle_ttft(run: dict[str, Any]) -> tuple[dict[str, float], int]:
    """({prompt tokens: median TTFT}, how many requests) over the run's requests that arrived with
    none in flight: the serving path's fixed share plus one prefill (and KV transfer) at each length,
    as the closed-loop probe's single stream measures it (planner.plan.PlanContext.idle_ttft_overhead)."""
    alone = {n: v for n, v in _isolated(run).items() if n > 0}
    return {str(n): statistics.median(v) for n, v in sorted(alone.items())}, sum(map(len, alone.values()))


def shapes_of(live: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """Per cluster, {"decode": {b, c}, "prefill": {scale, overhead_s}} as a closed-loop probe
    fitted them (or as an earlier bench fit took them from one: `shape_from`)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for cluster, entry in live.items():
        bench = (entry or {}).get("source") == "bench"
        for phase, keys in (("decode", ("b", "c")), ("prefill", ("scale", "overhead_s"))):
            q = (entry or {}).get(phase) or {}
            if "shape_from" in q:
                out.setdefault(cluster, {})[phase] = q["shape_from"]
            elif not bench and all(k in q for k in keys):
                out.setdefault(cluster, {})[phase] = {k: q[k] for k in keys}
    return out


def add_bench(coeffs: dict[str, Any], results: list[dict[str, Any]], sources: list[str] | None = None,
              ) -> dict[str, dict[str, Any]]:
    """Fit `results` (fit_bench, prefill as a ratio to coeffs' engine fit) into coeffs["live"]; of
    a cluster's earlier entry only its `idle_ttft_s` is kept, where the runs had too few requests
    that arrived with none in flight to take it from. Returns the new entries."""
    live = coeffs.setdefault("live", {})
    fitted = fit_bench(results, coeffs["prefill"], sources, shapes_of(live))
    for cluster, entry in fitted.items():
        idle = (live.get(cluster) or {}).get("idle_ttft_s")
        live[cluster] = {**({"idle_ttft_s": idle} if idle else {}), **entry}
    return fitted
