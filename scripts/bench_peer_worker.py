#!/usr/bin/env python
"""One engine in its own process, driven by scripts/bench_vs_vllm.py over stdin/stdout.

    python scripts/bench_peer_worker.py --system ours --model DIR --dtype float32 --threads 2
    .venv-vllm/bin/python scripts/bench_peer_worker.py --system vllm --model DIR ...

The process loads the engine, warms it up (vLLM compiles here; ours too when compilation is on),
prints one JSON line `{"ready": true, "load_s": ...}`, then answers each request line
`{"prompts": [[ids...], ...], "max_tokens": [n, ...]}` with `{"wall_s": ..., "tokens": [[...], ...],
"stats": {...}}`: the wall clock around one `generate` call of greedy, `ignore_eos` requests.
`{"quit": true}` ends it. Everything else the engines print goes to stderr.

The `vllm` system needs only vLLM in its environment (no project import); `ours` needs only the
project. Prefix caching stays on in both: the driver sends fresh prompt ids per repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

WARM_UP = ([[5 + i for i in range(16)], [40 + i for i in range(24)]], [4, 4])


class Ours:
    def __init__(self, args: argparse.Namespace) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        import torch

        torch.set_num_threads(args.threads)
        from pdcluster import LLM, SamplingParams

        self.SamplingParams = SamplingParams
        self.llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, mode=args.mode)
        from benchmarks.decode_steps import DecodeSteps

        self.decode = DecodeSteps(self.llm.engines[-1])  # the colocated engine, or the decode one

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> tuple[list[list[int]], dict]:
        self.decode.reset()
        params = [self.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
        outs = self.llm.generate(prompts, params)
        runner = self.llm.engines[0].runner
        return [o.token_ids for o in outs], {"decode": dict(self.decode.totals), "dtype": str(runner.dtype)}


class VLLM:
    def __init__(self, args: argparse.Namespace) -> None:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if args.threads == 1 else f"0-{args.threads - 1}")
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        self.SamplingParams, self.TokensPrompt = SamplingParams, TokensPrompt
        self.llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                       gpu_memory_utilization=args.vllm_memory_utilization,
                       enforce_eager=args.no_compile, seed=0)

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> tuple[list[list[int]], dict]:
        params = [self.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
        outs = self.llm.generate([self.TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system", choices=["ours", "vllm"], required=True)
    ap.add_argument("--model", required=True, help="a checkpoint directory")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--mode", default="colocated", help="ours: LLM mode, colocated or disaggregated")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--no-compile", action="store_true", help="vLLM: enforce_eager (ours has no compiled path)")
    ap.add_argument("--vllm-memory-utilization", type=float, default=0.3,
                    help="vLLM on CPU: the share of host memory for its KV cache")
    args = ap.parse_args()

    # Replies go out on a copy of fd 1; fd 1 itself becomes stderr, so that nothing the engines or
    # their child processes print mixes with the replies.
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    t = time.perf_counter()
    engine = Ours(args) if args.system == "ours" else VLLM(args)
    engine.generate(*WARM_UP)
    print(json.dumps({"ready": True, "load_s": time.perf_counter() - t}), file=reply, flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("quit"):
            break
        t = time.perf_counter()
        tokens, stats = engine.generate(msg["prompts"], msg["max_tokens"])
        wall = time.perf_counter() - t
        print(json.dumps({"wall_s": wall, "tokens": tokens, "stats": stats}), file=reply, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
