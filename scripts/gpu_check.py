#!/usr/bin/env python
"""GPU paths in one go, for a machine with an NVIDIA GPU (run: bash scripts/gpu_check.sh).

1. CUDA engine parity: greedy `LLM(device="cuda")` equals transformers `generate()` on the same GPU,
   float32 (built-in model) and bfloat16 (a tiny Qwen2-shaped checkpoint written here).
2. Decode throughput on the GPU: 64 requests x 128 output tokens through the offline path, ours vs
   transformers `generate()` in padded batches of 16, same prompts.
3. GPU-memory KV hand-off between two processes: a 'prefill' process holds one layer of KV for a
   2k-token Llama-3-8B-shaped prompt (bf16, 256 MiB) on the GPU and hands it to a 'decode' process:
   with two GPUs over NCCL (torch.distributed send/recv, GPU 0 -> GPU 1); with one GPU through
   CUDA IPC (torch.multiprocessing shares the device allocation) and a device-to-device copy.
4. Tensor parallelism over NCCL (two GPUs or more): greedy `LLM(device="cuda", tensor_parallel_size=2)`,
   one rank per GPU, equals transformers `generate()` (built-in model, float32); skipped on one GPU.
Prints one table; exit status 1 if a parity check fails or there is no CUDA device.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KV_SHAPE = (2, 128, 16, 8, 128)  # (K/V, blocks, block_size, kv_heads, head_dim): 2048 tokens of Llama-3-8B


def parity() -> list[tuple[str, str]]:
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from engine.builtin_model import resolve_model_path
    from pdcluster import LLM, SamplingParams

    rows = []
    tmp = Path(tempfile.mkdtemp())
    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512))
    with torch.no_grad():
        qwen.lm_head.weight.mul_(8.0)
    qwen.to(torch.bfloat16).save_pretrained(tmp / "qwen2")
    cases = [("builtin float32", str(resolve_model_path("builtin:tiny-llama")), "float32", 8192),
             ("qwen2 bfloat16", str(tmp / "qwen2"), "bfloat16", 512)]
    g = torch.Generator().manual_seed(1)
    for name, path, dtype, vocab in cases:
        prompts = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (7, 64, 300)]
        llm = LLM(path, dtype=dtype, device="cuda", max_model_len=1024)
        outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).cuda().eval()
        ok = True
        for p, o in zip(prompts, outs):
            ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=32, min_new_tokens=32,
                              do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            ok &= ref == o.token_ids
        rows.append((f"parity {name}", "token-identical" if ok else "MISMATCH"))
        del llm, hf
        torch.cuda.empty_cache()
    return rows


def throughput() -> list[tuple[str, str]]:
    from transformers import AutoModelForCausalLM

    from engine.builtin_model import resolve_model_path
    from pdcluster import LLM, SamplingParams

    path = str(resolve_model_path("builtin:tiny-llama"))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(4, 8192, (int(n),), generator=g).tolist() for n in torch.randint(32, 512, (64,), generator=g)]
    n_out = 128
    llm = LLM(path, device="cuda", max_model_len=1024)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True))
    torch.cuda.synchronize()
    ours = len(prompts) * n_out / (time.perf_counter() - t)
    hf = AutoModelForCausalLM.from_pretrained(path).cuda().eval()
    t = time.perf_counter()
    for i in range(0, len(prompts), 16):
        batch = prompts[i:i + 16]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device="cuda")
        hf.generate(ids, attention_mask=mask, max_new_tokens=n_out, min_new_tokens=n_out, do_sample=False,
                    eos_token_id=None, pad_token_id=0)
    torch.cuda.synchronize()
    theirs = len(prompts) * n_out / (time.perf_counter() - t)
    return [("decode throughput, ours", f"{ours:.0f} out tok/s"), ("decode throughput, transformers", f"{theirs:.0f} out tok/s"),
            ("ratio", f"{ours / theirs:.2f}x")]


def _ipc_child(q_in: "mp.Queue", q_out: "mp.Queue") -> None:
    shared = q_in.get()  # a CUDA tensor shared by the parent through CUDA IPC
    dst = torch.empty_like(shared)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        dst.copy_(shared)
    torch.cuda.synchronize()
    q_out.put(((time.perf_counter() - t) / 10, bool(torch.equal(dst, shared))))


def _nccl_rank(rank: int, q_out: "mp.Queue") -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("nccl", rank=rank, world_size=2)
    torch.cuda.set_device(rank)
    x = torch.full(KV_SHAPE, 1.5, dtype=torch.bfloat16, device="cuda") if rank == 0 else \
        torch.empty(KV_SHAPE, dtype=torch.bfloat16, device="cuda")
    for i in range(11):
        if i == 1:
            torch.cuda.synchronize()
            t = time.perf_counter()
        dist.send(x, 1) if rank == 0 else dist.recv(x, 0)
    torch.cuda.synchronize()
    if rank == 1:
        q_out.put(((time.perf_counter() - t) / 10, bool(torch.all(x == 1.5))))
    dist.destroy_process_group()


def handoff() -> list[tuple[str, str]]:
    ctx = mp.get_context("spawn")
    nbytes = torch.Size(KV_SHAPE).numel() * 2
    q_out = ctx.Queue()
    if torch.cuda.device_count() >= 2:
        procs = [ctx.Process(target=_nccl_rank, args=(r, q_out)) for r in (0, 1)]
        how = "NCCL GPU0 -> GPU1"
    else:
        q_in = ctx.Queue()
        procs = [ctx.Process(target=_ipc_child, args=(q_in, q_out))]
        how = "CUDA IPC + device copy, one GPU"
    for p in procs:
        p.start()
    if len(procs) == 1:
        layer = torch.full(KV_SHAPE, 1.5, dtype=torch.bfloat16, device="cuda")
        q_in.put(layer)
    seconds, ok = q_out.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    return [(f"KV hand-off ({how}), 256 MiB layer", f"{nbytes / seconds / 1e9:.1f} GB/s, {'exact' if ok else 'CORRUPT'}")]


def tensor_parallel() -> list[tuple[str, str]]:
    if torch.cuda.device_count() < 2:
        return [("TP 2 over NCCL", "skipped: one GPU (needs two)")]
    from transformers import AutoModelForCausalLM

    from engine.builtin_model import resolve_model_path
    from pdcluster import LLM, SamplingParams

    path = str(resolve_model_path("builtin:tiny-llama"))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(4, 8192, (n,), generator=g).tolist() for n in (9, 120)]
    llm = LLM(path, dtype="float32", device="cuda", max_model_len=1024, tensor_parallel_size=2)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    finally:
        llm.close()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    ok = all(hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                         eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() == o.token_ids
             for p, o in zip(prompts, outs))
    return [("parity TP 2 over NCCL (builtin float32)", "token-identical" if ok else "MISMATCH")]


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (run this on a machine with an NVIDIA GPU)")
        return 1
    print(f"GPU: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}")
    rows = parity() + throughput() + handoff() + tensor_parallel()
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0 if all("MISMATCH" not in v and "CORRUPT" not in v for _, v in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
