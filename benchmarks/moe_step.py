"""A mixture-of-experts decode step against the step of a dense model of its active size.

    python scripts/bench_moe_step.py                      # moe-400m vs moe-400m-dense, batch 1 and 16
    python scripts/bench_moe_step.py --batches 1,4,16 --repeats 5

Both models load in this process with the same engine settings. Per repeat and batch, each
generates from the same `--batch` random prompts of `--prompt-len` tokens, greedy, `--steps` tokens
each; every pure decode step is timed (the engine's own step, as bench_vs_vllm times it) and the
mean is the repeat's figure. The order alternates per repeat. Printed per batch: the medians, the
ratio MoE / dense (the goal: at most 1.3), and the weight bytes each step must read: the dense
model reads all its weights; the MoE reads its attention, routers and the experts its tokens chose,
in expectation E (1 - (1 - k/E)^batch) experts per layer (k of E each token, picked independently).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from benchmarks.decode_steps import DecodeSteps
from benchmarks.machine import gemm_tflops, git_commit, read_bandwidth_gbs, write_measurement
from engine.builtin_model import resolve_model_path
from planner.models import ModelShape, from_checkpoint


def step_bytes(shape: ModelShape, itemsize: int, batch: int) -> float:
    """Weights one decode step of `batch` sequences reads (the embedding table excepted)."""
    e = shape.experts
    total = shape.params - shape.embedding_params
    if e is None:
        return total * itemsize
    chosen = e.num * (1 - (1 - e.per_token / e.num) ** batch)
    unread = shape.moe_layers * (e.num - chosen) * e.expert_params(shape.hidden_size)
    return (total - unread) * itemsize


class Timed:
    """One model's LLM with its pure decode steps timed."""

    def __init__(self, model: str, dtype: str, threads: int) -> None:
        from pdcluster import LLM

        torch.set_num_threads(threads)
        self.path = resolve_model_path(model)
        self.llm = LLM(model, dtype=dtype, max_model_len=1024)
        self.dtype = self.llm.engines[-1].runner.dtype
        self.decode = DecodeSteps(self.llm.engines[-1])

    def mean_step(self, prompts: list[list[int]], steps: int) -> float:
        from pdcluster import SamplingParams

        self.decode.reset()
        params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
        self.llm.generate(prompts, [params] * len(prompts))
        return self.decode.mean_seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moe", default="builtin:moe-400m")
    ap.add_argument("--dense", default="builtin:moe-400m-dense")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    batches = [int(b) for b in args.batches.split(",")]
    systems = {"moe": Timed(args.moe, args.dtype, args.threads), "dense": Timed(args.dense, args.dtype, args.threads)}
    dtype = systems["moe"].dtype
    shapes = {k: from_checkpoint(s.path) for k, s in systems.items()}
    gemm, bw = gemm_tflops(dtype), read_bandwidth_gbs()
    print(f"models   {args.moe} ({shapes['moe'].active_params:,} active of {shapes['moe'].params:,}) vs "
          f"{args.dense} ({shapes['dense'].params:,}); {dtype}, {args.threads} threads, commit {git_commit()}")
    print(f"machine  GEMM {gemm:.3f} TFLOP/s, memory read {bw:.1f} GB/s", flush=True)
    vocab = min(s.vocab_size for s in shapes.values())
    warm = [list(range(5, 5 + args.prompt_len))]
    for s in systems.values():
        s.mean_step(warm, 2)
    times: dict[int, dict[str, list[float]]] = {b: {"moe": [], "dense": []} for b in batches}
    for r in range(args.repeats):
        order = ("moe", "dense") if r % 2 == 0 else ("dense", "moe")
        for b in batches:
            g = torch.Generator().manual_seed(100 * r + b)
            prompts = [torch.randint(4, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(b)]
            for name in order:
                times[b][name].append(systems[name].mean_step(prompts, args.steps))
            print(f"[repeat {r + 1}/{args.repeats}] batch {b:3d}  moe {times[b]['moe'][-1] * 1e3:7.2f} ms  "
                  f"dense {times[b]['dense'][-1] * 1e3:7.2f} ms", flush=True)
    rows = []
    for b in batches:
        moe, dense = statistics.median(times[b]["moe"]), statistics.median(times[b]["dense"])
        mb, db = (step_bytes(shapes[k], dtype.itemsize, b) for k in ("moe", "dense"))
        rows.append({"batch": b, "moe_ms": moe * 1e3, "dense_ms": dense * 1e3, "ratio": moe / dense,
                     "moe_weight_bytes": mb, "dense_weight_bytes": db})
        print(f"batch {b:3d}  MoE step {moe * 1e3:7.2f} ms  dense {dense * 1e3:7.2f} ms  MoE/dense {moe / dense:.2f}x "
              f"(goal <= 1.3); weights read {mb / 1e6:.0f} MB vs {db / 1e6:.0f} MB ({mb / db:.2f}x): "
              f"MoE {mb / moe / 1e9:.1f} GB/s, dense {db / dense / 1e9:.1f} GB/s")
    write_measurement(args, dtype, gemm, bw, rows=rows, times=times)
    return 0
