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

from array import array
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


def completion_start(h: History) -> int:
    """Where the completion starts in `h.token_ids` (before the prompt's end on a resumed request)."""
    return h.num_prompt_tokens - h.output_offset


def completion_ids(h: History) -> list[int]:
    return h.token_ids[completion_start(h) :]


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
    _penalize(out, params, histories)
    return out


def _distinct(lists: list[list[int]], vocab: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(list index, token, occurrences) of each distinct token of each list, vectorised: the
    lists are copied into one buffer at C speed, not converted element by element."""
    flat = array("q")
    for x in lists:
        flat.extend(x)
    toks = torch.frombuffer(flat, dtype=torch.int64) if flat else torch.empty(0, dtype=torch.int64)
    owner = torch.repeat_interleave(torch.arange(len(lists)), torch.tensor([len(x) for x in lists]))
    keep = toks < vocab
    keys, counts = torch.unique(owner[keep] * vocab + toks[keep], return_counts=True)
    return (keys // vocab).to(device), (keys % vocab).to(device), counts.to(device)


def _penalize(logits: torch.Tensor, params: Seq[SamplingParams], histories: Seq[History]) -> None:
    """Penalties in place, over the (row, token) pairs a row's history holds: the work grows with
    the tokens seen, not with the vocabulary."""
    dev, vocab, dtype = logits.device, logits.shape[-1], logits.dtype
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep:  # every distinct token of prompt + completion
        which, cols, _ = _distinct([histories[i].token_ids for i in rep], vocab, dev)
        rows = torch.tensor(rep, device=dev)[which]
        r = torch.tensor([params[i].repetition_penalty for i in rep], dtype=dtype, device=dev)[which]
        v = logits[rows, cols]
        logits[rows, cols] = torch.where(v > 0, v / r, v * r)
    fp = [i for i, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
    if fp:  # every distinct completion token
        which, cols, n = _distinct([completion_ids(histories[i]) for i in fp], vocab, dev)
        rows = torch.tensor(fp, device=dev)[which]
        f = torch.tensor([params[i].frequency_penalty for i in fp], dtype=dtype, device=dev)[which]
        p = torch.tensor([params[i].presence_penalty for i in fp], dtype=dtype, device=dev)[which]
        logits[rows, cols] -= f * n.to(dtype) + p
