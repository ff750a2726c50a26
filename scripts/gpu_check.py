#!/usr/bin/env python
"""The product's GPU paths in one go: `bash scripts/gpu_check.sh` on a machine with NVIDIA GPUs
(about 3-5 minutes on one H200); `python scripts/gpu_check.py --device cpu --quick` runs the same
code on CPU (tests/integration/test_gpu_check.py does, so the script is known to work before a GPU
ever runs it).

Prints one line per check: name, verdict (PASS, FAIL, SKIP, INFO), seconds, detail; exit status 1
if any check fails. Tracebacks and the product's own logs go to stderr.

1. parity: greedy `pdcluster.LLM(path, device=..., dtype=...)` equals transformers' `generate()` on
   the same device token for token, in both offline modes: colocated (a small token budget, so
   prompts are chunked and steps mix prefill with decode) and disaggregated (prefill engine ->
   in-process KV transfer -> decode engine). Every shape of tests/checkpoints.py (Llama variants,
   Mistral, Qwen2, Qwen3) in float32, two of them in bfloat16, and builtin:tiny-llama.
2. tensor parallel 2: `LLM(..., tensor_parallel_size=2)` against transformers; one GPU per rank
   over NCCL (two GPUs or more, else skipped); on CPU the same over gloo.
3. cuda graphs: the engine has no CUDA graph path (it runs eager on CUDA); an INFO line says so.
4. throughput: the offline engine against transformers' batched `generate()` (INFO, no verdict).
5. cluster, KV auto: `pdcluster up -c FILE --detach` of one prefill and one decode worker of
   builtin:tiny-llama in float32 (num_gpus 0.5 each: one GPU shared; on CPU, num_cpus 1), greedy
   tokens through the gRPC client and the HTTP API equal transformers', the KV backend `auto`
   picked (from the router's /metrics; shm expected on one node without two GPUs), `pdcluster down`.
6. cluster, KV over a process group: the same with num_gpus 1 each on two GPUs, where `auto` must
   pick torch_distributed (NCCL); skipped on one GPU; on CPU the backend pinned to
   torch_distributed (gloo).

Every wait is bounded; `--budget-s` (default 540) stops the whole run, cluster included, with a
FAIL line naming the check in flight. `--only WORDS` runs only the checks whose names contain one
of the words, `--skip WORDS` leaves those out.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from gpu_check_cluster import CLEANUPS, ClusterSpec, cluster_check, differences  # noqa: E402

from engine.builtin_model import resolve_model_path  # noqa: E402
from pdcluster import LLM, SamplingParams  # noqa: E402
from tests.checkpoints import SHAPES, make_checkpoint  # noqa: E402
from tests.reference import hf_greedy  # noqa: E402

Result = tuple[str, str]  # (verdict, detail)
BF16_SHAPES = ("llama-gqa", "qwen2-bias")
# colocated: a token budget below the longest prompt, so it is chunked and steps mix prefill with decode
MODE_KWARGS: dict[str, dict[str, int]] = {"colocated": dict(max_num_batched_tokens=64, max_num_seqs=8),
                                          "disaggregated": {}}


@dataclass(frozen=True)
class Sizes:
    prompt_lens: tuple[int, ...]  # parity and cluster prompts
    max_tokens: int
    bench_requests: int  # throughput: requests of 16-256 prompt tokens, each generating bench_tokens
    bench_tokens: int


FULL = Sizes((7, 64, 300), 32, 64, 128)
QUICK = Sizes((5, 40, 90), 12, 8, 16)


@dataclass(frozen=True)
class Target:
    device: str  # "cuda" or "cpu"
    gpus: int  # CUDA devices (0 on CPU)
    sizes: Sizes
    work: Path  # where the checkpoints are written

    @property
    def kv_plane(self) -> str:
        return "NCCL" if self.device == "cuda" else "gloo"


def _free(t: Target) -> None:
    gc.collect()
    if t.device == "cuda":
        torch.cuda.empty_cache()


def _sync(t: Target) -> None:
    if t.device == "cuda":
        torch.cuda.synchronize()


def _prompts(path: str, lens: tuple[int, ...], seed: int = 1) -> list[list[int]]:
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lens]


def reference(t: Target, path: str, dtype: str, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens on the target device, one prompt at a time (no padding)."""
    ref = hf_greedy(path, dtype=getattr(torch, dtype), device=t.device)
    want = [ref(p, t.sizes.max_tokens) for p in prompts]
    del ref
    _free(t)
    return want


def parity(t: Target, path: str, dtype: str, modes: tuple[str, ...] = tuple(MODE_KWARGS),
           tp: int = 1) -> Result:
    prompts = _prompts(path, t.sizes.prompt_lens)
    want = reference(t, path, dtype, prompts)
    bad: list[str] = []
    for mode in modes:
        llm = LLM(path, device=t.device, dtype=dtype, mode=mode, max_model_len=512, num_blocks=128,
                  tensor_parallel_size=tp, **MODE_KWARGS[mode])
        try:
            outs = llm.generate(prompts, SamplingParams(max_tokens=t.sizes.max_tokens, temperature=0.0,
                                                        ignore_eos=True))
        finally:
            llm.close()
            del llm
            _free(t)
        bad += differences(prompts, [o.token_ids for o in outs], want, [mode] * len(prompts))
    detail = f"{' + '.join(modes)}, {len(prompts)} prompts x {t.sizes.max_tokens} tokens"
    return ("FAIL", f"{detail}: {'; '.join(bad)}") if bad else ("PASS", f"{detail} token-identical")


def checkpoint(t: Target, shape: str, dtype: str) -> str:
    out = t.work / f"{shape}-{dtype}"
    if not (out / "config.json").is_file():
        make_checkpoint(out, shape, dtype=getattr(torch, dtype))
    return str(out)


def cuda_graphs() -> Result:
    """Whether the engine captures CUDA graphs at all (a grep, so this line cannot go stale)."""
    uses = [p.name for p in (ROOT / "engine").rglob("*.py") if "CUDAGraph" in p.read_text() or
            "cuda.graph" in p.read_text()]
    if uses:
        return "INFO", f"engine/{', '.join(uses)} mention CUDA graphs, which no check here covers yet"
    return "INFO", "not built (engine runs eager on CUDA)"


def throughput(t: Target) -> Result:
    """Offline throughput on builtin:tiny-llama, ours vs transformers' generate() in batches of 16."""
    from transformers import AutoModelForCausalLM

    path, s = builtin(), t.sizes
    g = torch.Generator().manual_seed(2)
    lens = torch.randint(16, 256, (s.bench_requests,), generator=g).tolist()
    prompts = [torch.randint(4, 8192, (n,), generator=g).tolist() for n in lens]
    llm = LLM(path, device=t.device, dtype="float32", max_model_len=512,
              num_blocks=s.bench_requests * (256 + s.bench_tokens) // 16 + 64)
    try:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
        _sync(t)
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=s.bench_tokens, temperature=0.0, ignore_eos=True))
        _sync(t)
        ours = len(prompts) * s.bench_tokens / (time.perf_counter() - start)
    finally:
        llm.close()
        del llm
        _free(t)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(t.device).eval()
    start = time.perf_counter()
    for i in range(0, len(prompts), 16):
        batch = prompts[i:i + 16]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=t.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=t.device)
        hf.generate(ids, attention_mask=mask, max_new_tokens=s.bench_tokens, min_new_tokens=s.bench_tokens,
                    do_sample=False, eos_token_id=None, pad_token_id=0)
    _sync(t)
    theirs = len(prompts) * s.bench_tokens / (time.perf_counter() - start)
    return "INFO", (f"{s.bench_requests} requests x {s.bench_tokens} tokens: ours {ours:.0f} tok/s, "
                    f"transformers {theirs:.0f} tok/s, {ours / theirs:.2f}x")


def cluster(t: Target, backend: str, gpus_per_worker: float, expect: tuple[str, ...]) -> Result:
    path = builtin()
    prompts = _prompts(path, t.sizes.prompt_lens, seed=3)
    want = reference(t, path, "float32", prompts)
    spec = ClusterSpec(path, t.device, "float32", backend, gpus_per_worker)
    return cluster_check(spec, prompts, want, expect)


def builtin() -> str:
    return str(resolve_model_path("builtin:tiny-llama"))


def device_info(t: Target) -> Result:
    if t.device == "cuda":
        return "INFO", (f"{torch.cuda.get_device_name(0)} x{t.gpus}, torch {torch.__version__}, "
                        f"CUDA {torch.version.cuda}")
    return "INFO", f"cpu ({os.cpu_count()} cores), torch {torch.__version__}"


def checks(t: Target) -> list[tuple[str, Callable[[], Result]]]:
    """(name, check) in the order they run."""
    two = t.device == "cpu" or t.gpus >= 2  # the checks that need two GPUs run on CPU over gloo
    one_gpu: Callable[[], Result] = lambda: ("SKIP", "skipped: one GPU")  # noqa: E731
    out: list[tuple[str, Callable[[], Result]]] = [("device", lambda: device_info(t))]
    for shape, dtype in [(s, "float32") for s in sorted(SHAPES)] + [(s, "bfloat16") for s in BF16_SHAPES]:
        out.append((f"parity {shape} {dtype}", lambda s=shape, d=dtype: parity(t, checkpoint(t, s, d), d)))
    out += [
        ("parity builtin:tiny-llama float32", lambda: parity(t, builtin(), "float32")),
        (f"tensor parallel 2 over {t.kv_plane}",
         (lambda: parity(t, builtin(), "float32", ("colocated",), tp=2)) if two else one_gpu),
        ("cuda graphs", cuda_graphs),
        ("throughput vs transformers", lambda: throughput(t)),
    ]
    where = "0.5 GPU each" if t.device == "cuda" else "CPU"
    shared = ("shm",) if t.gpus < 2 else ("shm", "torch_distributed")  # Ray may place 0.5 + 0.5 on two GPUs
    out.append((f"cluster P+D on {where}, KV auto", lambda: cluster(t, "auto", 0.5, shared)))
    if t.device == "cuda":
        out.append(("cluster P and D on two GPUs, KV auto (NCCL)",
                    (lambda: cluster(t, "auto", 1, ("torch_distributed",))) if two else one_gpu))
    else:
        out.append(("cluster P+D on CPU, KV torch_distributed (gloo)",
                    lambda: cluster(t, "torch_distributed", 0, ("torch_distributed",))))
    return out


def line(name: str, verdict: str, seconds: float, detail: str) -> str:
    return f"{name:<48} {verdict:<4} {seconds:6.1f}s  {detail}"


class Run:
    """Runs checks one by one, prints each one's line, and stops everything when the budget is spent."""

    def __init__(self, budget_s: float) -> None:
        self.current, self.started = "budget", time.perf_counter()
        self.lock, self.expired = threading.Lock(), False
        self.timer = threading.Timer(budget_s, self._expire, args=(budget_s,))
        self.timer.daemon = True
        self.timer.start()

    def _expire(self, budget_s: float) -> None:
        with self.lock:  # the check in flight prints no line of its own after this one
            self.expired = True
            print(line(self.current, "FAIL", time.perf_counter() - self.started,
                       f"the run's budget of {budget_s:.0f}s is spent: stopped here"), flush=True)
        faulthandler.dump_traceback(file=sys.stderr)
        for cleanup in list(CLEANUPS):
            try:
                cleanup()
            except Exception:
                traceback.print_exc(file=sys.stderr)
        os._exit(1)

    def check(self, name: str, fn: Callable[[], Result]) -> str:
        self.current, self.started = name, time.perf_counter()
        try:
            verdict, detail = fn()
        except Exception as e:  # a check that raises fails; the traceback goes to stderr
            traceback.print_exc(file=sys.stderr)
            text = str(e).strip().splitlines()
            verdict, detail = "FAIL", f"{type(e).__name__}: {text[-1] if text else ''}"
        with self.lock:
            if not self.expired:
                print(line(name, verdict, time.perf_counter() - self.started, detail), flush=True)
                return verdict
        time.sleep(600)  # the watchdog is stopping what runs, then the process
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--quick", action="store_true", help="small sizes (shorter prompts, fewer tokens)")
    parser.add_argument("--only", nargs="+", metavar="WORD",
                        help="run only the checks whose names contain a WORD")
    parser.add_argument("--skip", nargs="+", metavar="WORD", default=[],
                        help="leave out the checks whose names contain a WORD")
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="stop everything after this many seconds")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(line("device", "FAIL", 0.0, "no CUDA device (use a machine with NVIDIA GPUs, or --device cpu)"))
        return 1
    target = Target(args.device, torch.cuda.device_count() if args.device == "cuda" else 0,
                    QUICK if args.quick else FULL, Path(tempfile.mkdtemp(prefix="gpu-check-")))
    run = Run(args.budget_s)
    chosen = [(name, fn) for name, fn in checks(target) if name == "device" or (
        (not args.only or any(w in name for w in args.only)) and not any(w in name for w in args.skip))]
    verdicts = [run.check(name, fn) for name, fn in chosen]
    run.timer.cancel()
    shutil.rmtree(target.work, ignore_errors=True)
    return 1 if "FAIL" in verdicts else 0


if __name__ == "__main__":
    sys.exit(main())
