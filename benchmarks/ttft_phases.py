"""Experiment: where a short request's TTFT goes while other requests stream their tokens.

    python scripts/exp_ttft_phases.py                        # both clusters, ~4 min on 2 cores
    python scripts/exp_ttft_phases.py --systems disaggregated --repeats 1

Starts the clusters of scripts/exp_disagg_vs_colocated.py (one at a time: 1 prefill + 1 decode
worker pinned to a core each, or 2 colocated workers) and sends short prompts one after another,
first alone, then while 1 and 2 other requests stream long outputs in the background. Per case it
prints the client's median TTFT and, from the router's `pdcluster_request_phase_seconds` histogram
(the difference of its sums and counts over the case), the mean time per phase: router queue (the
Reserve on the decode worker included), prefill queue, prefill compute, KV transfer (the commit,
its wait for the decode worker's engine lock included) and decode queue, plus the router's TTFT.
The planner's simulator (planner/simulator.py) models these waits; this shows them measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.disagg_vs_colocated import cluster_files
from benchmarks.local_clusters import REPO, start, stop, warm_up

MODEL = "builtin:tiny-llama"
TTFT = "pdcluster_time_to_first_token_seconds"
PHASES = "pdcluster_request_phase_seconds"


def histogram_sums(text: str) -> dict[tuple[str, str], float]:
    """{(phase, or "ttft" for the router's TTFT, "sum" | "count"): value} from the router's metrics text."""
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name not in (TTFT, PHASES):
            continue
        for s in family.samples:
            kind = s.name.rsplit("_", 1)[-1]
            if kind in ("sum", "count"):
                out[(s.labels.get("phase", "ttft"), kind)] = s.value
    return out


def phase_means_ms(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]) -> dict[str, float]:
    """Mean ms per phase (and the router's TTFT) over the requests finished between two scrapes."""
    out = {}
    for (phase, kind), total in after.items():
        if kind == "sum":
            n = after[(phase, "count")] - before.get((phase, "count"), 0.0)
            if n:
                out[f"{phase}_ms"] = (total - before.get((phase, "sum"), 0.0)) / n * 1e3
    return out


def scrape(url: str) -> dict[tuple[str, str], float]:
    return histogram_sums(httpx.get(f"{url}/metrics", timeout=10).text)


def ttft_ms(url: str, words: int, max_tokens: int, client: httpx.Client) -> float:
    """One streamed completion; the client's time to its first token, ms. `client`: a kept one (a
    new httpx client builds its TLS context, ~20 ms, even for plain HTTP: it would be counted)."""
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", f"{url}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": "hello " * words, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data:") and '"text"' in line:
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("the stream carried no token")
    return first * 1e3


def case(url: str, streams: int, requests: int) -> dict[str, float]:
    """`requests` short prompts one after another while `streams` long outputs stream."""
    done = threading.Event()

    def background() -> None:
        with httpx.Client(timeout=120) as own:
            while not done.is_set():
                ttft_ms(url, 20, 150, own)

    threads = [threading.Thread(target=background, daemon=True) for _ in range(streams)]
    for t in threads:
        t.start()
    client = []
    with httpx.Client(timeout=120) as http:
        ttft_ms(url, 45, 8, http)  # the connection opened before the measured requests
        time.sleep(0.5 if streams else 0.0)
        before = scrape(url)
        for _ in range(requests):
            time.sleep(0.15)
            client.append(ttft_ms(url, 45, 8, http))
        after = scrape(url)
    done.set()
    for t in threads:
        t.join(timeout=60)
    row = {"client_ttft_ms": statistics.median(client), **phase_means_ms(before, after)}
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="disaggregated,colocated")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--requests", type=int, default=20, help="short prompts per case")
    ap.add_argument("--out", type=Path, default=REPO / "bench_results" / "exp_ttft_phases")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    files = cluster_files(args.out, 2048)
    for system in args.systems.split(","):
        proc, url = start(system, files[system], args.out)
        try:
            warm_up(url, MODEL)
            for _ in range(args.repeats):
                for streams in (0, 1, 2):
                    row = case(url, streams, args.requests)
                    print(f"{system:13s} {streams} streaming: " + ", ".join(
                        f"{k.removesuffix('_ms')} {v:.1f}" for k, v in row.items()), flush=True)
        finally:
            stop(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
