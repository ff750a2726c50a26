"""Step time of a tensor-parallel engine against one rank, on this machine.

    python -m benchmarks.tensor_parallel                  # builtin:llama-200m, TP 1 (2 threads) vs TP 2 (1 each)
    python -m benchmarks.tensor_parallel --model builtin:tiny-llama --repeats 3 --out bench_results/tp.json

Both engines load once; per repeat, in alternating order, each runs (1) one prefill step of a
`--prompt-tokens` prompt and (2) `--decode-steps` decode steps of `--batch` sequences whose context
is `--prompt-tokens` (the median step). TP 2 on two CPU processes pays an all-reduce per layer twice
over gloo and the per-step message to the other rank: on CPUs this shows the cost of the machinery,
not a speed-up (the point here is correctness; on GPUs with NCCL the same split is how a model
larger than one device is served). Medians over repeats; ratios TP2 / TP1 (> 1: TP 2 slower).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from engine.sampling_params import SamplingParams
from pdcluster.llm import LLM


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + 31 * j) % 8000 + 10 for j in range(n)]


def _prefill_ms(llm: LLM, tokens: int, seed: int) -> float:
    engine = llm.engine
    engine.add_request(f"p{seed}", _prompt(tokens, seed), SamplingParams(max_tokens=1, temperature=0.0))
    t0 = time.perf_counter()
    engine.step()
    ms = (time.perf_counter() - t0) * 1e3
    while engine.has_work():
        engine.step()
    return ms


def _decode_ms(llm: LLM, batch: int, context: int, steps: int, seed: int) -> float:
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{seed}-{i}", _prompt(context, seed * 100 + i), params)
    started: set[str] = set()
    while len(started) < batch:  # every prompt computed (each has its first token)
        started.update(seq.request_id for seq in engine.step())
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
    while engine.has_work():
        engine.step()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:llama-200m")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads in all (TP 2: half each)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    common = dict(dtype="float32", max_model_len=args.prompt_tokens + args.decode_steps + 8, enable_prefix_caching=False,
                  max_num_batched_tokens=max(2048, args.prompt_tokens), max_num_seqs=max(args.batch, 1))
    llms = {1: LLM(args.model, num_threads=args.threads, **common),
            2: LLM(args.model, tensor_parallel_size=2, num_threads=max(1, args.threads // 2), **common)}
    rows: dict[int, dict[str, list[float]]] = {tp: {"prefill_ms": [], "decode_step_ms": []} for tp in llms}
    try:
        for tp, llm in llms.items():  # warm-up
            _prefill_ms(llm, args.prompt_tokens, 999)
            _decode_ms(llm, 2, 16, 2, 999)
        for r in range(args.repeats):
            for tp in ([1, 2] if r % 2 == 0 else [2, 1]):
                rows[tp]["prefill_ms"].append(_prefill_ms(llms[tp], args.prompt_tokens, r))
                rows[tp]["decode_step_ms"].append(_decode_ms(llms[tp], args.batch, args.prompt_tokens,
                                                             args.decode_steps, r))
    finally:
        for llm in llms.values():
            llm.close()
    med = {tp: {k: statistics.median(v) for k, v in m.items()} for tp, m in rows.items()}
    print(f"{args.model}: prefill of {args.prompt_tokens} tokens; decode steps of {args.batch} sequences at "
          f"context {args.prompt_tokens}; {args.threads} threads in all; medians of {args.repeats}")
    print(f"{'':<16}{'TP 1':>8}{'TP 2':>12}{'TP2/TP1':>10}")
    for key in ("prefill_ms", "decode_step_ms"):
        print(f"{key:<16}{med[1][key]:>8.1f}{med[2][key]:>12.1f}{med[2][key] / med[1][key]:>10.2f}")
    write_runs(args, rows, med)
    return 0


def write_runs(args: argparse.Namespace, rows: dict, medians: dict) -> None:
    """With `--out`: the arguments, every repeat and the medians, as JSON."""
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": rows,
                                        "medians": medians}, indent=2))


if __name__ == "__main__":
    raise SystemExit(main())
