"""One measured `pdcluster bench serve` run replayed through the planner's simulator: the cluster a
run's label names, its requests at the times the client sent them, the percentiles both ways."""

from __future__ import annotations

from benchmarks.planner_accuracy_tables import METRICS, cell, pct_ms
from loadgen.metrics import SLO
from planner.plan import Plan, Pool
from planner.search import RequestTimes
from planner.simulator import Simulator


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
        out[f"{key}_p{q}"] = cell(pct_ms(measured[key], q), pct_ms(simulated[key], q))
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
