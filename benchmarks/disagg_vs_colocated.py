"""Experiment: disaggregated against colocated serving, same model, same cores, same workload.

    python scripts/exp_disagg_vs_colocated.py            # defaults below; ~15 min on 2 cores

Two clusters of the built-in model run side by side on this machine, each a foreground
`pdcluster up` with its own embedded Ray:

  disaggregated  one prefill worker pinned to CPU 0, one decode worker pinned to CPU 1
  colocated      two colocated workers (each does both phases), both pinned to CPUs {0, 1}

Every engine uses one torch thread, so each system has two engine threads on the same two cores.
The router, HTTP front end and load generator are not pinned (the same for both). One
`pdcluster bench serve` run then drives both endpoints with the same requests (the Azure LLM
inference trace, conversation service, lengths scaled to the context) at a sweep of Poisson rates,
interleaved per rate so machine noise hits both alike. The SLO is `slo` in cluster.yaml.

Reported per system and rate: SLO attainment, goodput, TTFT/TPOT percentiles. The two goals:
  - at the highest rate where colocated still meets the SLO (>= 90% of requests within both
    bounds), p99 TPOT of disaggregated <= 0.5x colocated;
  - goodput >= 1.5x colocated, compared as the highest rate each system sustains at >= 90% SLO
    attainment (DistServe's definition), and per rate.
Writes the load generator's result.json / summary.md / plots plus exp_summary.json and .md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
from pathlib import Path

import httpx

from benchmarks import rate_sweep as sweep
from benchmarks.local_clusters import REPO, Servers, interrupt, start, two_cpus, warm_up, write_cluster_files
from pdcluster.cluster_config import PoolConfig, load_cluster_config


def cluster_files(out: Path, max_model_len: int) -> dict[str, Path]:
    """The two deployments, derived from cluster.yaml (SLO, timeouts as there; the model its results were
    measured on, builtin:tiny-llama)."""
    base = load_cluster_config(REPO / "cluster.yaml")
    a, b = two_cpus()
    common = dict(
        router=dataclasses.replace(base.router, grpc_port=0, http_port=0),
        model=dataclasses.replace(base.model, path="builtin:tiny-llama", max_model_len=max_model_len),
        engine=dataclasses.replace(base.engine, num_threads=1),
    )
    one = {"num_cpus": 1.0}
    systems = {
        "disaggregated": dataclasses.replace(base, mode="disaggregated", **common, pools=(
            PoolConfig("prefill", "prefill", 1, "cpu", one, (a,)),
            PoolConfig("decode", "decode", 1, "cpu", one, (b,)))),
        "colocated": dataclasses.replace(base, mode="colocated", **common, pools=(
            PoolConfig("workers", "colocated", 2, "cpu", one, (a, b)),)),
    }
    return write_cluster_files(out, systems)


def calibrate_live(urls: dict[str, str], out: Path, levels: tuple[int, ...], seconds: float,
                   prompt_lens: tuple[int, ...] = (64, 256, 768)) -> Path:
    """Each cluster's step costs under load, added to a copy of the calibrated coefficients."""
    from planner.calibrate_serving import add_live
    from planner.cost_model import CPU_COEFFICIENTS

    coeffs = json.loads(CPU_COEFFICIENTS.read_text())
    coeffs["live"] = {}
    for name, url in urls.items():
        print(f"live calibration of {name} ({url}):", flush=True)
        add_live(coeffs, url, "colocated" if name == "colocated" else "decode", levels=levels,
                 prompt_lens=prompt_lens, seconds=seconds)
    path = out / "cpu_coefficients_live.json"
    path.write_text(json.dumps(coeffs, indent=1) + "\n")
    print(f"wrote {path}", flush=True)
    return path


def analyse(result: dict) -> dict:
    """Per system and rate: attainment, goodput, p99 TPOT; the two goals' ratios."""
    table = sweep.rate_table(result, ("attainment", "goodput", "tpot_p99", "tpot_p50", "ttft_p90", "ttft_p99", "ttft_p50",
                                "throughput", "failed", "unfinished"))
    dis, col = table["disaggregated"], table["colocated"]
    rates = sorted(set(dis) & set(col))
    sustained = sweep.highest_rates(table, rates)
    out: dict = {"rates": rates, "table": {k: {str(r): v for r, v in t.items()} for k, t in table.items()},
                 "attainment_bar": sweep.ATTAINMENT, "max_rate_meeting_slo": sustained}
    r_star = sustained["colocated"]
    if r_star is not None:
        out["at_rate"] = r_star
        out["tpot_p99_ratio"] = dis[r_star]["tpot_p99"] / col[r_star]["tpot_p99"]
        out["goodput_ratio_at_rate"] = dis[r_star]["goodput"] / col[r_star]["goodput"] if col[r_star]["goodput"] else None
    if sustained["colocated"] and sustained["disaggregated"]:
        out["sustained_rate_ratio"] = sustained["disaggregated"] / sustained["colocated"]
    out["goodput_ratio_per_rate"] = {str(r): (dis[r]["goodput"] / col[r]["goodput"] if col[r]["goodput"] else None)
                                     for r in rates}
    out["tpot_p99_ratio_per_rate"] = {str(r): dis[r]["tpot_p99"] / col[r]["tpot_p99"] for r in rates}
    return out


def report(a: dict, slo: str) -> str:
    lines = sweep.table_lines(a, slo, ["disaggregated", "colocated"])
    lines += ["", "| goal | measured |", "|---|---|"]
    sus = a["max_rate_meeting_slo"]
    if "at_rate" in a:
        lines.append(f"| p99 TPOT, disaggregated / colocated, at {a['at_rate']:g} req/s (colocated's highest rate "
                     f"meeting the SLO) <= 0.5 | **{a['tpot_p99_ratio']:.2f}** |")
        if a.get("goodput_ratio_at_rate") is not None:
            lines.append(f"| goodput ratio at that rate | {a['goodput_ratio_at_rate']:.2f} |")
    else:
        lines.append("| p99 TPOT ratio | colocated met the SLO at none of the rates |")
    if "sustained_rate_ratio" in a:
        lines.append(f"| highest rate meeting the SLO, disaggregated / colocated ({sus['disaggregated']:g} / "
                     f"{sus['colocated']:g} req/s) >= 1.5 | **{a['sustained_rate_ratio']:.2f}** |")
    else:
        lines.append(f"| highest rate meeting the SLO | disaggregated {sus['disaggregated']}, colocated {sus['colocated']} |")
    per = ", ".join(f"{r}: {v:.2f}" if v is not None else f"{r}: -" for r, v in a["goodput_ratio_per_rate"].items())
    lines.append(f"| goodput ratio per rate | {per} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="1,2,3,4,6,8")
    p.add_argument("--num-requests", type=int, default=150)
    p.add_argument("--max-context", type=int, default=1024, help="trace lengths scaled to fit this")
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--time-limit-s", type=float, default=180.0, help="per run")
    p.add_argument("--out", default="bench_results/exp_disagg_vs_colocated")
    p.add_argument("--fresh-prompts", action="store_true",
                   help="bench serve --fresh-prompts: each rate its own prompt texts (no prefix cached by an "
                        "earlier rate's run is reused)")
    p.add_argument("--seed", type=int, default=0, help="bench serve --seed: prompt texts and arrival times")
    p.add_argument("--sample-seed", type=int, default=None,
                   help="bench serve --sample-seed: a seeded sample of the trace's rows instead of the first ones "
                        "(a run to calibrate from, held out from the runs the planner is checked against)")
    p.add_argument("--calibrate-live", action="store_true",
                   help="before the sweep, fit each cluster's step costs under load (planner/calibrate_serving.py) "
                        "into OUT/cpu_coefficients_live.json, for scripts/exp_planner_accuracy.py --coefficients")
    p.add_argument("--calibrate-levels", default="1,2,4,8,16,32")
    p.add_argument("--calibrate-seconds", type=float, default=8.0)
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, interrupt)  # stop the clusters on a kill too (see Servers)
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    slo = load_cluster_config(REPO / "cluster.yaml").slo
    files = cluster_files(out, args.max_context + 64)
    with Servers() as servers:
        for name, path in files.items():
            url = servers.add(name, start(name, path, out))
            print(f"{name}: {url}", flush=True)
        urls = servers.urls
        model = httpx.get(f"{urls['disaggregated']}/v1/models", timeout=10).json()["data"][0]["id"]
        for url in urls.values():
            warm_up(url, model)
        if args.calibrate_live:
            calibrate_live(urls, out, tuple(int(x) for x in args.calibrate_levels.split(",")), args.calibrate_seconds)
        argv_serve = ["--workload", "azure-conv", "--num-requests", str(args.num_requests), "--rates", args.rates,
                      "--max-context", str(args.max_context), "--max-output", str(args.max_output),
                      "--tokenizer", "builtin:tiny-llama", "--ignore-eos", "--slo-ttft-ms", str(slo.ttft_ms),
                      "--slo-tpot-ms", str(slo.tpot_ms), "--time-limit-s", str(args.time_limit_s), "--out", str(out)]
        if args.fresh_prompts:
            argv_serve.append("--fresh-prompts")
        argv_serve += ["--seed", str(args.seed)]
        if args.sample_seed is not None:
            argv_serve += ["--sample-seed", str(args.sample_seed)]
        rc = sweep.run_bench_serve(urls, argv_serve)
        if rc != 0:
            return rc
    return sweep.summarise(out, analyse, report, f"TTFT <= {slo.ttft_ms:g} ms and TPOT <= {slo.tpot_ms:g} ms")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
