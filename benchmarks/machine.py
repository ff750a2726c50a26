"""What the machine can do and how busy it is, measured next to the offline benchmarks: other
processes' load, the GEMM rate of a dtype, memory read bandwidth; and the commit measured."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def busy_cores(sample_s: float = 1.0) -> float | None:
    """Cores kept busy by other processes, sampled from /proc/stat while this one sleeps (Linux only)."""

    def read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
        return sum(v[:8]) - idle, sum(v[:8])

    try:
        b0, t0 = read()
        time.sleep(sample_s)
        b1, t1 = read()
    except (OSError, ValueError, IndexError):
        return None
    return (b1 - b0) / max(1, t1 - t0) * (os.cpu_count() or 1)


def git_commit() -> str | None:
    """The repository's short commit, with -dirty when tracked files changed."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def gemm_tflops(dtype: torch.dtype, m: int = 1024, k: int = 1024, n: int = 2816, reps: int = 8) -> float:
    """The best of torch's matmul and oneDNN's on a prepacked weight, for a prefill-sized GEMM."""
    from engine.packed_linear import can_pack

    a, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    fns = [lambda: torch.nn.functional.linear(a, w)]
    if can_pack(a.device, dtype):
        packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
        fns.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
    best = float("inf")
    for fn in fns:
        fn()
        best = min([best, *(_timed(fn) for _ in range(reps))])
    return 2 * m * k * n / best / 1e12


def read_bandwidth_gbs(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Memory read bandwidth (GB/s): the best of `reps` sums over `nbytes` of float32."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    x.sum()
    best = min(_timed(x.sum) for _ in range(reps))
    return nbytes / best / 1e9


def write_measurement(args: argparse.Namespace, dtype: torch.dtype, gemm: float, bw: float, **results: object) -> None:
    """A benchmark's JSON (to `args.out`, when set): its arguments, the dtype, the machine's GEMM rate
    and bandwidth measured in the run, the commit, then `results`."""
    if args.out is None:
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"argv": vars(args) | {"out": str(args.out)}, "dtype": str(dtype),
                                    "gemm_tflops": gemm, "read_gbs": bw, "commit": git_commit(), **results}, indent=1))
    print(f"wrote {args.out}")


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t
