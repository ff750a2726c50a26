"""Which grammar engine constrains decoding cheaper: xgrammar or llguidance, on this machine.

    pip install xgrammar llguidance
    python -m benchmarks.grammar_engines [--model builtin:tiny-llama] [--schemas 40] [--steps 48]

For each engine, over the same JSON schemas (generated, seeded) and the model's tokenizer: the time
to prepare the tokenizer, to compile each schema, and per generated token the time to fill the
next-token mask of one sequence, apply it to a row of logits and advance the matcher by the token
picked (a seeded random allowed token, so every schema's walk is the same for both engines' masks
as long as they allow the same tokens; the share of steps where they do not is printed).
Runs one thread; prints medians and the ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch


def schemas(n: int, seed: int) -> list[dict[str, Any]]:
    """Small object schemas with bounded strings and numbers (so a walk ends)."""
    rng = random.Random(seed)
    kinds = [{"type": "integer", "minimum": 0, "maximum": 999}, {"type": "boolean"},
             {"type": "string", "maxLength": 8}, {"enum": ["red", "green", "blue"]},
             {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}]
    out = []
    for _ in range(n):
        props = {f"f{i}": rng.choice(kinds) for i in range(rng.randint(1, 5))}
        out.append({"type": "object", "properties": props, "required": sorted(props),
                    "additionalProperties": False})
    return out


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.mask = xgr.allocate_token_bitmask(1, vocab)

    def compile(self, schema: str) -> Any:
        return self.compiler.compile_json_schema(schema)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m: Any, logits: torch.Tensor) -> None:
        m.fill_next_token_bitmask(self.mask, 0)
        self.xgr.apply_token_bitmask_inplace(logits, self.mask)

    def accept(self, m: Any, token: int) -> bool:
        return m.accept_token(token)

    def done(self, m: Any) -> bool:
        return m.is_terminated()


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll = llguidance
        self.lt = llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.mask = llguidance.torch.allocate_token_bitmask(1, vocab)

    def compile(self, schema: str) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema)
        err = self.ll.LLMatcher.validate_grammar(grammar, self.tok)
        if err:
            raise ValueError(err)
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.ll.LLMatcher(self.tok, compiled)

    def fill(self, m: Any, logits: torch.Tensor) -> None:
        self.lt.fill_next_token_bitmask(m, self.mask, 0)
        self.lt.apply_token_bitmask_inplace(logits, self.mask)

    def accept(self, m: Any, token: int) -> bool:
        return m.consume_token(token)

    def done(self, m: Any) -> bool:
        return m.is_stopped()


def walk(engine: Any, compiled: Any, vocab: int, steps: int, seed: int) -> tuple[list[float], list[int]]:
    """Per-token seconds (fill + apply + accept) and the tokens picked."""
    m = engine.matcher(compiled)
    rng = torch.Generator().manual_seed(seed)
    times, picked = [], []
    for _ in range(steps):
        if engine.done(m):
            break
        logits = torch.rand(1, vocab, generator=rng)
        t = time.perf_counter()
        engine.fill(m, logits)
        token = int(logits.argmax())
        ok = engine.accept(m, token)
        times.append(time.perf_counter() - t)
        picked.append(token)
        if not ok:
            break
    return times, picked


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:tiny-llama")
    p.add_argument("--schemas", type=int, default=40)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from engine.builtin_model import resolve_model_path
    from engine.config import ModelConfig
    from engine.tokenizer import load_tokenizer

    path = resolve_model_path(args.model)
    tokenizer, vocab = load_tokenizer(path), ModelConfig.from_pretrained(path).vocab_size
    texts = [json.dumps(s) for s in schemas(args.schemas, args.seed)]
    results: dict[str, dict[str, float]] = {}
    walks: dict[str, list[list[int]]] = {}
    for cls in (Xgrammar, Llguidance):
        t = time.perf_counter()
        engine = cls(tokenizer, vocab)
        setup = time.perf_counter() - t
        compile_s, token_s = [], []
        walks[cls.name] = []
        for i, text in enumerate(texts):
            t = time.perf_counter()
            compiled = engine.compile(text)
            compile_s.append(time.perf_counter() - t)
            times, picked = walk(engine, compiled, vocab, args.steps, args.seed + i)
            token_s += times
            walks[cls.name].append(picked)
        results[cls.name] = {"tokenizer_setup_ms": setup * 1e3, "compile_ms_p50": statistics.median(compile_s) * 1e3,
                             "per_token_us_p50": statistics.median(token_s) * 1e6,
                             "per_token_us_mean": statistics.fmean(token_s) * 1e6, "tokens": len(token_s)}
    same = sum(a == b for a, b in zip(walks["xgrammar"], walks["llguidance"]))
    print(f"model {args.model} (vocab {vocab}), {len(texts)} JSON schemas, up to {args.steps} tokens each, one thread")
    print("| engine | tokenizer setup ms | compile ms p50 | per token us p50 | per token us mean | tokens |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['tokenizer_setup_ms']:.0f} | {r['compile_ms_p50']:.2f} | {r['per_token_us_p50']:.0f} | "
              f"{r['per_token_us_mean']:.0f} | {r['tokens']} |")
    x, g = results["xgrammar"], results["llguidance"]
    print(f"per token p50 xgrammar / llguidance: {x['per_token_us_p50'] / g['per_token_us_p50']:.2f}x; "
          f"compile p50: {x['compile_ms_p50'] / g['compile_ms_p50']:.2f}x; identical walks: {same}/{len(texts)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
