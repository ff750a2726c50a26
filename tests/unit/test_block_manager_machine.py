"""BlockManager under random operations: exact block accounting and prefix-hit soundness.

A rule-based state machine drives random operations (allocate with prefix hits, compute and
`cache_full_blocks`, append tokens + `append_slot`, free, remote reservations) and checks after
every step that no block is lost or double-counted. It also keeps a shadow "KV cache" (for each
slot, the token prefix whose K/V was written there) to check that a prefix hit only ever serves
blocks whose K/V were computed for exactly the same prefix, and that no one writes into a block
that is shared or entered in the prefix cache.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.block_manager import BlockManager
from engine.sequence import Sequence
from tests.unit.block_helpers import assert_accounting, make_seq

# ---------------------------------------------------------------------------------------------
# Property test: random operation sequences
# ---------------------------------------------------------------------------------------------

TOKENS = st.integers(min_value=0, max_value=2)  # small alphabet: prefixes repeat, so hits happen


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.seqs: dict[str, Sequence] = {}
        self.reservations: dict[str, tuple[int, list[int]]] = {}  # id -> (num_tokens, block ids)
        self.next_id = 0
        self.prompts: list[list[int]] = []  # every prompt allocated so far, to repeat them (prefix hits)

    @initialize(
        num_blocks=st.integers(min_value=3, max_value=24),
        block_size=st.sampled_from([1, 2, 4]),
        caching=st.booleans(),
    )
    def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.bs = block_size
        self.caching = caching
        # shadow KV: kv[block][slot] = the token prefix the K/V in that slot was computed with
        self.kv: list[list[tuple[int, ...] | None]] = [[None] * block_size for _ in range(num_blocks)]

    # ------------------------------------------------------------------ helpers
    def _new_id(self, prefix: str) -> str:
        self.next_id += 1
        return f"{prefix}{self.next_id}"

    def _tables(self) -> list[list[int]]:
        return [s.block_table for s in self.seqs.values()] + [ids for _, ids in self.reservations.values()]

    def _fresh(self, block_ids: list[int]) -> None:
        """Blocks just handed out by the free pool: exclusively owned and out of the prefix cache."""
        for b in block_ids:
            block = self.bm.blocks[b]
            assert block.ref_count == 1, block
            assert block.hash is None and block.token_ids == (), block
            assert b not in self.bm.hash_to_block.values(), f"evicted block {b} still in the prefix cache"
            self.kv[b] = [None] * self.bs

    def _write(self, seq: Sequence, start: int, end: int) -> None:
        """K/V for positions [start, end) of `seq` are written into its blocks."""
        for p in range(start, end):
            assert p // self.bs < len(seq.block_table), "block table does not cover a computed position"
            b = seq.block_table[p // self.bs]
            block = self.bm.blocks[b]
            assert block.ref_count == 1, f"write into shared block {b} (ref {block.ref_count})"
            assert block.hash is None, f"write into prefix-cached block {b}"
            self.kv[b][p % self.bs] = tuple(seq.token_ids[: p + 1])

    def _grow_table(self, seq: Sequence) -> bool:
        """Decode-step bookkeeping: cover all tokens, or give up (preempt) when out of blocks."""
        before = len(seq.block_table)
        if not self.bm.can_append(seq):
            assert self.bm.num_free_blocks == 0
            assert len(seq.block_table) * self.bs < len(seq.token_ids)
            self.bm.free(seq)
            del self.seqs[seq.request_id]
            return False
        self.bm.append_slot(seq)
        assert len(seq.block_table) == self.bm.blocks_needed(len(seq.token_ids))
        assert len(seq.block_table) - before <= 1
        self._fresh(seq.block_table[before:])
        return True

    # ------------------------------------------------------------------ rules
    @rule(tokens=st.lists(TOKENS, min_size=1, max_size=16))
    def allocate(self, tokens: list[int]) -> None:
        self._allocate(tokens)

    @precondition(lambda self: self.prompts)
    @rule(data=st.data(), extra=st.lists(TOKENS, max_size=5))
    def allocate_repeated_prompt(self, data: st.DataObject, extra: list[int]) -> None:
        """An earlier prompt again, possibly extended: the prefix-hit path."""
        self._allocate(data.draw(st.sampled_from(self.prompts)) + extra)

    def _allocate(self, tokens: list[int]) -> None:
        bm, bs = self.bm, self.bs
        self.prompts.append(list(tokens))
        seq = make_seq(tokens, self._new_id("s"))
        n = len(tokens)
        free_before = bm.num_free_blocks
        if not bm.can_allocate(n):
            with pytest.raises(RuntimeError):
                bm.allocate(seq)
            assert bm.num_free_blocks == free_before and seq.block_table == []
            return
        hits_before = bm.prefix_hits
        bm.allocate(seq)
        table = seq.block_table
        assert len(table) == bm.blocks_needed(n)
        assert len(set(table)) == len(table), f"a block appears twice in one table: {table}"
        cached = seq.num_computed_tokens
        assert cached == seq.num_cached_tokens and cached % bs == 0
        assert cached < n, "the block holding the last token must be computed afresh"
        hits = cached // bs
        assert bm.prefix_hits - hits_before == hits
        assert seq.num_registered_blocks == hits
        if not self.caching:
            assert hits == 0
        for i in range(hits):  # a hit serves K/V computed for exactly this prefix
            b = table[i]
            assert bm.blocks[b].ref_count >= 1
            for s in range(bs):
                assert self.kv[b][s] == tuple(tokens[: i * bs + s + 1]), f"wrong K/V served for block {i}"
        self._fresh(table[hits:])
        self.seqs[seq.request_id] = seq

    @precondition(lambda self: any(s.num_remaining > 0 for s in self.seqs.values()))
    @rule(data=st.data(), k=st.one_of(st.integers(min_value=1, max_value=4), st.just(64)))
    def compute(self, data: st.DataObject, k: int) -> None:
        rid = data.draw(st.sampled_from(sorted(r for r, s in self.seqs.items() if s.num_remaining > 0)))
        seq = self.seqs[rid]
        start = seq.num_computed_tokens
        n = min(k, seq.num_remaining)
        self._write(seq, start, start + n)
        seq.num_computed_tokens += n
        self.bm.cache_full_blocks(seq)
        full = min(seq.num_computed_tokens // self.bs, len(seq.block_table))
        if self.caching:
            assert seq.num_registered_blocks == full
            for i in range(full):
                block = self.bm.blocks[seq.block_table[i]]
                assert block.hash is not None
                assert block.token_ids == tuple(seq.token_ids[i * self.bs : (i + 1) * self.bs])
        else:
            assert not self.bm.hash_to_block

    @precondition(lambda self: any(s.num_remaining == 0 for s in self.seqs.values()))
    @rule(data=st.data(), token=TOKENS)
    def sample(self, data: st.DataObject, token: int) -> None:
        rid = data.draw(st.sampled_from(sorted(r for r, s in self.seqs.items() if s.num_remaining == 0)))
        seq = self.seqs[rid]
        seq.token_ids.append(token)
        self._grow_table(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), register=st.booleans())
    def free(self, data: st.DataObject, register: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.seqs)))
        seq = self.seqs.pop(rid)
        if register:  # as Scheduler.finish does
            self.bm.cache_full_blocks(seq)
        free_before = self.bm.num_free_blocks
        exclusive = [b for b in set(seq.block_table) if self.bm.blocks[b].ref_count == 1]
        self.bm.free(seq)
        assert seq.block_table == [] and seq.num_computed_tokens == 0 and seq.num_registered_blocks == 0
        assert self.bm.num_free_blocks == free_before + len(exclusive)

    @rule(num_tokens=st.integers(min_value=1, max_value=24))
    def reserve(self, num_tokens: int) -> None:
        bm = self.bm
        free_before = bm.num_free_blocks
        if not bm.can_allocate(num_tokens):
            with pytest.raises(RuntimeError):
                bm.allocate_blocks(num_tokens)
            assert bm.num_free_blocks == free_before
            return
        ids = bm.allocate_blocks(num_tokens)
        assert len(ids) == bm.blocks_needed(num_tokens) == len(set(ids))
        assert bm.num_free_blocks == free_before - len(ids)
        self._fresh(ids)
        self.reservations[self._new_id("x")] = (num_tokens, ids)

    @precondition(lambda self: self.reservations)
    @rule(data=st.data())
    def release_reservation(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reservations)))
        _, ids = self.reservations.pop(rid)
        free_before = self.bm.num_free_blocks
        self.bm.free_blocks(ids)
        assert self.bm.num_free_blocks == free_before + len(ids)

    @precondition(lambda self: self.reservations)
    @rule(data=st.data(), first_token=TOKENS)
    def commit_reservation(self, data: st.DataObject, first_token: int) -> None:
        """Remote K/V arrived: the reservation becomes a running sequence (as in DecodeEngine.commit)."""
        rid = data.draw(st.sampled_from(sorted(self.reservations)))
        num_tokens, ids = self.reservations.pop(rid)
        prompt = data.draw(st.lists(TOKENS, min_size=num_tokens, max_size=num_tokens))
        seq = make_seq(prompt, rid)
        seq.block_table = ids
        self._write(seq, 0, num_tokens)
        seq.num_computed_tokens = num_tokens
        seq.token_ids.append(first_token)
        self.seqs[rid] = seq
        if self._grow_table(seq):
            self.bm.cache_full_blocks(seq)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def accounting_is_exact(self) -> None:
        if not hasattr(self, "bm"):
            return
        assert_accounting(self.bm, self._tables())
        for seq in self.seqs.values():
            assert len(seq.block_table) * self.bs >= len(seq.token_ids)

    @invariant()
    def cached_blocks_are_computed(self) -> None:
        if not hasattr(self, "bm"):
            return
        for h, b in self.bm.hash_to_block.items():
            block = self.bm.blocks[b]
            assert len(block.token_ids) == self.bs
            slots = self.kv[b]
            assert all(s is not None for s in slots), f"block {b} is in the prefix cache but not computed"
            assert tuple(s[-1] for s in slots) == block.token_ids
            assert len(slots[-1]) % self.bs == 0  # a whole block, at a block-aligned position

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        for seq in list(self.seqs.values()):
            self.bm.free(seq)
        for _, ids in self.reservations.values():
            self.bm.free_blocks(ids)
        assert_accounting(self.bm, [])
        assert self.bm.num_free_blocks == self.bm.num_blocks


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_block_manager_random_operations_keep_exact_accounting = BlockManagerMachine.TestCase
