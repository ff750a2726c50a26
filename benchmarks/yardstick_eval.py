"""How well the yardstick model (`builtin:stdlib-4m`) predicts Python it has never seen.

    python scripts/eval_yardstick.py                   # the shipped checkpoint, 20,000 tokens
    python scripts/eval_yardstick.py --tokens 5000 --model /path/to/checkpoint

Teacher-forced, with transformers in float32: the first `--tokens` tokens of the held-back
standard-library text (benchmarks/stdlib_corpus.py `heldout_text`, tokenized with bos) are cut
into windows of the model's training length (256); each window predicts its next tokens from its
own context only. Printed: the mean cross-entropy (nats per token), the perplexity exp(loss) and
the next-token top-1 accuracy. A random model scores a perplexity near the vocabulary size (4096).

Then a greedy completion of `def fibonacci(n):` (64 new tokens, float32) through the project's own
engine (`pdcluster.llm.LLM`), from this model and from `builtin:tiny-llama` (random weights), so
the two can be read side by side.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.stdlib_corpus import heldout_text

YARDSTICK = "builtin:stdlib-4m"
SEQ_LEN = 256  # the training length (benchmarks/yardstick_train.py)
PROMPT = "def fibonacci(n):"
CHARS_PER_TOKEN_BOUND = 8  # read this many characters per wanted token: more than enough text


@dataclass
class HeldoutScore:
    """Teacher-forced next-token scores over `tokens` predictions."""

    tokens: int
    loss: float  # mean cross-entropy, nats per token
    top1: float  # fraction of positions where the most likely token was the next one

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


def heldout_ids(tokenizer: Any, n_tokens: int) -> list[int]:
    """The first `n_tokens` + 1 token ids of the held-back text (bos first)."""
    ids = tokenizer(heldout_text(CHARS_PER_TOKEN_BOUND * (n_tokens + 1)), verbose=False)["input_ids"]
    if len(ids) < n_tokens + 1:
        raise ValueError(f"the held-back text has only {len(ids)} tokens; {n_tokens + 1} wanted")
    return ids[:n_tokens + 1]


@torch.no_grad()
def score(model: torch.nn.Module, ids: list[int], window: int = SEQ_LEN) -> HeldoutScore:
    """Teacher-forced loss and top-1 of `model` predicting ids[1:] from windows of `window` tokens."""
    total_loss, hits, count = 0.0, 0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor(ids[start:start + window + 1])
        logits = model(chunk[None, :-1]).logits[0].float()
        targets = chunk[1:]
        total_loss += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        hits += int((logits.argmax(-1) == targets).sum())
        count += len(targets)
    return HeldoutScore(tokens=count, loss=total_loss / count, top1=hits / count)


def evaluate_checkpoint(path: str | Path, n_tokens: int) -> HeldoutScore:
    """The held-back score of the checkpoint at `path`, loaded in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return score(model, heldout_ids(tokenizer, n_tokens))


def complete(model: str, prompt: str = PROMPT, max_tokens: int = 64) -> str:
    """A greedy float32 completion of `prompt` by our engine (no stop at eos)."""
    from pdcluster.llm import LLM, SamplingParams

    llm = LLM(model, dtype="float32", max_model_len=512)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return llm.generate([prompt], params)[0].text
    finally:
        llm.close()


def main(argv: list[str] | None = None) -> int:
    from engine.builtin_model import resolve_model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=YARDSTICK, help="builtin:NAME or a checkpoint directory")
    ap.add_argument("--tokens", type=int, default=20_000, help="held-back tokens to predict")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    result = evaluate_checkpoint(resolve_model_path(args.model), args.tokens)
    print(f"{args.model}: {result.tokens} held-back tokens, windows of {SEQ_LEN}: loss {result.loss:.4f} "
          f"nats/token, perplexity {result.perplexity:.2f}, top-1 {result.top1:.1%}")
    for model in (args.model, "builtin:tiny-llama"):
        print(f"\n--- {model}, greedy, 64 tokens ---\n{PROMPT}{complete(model)}")
    return 0
