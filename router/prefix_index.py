"""The router's picture of every worker's prefix cache: the block hashes each holds, kept from the
change lists the workers answer Stats polls with (engine/cache_events.py), and the prompts the
router has just sent each one (expected there once computed, before the next poll can say so).

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

    def apply(self, worker_id: str, events: wk.PrefixCacheEvents) -> None:
        """Take a worker's change list (a snapshot replaces what was known of it)."""
        with self._lock:
            held = self._held.setdefault(worker_id, set())
            if events.snapshot:
                held.clear()
            held.update(events.stored)
            held.difference_update(events.removed)
            self._block_size[worker_id] = events.block_size

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

    def cached_tokens(self, worker_id: str, prompt: PromptBlocks) -> int:
        """Leading prompt tokens the worker is expected to hold (whole blocks)."""
        with self._lock:
            bs = self._block_size.get(worker_id)
            held = self._held.get(worker_id)
            if not bs or not held:
                return 0
            n = 0
            usable = (len(prompt.token_ids) - 1) // bs  # a worker computes the last token's block afresh
            for h in prompt.hashes(bs)[:usable]:
                if h not in held:
                    break
                n += 1
            return n * bs
