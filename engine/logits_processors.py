"""What a request's sampling parameters do to its logits before a token is picked, batched over the
rows that ask for it (no per-row loop over the vocabulary), in vLLM's order and with its semantics:

1. `logit_bias`: each named token's logit += its bias (OpenAI's -100..100).
2. `min_tokens`: until that many completion tokens exist, EOS and `stop_token_ids` get -inf.
3. `repetition_penalty` r (transformers' and vLLM's): a token seen in the prompt or the completion
   has its logit divided by r when positive, multiplied by r otherwise.
4. `frequency_penalty` f and `presence_penalty` p (OpenAI's): logit -= f * (times the token occurs
   in the completion) + p * (1 if it occurs at all).

The completion counts the tokens generated before a resume too (a resumed sequence's prompt ends
with them), so a retried request is penalised exactly as if it had not failed. Greedy decoding picks
the argmax of the adjusted logits; reported logprobs are those of the raw logits (vLLM's default).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

import torch

from engine.sampling_params import SamplingParams


class History(Protocol):
    """What a row's adjustments read (engine.sequence.Sequence has these)."""

    token_ids: list[int]
    num_prompt_tokens: int
    output_offset: int  # completion tokens at the end of the prompt (a resumed request)
    eos_token_ids: frozenset[int]


def completion_ids(h: History) -> list[int]:
    return h.token_ids[h.num_prompt_tokens - h.output_offset :]


def needs_adjusting(p: SamplingParams) -> bool:
    return bool(p.logit_bias) or p.min_tokens > 0 or p.penalized


def adjust_logits(logits: torch.Tensor, params: Seq[SamplingParams], steps: Seq[int],
                  histories: Seq[History]) -> torch.Tensor:
    """A copy of `logits` (rows, vocab) with each row's adjustments applied; `logits` when no row
    has any. `steps[i]`: completion tokens row i already has (its sample index)."""
    if not any(needs_adjusting(p) for p in params):
        return logits
    out = logits.clone()
    vocab = out.shape[-1]
    dev = out.device
    rows, cols, vals = [], [], []
    for i, p in enumerate(params):
        for tok, bias in p.logit_bias.items():
            if 0 <= tok < vocab:
                rows.append(i)
                cols.append(tok)
                vals.append(bias)
    if rows:
        idx = (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev))
        out.index_put_(idx, torch.tensor(vals, dtype=out.dtype, device=dev), accumulate=True)
    rows, cols = [], []
    for i, p in enumerate(params):
        if steps[i] < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(histories[i].eos_token_ids))
            for tok in stops:
                if 0 <= tok < vocab:
                    rows.append(i)
                    cols.append(tok)
    if rows:
        out[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = float("-inf")
    pen = [i for i, p in enumerate(params) if p.penalized]
    if pen:
        out[pen] = _penalize(out[pen], [params[i] for i in pen], [histories[i] for i in pen])
    return out


def _counts(ids: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """(rows, vocab) occurrences of each token in each row's list."""
    width = max((len(x) for x in ids), default=0)
    padded = torch.full((len(ids), width), vocab, dtype=torch.long, device=device)  # vocab: a spare column
    for r, x in enumerate(ids):
        if x:
            padded[r, : len(x)] = torch.tensor(x, dtype=torch.long, device=device)
    counts = torch.zeros((len(ids), vocab + 1), dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab]


def _penalize(logits: torch.Tensor, params: list[SamplingParams], histories: list[History]) -> torch.Tensor:
    vocab, dev = logits.shape[-1], logits.device
    out_counts = _counts([completion_ids(h) for h in histories], vocab, dev)
    rep = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype, device=dev)[:, None]
    if bool((rep != 1.0).any()):
        seen = _counts([h.token_ids for h in histories], vocab, dev) > 0  # prompt and completion
        scaled = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, scaled, logits)
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype, device=dev)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype, device=dev)[:, None]
    return logits - freq * out_counts - pres * (out_counts > 0).to(logits.dtype)
