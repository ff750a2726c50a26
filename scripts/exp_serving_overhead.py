"""Experiment: the serving path's own cost at zero load, hop by hop, against the engine alone.

    python scripts/exp_serving_overhead.py                       # tiny-llama, both modes, ~3 min
    python scripts/exp_serving_overhead.py --model builtin:llama-200m --prompt-tokens 64,512

For each mode (`disaggregated`: a prefill worker on CPU 0 and a decode worker on CPU 1, one thread
each; `disaggregated-serial`: the same with router.reserve_overlap_max_tokens 0, so the Reserve on the
decode worker precedes the prefill instead of overlapping it; `colocated`: one worker with two
threads on both) and prompt length it measures, one request at a time on an otherwise idle cluster:

  engine         the worker's engine in this process, same config, threads and cores: the prefill
                 step (prompt -> first token) and one decode step; no server
  worker         what the workers report in the reply's timing: prefill queue + compute + KV
                 transfer (disaggregated; a ticket that followed: its wait too), the router's queue
                 (until the prompt went to its prefill worker) and the decode queue
  router         the router's own TTFT (arrival to the first token leaving it) and mean TPOT
  grpc client    TTFT and inter-token gap seen by a gRPC client of the router (pdcluster.client)
  http client    the same through the OpenAI HTTP API, streamed (SSE): the HTTP front end, its
                 loopback gRPC hop to the router, and SSE framing on top

The table gives each hop's share of TTFT (medians over --requests) and the per-token overhead
(client inter-token gap minus the engine's decode step). Writes --out/overhead.json and .md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

from benchmarks.local_clusters import REPO, start, stop, warm_up, write_cluster_files
from benchmarks.serving_vs_vllm import cluster_files
from pdcluster.client import Client
from pdcluster.cluster_config import load_cluster_config

MODES = ("disaggregated", "colocated")  # also: disaggregated-serial (no Reserve/prefill overlap)


def engine_reference(model: str, max_model_len: int, threads: int, cpus: set[int], prompt_tokens: int,
                     repeats: int) -> dict[str, float]:
    """Median ms of the prefill step and of one decode step, the engine alone on `cpus`."""
    import torch

    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads)
    try:
        eng = Engine(EngineConfig(model=model, max_model_len=max_model_len, num_threads=threads), "colocated")
        vocab = eng.model_cfg.vocab_size
        prefill, decode = [], []
        for i in range(repeats + 1):  # the first is a warm-up
            ids = [(7 * i + 13 * j) % (vocab - 10) + 5 for j in range(prompt_tokens)]  # no prefix reuse
            eng.add_request(f"r{i}", ids, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            t0 = time.perf_counter()
            eng.step()
            t1 = time.perf_counter()
            eng.step()
            t2 = time.perf_counter()
            while eng.has_work():
                eng.step()
            if i:
                prefill.append((t1 - t0) * 1e3)
                decode.append((t2 - t1) * 1e3)
        del eng
        return {"prefill_ms": statistics.median(prefill), "decode_step_ms": statistics.median(decode)}
    finally:
        os.sched_setaffinity(0, before)


def prompt_ids(prompt_tokens: int, i: int, vocab: int) -> list[int]:
    return [(11 * i + 17 * j + 3) % (vocab - 10) + 5 for j in range(prompt_tokens)]


def grpc_request(client, ids: list[int], max_tokens: int) -> dict[str, float]:
    """One streamed request through the router's gRPC API (a `pdcluster.client.Client`, its channel
    open): client TTFT, mean inter-token gap, the router's timing."""
    t0 = time.perf_counter()
    times, timing = [], {}
    for chunk in client.stream(ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
        now = time.perf_counter()
        times.extend([now] * len(chunk.token_ids))
        if chunk.finish_reason:
            timing = {f.name: v for f, v in chunk.timing.ListFields()}
    return {"ttft_ms": (times[0] - t0) * 1e3, "gap_ms": (times[-1] - times[0]) / (len(times) - 1) * 1e3,
            **{f"router_{k}": v for k, v in timing.items()}}


def http_request(http: httpx.Client, url: str, model: str, ids: list[int], max_tokens: int) -> dict[str, float]:
    """One streamed completion through the OpenAI HTTP API on a kept-alive connection (a new
    httpx client costs ~20 ms of its own here, building its TLS context): client TTFT and mean
    inter-token gap."""
    t0 = time.perf_counter()
    times = []
    with http.stream("POST", f"{url}/v1/completions", timeout=120, json={
            "model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:") and '"text"' in line:
                times.append(time.perf_counter())
    return {"ttft_ms": (times[0] - t0) * 1e3, "gap_ms": (times[-1] - times[0]) / (len(times) - 1) * 1e3}


def router_address(log: Path) -> str:
    for line in log.read_text().splitlines():
        if "router gRPC" in line:
            return line.split()[-1]
    raise SystemExit(f"no router gRPC address in {log}")


def med(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r.get(key, 0.0) for r in rows)


def breakdown(eng: dict[str, float], grpc_rows: list[dict], http_rows: list[dict], mode: str) -> dict[str, float]:
    """Median ms per hop of TTFT, and per-token overheads."""
    router_ttft = med(grpc_rows, "router_ttft_ms")
    worker = {k: med(grpc_rows, f"router_{k}") for k in
              ("router_queue_ms", "prefill_queue_ms", "prefill_compute_ms", "kv_transfer_ms", "decode_queue_ms")}
    # disaggregated: the first token is the prefill worker's, sent before any decode step
    inside = (sum(v for k, v in worker.items() if k != "decode_queue_ms") if mode.startswith("disaggregated")
              else router_ttft)
    out = {
        "engine_prefill_ms": eng["prefill_ms"], "engine_decode_step_ms": eng["decode_step_ms"],
        **{f"worker_{k}": v for k, v in worker.items()},
        "router_ttft_ms": router_ttft,
        "router_other_ms": router_ttft - inside,  # RPC round trips, relay and detokenize of the first token
        "grpc_ttft_ms": med(grpc_rows, "ttft_ms"), "http_ttft_ms": med(http_rows, "ttft_ms"),
        "router_tpot_ms": med(grpc_rows, "router_mean_tpot_ms"), "grpc_gap_ms": med(grpc_rows, "gap_ms"),
        "http_gap_ms": med(http_rows, "gap_ms"),
    }
    out["grpc_hop_ms"] = out["grpc_ttft_ms"] - router_ttft
    out["http_hop_ms"] = out["http_ttft_ms"] - out["grpc_ttft_ms"]
    out["ttft_over_engine_ms"] = out["http_ttft_ms"] - eng["prefill_ms"]  # the first token is the prefill's
    out["ttft_goal_ms"] = eng["prefill_ms"] + eng["decode_step_ms"] + 5.0
    out["per_token_overhead_ms"] = out["http_gap_ms"] - eng["decode_step_ms"]
    return out


HOPS = [("engine prefill step (alone)", "engine_prefill_ms"), ("router queue (to the prefill worker)",
        "worker_router_queue_ms"), ("prefill queue", "worker_prefill_queue_ms"),
        ("prefill compute (worker)", "worker_prefill_compute_ms"),
        ("KV transfer + commit (+ the ticket's wait)", "worker_kv_transfer_ms"),
        ("decode queue (to the first decode step)", "worker_decode_queue_ms"),
        ("router: relay + detokenize", "router_other_ms"), ("router TTFT", "router_ttft_ms"),
        ("gRPC hop to the client", "grpc_hop_ms"), ("HTTP front end + its gRPC hop + SSE", "http_hop_ms"),
        ("**HTTP client TTFT**", "http_ttft_ms"), ("goal: engine prefill + one decode step + 5", "ttft_goal_ms"), ("TTFT over the engine's own time", "ttft_over_engine_ms"),
        ("engine decode step (alone, batch 1)", "engine_decode_step_ms"), ("router mean TPOT", "router_tpot_ms"),
        ("gRPC client inter-token gap", "grpc_gap_ms"), ("HTTP client inter-token gap", "http_gap_ms"),
        ("**per-token overhead** (HTTP gap - engine step)", "per_token_overhead_ms")]


def report(results: dict) -> str:
    cols = [(m, p) for m in results for p in results[m]]
    lines = ["| ms (medians) | " + " | ".join(f"{m} {p} tok" for m, p in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for label, key in HOPS:
        lines.append(f"| {label} | " + " | ".join(f"{results[m][p].get(key, 0.0):.2f}" for m, p in cols) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:tiny-llama")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--prompt-tokens", default="64,512", help="prompt lengths, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=15, help="requests per mode, length and API")
    ap.add_argument("--out", type=Path, default=REPO / "bench_results" / "exp_serving_overhead")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < 2:
        raise SystemExit(f"needs 2 usable CPUs, this process may use {usable}")
    cpus = (usable[0], usable[1])
    lengths = [int(x) for x in args.prompt_tokens.split(",")]
    files = cluster_files(args.out, args.model, args.max_model_len, cpus)
    serial = load_cluster_config(files["disaggregated"])
    files.update(write_cluster_files(args.out, {"disaggregated-serial": dataclasses.replace(
        serial, router=dataclasses.replace(serial.router, reserve_overlap_max_tokens=0))}))
    from engine.builtin_model import resolve_model_path
    from engine.config import ModelConfig

    vocab = ModelConfig.from_pretrained(resolve_model_path(args.model)).vocab_size
    results: dict[str, dict[int, dict]] = {}
    for mode in args.modes.split(","):
        threads, cores = (1, {cpus[0]}) if mode.startswith("disaggregated") else (2, set(cpus))
        engine = {p: engine_reference(args.model, args.max_model_len, threads, cores, p, args.requests)
                  for p in lengths}
        proc, url = start(mode, files[mode], args.out)
        try:
            address = router_address(args.out / f"{mode}.log")
            warm_up(url, args.model, (8, 64))
            results[mode] = {}
            with Client(address, timeout_s=120) as client, httpx.Client() as http:
                for p in lengths:
                    grpc_rows, http_rows = [], []
                    for i in range(args.requests):  # alternate the APIs; fresh prompts (no prefix reuse)
                        grpc_rows.append(grpc_request(client, prompt_ids(p, 2 * i, vocab), args.max_tokens))
                        time.sleep(0.05)
                        http_rows.append(http_request(http, url, args.model, prompt_ids(p, 2 * i + 1, vocab),
                                                      args.max_tokens))
                        time.sleep(0.05)
                    results[mode][p] = breakdown(engine[p], grpc_rows, http_rows, mode)
                    print(f"{mode} {p} tokens: " + ", ".join(f"{k} {v:.2f}" for k, v in results[mode][p].items()),
                          flush=True)
        finally:
            stop(proc)
    (args.out / "overhead.json").write_text(json.dumps(results, indent=1) + "\n")
    md = report(results)
    (args.out / "overhead.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
