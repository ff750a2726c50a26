"""Train the yardstick model: a ~4M-parameter Llama that has read Python's standard library.

    python scripts/train_yardstick.py --out /tmp/stdlib-4m --pack-to engine/builtin_checkpoints/stdlib-4m

The built-in random models write gibberish, so a numerical error (a quantized KV cache, a new
kernel) cannot be read from their text; this one writes Python-like code, and its held-back
perplexity moves when its numbers do. Steps, each deterministic for a given seed and machine:

1. a byte-level BPE tokenizer (vocab 4096, the built-ins' special tokens and chat template,
   engine/builtin_model.py) trained on the training files of benchmarks/stdlib_corpus.py;
2. those files tokenized into one stream, each file as <s> text </s>;
3. a LlamaForCausalLM (hidden 256, 4 layers, 4 heads of 64 with 2 KV heads, MLP 640, tied
   embeddings) trained on windows of 256 tokens at random offsets of the stream: AdamW, linear
   warmup then cosine decay, gradient clipping, bfloat16 autocast where the CPU has native bf16;
4. the weights saved as bfloat16 with the tokenizer, then reloaded in float32 and scored on the
   held-back files (benchmarks/yardstick_eval.py);
5. with --pack-to, packed for the repository (int8 rows, engine/packed_checkpoint.py: about half
   the bytes); the shipped model is that packing, expanded into the cache on first use.

The default step count takes about 6 minutes on 2 cores of a Xeon with AMX (docs/yardstick.md).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from benchmarks.stdlib_corpus import read_source, train_files
from benchmarks.yardstick_eval import SEQ_LEN, evaluate_checkpoint
from engine.builtin_model import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, _build_tokenizer
from engine.config import cpu_has_native

CONFIG = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 640,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "tie_word_embeddings": True,
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
    "pad_token_id": PAD_TOKEN_ID,
}


def token_stream(tokenizer: Any, texts: list[str]) -> torch.Tensor:
    """All `texts` tokenized into one int64 stream, each as <s> ids </s>."""
    encoded = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    ids: list[int] = []
    for enc in encoded:
        ids += [BOS_TOKEN_ID, *enc.ids, EOS_TOKEN_ID]
    return torch.tensor(ids, dtype=torch.int64)


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup to `peak`, then cosine decay to a tenth of it at the last step."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train(model: torch.nn.Module, stream: torch.Tensor, steps: int, batch_size: int, peak_lr: float,
          seed: int) -> list[float]:
    """Train `model` in place; returns the loss of every step."""
    decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices; not the norms' gains
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=peak_lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(SEQ_LEN + 1)
    use_bf16 = cpu_has_native(torch.bfloat16)
    warmup = max(1, steps // 20)
    losses = []
    model.train()
    bar = tqdm(range(steps), desc="train", unit="step")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, steps, peak_lr, warmup)
        starts = torch.randint(0, len(stream) - SEQ_LEN - 1, (batch_size,), generator=gen)
        batch = stream[starts[:, None] + offsets]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
            logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 10 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses


def save(model: torch.nn.Module, tokenizer: Any, out: Path) -> None:
    """The model as a bfloat16 Hugging Face checkpoint with its tokenizer and generation config."""
    from transformers import GenerationConfig

    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.generation_config = GenerationConfig(bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID,
                                               pad_token_id=PAD_TOKEN_ID, do_sample=False)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    ap.add_argument("--pack-to", type=Path, default=None, help="also pack it there (the shipped form)")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=16, help="windows of 256 tokens per step")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-tokens", type=int, default=20_000, help="held-back tokens scored at the end")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()

    texts = [t for t in map(read_source, train_files()) if t is not None]
    spec = {"config": CONFIG}
    tokenizer = _build_tokenizer(spec, texts)
    stream = token_stream(tokenizer, texts)
    print(f"{len(texts)} training files, {sum(map(len, texts)):,} characters, {len(stream):,} tokens "
          f"(tokenizer: {time.perf_counter() - t0:.0f} s)")

    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).float()
    print(f"LlamaForCausalLM: {sum(p.numel() for p in model.parameters()):,} parameters")
    losses = train(model, stream, args.steps, args.batch_size, args.lr, args.seed)
    save(model, tokenizer, args.out)
    train_loss = sum(losses[-50:]) / len(losses[-50:])
    held = evaluate_checkpoint(args.out, args.eval_tokens)
    print(f"train loss (mean of the last {len(losses[-50:])} steps) {train_loss:.4f}; held-back "
          f"({held.tokens} tokens, bf16 checkpoint in float32): loss {held.loss:.4f}, perplexity "
          f"{held.perplexity:.2f}, top-1 {held.top1:.1%}; {time.perf_counter() - t0:.0f} s in all")
    if args.pack_to is not None:
        from engine.packed_checkpoint import pack

        pack(args.out, args.pack_to)
        print(f"packed into {args.pack_to}")
    return 0
