"""The engine's CPU kernels against their rooflines and against torch's, measured in one run.

    python scripts/bench_kernels.py                       # llama-200m's shapes, the dtype `auto` gives
    python scripts/bench_kernels.py --dtype float32 --repeats 5

Measured first: the GEMM rate of the dtype (benchmarks/machine.py: the best of torch and oneDNN on
a prefill-sized matmul) and memory read bandwidth. Then, interleaved per repeat (medians printed):

  decode linears   every linear of the model's layers (distinct weights, so each is read from
                   memory, as in a decode step) at 1-64 rows: oneDNN on its prepacked weight
                   against the panel kernel (engine/csrc/linear_panels.c), each as a share of the
                   roofline max(weight bytes / bandwidth, flops / GEMM rate)
  prefill linears  one layer's linears at prefill sizes: a share of the GEMM rate
  prefill attention causal attention over a prompt: torch's scaled_dot_product_attention against
                   the native kernel (engine/csrc/prefill_attention.c)
  decode step      the engine's whole decode step (LLM, the model loaded as served) at `--batches`,
                   against its roofline: max((weights + KV) / bandwidth, flops / GEMM rate)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.decode_steps import DecodeSteps
from benchmarks.machine import gemm_tflops, git_commit, read_bandwidth_gbs, write_measurement
from engine import linear_panels
from engine.attention import prefill_attention
from engine.builtin_model import resolve_model_path
from engine.config import EngineConfig, ModelConfig
from engine.native import native_lib


def _best(fn: Callable[[], object], reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def layer_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of one layer's linears: q/k/v fused, o, gate/up fused, down."""
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    return [(qkv, cfg.hidden_size), (cfg.hidden_size, cfg.num_heads * cfg.head_dim),
            (2 * cfg.intermediate_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size)]


@dataclass
class Linears:
    """Linear weights in both layouts: oneDNN's and the panels."""

    shapes: list[tuple[int, int]]
    onednn: list[torch.Tensor]
    panels: list[torch.Tensor]
    lib: Any
    dtype: torch.dtype

    @classmethod
    def random(cls, shapes: list[tuple[int, int]], dtype: torch.dtype, lib: Any) -> Linears:
        weights = [torch.randn(n, k).to(dtype) for n, k in shapes]
        return cls(shapes, [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights],
                   [linear_panels.pack_panels(w) for w in weights], lib, dtype)

    def first(self, count: int) -> Linears:
        """The first `count` weights (one layer's), sharing these tensors."""
        return Linears(self.shapes[:count], self.onednn[:count], self.panels[:count], self.lib, self.dtype)

    @property
    def params(self) -> int:
        return sum(n * k for n, k in self.shapes)

    @property
    def bytes(self) -> int:
        return self.params * self.dtype.itemsize

    def inputs(self, rows: int) -> dict[int, torch.Tensor]:
        return {k: torch.randn(rows, k).to(self.dtype) for k in {k for _, k in self.shapes}}

    def run_onednn(self, xs: dict[int, torch.Tensor]) -> None:
        for w, (_, k) in zip(self.onednn, self.shapes):
            torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")

    def run_panels(self, xs: dict[int, torch.Tensor]) -> None:
        for w, (n, k) in zip(self.panels, self.shapes):
            linear_panels.linear(self.lib, xs[k], w, None, n)


def decode_step_roofline(params: int, itemsize: int, kv_bytes: float, batch: int, gemm: float, bw: float) -> float:
    """Seconds a decode step needs at least: its reads at the bandwidth or its flops at the GEMM rate."""
    return max((params * itemsize + kv_bytes) / (bw * 1e9), 2 * params * batch / (gemm * 1e12))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:llama-200m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rows", default="1,4,8,16,32,64", help="decode linears: rows per call")
    ap.add_argument("--prefill-rows", default="512,2048")
    ap.add_argument("--prompt-lens", default="271,1024", help="prefill attention: tokens")
    ap.add_argument("--batches", default="1,16", help="decode step: sequences")
    ap.add_argument("--context", type=int, default=256, help="decode step: prompt tokens per sequence")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    lib = native_lib()
    path = resolve_model_path(args.model)
    cfg = ModelConfig.from_pretrained(path)
    dtype = EngineConfig(model=str(path), dtype=args.dtype, device="cpu").torch_dtype(cfg)
    if not linear_panels.served(lib, dtype):
        print(f"the panel kernel does not serve {dtype} on this CPU (no AVX2/AVX-512, or no AVX-512 BF16)")
        return 1
    gemm, bw = gemm_tflops(dtype), read_bandwidth_gbs()
    print(f"model    {args.model}, {dtype}, {args.threads} threads, commit {git_commit()}")
    print(f"machine  GEMM {gemm:.3f} TFLOP/s, memory read {bw:.1f} GB/s", flush=True)
    rows = [int(r) for r in args.rows.split(",")]
    prefill_rows = [int(r) for r in args.prefill_rows.split(",")]
    lens = [int(n) for n in args.prompt_lens.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    lin = Linears.random(layer_shapes(cfg) * cfg.num_layers, dtype, lib)
    one = lin.first(len(layer_shapes(cfg)))

    from pdcluster import LLM, SamplingParams

    llm = LLM(str(path), dtype=str(dtype).removeprefix("torch."), max_model_len=args.context + args.steps + 8)
    engine = llm.engines[-1]
    steps = DecodeSteps(engine)
    weights = sum(b.numel() for n, b in engine.runner.model.named_buffers() if n.endswith("panels"))
    kv_per_token = sum(c[0, 0, 0].numel() * 2 * c.element_size() for c in engine.runner.kv_caches)

    t: dict[str, list[float]] = {}

    def add(key: str, seconds: float) -> None:
        t.setdefault(key, []).append(seconds)

    for r in range(args.repeats):
        for n in rows:
            xs = lin.inputs(n)
            fns = [("onednn", lin.run_onednn), ("panels", lin.run_panels)]
            for name, fn in fns if r % 2 == 0 else fns[::-1]:
                add(f"decode {n} {name}", _best(lambda: fn(xs), 2))
        for n in prefill_rows:
            xs = one.inputs(n)
            add(f"prefill {n} onednn", _best(lambda: one.run_onednn(xs), 2))
            add(f"prefill {n} panels", _best(lambda: one.run_panels(xs), 2))
        for n in lens:
            g = torch.Generator().manual_seed(n)
            q = torch.randn(n, cfg.num_heads, cfg.head_dim, generator=g).to(dtype)
            k, v = (torch.randn(n, cfg.num_kv_heads, cfg.head_dim, generator=g).to(dtype) for _ in range(2))
            qs, ks, vs = (x.transpose(0, 1)[None] for x in (q, k, v))
            add(f"attention {n} sdpa", _best(lambda: F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, enable_gqa=True), 3))
            add(f"attention {n} native", _best(lambda: prefill_attention(lib, q, k, v, 0, cfg.head_dim ** -0.5), 3))
        for b in batches:
            g = torch.Generator().manual_seed(100 * r + b)
            prompts = [torch.randint(4, cfg.vocab_size, (args.context,), generator=g).tolist() for _ in range(b)]
            steps.reset()
            llm.generate(prompts, SamplingParams(max_tokens=args.steps + 1, temperature=0.0, ignore_eos=True))
            add(f"step {b}", steps.mean_seconds)
            add(f"step {b} context", steps.totals["context"] / max(1, steps.totals["steps"]))
        print(f"[repeat {r + 1}/{args.repeats}] done", flush=True)

    med = {k: statistics.median(v) for k, v in t.items()}
    report: dict[str, list[dict]] = {"decode_linears": [], "prefill_linears": [], "attention": [], "decode_step": []}
    print(f"\ndecode linears: {len(lin.shapes)} weights, {lin.bytes / 1e6:.0f} MB, each read from memory")
    for n in rows:
        bound = max(lin.bytes / (bw * 1e9), 2 * lin.params * n / (gemm * 1e12))
        a, b = med[f"decode {n} onednn"], med[f"decode {n} panels"]
        report["decode_linears"].append({"rows": n, "onednn_s": a, "panels_s": b, "roofline_s": bound})
        print(f"  {n:4d} rows  oneDNN {a * 1e3:7.2f} ms ({bound / a:4.0%} of roofline)  panels {b * 1e3:7.2f} ms "
              f"({bound / b:4.0%})  {a / b:.2f}x")
    print("prefill linears: one layer's, share of the GEMM rate")
    for n in prefill_rows:
        flops = 2 * n * sum(a * b for a, b in one.shapes)
        a, b = med[f"prefill {n} onednn"], med[f"prefill {n} panels"]
        report["prefill_linears"].append({"rows": n, "onednn_s": a, "panels_s": b, "flops": flops})
        print(f"  {n:4d} rows  oneDNN {flops / a / 1e12 / gemm:4.0%}  panels {flops / b / 1e12 / gemm:4.0%}")
    print("prefill attention (causal, one prompt, every head)")
    for n in lens:
        flops = 4 * n * n / 2 * cfg.head_dim * cfg.num_heads
        a, b = med[f"attention {n} sdpa"], med[f"attention {n} native"]
        report["attention"].append({"tokens": n, "sdpa_s": a, "native_s": b, "flops": flops})
        print(f"  {n:4d} tokens  SDPA {a * 1e3:7.2f} ms ({flops / a / 1e9:4.0f} GFLOP/s)  native {b * 1e3:7.2f} ms "
              f"({flops / b / 1e9:4.0f} GFLOP/s)  {a / b:.2f}x")
    print(f"decode step (the engine, {weights * dtype.itemsize / 1e6:.0f} MB of linear weights)")
    for b in batches:
        s, ctx = med[f"step {b}"], med[f"step {b} context"]
        bound = decode_step_roofline(weights, dtype.itemsize, ctx * kv_per_token, b, gemm, bw)
        report["decode_step"].append({"batch": b, "step_s": s, "roofline_s": bound, "context": ctx})
        print(f"  batch {b:3d}  {s * 1e3:7.2f} ms, roofline {bound * 1e3:6.2f} ms: {bound / s:4.0%} of it (goal 60%)")
    write_measurement(args, dtype, gemm, bw, report=report, times=t)
    return 0
