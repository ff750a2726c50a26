"""What quantized KV pages cost in quality, on a model whose predictions mean something: the
yardstick model (builtin:stdlib-4m, trained on Python's standard library) reads held-back files of
its corpus, teacher-forced through the engine (prompt logprobs: every query attends to the keys as
the cache holds them, engine/attention.py `write_kv`), once per cache format.

Reported per format: perplexity (and its change against the model's own dtype), top-1 accuracy
against the text, and top-1 agreement with the unquantized cache (the share of positions whose most
likely next token is the same). Then the opt-in KV bound (sinks + recent window, approximate by
design) at two sizes below the prompts' length, measured the same way.

    python scripts/bench_kv_quality.py [--tokens 16384] [--window 256]
"""

from __future__ import annotations

import argparse
import math
import time

from benchmarks.stdlib_corpus import heldout_text
from engine.builtin_model import resolve_model_path
from engine.sampling_params import SamplingParams
from engine.tokenizer import load_tokenizer
from pdcluster.llm import LLM

FORMATS = ["auto", "int8", "fp8_e4m3", "fp8_e5m2"]
BOUNDS = [(16, 128), (16, 64)]  # (sink tokens, recent tokens), below the prompts' 256
MODEL = "builtin:stdlib-4m"


def windows(model: str, tokens: int, window: int) -> list[list[int]]:
    """The first `tokens` tokens of the held-back text, cut into prompts of `window` (bos first)."""
    tok = load_tokenizer(resolve_model_path(model))
    ids = tok.encode(heldout_text(tokens * 8), add_special_tokens=False)[:tokens]
    if len(ids) < window:
        raise SystemExit(f"the held-back text has only {len(ids)} tokens; lower --window")
    bos = tok.bos_token_id
    return [[bos] + ids[i:i + window - 1] for i in range(0, len(ids) - window + 2, window - 1)]


def score(model: str, prompts: list[list[int]], threads: int, **engine: object) -> dict[str, list]:
    """Each prompt position's logprob of the actual next token and the engine's top-1 token, with
    the engine settings `engine` (kv_cache_dtype, kv_sink_tokens, kv_recent_tokens)."""
    llm = LLM(model, dtype="float32", max_model_len=max(map(len, prompts)) + 8, num_threads=threads,
              enable_prefix_caching=False, **engine)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
    finally:
        llm.close()
    logprobs, top1, truth = [], [], []
    for prompt, out in zip(prompts, outs):
        rows = [lp for lp in out.prompt_logprobs if lp is not None]
        logprobs += [lp.logprob for lp in rows]
        top1 += [lp.top[0][0] for lp in rows]
        truth += prompt[1:len(rows) + 1]
    return {"logprob": logprobs, "top1": top1, "truth": truth}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--tokens", type=int, default=16384, help="held-back tokens scored")
    ap.add_argument("--window", type=int, default=256, help="tokens per prompt (the yardstick was trained on 256)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    prompts = windows(a.model, a.tokens, a.window)
    print(f"{a.model}: {sum(len(p) - 1 for p in prompts)} held-back tokens in {len(prompts)} prompts of "
          f"<= {a.window}, float32 model, teacher-forced (prompt logprobs)")
    runs = [(name, {"kv_cache_dtype": name}) for name in FORMATS]
    runs += [(f"bound {sink}+{recent}", {"kv_sink_tokens": sink, "kv_recent_tokens": recent})
             for sink, recent in BOUNDS]
    results = {}
    for name, engine in runs:
        t = time.perf_counter()
        results[name] = r = score(a.model, prompts, a.threads, **engine)
        n = len(r["logprob"])
        ppl = math.exp(-sum(r["logprob"]) / n)
        acc = sum(p == x for p, x in zip(r["top1"], r["truth"])) / n
        base = results["auto"]
        agree = sum(p == q for p, q in zip(r["top1"], base["top1"])) / n
        base_ppl = math.exp(-sum(base["logprob"]) / len(base["logprob"]))
        print(f"  {name:13s} perplexity {ppl:8.4f} ({(ppl / base_ppl - 1) * 100:+.2f}%)  top-1 accuracy {acc:.4f}  "
              f"top-1 agreement with auto {agree * 100:.2f}%  ({time.perf_counter() - t:.0f} s)")
    return 0
