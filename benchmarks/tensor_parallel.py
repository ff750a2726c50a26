"""Step time of a tensor-parallel engine against one rank, on this machine.

    python -m benchmarks.tensor_parallel                  # builtin:llama-200m, TP 1 (2 threads) vs TP 2 (1 each)
    python -m benchmarks.tensor_parallel --model builtin:tiny-llama --repeats 3 --out bench_results/tp.json
    python -m benchmarks.tensor_parallel --model builtin:moe-400m --layouts tp1,tp2,ep2   # experts split vs placed

Both engines load once; per repeat, in alternating order, each runs (1) one prefill step of a
`--prompt-tokens` prompt and (2) `--decode-steps` decode steps of `--batch` sequences whose context
is `--prompt-tokens` (the median step). TP 2 on two CPU processes pays an all-reduce per layer twice
over gloo and the per-step message to the other rank: on CPUs this shows the cost of the machinery,
not a speed-up (the point here is correctness; on GPUs with NCCL the same split is how a model
larger than one device is served). `ep2`: two ranks with expert parallelism (each holds half the
routed experts whole; attention split as in TP 2). Medians over repeats; ratios to the first layout
(> 1: slower).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

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


LAYOUTS = {"tp1": {}, "tp2": {"tensor_parallel_size": 2}, "ep2": {"tensor_parallel_size": 2, "expert_parallel": True}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:llama-200m")
    ap.add_argument("--layouts", default="tp1,tp2", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads in all (2 ranks: half each)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    layouts = args.layouts.split(",")
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        ap.error(f"--layouts: unknown {unknown}; known: {', '.join(LAYOUTS)}")
    common = dict(dtype=args.dtype, max_model_len=args.prompt_tokens + args.decode_steps + 8,
                  enable_prefix_caching=False, max_num_batched_tokens=max(2048, args.prompt_tokens),
                  max_num_seqs=max(args.batch, 1))
    threads = {name: max(1, args.threads // LAYOUTS[name].get("tensor_parallel_size", 1)) for name in layouts}
    llms = {name: LLM(args.model, num_threads=threads[name], **LAYOUTS[name], **common) for name in layouts}
    rows: dict[str, dict[str, list[float]]] = {name: {"prefill_ms": [], "decode_step_ms": []} for name in llms}
    try:
        for name, llm in llms.items():  # warm-up
            torch.set_num_threads(threads[name])
            _prefill_ms(llm, args.prompt_tokens, 999)
            _decode_ms(llm, 2, 16, 2, 999)
        for r in range(args.repeats):
            for name in (layouts if r % 2 == 0 else layouts[::-1]):
                # rank 0 runs in this process, whose thread count the engine loaded last has set
                torch.set_num_threads(threads[name])
                rows[name]["prefill_ms"].append(_prefill_ms(llms[name], args.prompt_tokens, r))
                rows[name]["decode_step_ms"].append(_decode_ms(llms[name], args.batch, args.prompt_tokens,
                                                               args.decode_steps, r))
    finally:
        for llm in llms.values():
            llm.close()
    med = {name: {k: statistics.median(v) for k, v in m.items()} for name, m in rows.items()}
    print(f"{args.model} ({args.dtype}): prefill of {args.prompt_tokens} tokens; decode steps of {args.batch} "
          f"sequences at context {args.prompt_tokens}; {args.threads} threads in all; medians of {args.repeats}")
    base = layouts[0]
    print(f"{'':<16}" + "".join(f"{name.upper():>10}" for name in layouts)
          + "".join(f"{name.upper() + '/' + base.upper():>12}" for name in layouts[1:]))
    for key in ("prefill_ms", "decode_step_ms"):
        print(f"{key:<16}" + "".join(f"{med[name][key]:>10.1f}" for name in layouts)
              + "".join(f"{med[name][key] / med[base][key]:>12.2f}" for name in layouts[1:]))
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
