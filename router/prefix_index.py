"""The router's picture of every worker's prefix cache: the block hashes each holds, kept from the
change lists the workers answer Stats polls with (engine/cache_events.py), and the prompts the
router has just sent each one (expected there once computed, before the next poll can say so).

A worker with an offload tier (engine/kv_tier.py) also reports the tier's changes, under the tier's
id: every worker of a node shares its tier, so a block one of them evicted to the tier counts as held
by all of them (they read it back instead of computing it).

The picture may be late or wrong (an eviction not yet reported, a prefill that failed): it only
steers routing. A worker confirms every hit by token ids before it serves one.
"""

from __future__ import annotations

import threading

from engine.prefix_hash import extend_hashes
from proto import worker_pb2 as wk


class PromptBlocks:
    """A request's token ids and their block hashes, each computed once per block size asked for
    (the decode worker's choice, the prefill worker's, the index's expectations reuse them)."""

    def __init__(self, token_ids: list[int], by_size: dict[int, list[bytes]] | None = None) -> None:
        self.token_ids = token_ids
        self._by_size = by_size or {}

    def hashes(self, block_size: int) -> list[bytes]:
        return extend_hashes(self._by_size.setdefault(block_size, []), self.token_ids, block_size,
                             len(self.token_ids) // block_size)

    def extended(self, more: list[int]) -> PromptBlocks:
        """These tokens followed by `more` (a prompt and its answer), keeping the hashes computed."""
        return PromptBlocks(self.token_ids + more, {bs: list(h) for bs, h in self._by_size.items()})


class PrefixIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, set[bytes]] = {}
        self._block_size: dict[str, int] = {}
        self._tier_of: dict[str, str] = {}  # worker id -> its offload tier's id
        self._tiers: dict[str, set[bytes]] = {}  # tier id -> block hashes it holds

    def apply(self, worker_id: str, events: wk.PrefixCacheEvents) -> None:
        """Take a worker's change list (a snapshot replaces what was known of it)."""
        with self._lock:
            held = self._held.setdefault(worker_id, set())
            if events.snapshot:
                held.clear()
            held.update(events.stored)
            held.difference_update(events.removed)
            self._block_size[worker_id] = events.block_size
            if events.tier_id:
                self._tier_of[worker_id] = events.tier_id
                tier = self._tiers.setdefault(events.tier_id, set())
                if events.tier_snapshot:
                    tier.clear()
                tier.update(events.tier_stored)
                tier.difference_update(events.tier_removed)

    def expect(self, worker_id: str, blocks: PromptBlocks) -> None:
        """`blocks`' full blocks will be in the worker's cache once computed."""
        with self._lock:
            bs = self._block_size.get(worker_id)
            if bs:
                self._held.setdefault(worker_id, set()).update(blocks.hashes(bs))

    def knows(self, worker_id: str) -> bool:
        """Whether a snapshot of the worker's cache came (before it, nothing is expected there)."""
        with self._lock:
            return bool(self._block_size.get(worker_id))

    def forget(self, worker_id: str) -> None:
        """The worker is gone or restarted: nothing is known of its cache until its next snapshot."""
        with self._lock:
            self._held.pop(worker_id, None)
            self._block_size.pop(worker_id, None)
            self._tier_of.pop(worker_id, None)  # the tier itself outlives a worker: its other users keep it

    def other_tier(self, worker_id: str, prompt: PromptBlocks, beyond_tokens: int) -> tuple[int, list[str]] | None:
        """Another node's tier that holds more of the prompt's leading blocks than `beyond_tokens`
        (what the worker holds itself), when the worker has a tier to read them into: (blocks it
        holds, the workers of that node), the tier holding the most; None otherwise."""
        with self._lock:
            bs, own = self._block_size.get(worker_id), self._tier_of.get(worker_id)
            if not bs or not own:
                return None
            hashes = prompt.hashes(bs)[: (len(prompt.token_ids) - 1) // bs]
            best: tuple[int, str] | None = None
            for tier_id, held in self._tiers.items():
                if tier_id == own:
                    continue
                n = next((i for i, h in enumerate(hashes) if h not in held), len(hashes))
                if n * bs > beyond_tokens and (best is None or n > best[0]):
                    best = (n, tier_id)
            if best is None:
                return None
            return best[0], sorted(w for w, t in self._tier_of.items() if t == best[1])

    def tier_blocks(self, tier_id: str) -> int:
        """Blocks the index believes the tier holds."""
        with self._lock:
            return len(self._tiers.get(tier_id, ()))

    def cached_tokens(self, worker_id: str, prompt: PromptBlocks) -> int:
        """Leading prompt tokens the worker is expected to hold (whole blocks), in its own cache or
        in its node's offload tier."""
        with self._lock:
            bs = self._block_size.get(worker_id)
            held = self._held.get(worker_id) or set()
            tier = self._tiers.get(self._tier_of.get(worker_id, ""), set())
            if not bs or not (held or tier):
                return 0
            n = 0
            usable = (len(prompt.token_ids) - 1) // bs  # a worker computes the last token's block afresh
            for h in prompt.hashes(bs)[:usable]:
                if h not in held and h not in tier:
                    break
                n += 1
            return n * bs
