"""`pdcluster plan calibrate`: time the real engine on this machine and fit the cpu cost model.

The engine (engine.Engine, the code every worker runs) is stepped directly with one torch thread,
the process pinned to one CPU, as one core of a pinned worker (pools[].cpus: [N]) runs it:

    prefill  prompts of 16..2048 tokens alone and in batches, and a 3000-token prompt chunked under
             the 2048-token budget; each step timed `repeats` times (all shapes, then again), the
             fastest kept
    decode   batches of 1..96 sequences at contexts 32..1024. Their KV is not computed: blocks are
             allocated and the sequences enter the running batch as a committed transfer does
             (the step's cost does not depend on the cache's values), then `steps` decode steps
             are timed, the fastest kept

and fits, by least squares on relative error with non-negative coefficients,

    prefill = a + b * sum_new + c * sum_attn     sum_attn = sum(n_i * (p_i + n_i)), p_i = cached tokens
    decode  = a + b * sum_context + c * batch

A step time includes what `Engine.step()` does around the forward pass (scheduling, sampling,
postprocessing). Then a zero-load probe of the serving path (`probe_serving`: router, HTTP API,
shm KV transfer) measures what a request pays around the engine. The result (coefficients, fit errors, the samples, the machine, the command) is
written as JSON, by default planner/cpu_coefficients.json, which the planner uses for `cpu` pools.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from planner.cost_model import CPU_COEFFICIENTS

PREFILL_SHAPES = [(1, n) for n in (16, 64, 128, 256, 512, 768, 1024, 1536, 2048)] + [
    (16, 32), (8, 64), (8, 128), (4, 256), (2, 512), (3, 600), (2, 1024), (1, 3000)]
DECODE_SHAPES = [(b, c) for c in (32, 256, 1024) for b in (1, 2, 4, 8, 16, 32, 64, 96)]


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0 (drop the most negative one and refit)."""
    active = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        coef[active] = sol
        if (sol >= 0).all() or len(active) == 1:
            return np.clip(coef, 0, None)
        active.pop(int(np.argmin(sol)))


def fit(features: list[list[float]], seconds: list[float]) -> tuple[list[float], dict[str, float]]:
    """Coefficients minimizing the relative error; and the fit's mean/max absolute % error."""
    x, y = np.asarray(features, float), np.asarray(seconds, float)
    w = 1.0 / y
    coef = _nnls(x * w[:, None], y * w)
    err = np.abs(x @ coef - y) / y * 100
    return coef.tolist(), {"mean_abs_pct_error": float(err.mean()), "max_abs_pct_error": float(err.max())}


def _machine() -> dict[str, Any]:
    import torch

    cpu = platform.processor()
    if Path("/proc/cpuinfo").exists():
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "load_avg_1m_at_start": os.getloadavg()[0]}


PROBE_PROMPTS = (32, 128, 256, 512, 768, 1024)


def probe_serving(model: str, prefill_fit: list[float], decode_fit: list[float], kv_bytes: int,
                  repeats: int = 2, output_tokens: int = 32) -> dict[str, Any]:
    """The serving path around the engine, at zero load: a real router, prefill and decode worker
    (gRPC servers, shm KV transfer) and the OpenAI HTTP API in this process, one request at a time.
    Per prompt length n, one request over gRPC (the router's timing breakdown: the workers' own
    prefill compute and KV transfer times) and one over HTTP with the load generator's client:

        kv_transfer_ms(n)                           = latency + n * KV bytes per token / rate   (fit)
        router TTFT - (prefill queue + compute + kv) = the router's own time per request       (median)
        HTTP TTFT - router TTFT                     = the HTTP API's time per request          (median)
        HTTP TPOT - fitted decode step D(1, n + j)  = extra per token                          (median)
        (process CPU time - fitted engine time) / tokens = serving-path CPU per streamed token (median)

    The last one is what the router, the HTTP API, the gRPC streams and the load generator's client
    take from a host's cores per token; on a machine whose cores also run the workers, the
    simulator makes the workers share the cores with it (ClusterSpec.host_cores).
    """
    from engine.builtin_model import resolve_model_path
    from engine.config import EngineConfig
    from engine.sampling_params import SamplingParams
    from loadgen.cli import load_tokenizer
    from loadgen.client import EndpointConfig, fetch_model
    from loadgen.runner import run
    from loadgen.workload import WorkloadConfig, load_workload
    from pdcluster.client import Client
    from pdcluster.local_cluster import LocalCluster

    path = str(resolve_model_path(model))
    cfg = EngineConfig(model=path, num_threads=1, enable_prefix_caching=False)
    cluster = LocalCluster(cfg, prefill={"kv_backend": "shm"}, decode={"kv_backend": "shm"},
                           router={"request_timeout_s": 120, "model_name": "probe"}, http={})
    api, router = cluster.http, cluster.router
    rows = []
    try:
        tok = load_tokenizer(model)
        endpoint = EndpointConfig(f"http://{api.address}", ignore_eos=True, request_timeout_s=120)
        name = asyncio.run(fetch_model(endpoint))
        params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
        with Client(router.address, timeout_s=120) as client:
            for r in range(repeats + 1):  # the first round warms up
                for n in PROBE_PROMPTS:
                    w = load_workload(WorkloadConfig("synthetic", 1, seed=r * 1000 + n, synthetic_input=f"fixed:{n}",
                                                     synthetic_output=f"fixed:{output_tokens}"), tok, model)
                    timing = client.complete(w.requests[0].prompt, params).timing
                    cpu0 = time.process_time()  # every thread of this process: workers, router, HTTP, client
                    rec = run(w.requests, [0.0], endpoint, name, time_limit_s=120).records[0]
                    cpu = time.process_time() - cpu0
                    if r and rec.ok and rec.ttft is not None and rec.tpot is not None:
                        rows.append({"prompt": w.requests[0].prompt_len, "http_ttft_s": rec.ttft,
                                     "http_tpot_s": rec.tpot, "process_cpu_s": cpu,
                                     "output_tokens": rec.output_tokens, **{k: timing.get(k, 0.0) for k in (
                                         "prefill_queue_ms", "prefill_compute_ms", "kv_transfer_ms", "ttft_ms",
                                         "mean_tpot_ms")}})
    finally:
        cluster.stop()
    if not rows:
        raise RuntimeError("the serving probe got no answers")
    lat, per_token = _nnls(np.asarray([[1.0, x["prompt"]] for x in rows]),
                           np.asarray([x["kv_transfer_ms"] / 1e3 for x in rows])).tolist()
    router = statistics.median(x["ttft_ms"] - x["prefill_queue_ms"] - x["prefill_compute_ms"] - x["kv_transfer_ms"]
                               for x in rows) / 1e3
    http = statistics.median(x["http_ttft_s"] - x["ttft_ms"] / 1e3 for x in rows)
    overhead = router + max(0.0, http)
    da, db, dc = decode_fit
    pa, pb, pc = prefill_fit
    # CPU the serving path spends per streamed token: the process's CPU time for the request less
    # the engine's (its fitted step times: one thread, so CPU time = step time)
    serving_cpu = statistics.median(
        (x["process_cpu_s"] - (pa + pb * x["prompt"] + pc * x["prompt"] ** 2)
         - sum(da + db * (x["prompt"] + j) + dc for j in range(1, x["output_tokens"]))) / x["output_tokens"]
        for x in rows)
    extra = statistics.median(x["http_tpot_s"] - statistics.fmean(da + db * (x["prompt"] + j) + dc
                                                                  for j in range(1, output_tokens)) for x in rows)
    return {
        "router_in_s": max(0.0, overhead) / 2, "first_token_out_s": max(0.0, overhead) / 2,
        "kv_latency_s": lat, "kv_gbps": kv_bytes / per_token / 1e9 if per_token > 0 else None,
        "decode_token_s": max(0.0, extra), "router_s": router, "http_s": http,
        "cpu_per_token_s": max(0.0, serving_cpu),
        "host_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "method": "zero-load probe in process: router + HTTP API + prefill/decode gRPC workers with shm KV transfer, "
                  "one request at a time; kv_transfer_ms = latency + prompt * bytes / rate (fit); "
                  "overhead = median(router TTFT - worker prefill queue/compute/transfer) "
                  "+ median(HTTP TTFT - router TTFT), split evenly in/out; decode_token_s = HTTP TPOT - fitted decode step (median), "
                  "added per sequence to each decode step; cpu_per_token_s = (process CPU time of the "
                  "HTTP request - fitted engine time) / output tokens (median)",
        "samples": rows,
    }


def calibrate(model: str = "builtin:tiny-llama", cpu: int | None = None, repeats: int = 3, steps: int = 4,
              out: Path | None = CPU_COEFFICIENTS, say: Callable[[str], None] = print,
              quick: bool = False, serving: bool = True) -> dict[str, Any]:
    from tqdm import tqdm

    from engine.admission_rule import blocks_needed
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.sampling_params import SamplingParams
    from planner.models import from_checkpoint

    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pinned = cpu if cpu is not None else (usable[0] if usable else None)
    if pinned is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {pinned})
    try:
        t_start = time.perf_counter()
        cfg = EngineConfig(model=model, num_threads=1, enable_prefix_caching=False)
        engine = Engine(cfg, "colocated")
        shape = from_checkpoint(model)
        vocab = engine.model_cfg.vocab_size
        rng = random.Random(0)
        prompt = lambda n: [rng.randrange(3, vocab) for _ in range(n)]
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        prefill_shapes = PREFILL_SHAPES[::2] if quick else PREFILL_SHAPES
        decode_shapes = DECODE_SHAPES[::3] if quick else DECODE_SHAPES
        bar = tqdm(total=len(prefill_shapes) * repeats + len(decode_shapes), desc="calibrate", unit="shape")

        # warm-up: first calls allocate and pick kernels
        for _ in range(3):
            engine.add_request("warm", prompt(64), one)
            while engine.has_work():
                engine.step()

        # repeats outside, shapes inside: a burst of other load on the machine hits one repeat of
        # many shapes rather than every repeat of one; the fastest repeat is kept (the engine's own
        # cost; contention the simulator knows about is modelled there, the rest is noise)
        times: dict[tuple[int, int, int], list[float]] = {}
        feats: dict[tuple[int, int, int], tuple[int, int, int]] = {}
        for r in range(repeats):
            for count, length in prefill_shapes:
                for i in range(count):
                    engine.add_request(f"p{count}x{length}-{r}-{i}", prompt(length), one)
                k = 0
                while engine.has_work():  # Engine.step(), with the batch's shape noted
                    t0 = time.perf_counter()
                    _, rows = engine.step_with_rows()  # (tokens cached or computed before, new) per sequence
                    times.setdefault((count, length, k), []).append(time.perf_counter() - t0)
                    feats[(count, length, k)] = (sum(n for _, n in rows), sum(n * (p + n) for p, n in rows),
                                                 sum(p for p, _ in rows))
                    k += 1
                bar.update()
        prefill_samples: list[dict[str, Any]] = []
        for key, ts in times.items():
            new, attn, prior = feats[key]
            prefill_samples.append({"seqs": key[0], "sum_new": new, "sum_attn": attn, "sum_prior": prior,
                                    "seconds": min(ts), "all_seconds": ts})

        decode_samples: list[dict[str, Any]] = []
        for batch_size, ctx in decode_shapes:
            if batch_size * blocks_needed(ctx + steps + 2, cfg.block_size) > engine.load().blocks_free:
                continue  # more than this engine's KV cache holds
            seqs = []
            for i in range(batch_size):  # enter the batch as a committed KV transfer does
                seq = engine.make_sequence(f"d{batch_size}x{ctx}-{i}", prompt(ctx),
                                           SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True))
                seq.block_table = engine.allocate_blocks(ctx)
                seq.num_computed_tokens = ctx
                seq.append_token(rng.randrange(3, vocab))
                engine.add_running(seq)
                seqs.append(seq)
            shape_steps = []
            for _ in range(steps):
                # the running batch is these sequences (none finishes, none is preempted: room checked above)
                sum_ctx = sum(len(s.token_ids) for s in seqs)
                n = len(seqs)
                t0 = time.perf_counter()
                engine.step()
                shape_steps.append({"batch": n, "sum_context": sum_ctx, "seconds": time.perf_counter() - t0})
            # the fastest of the shape's steps (their contexts differ by one token per sequence)
            fastest = min(shape_steps, key=lambda x: x["seconds"])
            decode_samples.append({**fastest, "all_seconds": [x["seconds"] for x in shape_steps]})
            for s in seqs:
                engine.abort(s.request_id)
            bar.update()
        bar.close()

        pc, perr = fit([[1, s["sum_new"], s["sum_attn"]] for s in prefill_samples],
                       [s["seconds"] for s in prefill_samples])
        dc, derr = fit([[1, s["sum_context"], s["batch"]] for s in decode_samples],
                       [s["seconds"] for s in decode_samples])
        kv_cache = engine.kv_caches[0]  # (2, num_blocks, block_size, kv heads, head dim), the engine's dtype
        num_blocks = kv_cache.shape[1]
        kv_bytes = engine.model_cfg.kv_bytes_per_token(kv_cache.dtype)
        result = {
            "hardware": "cpu",
            "model": model,
            "model_shape": {"name": shape.name, "params": shape.params, "layers": shape.num_layers,
                            "kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim},
            "dtype": str(kv_cache.dtype).removeprefix("torch."),
            "prefill": {"a": pc[0], "b": pc[1], "c": pc[2], **perr,
                        "formula": "a + b * sum_new + c * sum(n_i * (p_i + n_i))"},
            "decode": {"a": dc[0], "b": dc[1], "c": dc[2], **derr, "formula": "a + b * sum_context + c * batch"},
            "kv_bytes_per_token": kv_bytes,
            "kv_capacity_tokens": num_blocks * cfg.block_size,
            "kv_cache": {"num_blocks": num_blocks, "block_size": cfg.block_size,
                         "memory_bytes": num_blocks * cfg.block_size * kv_bytes},
            "engine": {"max_num_batched_tokens": cfg.max_num_batched_tokens, "max_num_seqs": cfg.max_num_seqs,
                       "torch_threads": 1, "pinned_cpu": pinned},
            "machine": _machine(),
            "command": "pdcluster " + " ".join(sys.argv[1:]) if Path(sys.argv[0]).name in ("pdcluster", "cli.py")
            or Path(sys.argv[0]).parts[-2:] == ("cli", "__main__.py") else " ".join(sys.argv),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "wall_s": round(time.perf_counter() - t_start, 1),
            "samples": {"prefill": prefill_samples, "decode": decode_samples},
        }
    finally:
        if usable and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, set(usable))
    if serving:
        say("serving path probe (router + HTTP API + shm KV transfer, one request at a time) ...")
        result["serving"] = probe_serving(model, pc, dc, kv_bytes)
        sv = result["serving"]
        kv = "-" if sv["kv_gbps"] is None else f"{sv['kv_gbps']:.2f} GB/s"
        say(f"serving  {(sv['router_in_s'] + sv['first_token_out_s']) * 1e3:.1f} ms per request, KV link {kv}, "
            f"{sv['decode_token_s'] * 1e3:.2f} ms per token on the decode step, "
            f"{sv['cpu_per_token_s'] * 1e3:.2f} ms CPU per token on the host")
    say(f"prefill  {pc[0] * 1e3:.3f} ms + {pc[1] * 1e6:.3f} us * sum_new + {pc[2] * 1e9:.4f} ns * sum_attn "
        f"(fit error mean {perr['mean_abs_pct_error']:.1f}%, max {perr['max_abs_pct_error']:.1f}%)")
    say(f"decode   {dc[0] * 1e3:.3f} ms + {dc[1] * 1e6:.4f} us * sum_context + {dc[2] * 1e3:.3f} ms * batch "
        f"(fit error mean {derr['mean_abs_pct_error']:.1f}%, max {derr['max_abs_pct_error']:.1f}%)")
    say(f"kv cache {result['kv_capacity_tokens']} tokens ({kv_bytes} bytes per token); {result['wall_s']} s")
    if out is not None:
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
        say(f"wrote {out}")
    return result
