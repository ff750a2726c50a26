"""What structured output costs: output throughput constrained by a JSON schema against unconstrained,
same engine, same batch, same number of output tokens.

    python -m benchmarks.structured_output [--model builtin:tiny-llama] [--batch 1,8,32] [--repeats 3]

Per repeat: fresh prompts; one constrained run (a JSON array of exactly `--items` small integers)
gives each request's output length; then the constrained run and an unconstrained one whose
requests stop at those same lengths (max_tokens, ignore_eos) are timed, in alternating order, on the
same prompts (prefix caching off). The two differ only by the masks (filled per sequence and step,
applied to the logits before sampling). Sampling at temperature 1 with per-request seeds, one
`LLM.generate` per run; prints the medians of `--repeats` and the ratio (constrained /
unconstrained throughput), and the share of the constrained run's time spent in the masks (timed
around GuidedDecoder.mask: what constraining costs, without the run-to-run noise of two runs).
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
    llm = LLM(args.model, max_model_len=1024, enable_prefix_caching=False)  # the same prompts twice
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
              "minItems": args.items, "maxItems": args.items}
    guided = GuidedDecoding("json", json.dumps(schema))
    rng = random.Random(0)

    from engine.guided import GuidedDecoder

    in_mask = [0.0]  # seconds spent computing and applying masks (GuidedDecoder.mask), timed around it
    mask = GuidedDecoder.mask

    def timed_mask(self: GuidedDecoder, *a: object) -> torch.Tensor:
        t = time.perf_counter()
        try:
            return mask(self, *a)
        finally:
            in_mask[0] += time.perf_counter() - t

    GuidedDecoder.mask = timed_mask  # type: ignore[method-assign]

    def run(prompts: list[list[int]], lengths: list[int] | None) -> tuple[float, list[int]]:
        """One generate call: constrained (lengths None) or unconstrained to those lengths."""
        if lengths is None:
            params = [SamplingParams(max_tokens=512, temperature=1.0, seed=i, guided=guided) for i in range(len(prompts))]
        else:
            params = [SamplingParams(max_tokens=n, temperature=1.0, seed=i, ignore_eos=True) for i, n in enumerate(lengths)]
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t, [len(o.token_ids) for o in outs]

    run([[1, 5, 6, 7]] * 4, None)  # warm-up: the tokenizer, the grammar, the kernels
    print(f"model {args.model}, {args.threads} thread(s), schema: array of {args.items} integers in [0, 99]")
    print("| batch | tokens / request | unconstrained tok/s | constrained tok/s | constrained / unconstrained | "
          "masks' share of the constrained run |")
    print("|---|---|---|---|---|---|")
    for n in (int(x) for x in args.batch.split(",")):
        ratios, free_tps, guided_tps, shares = [], [], [], []
        for r in range(args.repeats):
            prompts = [[1] + [rng.randrange(4, 8000) for _ in range(32)] for _ in range(n)]
            _, lengths = run(prompts, None)  # each request's constrained length, which its unconstrained run matches
            res = {}
            for c in ((True, False) if r % 2 else (False, True)):
                in_mask[0] = 0.0
                res[c] = run(prompts, None if c else lengths)
                if c:
                    shares.append(in_mask[0] / res[c][0])
            guided_tps.append(sum(res[True][1]) / res[True][0])
            free_tps.append(sum(res[False][1]) / res[False][0])
            ratios.append(guided_tps[-1] / free_tps[-1])
        print(f"| {n} | {sum(lengths) / n:.0f} | {statistics.median(free_tps):.0f} | {statistics.median(guided_tps):.0f} | "
              f"{statistics.median(ratios):.2f} (repeats {', '.join(f'{x:.2f}' for x in ratios)}) | "
              f"{100 * statistics.median(shares):.1f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
