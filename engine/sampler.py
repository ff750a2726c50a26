"""Token sampling: the logits adjustments (logits_processors.py), the structured-output masks
(guided.py), then greedy, temperature, top-k, top-p, per-request seeds; top-n logprobs of the raw
logits."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from engine.guided import GuidedDecoder
from engine.logits_processors import History, adjust_logits
from engine.sampling_params import SamplingParams
from engine.sequence import TokenLogprobs

_MASK = float("-inf")


def _seeded_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    """The random stream for token `step` of a seeded request depends only on (seed, step)."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 0x9E3779B1 + step * 0x85EBCA77 + 1) % (2**63))
    return g


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0, guided: GuidedDecoder | None = None) -> None:
        self.device = device
        self.guided = guided  # None: constrained requests are refused upstream (validate_request)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,  # (n, vocab) float32
        params: list[SamplingParams],
        steps: list[int],  # index of the token being sampled for each row (0 = first output token)
        histories: Seq[History] | None = None,  # each row's tokens so far (penalties, min_tokens)
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        raw = logits
        if histories is not None:
            logits = adjust_logits(logits, params, steps, histories)
            guided = [i for i, p in enumerate(params) if p.guided is not None]
            if guided and self.guided is not None:
                logits = self.guided.mask(logits, guided, histories)
        tokens = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            idx = torch.tensor(rows, device=logits.device)
            sub = logits[idx] / torch.tensor([params[i].temperature for i in rows], device=logits.device)[:, None]
            sub = _top_k_top_p(sub, [params[i].top_k for i in rows], [params[i].top_p for i in rows])
            probs = torch.softmax(sub, dim=-1)
            # Exponential race (Gumbel-max): argmax(p / E), E ~ Exp(1), draws from p exactly.
            noise = torch.empty_like(probs)
            for j, i in enumerate(rows):
                seed = params[i].seed
                gen = self.generator if seed is None else _seeded_generator(seed, steps[i], logits.device)
                noise[j].exponential_(generator=gen)
            tokens[idx] = (probs / noise).argmax(dim=-1)
        token_list = tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(params)
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            lp = torch.log_softmax(raw[want], dim=-1)
            for j, i in enumerate(want):
                n = params[i].logprobs or 0
                top_v, top_i = lp[j].topk(n) if n else (lp[j][:0], lp[j][:0].long())
                logprobs[i] = TokenLogprobs(
                    token_list[i], float(lp[j, token_list[i]]), list(zip(top_i.tolist(), top_v.tolist()))
                )
        return token_list, logprobs


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[-1]
    if any(k > 0 for k in top_k):
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=logits.device)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, _MASK)
    if any(p < 1.0 for p in top_p):
        p = torch.tensor(top_p, device=logits.device)[:, None]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = (cum - sorted_logits.softmax(dim=-1)) >= p  # keep the smallest prefix reaching p
        sorted_logits = sorted_logits.masked_fill(drop, _MASK)
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    return logits
