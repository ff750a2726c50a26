"""Paged KV cache bookkeeping: block ids, reference counts and the prefix cache. Pure Python.

A block holds `block_size` consecutive tokens of one sequence. A sequence's `block_table[i]` is the
block with its tokens `[i*bs, (i+1)*bs)`:

    tokens     t0 .. t15 | t16 .. t31 | t32 t33 _ _ ...
    block_table   [  7   ,     2      ,     9          ]   (bs = 16; block 9 is partly filled)

Prefix cache: every *full* block whose K/V has been computed gets a chain hash
`h_i = H(h_{i-1}, tokens of block i)` and is entered in `hash_to_block`. A later sequence whose
leading full blocks hash the same reuses them (ref count + 1) after comparing the stored token ids and the
block they follow, so a hash collision can never serve the wrong K/V. Blocks are hashed only after their K/V exist
(`cache_full_blocks`), never at allocation, so a hit never points at a block still being computed.
A freed block keeps its hash and content until it is handed out again (least recently freed first),
so a preempted or repeated prompt can still hit it.

Sliding windows (`release_outside_window`): when every layer of the model attends only to its last
`window` positions, a running sequence's leading blocks that no later query can see are given back
(ref count - 1, so a block shared through the prefix cache stays with its other holders, and a
freed one keeps its hash until handed out again); their table entries become RELEASED.

Offload tier (`tier`, engine/kv_tier.py): a hashed block about to be handed out afresh is first
written to the node's tier; a prompt's leading blocks missing from the cache are looked up there
next and read into fresh blocks, which then enter the prefix cache like computed ones.

Invariants (checked by `check_invariants`, pinned by property tests): every block is either free
(ref 0, in the free list) or used (ref > 0, not in the free list); ref counts equal the number of
block-table entries that name the block (RELEASED entries name none).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from engine.cache_events import CacheEvents
from engine.prefix_hash import extend_hashes
from engine.sequence import Sequence

RELEASED = -1  # a block-table entry whose block was given back (outside every sliding window)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: tuple[int, ...] = ()
    epoch: int = 0  # bumped each time the block is handed out afresh
    parent: tuple[int, int] | None = None  # (block id, epoch) of the block before it when cached
    parent_hash: bytes | None = None  # the hash of the block before it (None: the first block)


class BlockTier(Protocol):
    """Where evicted blocks go and come back from (engine/kv_tier.py's TierLink)."""

    def holds(self, h: bytes) -> bool: ...
    def save(self, block_id: int, h: bytes, parent: bytes | None, token_ids: tuple[int, ...]) -> bool: ...
    def load(self, block_id: int, h: bytes, parent: bytes | None, token_ids: tuple[int, ...]) -> bool: ...


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 tier: BlockTier | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Ordered by time of release: popitem(last=False) hands out the least recently freed block.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[bytes, int] = {}
        self.prefix_hits = 0  # blocks served from the prefix cache, lifetime (the tier's included)
        self.tier = tier if enable_prefix_caching else None
        self.tier_hits = 0  # of those, blocks read back from the offload tier
        self.events = CacheEvents()  # hashes entered and evicted, for the router's prefix index

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        """Conservative: ignores prefix hits, which can only lower the need."""
        return self.blocks_needed(num_tokens) <= len(self._free)

    # ------------------------------------------------------------------ allocation
    def _take_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict its prefix-cache entry (to the tier, if there is one)
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
                self.events.removed(block.hash)
                if self.tier is not None:
                    self.tier.save(block_id, block.hash, block.parent_hash, block.token_ids)
            block.hash, block.token_ids, block.parent, block.parent_hash = None, (), None, None
        block.epoch += 1
        block.ref_count = 1
        return block_id

    def _acquire(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` blocks for all of its tokens, reusing prefix-cached full blocks.

        Sets `seq.num_computed_tokens` to the cached length. At least the last block is always
        computed afresh, so the step that follows has a position to take logits from and never
        writes into a block shared with another sequence.
        """
        assert not seq.block_table, f"{seq.request_id} already holds blocks"
        n = len(seq.token_ids)
        if not self.can_allocate(n):
            raise RuntimeError(f"not enough free KV blocks for {n} tokens")
        bs = self.block_size
        num_full = (n - 1) // bs  # full blocks that can be hits (never the block holding the last token)
        hashes = self._hashes(seq, num_full)
        table: list[int] = []
        if self.enable_prefix_caching and seq.params.prompt_logprobs is None:  # those need every prompt logit
            for i in range(num_full):
                block_id = self.hash_to_block.get(hashes[i])
                if block_id is None or not self._confirm(block_id, table, seq.token_ids[i * bs : (i + 1) * bs]):
                    break
                self._acquire(block_id)
                table.append(block_id)
            if self.tier is not None:
                self._recall(seq, hashes, table)
        hits = len(table)
        self.prefix_hits += hits
        # fresh blocks in ascending order: a transfer into them copies each run of consecutive ids as one slice
        table.extend(sorted(self._take_free() for _ in range(self.blocks_needed(n) - hits)))
        seq.block_table = table
        seq.num_registered_blocks = hits
        seq.num_cached_tokens = hits * bs
        seq.num_computed_tokens = hits * bs

    def _recall(self, seq: Sequence, hashes: list[bytes], table: list[int]) -> None:
        """Extend `table` (the prompt's blocks found in the cache) with the next blocks read back
        from the tier, each into a fresh block entered in the prefix cache, until one is missing."""
        bs = self.block_size
        for i in range(len(table), len(hashes)):
            if not self.tier.holds(hashes[i]):
                return
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            parent = hashes[i - 1] if i else None
            block_id = self._take_free()
            if not self.tier.load(block_id, hashes[i], parent, tokens):
                self.free_blocks([block_id])
                return
            self._register(block_id, hashes[i], tokens, table, parent)
            table.append(block_id)
            self.tier_hits += 1

    def _register(self, block_id: int, h: bytes, tokens: tuple[int, ...], table: list[int],
                  parent: bytes | None) -> None:
        """Enter a block whose K/V exist into the prefix cache, after the blocks of `table`."""
        block = self.blocks[block_id]
        block.hash, block.token_ids, block.parent, block.parent_hash = h, tokens, self._parent_of(table), parent
        if self.hash_to_block.setdefault(h, block_id) == block_id:
            self.events.stored(h)

    def _parent_of(self, table: list[int]) -> tuple[int, int] | None:
        return (table[-1], self.blocks[table[-1]].epoch) if table else None

    def _confirm(self, block_id: int, table: list[int], token_ids: list[int]) -> bool:
        """A hash hit counts only if the block holds these tokens *after the same blocks*: its own
        token ids and its parent (by id and epoch) are compared, so even a hash collision cannot
        serve K/V computed for another position or context."""
        block = self.blocks[block_id]
        return block.token_ids == tuple(token_ids) and block.parent == self._parent_of(table)

    def allocate_blocks(self, num_tokens: int) -> list[int]:
        """Fresh blocks for `num_tokens` tokens whose K/V will arrive from elsewhere (no prefix hits),
        in ascending order: the same blocks the free list gives, but a transfer copies each run of
        consecutive ids as one slice (freed blocks come back in reverse, so unsorted they would be
        one run per block)."""
        if not self.can_allocate(num_tokens):
            raise RuntimeError(f"not enough free KV blocks for {num_tokens} tokens")
        return sorted(self._take_free() for _ in range(self.blocks_needed(num_tokens)))

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Give `child` (another choice of `parent`'s prompt) the parent's prompt KV: the blocks
        before the one holding the prompt's last token are shared (ref count + 1, never written
        again: both sequences write only after the prompt), that block is copied into a fresh one,
        as both will write their own next tokens into it (copy-on-write, done at once because the
        next step writes). The child recomputes the prompt's last token, for its own first sample.
        Returns (source, copy) for the caller to copy the KV of; None, and nothing taken, when no
        block is free."""
        last = (parent.num_prompt_tokens - 1) // self.block_size
        assert parent.num_released_blocks == 0, "a sequence with choices to fork releases no blocks before"
        if not self._free:
            return None
        shared = parent.block_table[:last]
        for block_id in shared:
            self._acquire(block_id)
        copy = self._take_free()
        child.block_table = [*shared, copy]
        child.num_registered_blocks = min(parent.num_registered_blocks, last)
        child.num_cached_tokens = parent.num_cached_tokens
        child.num_computed_tokens = parent.num_prompt_tokens - 1
        return parent.block_table[last], copy

    def free_blocks(self, block_ids: list[int]) -> None:
        # Release in reverse so a sequence's head blocks (most shareable) are evicted last.
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    def free(self, seq: Sequence) -> None:
        self.free_blocks([b for b in seq.block_table if b != RELEASED])
        seq.block_table = []
        seq.num_registered_blocks = 0
        seq.num_released_blocks = 0
        seq.num_computed_tokens = 0

    def release_outside_window(self, seq: Sequence, window: int, keep_first: int = 0) -> int:
        """Give back `seq`'s leading blocks whose tokens are all older than any query to come can see,
        when every layer attends to at most `window` positions (itself included): the next query is
        at `num_computed_tokens`, so keys before num_computed_tokens - window + 1 are dead. With the
        prefix cache the block before the first unregistered one is kept, as registering a block
        names the block it follows (`_parent_of`). `keep_first`: blocks at the start every query
        still sees (a KV bound's sinks); those between them and the window go. Returns how many
        blocks were given back."""
        bs = self.block_size
        end = min((seq.num_computed_tokens - window + 1) // bs, len(seq.block_table) - 1)
        if self.enable_prefix_caching:
            end = min(end, seq.num_registered_blocks - 1)
        start = max(seq.num_released_blocks, keep_first)
        if end <= start:
            return 0
        self.free_blocks(seq.block_table[start:end])
        seq.block_table[start:end] = [RELEASED] * (end - start)
        seq.num_released_blocks = end
        return end - start

    def can_append(self, seq: Sequence) -> bool:
        return len(seq.block_table) * self.block_size >= len(seq.token_ids) or len(self._free) > 0

    def append_slot(self, seq: Sequence) -> None:
        """Make sure the block table covers every token of `seq` (one new block at a boundary)."""
        while len(seq.block_table) * self.block_size < len(seq.token_ids):
            seq.block_table.append(self._take_free())

    # ------------------------------------------------------------------ prefix cache
    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        return extend_hashes(seq.block_hashes, seq.token_ids, self.block_size, num_blocks)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Enter the sequence's full blocks whose K/V are computed into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        if num_full <= seq.num_registered_blocks:
            return
        hashes = self._hashes(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            if self.blocks[seq.block_table[i]].hash is None:
                self._register(seq.block_table[i], hashes[i], tuple(seq.token_ids[i * bs : (i + 1) * bs]),
                               seq.block_table[:i], hashes[i - 1] if i else None)
        seq.num_registered_blocks = num_full

    # ------------------------------------------------------------------ checks
    def check_invariants(self, tables: list[list[int]]) -> None:
        """Assert the accounting is exact given every live block table (for tests)."""
        refs = [0] * self.num_blocks
        for table in tables:
            for block_id in table:
                if block_id != RELEASED:
                    refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], (block, refs[block.block_id])
            assert (block.ref_count == 0) == (block.block_id in self._free), block
        for h, block_id in self.hash_to_block.items():
            assert self.blocks[block_id].hash == h
