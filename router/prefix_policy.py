"""Which worker a request goes to, by expected cost: the one rule the router and the planner's
simulator share (pure Python; each caller describes its workers as `Candidate`s).

Prefill worker: the least expected cost, in prompt tokens it still has to compute,

    cost(P) = (prompt tokens - those P's prefix cache is expected to hold) + prompt tokens queued on P

then fewer requests in flight, then the first listed. With nothing cached anywhere (or
`prefix_aware` off) this is routing by queued prompt tokens alone.

Decode worker: the one expected to hold the longest prefix of the prompt (an earlier turn of the
conversation: prompt and answer), among those with at most `decode_imbalance` more requests in
flight than the least loaded; then fewer requests in flight, then more free KV blocks. The
worker's reservation says whether it has room; when it has none the next is tried.

Conditional disaggregation: when the part of the prompt its decode worker is not expected to hold
is at most `local_prefill_uncached_tokens`, the decode worker prefills that part itself and no KV
moves (0: always a prefill worker). Otherwise a prefill worker computes the prompt, reusing its
own cached prefix, and sends only the blocks after the ones the decode worker holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Candidate:
    worker: Any  # the caller's handle on the worker
    cached_tokens: int = 0  # leading prompt tokens the worker's prefix cache is expected to hold
    queued_tokens: int = 0  # prompt tokens queued on it (prefill)
    inflight: int = 0  # requests in flight on it
    free_blocks: int = 0  # free KV blocks (decode)


@dataclass(frozen=True)
class RoutingPolicy:
    prefix_aware: bool = True  # False: by load only (cached prefixes are ignored)
    local_prefill_uncached_tokens: int = 0  # conditional disaggregation threshold; 0: always remote
    decode_imbalance: int = 4  # extra requests a decode worker may carry to keep a conversation

    def __post_init__(self) -> None:
        for name in ("local_prefill_uncached_tokens", "decode_imbalance"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def uncached(self, prompt_tokens: int, cached_tokens: int) -> int:
        """Prompt tokens a worker expected to hold `cached_tokens` of them would have to compute
        (all of them when routing by load)."""
        return prompt_tokens - (min(cached_tokens, prompt_tokens) if self.prefix_aware else 0)

    def prefill_cost(self, prompt_tokens: int, c: Candidate) -> int:
        return self.uncached(prompt_tokens, c.cached_tokens) + c.queued_tokens

    def pick_prefill(self, prompt_tokens: int, candidates: Sequence[Candidate]) -> Candidate | None:
        if not candidates:
            return None
        return min(candidates, key=lambda c: (self.prefill_cost(prompt_tokens, c), c.inflight))

    def pick_decode(self, candidates: Sequence[Candidate]) -> Candidate | None:
        if not candidates:
            return None
        if not self.prefix_aware:
            return min(candidates, key=lambda c: (c.inflight, -c.free_blocks))
        least = min(c.inflight for c in candidates)
        near = [c for c in candidates if c.inflight <= least + self.decode_imbalance]
        return min(near, key=lambda c: (-c.cached_tokens, c.inflight, -c.free_blocks))

    def prefill_on_decode(self, prompt_tokens: int, cached_tokens: int) -> bool:
        """Conditional disaggregation: does the decode worker, expected to hold `cached_tokens` of
        the prompt, prefill the part it lacks itself?"""
        limit = self.local_prefill_uncached_tokens
        return limit > 0 and self.uncached(prompt_tokens, cached_tokens) <= limit
