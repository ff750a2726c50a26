#!/usr/bin/env python
"""Bytes saved and logit drift of int8 in-transit KV compression, on the built-in model.

Runs the same greedy requests through the offline disaggregated path twice -- KV handed from the
prefill to the decode engine exactly, and quantized to int8 with per-block scales -- and reports
the bytes per token on the wire, how many leading tokens are identical, and how far the
log-probabilities of the chosen tokens moved (the first token is sampled on the prefill side and
never affected).

    python scripts/bench_kv_compression.py [--prompts 16] [--max-tokens 32] [--seed 0]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from pdcluster import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(16, 1024, (args.prompts,), generator=g).tolist()
    prompts = [torch.randint(4, 8192, (n,), generator=g).tolist() for n in lengths]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, logprobs=1)
    exact_llm = LLM(num_blocks=1024, max_model_len=2048, mode="disaggregated")
    exact = exact_llm.generate(prompts, params)
    int8 = LLM(num_blocks=1024, max_model_len=2048, kv_compression="int8", mode="disaggregated").generate(prompts, params)
    mc = exact_llm.model_config
    f32 = mc.kv_bytes_per_token(torch.float32)
    q8 = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim + 2 * mc.num_layers * 4 / 16  # + scales per block
    same, drift, agree = [], [], 0
    for a, b in zip(exact, int8):
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        same.append(n)
        drift += [abs(x.logprob - y.logprob) for x, y in zip(a.logprobs[1:n], b.logprobs[1:n])]
        agree += a.token_ids == b.token_ids
    print(f"built-in model: {mc.num_layers} layers x {mc.num_kv_heads} KV heads x head_dim {mc.head_dim}")
    print(f"KV bytes per token on the wire: float32 {f32}, int8 {q8:.0f} ({f32 / q8:.2f}x fewer)")
    print(f"{args.prompts} prompts of {min(lengths)}-{max(lengths)} tokens, {args.max_tokens} greedy tokens each")
    print(f"requests with identical output: {agree}/{len(exact)}; identical leading tokens: "
          f"min {min(same)}, median {statistics.median(same)}")
    print(f"|logprob drift| of the chosen token while outputs agree: median {statistics.median(drift):.4f}, "
          f"max {max(drift):.4f} (over {len(drift)} tokens)")


if __name__ == "__main__":
    main()
