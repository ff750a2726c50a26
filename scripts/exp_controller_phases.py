"""Experiment: the SLO controller against static clusters through traffic whose mix shifts.

    python scripts/exp_controller_phases.py                     # tiny-llama, 3 workers, ~6 min
    python scripts/exp_controller_phases.py --phases 384/4:5:40,32/96:5:40,384/4:5:40 --static 1+2,2+1

An in-process cluster (`LocalCluster`: the router and three workers in this process, one engine
thread each, shm KV transfer) per system, the same requests for each: phase by phase, Poisson
arrivals at RATE for SECONDS of prompts of PROMPT tokens asking for OUTPUT tokens
(`PROMPT/OUTPUT:RATE:SECONDS`), streamed through the router's gRPC API. Systems: each static split
in `--static` (P+D) and the controller (`pdcluster/live_controller.py`, starting at `--start`),
which may only move workers between the roles. Per system and phase: the share of requests meeting
the SLO (client TTFT and mean inter-token gap), and the controller's decisions. Writes
--out/phases.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import sys
import time
from pathlib import Path

from engine import EngineConfig
from engine.builtin_model import resolve_model_path
from pdcluster.live_controller import LiveController
from pdcluster.local_cluster import LocalCluster
from scaling.policy import ControllerConfig

REPO = Path(__file__).resolve().parent.parent


def requests_for(phases: str, vocab: int, seed: int) -> list[tuple[int, float, list[int], int]]:
    """(phase, arrival s, prompt ids, max_tokens) for every request, in arrival order."""
    rng, out, t0 = random.Random(seed), [], 0.0
    for k, item in enumerate(phases.split(",")):
        lengths, rate, seconds = item.split(":")
        prompt, output = (int(x) for x in lengths.split("/"))
        t = 0.0
        while (t := t + rng.expovariate(float(rate))) < float(seconds):
            ids = [rng.randrange(5, vocab - 5) for _ in range(prompt)]  # fresh prompts: no prefix reuse
            out.append((k, t0 + t, ids, output))
        t0 += float(seconds)
    return out


def one(client, ids: list[int], max_tokens: int) -> tuple[float, float]:
    """Client TTFT and mean inter-token gap, seconds."""
    t0 = time.perf_counter()
    times = []
    for chunk in client.stream(ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
        times.extend([time.perf_counter()] * len(chunk.token_ids))
    gap = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return times[0] - t0, gap


def run_system(cfg: EngineConfig, split: tuple[int, int], reqs: list, control: ControllerConfig | None,
               slo: tuple[float, float]) -> dict:
    with LocalCluster(cfg, split[0], split[1], prefill={"kv_backend": "shm"}, decode={"kv_backend": "shm"},
                      router={"request_timeout_s": 300}) as c, c.client(timeout_s=300) as client:
        for ids in ([5] * 64, [6] * 8):  # warm-up
            client.complete(ids, max_tokens=4)
        controller = LiveController(c, control).start() if control is not None else None
        start = time.perf_counter()
        rows = []
        try:
            with cf.ThreadPoolExecutor(64) as pool:
                futures = []
                for phase, at, ids, n in reqs:
                    time.sleep(max(0.0, at - (time.perf_counter() - start)))
                    futures.append((phase, pool.submit(one, client, ids, n)))
                for phase, f in futures:
                    ttft, gap = f.result(timeout=600)
                    rows.append((phase, ttft, gap))
        finally:
            if controller is not None:
                controller.stop()
        assert c.wait_blocks_free(30), "KV blocks still held"
        decisions = [(round(d.prefill_pressure, 2), round(d.decode_pressure, 2), d.action)
                     for d in (controller.decisions if controller else [])]
    phases = sorted({p for p, _, _ in rows})
    ok = [(p, ttft <= slo[0] and gap <= slo[1]) for p, ttft, gap in rows]
    return {"attained": sum(o for _, o in ok) / len(ok),
            "phases": [sum(o for q, o in ok if q == p) / sum(1 for q, _ in ok if q == p) for p in phases],
            "decisions": decisions}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:tiny-llama")
    ap.add_argument("--phases", default="384/4:5:40,32/96:5:40,384/4:5:40", help="PROMPT/OUTPUT:RATE:SECONDS,...")
    ap.add_argument("--static", default="1+2,2+1", help="static splits P+D, comma-separated")
    ap.add_argument("--start", default="1+2", help="the controller's first split")
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=50.0)
    ap.add_argument("--interval-s", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "bench_results" / "exp_controller_phases")
    args = ap.parse_args(argv)
    split = lambda s: tuple(int(x) for x in s.split("+"))  # noqa: E731
    cfg = EngineConfig(model=str(resolve_model_path(args.model)), max_model_len=1024, num_threads=1)
    from engine.config import ModelConfig

    vocab = ModelConfig.from_pretrained(cfg.model).vocab_size
    reqs = requests_for(args.phases, vocab, args.seed)
    slo = (args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    control = ControllerConfig(interval_s=args.interval_s, settle_intervals=2, cooldown_s=5 * args.interval_s,
                               warmup_s=2 * args.interval_s, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms)
    systems = [(f"static {s}", split(s), None) for s in args.static.split(",")]
    systems.append((f"controller from {args.start}", split(args.start), control))
    print(f"{len(reqs)} requests in phases {args.phases}; SLO TTFT {args.slo_ttft_ms:g} ms, TPOT {args.slo_tpot_ms:g} ms",
          flush=True)
    results = {}
    for name, first, ctl in systems:
        results[name] = r = run_system(cfg, first, reqs, ctl, slo)
        print(f"{name:<22} attained {r['attained']:6.1%}  phases " + "  ".join(f"{x:6.1%}" for x in r["phases"])
              + f"  decisions {r['decisions']}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "phases.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
