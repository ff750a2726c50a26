"""What structured output costs: output throughput constrained by a JSON schema against unconstrained,
same engine, same batch, same number of output tokens.

    python -m benchmarks.structured_output [--model builtin:tiny-llama] [--batch 1,8,32] [--repeats 3]

Each request's schema (an array of exactly `--items` small integers) fixes its output length, so
the constrained run generates the same count of tokens as the unconstrained one (max_tokens set to
that count, ignore_eos): the two differ only by the masks (filled per sequence and step, applied to
the logits before sampling). Sampling at temperature 1 with per-request seeds, one `LLM.generate`
per run, fresh prompts each time (no prefix-cache hits), the two runs alternating; prints the
medians of `--repeats` and the ratio (constrained / unconstrained throughput).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:tiny-llama")
    p.add_argument("--batch", default="1,8,32", help="requests per generate call (a sweep)")
    p.add_argument("--items", type=int, default=24, help="integers in each output array")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    from engine.sampling_params import GuidedDecoding, SamplingParams
    from pdcluster import LLM

    torch.set_num_threads(args.threads)
    llm = LLM(args.model, max_model_len=1024)  # torch threads: set above
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
              "minItems": args.items, "maxItems": args.items}
    guided = GuidedDecoding("json", json.dumps(schema))
    rng = random.Random(0)
    vocab = 8000

    def prompts(n: int) -> list[list[int]]:
        return [[1] + [rng.randrange(4, vocab) for _ in range(32)] for _ in range(n)]

    def run(n: int, constrained: bool, out_len: int | None) -> tuple[float, int]:
        if constrained:
            params = [SamplingParams(max_tokens=512, temperature=1.0, seed=i, guided=guided) for i in range(n)]
        else:
            params = [SamplingParams(max_tokens=out_len, temperature=1.0, seed=i, ignore_eos=True) for i in range(n)]
        t = time.perf_counter()
        outs = llm.generate(prompts(n), params, use_tqdm=False)
        dt = time.perf_counter() - t
        return dt, sum(len(o.token_ids) for o in outs)

    run(4, True, None)  # warm-up: the tokenizer, the grammar, the kernels
    print(f"model {args.model}, {args.threads} thread(s), schema: array of {args.items} integers in [0, 99]")
    print("| batch | tokens / request | unconstrained tok/s | constrained tok/s | constrained / unconstrained |")
    print("|---|---|---|---|---|")
    for n in (int(x) for x in args.batch.split(",")):
        _, toks = run(n, True, None)  # the constrained output length, which the unconstrained runs match
        out_len = max(1, round(toks / n))
        ratios, free_tps, guided_tps = [], [], []
        for r in range(args.repeats):
            res = {c: run(n, c, out_len) for c in ((True, False) if r % 2 else (False, True))}
            guided_tps.append(res[True][1] / res[True][0])
            free_tps.append(res[False][1] / res[False][0])
            ratios.append(guided_tps[-1] / free_tps[-1])
        print(f"| {n} | {out_len} | {statistics.median(free_tps):.0f} | {statistics.median(guided_tps):.0f} | "
              f"{statistics.median(ratios):.2f} (repeats {', '.join(f'{x:.2f}' for x in ratios)}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
