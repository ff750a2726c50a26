"""Experiment: the SLO controller of `pdcluster up` through shifting traffic, against static splits
(issue: the SLO controller; docs/controller.md).

    python scripts/exp_controller_cluster.py --phases 512/4:4:40,32/128:4:40,512/4:4:40 --static 1+2,2+1 --start 1+2

Each system is a real cluster on a local Ray (`pdcluster up` from cluster.yaml with the built-in
model, one engine thread a worker, shm KV transfer): static P+D splits, and the controller
(`controller.enabled`, flips only: its pools' bounds are its size) starting from `--start`. Each is
played the same phases by `pdcluster bench serve --phases` (the same requests and arrival times),
which reports per phase the SLO attainment and the worker-seconds per role; the controller's
decisions are read from the router's /metrics. Printed: one row per system; written to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import urllib.request
from pathlib import Path

from loadgen.cli import main as bench_serve
from pdcluster.cluster_config import load_cluster_config
from pdcluster.launcher import up

REPO = Path(__file__).resolve().parent.parent


def config(split: tuple[int, int], args: argparse.Namespace, controller: bool):
    cfg = load_cluster_config(REPO / "cluster.yaml")
    pools = (dataclasses.replace(cfg.pools[0], replicas=split[0]), dataclasses.replace(cfg.pools[1], replicas=split[1]))
    return dataclasses.replace(
        cfg, pools=pools, model=dataclasses.replace(cfg.model, path=args.model, max_model_len=1024),
        router=dataclasses.replace(cfg.router, grpc_port=0, http_port=0),
        engine=dataclasses.replace(cfg.engine, num_threads=1),
        kv_transfer=dataclasses.replace(cfg.kv_transfer, backend="shm"),
        kv_cache=dataclasses.replace(cfg.kv_cache, num_blocks=args.num_blocks or "auto"),
        slo=dataclasses.replace(cfg.slo, ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms),
        controller=dataclasses.replace(cfg.controller, enabled=controller, interval_s=args.interval_s,
                                       cooldown_s=5 * args.interval_s, warmup_s=2 * args.interval_s)).validate()


def decisions(http: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{http}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("pdcluster_controller_decisions_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.removeprefix("pdcluster_controller_decisions_total")] = float(value)
    return out


def run_system(name: str, cfg, args: argparse.Namespace) -> dict:
    out = args.out / name.replace(" ", "_").replace("+", "p")
    handle = up(cfg, say=lambda _: None, log_level=args.log_level)
    try:
        rc = bench_serve(["--endpoint", f"http://{handle.http_address}", "--endpoint-label", name,
                          "--phases", args.phases, "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms",
                          str(args.slo_tpot_ms), "--ignore-eos", "--seed", str(args.seed), "--out", str(out),
                          "--no-progress"])
        made = decisions(handle.http_address)
    finally:
        handle.stop()
    rows = json.loads((out / "phases.json").read_text())["rows"]
    return {"rc": rc, "rows": rows, "decisions": made}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:tiny-llama")
    ap.add_argument("--phases", default="512/4:4:40,32/128:4:40,512/4:4:40", help="as bench serve --phases")
    ap.add_argument("--static", default="1+2,2+1", help="static splits P+D, comma-separated")
    ap.add_argument("--start", default="1+2", help="the controller's first split ('' : no controller run)")
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=50.0)
    ap.add_argument("--interval-s", type=float, default=2.0)
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="KV blocks per worker (default: from kv_cache.memory_mb): few make decode need workers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-level", default="info", help="the cluster's (debug: the controller's every interval)")
    ap.add_argument("--out", type=Path, default=REPO / "bench_results" / "exp_controller_cluster")
    args = ap.parse_args(argv)
    split = lambda s: tuple(int(x) for x in s.split("+"))  # noqa: E731
    systems = [(f"static {s}", config(split(s), args, False)) for s in args.static.split(",") if s]
    if args.start:
        systems.append((f"controller from {args.start}", config(split(args.start), args, True)))
    results = {}
    for name, cfg in systems:
        results[name] = r = run_system(name, cfg, args)
        phases = "  ".join(f"{x['slo_attainment']:6.1%}" if x["slo_attainment"] is not None else "     -"
                           for x in r["rows"][:-1])
        total = r["rows"][-1]
        ws = sum(total["worker_seconds"].values())
        print(f"{name:<22} attained {total['slo_attainment']:6.1%}  phases {phases}  worker-s {ws:5.0f}  "
              f"decisions {r['decisions'] or '-'}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps({"argv": sys.argv[1:], "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
