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
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadgen.cli import main as bench_serve  # noqa: E402
from pdcluster.cluster_config import PoolConfig, load_cluster_config  # noqa: E402

ATTAINMENT = 0.9  # "meets the SLO": at least this fraction of requests within both bounds


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def cluster_files(out: Path, max_model_len: int) -> dict[str, Path]:
    """The two deployments, derived from cluster.yaml (model, SLO, timeouts as there)."""
    base = load_cluster_config(REPO / "cluster.yaml")
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < 2:
        raise SystemExit(f"needs 2 usable CPUs, this process may use {usable}")
    a, b = usable[0], usable[1]
    common = dict(
        router=dataclasses.replace(base.router, grpc_port=0, http_port=0),
        model=dataclasses.replace(base.model, max_model_len=max_model_len),
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
    files = {}
    for name, cfg in systems.items():
        path = out / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg.validate().to_dict(), sort_keys=False))
        files[name] = path
    return files


def start(name: str, config: Path, out: Path, timeout_s: float = 300.0) -> tuple[subprocess.Popen, str]:
    """`pdcluster up -c config` in the foreground; returns (process, http base URL) once healthy."""
    log = (out / f"{name}.log").open("w")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # its own process group (stopped as one), but this session: Linux's autogroup scheduler shares
    # the CPU between sessions first, so a cluster in a session of its own took an equal share with
    # the load generator whatever the niceness (Ray runs its workers at nice 15), and on 2 busy
    # cores the client fell 0.3-1 s behind its arrival schedule and saw the same gaps in its streams
    proc = subprocess.Popen([sys.executable, "-m", "cli", "up", "-c", str(config), "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, process_group=0)
    deadline = time.monotonic() + timeout_s
    url = None
    while time.monotonic() < deadline and proc.poll() is None:
        for line in (out / f"{name}.log").read_text().splitlines():
            if "OpenAI API at http://" in line:
                url = line.split("OpenAI API at ")[1].removesuffix("/v1").strip()
        if url:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
        time.sleep(1)
    stop(proc)
    raise SystemExit(f"{name} did not come up within {timeout_s:.0f} s; see {out / f'{name}.log'}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def warm_up(url: str, model: str, words: tuple[int, ...] = (8, 64, 300)) -> None:
    for n in words:
        httpx.post(f"{url}/v1/completions", timeout=300, json={
            "model": model, "prompt": "warm up " * n, "max_tokens": 8, "temperature": 0}).raise_for_status()


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
    table: dict[str, dict[float, dict]] = {}
    for run in result["runs"]:
        s = run["summary"]
        table.setdefault(run["label"], {})[run["rate"]] = {
            "attainment": s["slo_attainment"], "goodput": s["goodput"], "tpot_p99": s["tpot_ms"]["p99"],
            "tpot_p50": s["tpot_ms"]["p50"], "ttft_p90": s["ttft_ms"]["p90"], "ttft_p99": s["ttft_ms"]["p99"],
            "ttft_p50": s["ttft_ms"]["p50"], "throughput": s["request_throughput"], "failed": s["failed"],
            "unfinished": s["unfinished"]}
    dis, col = table["disaggregated"], table["colocated"]
    rates = sorted(set(dis) & set(col))
    sustained = {name: max([r for r in rates if t[r]["attainment"] is not None and t[r]["attainment"] >= ATTAINMENT],
                           default=None) for name, t in table.items()}
    out: dict = {"rates": rates, "table": {k: {str(r): v for r, v in t.items()} for k, t in table.items()},
                 "attainment_bar": ATTAINMENT, "max_rate_meeting_slo": sustained}
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
    lines = [f"SLO: {slo}; a system meets it at a rate when >= {a['attainment_bar']:.0%} of requests do", "",
             "| rate (req/s) | system | SLO attainment | goodput (req/s) | TTFT p50 / p90 ms | TPOT p50 / p99 ms |",
             "|---|---|---|---|---|---|"]
    for r in a["rates"]:
        for name in ("disaggregated", "colocated"):
            t = a["table"][name][str(r)]
            att = "-" if t["attainment"] is None else f"{t['attainment']:.0%}"
            lines.append(f"| {r:g} | {name} | {att} | {t['goodput'] or 0:.2f} | {t['ttft_p50']:.0f} / {t['ttft_p90']:.0f} "
                         f"| {t['tpot_p50']:.1f} / {t['tpot_p99']:.1f} |")
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


def run_bench_serve(urls: dict[str, str], workload_args: list[str]) -> int:
    """One `pdcluster bench serve` run over every endpoint (label = system name), interleaved."""
    argv_serve = [a for name, url in urls.items() for a in ("--endpoint", url, "--endpoint-label", name)]
    argv_serve += workload_args
    print("pdcluster bench serve " + " ".join(argv_serve), flush=True)
    return bench_serve(argv_serve)


def summarise(out: Path, analyse_fn, report_fn, slo_text: str) -> int:
    """Read bench serve's result.json in `out`, write exp_summary.json / .md, print the report."""
    a = analyse_fn(json.loads((out / "result.json").read_text()))
    text = report_fn(a, slo_text)
    (out / "exp_summary.json").write_text(json.dumps(a, indent=2))
    (out / "exp_summary.md").write_text(text)
    print("\n" + text)
    return 0


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
    signal.signal(signal.SIGTERM, _interrupt)  # stop the clusters on a kill too (see the finally below)
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    slo = load_cluster_config(REPO / "cluster.yaml").slo
    files = cluster_files(out, args.max_context + 64)
    procs = []
    try:
        urls = {}
        for name, path in files.items():
            proc, url = start(name, path, out)
            procs.append(proc)
            urls[name] = url
            print(f"{name}: {url}", flush=True)
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
        rc = run_bench_serve(urls, argv_serve)
        if rc != 0:
            return rc
    finally:
        for proc in procs:
            stop(proc)
    return summarise(out, analyse, report, f"TTFT <= {slo.ttft_ms:g} ms and TPOT <= {slo.tpot_ms:g} ms")


if __name__ == "__main__":
    sys.exit(main())
