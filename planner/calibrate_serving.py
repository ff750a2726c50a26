"""`pdcluster plan calibrate --serving-url URL`: fit the step costs of a running cluster under load.

`pdcluster plan calibrate` times the bare engine in one process. A serving worker's step costs
more: each iteration also hands its tokens to the response streams, and the worker shares its
process (gRPC threads, one GIL) and the machine (router, HTTP API, clients) with the serving path,
more so the more tokens per second flow. This probe measures that directly on a deployment:

    for each prompt length P and concurrency B: B clients send prompts of P tokens (distinct,
    so no prefix-cache hits) for `output_tokens` tokens each, back to back, over the OpenAI
    API with streaming, as the load generator does; after `warmup_s` the router's /metrics is
    read, again `seconds` later, and the difference of the workers' step counters
    (engine/step_stats.py) is one sample per phase:

        decode   mean step = a + b * mean sum(context) + c * mean batch
        prefill  mean step = (r + s x T) x E + o, E = the engine's fit (`calibrate`) at mean tokens,
                 mean tokens x P (prompts of P tokens from scratch: sum n(p + n) = n P), T = the
                 decode tokens per second of the same window; a few prompt lengths cannot pin three
                 new coefficients, so the engine's shape is kept: a scale r, a fixed cost o per
                 step, and a slope s per streamed token/s (the serving path's CPU per token takes
                 from the prefill worker's core: 1.2-1.8x the engine with one stream, 1.6-3.6x with
                 32 on this machine, disaggregated)

and fits the decode one as `calibrate` does (least squares on relative error, coefficients >= 0).
With one stream nothing queues, so the client's TTFT p50 at each prompt length (`idle_ttft_s`) is
the serving path's fixed share plus a prefill (and, disaggregated, a KV transfer): the planner takes
the fixed share as the intercept of TTFT against the modelled prefill
(planner.plan.PlanContext.idle_ttft_overhead). The
result goes into the coefficients file as `live`; the planner then uses these step costs for
`cpu` pools in place of the engine's own plus the zero-load serving probe's per-token cost; the
rest of the serving path's CPU (router, HTTP API, client) still competes for the host's cores, as
the probe's closed loop asks less of them per step than a trace's arrivals do.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any

from common.heap import freeze_startup_heap
from loadgen.server_counters import PREFIX, STEP_FIELDS, delta, is_bucket, scrape_counters
from planner.calibrate import fit

LEVELS = (1, 2, 4, 8, 16, 32)
PROMPT_LENS = (64, 256, 768)


def scrape_steps(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> dict[tuple[str, str], dict]:
    """{(role, phase): {steps, step_seconds, ...}} summed over the workers, from the router's /metrics
    (per phase; not the prefix cache's counters nor the per-batch-size buckets)."""
    return {k: v for k, v in scrape_counters(url, api_key, timeout_s).items() if k[1] != PREFIX and not is_bucket(k[1])}


async def _closed_loop(url: str, model: str, prompts: Iterator[str], concurrency: int, output_tokens: int,
                       warmup_s: float, seconds: float, api_key: str | None) -> tuple[dict, dict, float]:
    from loadgen.client import CompletionsClient, EndpointConfig, RequestRecord
    from loadgen.workload import Request

    endpoint = EndpointConfig(url, ignore_eos=True, request_timeout_s=max(60.0, 4 * seconds), api_key=api_key)
    tpots: list[float] = []
    ttfts: list[float] = []

    stop = asyncio.Event()
    async with CompletionsClient(endpoint) as client:
        t0 = time.perf_counter()

        async def worker() -> None:
            for i, prompt in enumerate(prompts):  # shared by the streams; each prompt is sent once
                if stop.is_set():  # (a cancel that lands as a request completes can be lost in wait_for)
                    return
                req = Request(i, prompt, 0, output_tokens, None)
                rec = RequestRecord(i, 0.0, 0, output_tokens)
                await client.send(req, rec, t0, model)
                # the client's TPOT of the requests that ran wholly inside the measured window
                if rec.start_s is not None and rec.end_s is not None \
                        and warmup_s <= rec.start_s and rec.end_s <= warmup_s + seconds:
                    if rec.tpot is not None:
                        tpots.append(rec.tpot)
                    if rec.ttft is not None:
                        ttfts.append(rec.ttft)

        tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        await asyncio.sleep(warmup_s)
        before = await asyncio.to_thread(scrape_steps, url, api_key)
        t1 = time.perf_counter()
        await asyncio.sleep(seconds)
        after = await asyncio.to_thread(scrape_steps, url, api_key)
        elapsed = time.perf_counter() - t1
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return delta(after, before), {"tpot_s": tpots, "ttft_s": ttfts}, elapsed


def probe_live(url: str, model: str, tokenizer: Any, levels: tuple[int, ...] = LEVELS,
               prompt_lens: tuple[int, ...] = PROMPT_LENS, output_tokens: int = 64, warmup_s: float = 3.0,
               seconds: float = 8.0, api_key: str | None = None, decode_role: str = "decode",
               engine_prefill: dict[str, float] | None = None,
               say: Callable[[str], None] = print) -> dict[str, Any]:
    """Drive the cluster behind `url` (its OpenAI API) at each (prompt length, concurrency) and fit
    its decode (and, where it has prefill steps, prefill) step costs; see the module docstring."""
    from loadgen.cli import load_tokenizer
    from loadgen.client import EndpointConfig, fetch_model

    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    name = asyncio.run(fetch_model(EndpointConfig(url, api_key=api_key)))
    samples: list[dict[str, Any]] = []
    idle_ttft: dict[int, float] = {}  # prompt length -> client TTFT p50 with one stream (nothing queued)
    for p in prompt_lens:
        prompts = _PromptPool(p, output_tokens, tok, model)
        per_stream = 16  # requests one stream sends in a level (warm-up and window), until measured
        for b in levels:
            sent = prompts.taken
            prompts.top_up(int(1.5 * per_stream * b) + 16)  # made before the clock runs
            freeze_startup_heap()  # a full collection over the client's heap would stall its streams
            delta, client, elapsed = asyncio.run(
                _closed_loop(url, name, prompts, b, output_tokens, warmup_s, seconds, api_key))
            per_stream = max(per_stream, (prompts.taken - sent) / b)
            tpot, ttft = _median(client["tpot_s"]), _median(client["ttft_s"])
            if b == 1 and ttft is not None:
                idle_ttft[p] = ttft
            for (role, phase), d in sorted(delta.items()):
                if d["steps"] <= 0:
                    continue
                samples.append({"prompt": p, "concurrency": b, "role": role, "phase": phase,
                                "window_s": elapsed, **{f: d[f] for f in STEP_FIELDS},
                                "client_tpot_p50_s": tpot, "client_ttft_p50_s": ttft})
            dec = delta.get((decode_role, "decode"))
            if dec and dec["steps"]:
                say(f"prompt {p:5d} x {b:3d} streams: decode {dec['step_seconds'] / dec['steps'] * 1e3:6.2f} ms/step "
                    f"at batch {dec['step_seqs'] / dec['steps']:5.1f}; client TPOT p50 "
                    f"{(tpot or float('nan')) * 1e3:6.2f} ms")
    out: dict[str, Any] = {"url": url, **fit_live(samples, decode_role, engine_prefill)}
    if idle_ttft:  # the serving path's fixed share of TTFT, which the planner takes the modelled parts from
        out["idle_ttft_s"] = {str(p): t for p, t in sorted(idle_ttft.items())}
    out.update({
        "levels": list(levels), "prompt_lens": list(prompt_lens), "output_tokens": output_tokens,
        "warmup_s": warmup_s, "seconds": seconds,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "method": "closed-loop streams over the OpenAI API at each (prompt length, concurrency); per window "
                  "the difference of the workers' step counters from the router's /metrics = one sample "
                  "(mean step time, batch, context, tokens); fitted on relative error, coefficients >= 0",
        "samples": samples,
    })
    return out


def fit_live(samples: list[dict[str, Any]], decode_role: str = "decode",
             engine_prefill: dict[str, float] | None = None) -> dict[str, Any]:
    """The step-cost fits of `probe_live`'s samples (see the module docstring): "decode", and
    "prefill" where there are prefill samples and the engine's own prefill fit to scale."""
    decode = [s for s in samples if s["role"] == decode_role and s["phase"] == "decode"]
    out: dict[str, Any] = {"decode_role": decode_role, "decode": fit_decode(decode)}
    prefill_role = "prefill" if decode_role == "decode" else decode_role
    prefill = [s for s in samples if s["role"] == prefill_role and s["phase"] == "prefill"]
    if prefill and engine_prefill is not None:
        a, b, c = (engine_prefill[k] for k in "abc")
        rate = {(s["prompt"], s["concurrency"]): s["step_tokens"] / s["window_s"] for s in decode}
        # prompts of P tokens from scratch: sum n(p + n) over a step = its tokens x P
        engine = [a + (b + c * s["prompt"]) * s["step_tokens"] / s["steps"] for s in prefill]
        tps = [rate.get((s["prompt"], s["concurrency"]), 0.0) for s in prefill]
        out["prefill"] = fit_prefill(prefill, engine, tps, engine_prefill)
    return out


def fit_decode(decode: list[dict[str, Any]], shape: dict[str, float] | None = None) -> dict[str, Any]:
    """Windows of decode step counters -> mean step = a + b * mean sum(context) + c * mean batch.
    `shape` ({b, c}, another fit's): where the windows cannot tell batch from context (one trace:
    the same context per sequence in every window), their ratio is taken from it and only a and a
    factor k on both are fitted (recorded as `shape_from`)."""
    if len(decode) < 3:
        raise RuntimeError(f"too few decode samples ({len(decode)}): is the cluster serving?")
    y = [s["step_seconds"] / s["steps"] for s in decode]
    ctx = [s["step_context_tokens"] / s["steps"] for s in decode]
    batch = [s["step_seqs"] / s["steps"] for s in decode]
    if shape:
        (a, k), err = fit([[1.0, shape["b"] * x + shape["c"] * n] for x, n in zip(ctx, batch)], y)
        b, c, extra = k * shape["b"], k * shape["c"], {"shape_from": dict(shape)}
    else:
        (a, b, c), err = fit([[1.0, x, n] for x, n in zip(ctx, batch)], y)
        extra = {}
    return {"a": a, "b": b, "c": c, **extra, **err, "formula": "a + b * sum_context + c * batch"}


def fit_prefill(prefill: list[dict[str, Any]], engine: list[float], tps: list[float],
                engine_prefill: dict[str, float], shape: dict[str, float] | None = None) -> dict[str, Any]:
    """Windows of prefill step counters, with the engine fit's mean step (`engine`) and the decode
    tokens per second (`tps`) of each window -> mean step = (r + s x T) x E + o. A few prompt
    lengths cannot pin three coefficients: the engine's shape is kept, scaled, plus a fixed cost per
    step, the scale growing with the decode tokens streamed per second meanwhile (the serving path's
    CPU per token shares the prefill worker's core). `shape` ({scale, overhead_s}, another fit's):
    where the windows cannot tell a per-step cost from a per-token one (one trace: the same prompt
    mix in every window), that split is taken from it: k x (r E + o) x (1 + s x T), k and s fitted."""
    y = [s["step_seconds"] / s["steps"] for s in prefill]
    if shape:
        shaped = [shape["scale"] * e + shape["overhead_s"] for e in engine]
        (k, ks), err = fit([[x, x * t] for x, t in zip(shaped, tps)], y)
        k = max(k, 1e-9)
        scale, overhead, slope = k * shape["scale"], k * shape["overhead_s"], ks / k
        extra = {"shape_from": dict(shape)}
    else:
        (scale, r1, overhead), err = fit([[e, e * t, 1.0] for e, t in zip(engine, tps)], y)
        scale = max(scale, 1e-9)
        slope, extra = r1 / scale, {}
    a, b, c = (engine_prefill[k] for k in "abc")
    return {"a": scale * a + overhead, "b": scale * b, "c": scale * c, "scale": scale, "load_slope": slope,
            "overhead_s": overhead, **extra, **err,
            "formula": "(scale x the engine's prefill fit + overhead_s) x (1 + load_slope x decode tokens/s)"}


def add_live(coeffs: dict[str, Any], url: str, role: str = "decode", **kwargs: Any) -> dict[str, Any]:
    """Probe the cluster behind `url` (`probe_live`, its model the coefficients' model, prefill as a
    ratio to their engine fit) and store the result as coeffs["live"][role]; returns it."""
    live = probe_live(url, coeffs["model"], coeffs["model"], decode_role=role, engine_prefill=coeffs["prefill"],
                      **kwargs)
    coeffs.setdefault("live", {})[role] = live
    return live


class _PromptPool:
    """Distinct prompts of `prompt_len` tokens (no prefix-cache hits), as many as the streams ask
    for: topped up before each level from the last level's pace, and refilled on the spot if the
    streams outrun that (a fixed pool ran dry on a fast machine before a level's measured window)."""

    def __init__(self, prompt_len: int, output_tokens: int, tokenizer: Any, model: str) -> None:
        self.prompt_len, self.output_tokens, self.tokenizer, self.model = prompt_len, output_tokens, tokenizer, model
        self.pool: list[str] = []
        self.taken = 0
        self._chunks = itertools.count()

    def top_up(self, n: int) -> None:
        from loadgen.workload import WorkloadConfig, load_workload

        while len(self.pool) < n:
            seed = self.prompt_len * 100_003 + next(self._chunks)
            w = load_workload(WorkloadConfig("synthetic", max(64, n - len(self.pool)), seed=seed,
                                             synthetic_input=f"fixed:{self.prompt_len}",
                                             synthetic_output=f"fixed:{self.output_tokens}"), self.tokenizer, self.model)
            self.pool.extend(r.prompt for r in w.requests)

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        if not self.pool:
            self.top_up(64)
        self.taken += 1
        return self.pool.pop()


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None
