"""A simulated worker's prefix cache, and the reuse bound of a workload.

Blocks are named by keys: a key per full block that stands for the whole prefix up to the end of
that block (as the engine's chained hash), so two requests share a key exactly when they share the
tokens up to there. A cached block is either held (by sequences in flight on the worker: a decode
worker's reservations and running sequences) or free (least recently used first out when blocks
are needed). A prefill worker's or a colocated worker's blocks are free between prompts, so their
caches are bounded by the worker's block count; a decode worker's free cached blocks by its free
blocks (SimDecodeWorker trims it as they are taken).

The offload tier (engine/kv_tier.py) is a TierCache shared by the workers' caches: a free block
trimmed out of a cache goes to it (least recently used out past its size), and a prompt's leading
blocks missing from a cache are looked up there next; those it holds count as cached, as the engine
reads them back instead of computing them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence


class TierCache:
    """An offload tier's keys, least recently used first, at most `capacity` blocks."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[Hashable, None] = OrderedDict()
        self.hit_blocks = 0  # blocks read back (the simulated tier's hits)

    def put(self, key: Hashable) -> None:
        self.keys[key] = None
        self.keys.move_to_end(key)
        while len(self.keys) > self.capacity:
            self.keys.popitem(last=False)

    def run(self, keys: Sequence[Hashable]) -> int:
        """How many of `keys` it holds from the first on (nothing is touched)."""
        n = 0
        for key in keys:
            if key not in self.keys:
                break
            n += 1
        return n

    def use(self, keys: Sequence[Hashable]) -> int:
        """As run, and those become the most recently used and count as hits."""
        n = self.run(keys)
        for key in keys[:n]:
            self.keys.move_to_end(key)
        self.hit_blocks += n
        return n


class PrefixCache:
    def __init__(self, tier: TierCache | None = None) -> None:
        self.free: OrderedDict[Hashable, None] = OrderedDict()  # least recently used first
        self.held: dict[Hashable, int] = {}  # key -> sequences holding it
        self.tier = tier  # where trimmed blocks go and missing ones are looked up (None: nowhere)

    def __len__(self) -> int:
        return len(self.free) + len(self.held)

    def holds(self, key: Hashable) -> bool:
        return key in self.free or key in self.held

    def prefix_blocks(self, keys: Sequence[Hashable], limit: int) -> int:
        """How many of keys[:limit] are cached from the first on, here or in the tier (nothing is touched)."""
        n = 0
        for key in keys[:limit]:
            if key not in self.free and key not in self.held:
                break
            n += 1
        if self.tier is not None and n < limit:
            n += self.tier.run(keys[n:limit])
        return n

    def use_prefix(self, keys: Sequence[Hashable], limit: int) -> int:
        """As prefix_blocks, and the free ones among them become the most recently used (the
        tier's ones are read back: the caller holds or stores them like computed ones)."""
        n = 0
        for key in keys[:limit]:
            if key in self.free:
                self.free.move_to_end(key)
            elif key not in self.held:
                break
            n += 1
        if self.tier is not None and n < limit:
            n += self.tier.use(keys[n:limit])
        return n

    def store(self, keys: Iterable[Hashable], cap: int) -> None:
        """Keep `keys` as the most recently used free blocks, then at most `cap` free blocks."""
        free, held = self.free, self.held
        for key in keys:
            if key not in held:
                free[key] = None
                free.move_to_end(key)
        self.trim(cap)

    def trim(self, cap: int) -> None:
        while len(self.free) > max(0, cap):
            key, _ = self.free.popitem(last=False)
            if self.tier is not None:
                self.tier.put(key)

    def hold(self, keys: Iterable[Hashable]) -> None:
        """A sequence holds these blocks (shared from the cache, or its own KV landed)."""
        for key in keys:
            self.free.pop(key, None)
            self.held[key] = self.held.get(key, 0) + 1

    def release(self, keys: Iterable[Hashable]) -> None:
        """A sequence gives its blocks back: the last holder's become free, most recently used."""
        held = self.held
        for key in keys:
            n = held.get(key, 0) - 1
            if n > 0:
                held[key] = n
            elif n == 0:
                del held[key]
                self.free[key] = None

    def release_all(self) -> None:
        """Every held block becomes free (a run that stopped early left sequences in flight)."""
        for key in self.held:
            self.free[key] = None
        self.held.clear()


def reuse_bound(arrivals: Sequence[float], prompts: Sequence[int], block_keys: Sequence[Sequence[Hashable]],
                block_size: int) -> int:
    """Prompt tokens an infinite cache shared by all workers would serve: in arrival order, each
    prompt's leading full blocks (never the last token's) named by an earlier request."""
    seen: set[Hashable] = set()
    hits = 0
    for i in sorted(range(len(prompts)), key=lambda i: arrivals[i]):
        keys = block_keys[i]
        n = 0
        for key in keys[:(prompts[i] - 1) // block_size]:
            if key not in seen:
                break
            n += 1
        hits += n * block_size
        seen.update(keys)
    return hits
