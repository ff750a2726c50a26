"""Quantized KV pages against the model's dtype: how many tokens a budget holds, and the native decode
attention's time and bytes at a long context (engine/csrc/paged_decode_attention.c reads the pages
in place), each format timed in turn, repeats interleaved, medians reported; the machine's read
bandwidth measured in the same run.

    python scripts/bench_kv_pages.py [--context 4096] [--batch 8] [--kv-heads 8] [--head-dim 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.machine import busy_cores, git_commit, read_bandwidth_gbs
from engine.attention import NativeDecode, _native_decode
from engine.kv_quant import KVQuant
from engine.kv_spec import KVSpec
from engine.native import native_lib

FORMATS = ["auto", "int8", "fp8_e4m3", "fp8_e5m2"]


def capacity(spec: KVSpec, dtype: torch.dtype, budget_bytes: int, block_size: int = 16) -> dict[str, int]:
    """Tokens a budget holds per format (whole blocks, as the engine sizes its cache)."""
    out = {}
    for name in FORMATS:
        s = KVSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim, cache_dtype=name)
        out[name] = budget_bytes // (s.bytes_per_token(dtype) * block_size) * block_size
    return out


def _layer(name: str, dtype: torch.dtype, blocks: int, bs: int, kvh: int, hd: int) -> torch.Tensor:
    """One layer's cache of random rows in a format."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(2, blocks, bs, kvh, hd, generator=g)
    return rows.to(dtype) if name == "auto" else KVQuant(name).quantize(rows)


def decode_attention(dtype: torch.dtype, context: int, batch: int, kvh: int, hd: int, group: int, threads: int,
                     repeats: int) -> dict[str, dict[str, float]]:
    """Per format: the median time of one layer's decode attention over `batch` sequences of
    `context` tokens, and the bytes of keys and values it reads."""
    lib = native_lib()
    if lib is None:
        raise SystemExit("the native kernels did not build (no C compiler): nothing to time")
    bs = 16
    per_seq = context // bs
    blocks = batch * per_seq
    tables = torch.arange(blocks, dtype=torch.int64).view(batch, per_seq)
    nd = NativeDecode(lib, tables, torch.full((batch,), context, dtype=torch.int64), threads)
    q = torch.randn(batch, kvh * group, hd).to(dtype)
    caches = {name: _layer(name, dtype, blocks, bs, kvh, hd) for name in FORMATS}
    times: dict[str, list[float]] = {name: [] for name in FORMATS}
    for name in FORMATS:  # warm-up
        _native_decode(q, caches[name], nd, hd ** -0.5, None if name == "auto" else KVQuant(name))
    for _ in range(repeats):
        for name in FORMATS:
            quant = None if name == "auto" else KVQuant(name)
            t = time.perf_counter()
            for _ in range(5):
                _native_decode(q, caches[name], nd, hd ** -0.5, quant)
            times[name].append((time.perf_counter() - t) / 5)
    out = {}
    for name in FORMATS:
        nbytes = caches[name].numel() * caches[name].element_size()
        med = statistics.median(times[name])
        out[name] = {"ms": med * 1e3, "bytes": nbytes, "gbs": nbytes / med / 1e9}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=4096, help="tokens per sequence")
    ap.add_argument("--batch", type=int, default=8, help="sequences")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--group", type=int, default=2, help="query heads per KV head")
    ap.add_argument("--layers", type=int, default=16, help="for the capacity table")
    ap.add_argument("--budget-mb", type=int, default=512, help="for the capacity table")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(f"commit {git_commit()}, {a.threads} threads, cores busy before start: {busy_cores():.2f}")
    print(f"machine memory read {read_bandwidth_gbs():.1f} GB/s")
    spec = KVSpec(a.layers, a.kv_heads, a.head_dim)
    for dtype in (torch.float32, torch.bfloat16):
        dt = str(dtype).removeprefix("torch.")
        cap = capacity(spec, dtype, a.budget_mb << 20)
        print(f"\n{dt} model, {a.layers} layers x {a.kv_heads} KV heads x {a.head_dim}: tokens in {a.budget_mb} MiB")
        for name in FORMATS:
            print(f"  {name:9s} {cap[name]:9d}  ({cap[name] / cap['auto']:.2f}x)")
        res = decode_attention(dtype, a.context, a.batch, a.kv_heads, a.head_dim, a.group, a.threads, a.repeats)
        print(f"  decode attention, one layer, {a.batch} sequences x {a.context} tokens (median of {a.repeats}):")
        for name in FORMATS:
            r = res[name]
            print(f"  {name:9s} {r['ms']:8.2f} ms  {r['bytes'] / 1e6:7.1f} MB read  {r['gbs']:5.1f} GB/s  "
                  f"time {r['ms'] / res['auto']['ms']:.2f}x, bytes {r['bytes'] / res['auto']['bytes']:.2f}x")
    return 0
