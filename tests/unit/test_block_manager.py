"""BlockManager: block accounting, prefix cache hits, eviction.

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

import engine.block_manager as block_manager_module
from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BS = 4


def make_seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(
        request_id=rid, token_ids=list(tokens), num_prompt_tokens=len(tokens), params=SamplingParams()
    )


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """Pretend a forward pass computed every token of `seq`, then register its full blocks."""
    seq.num_computed_tokens = len(seq.token_ids)
    bm.cache_full_blocks(seq)


def assert_accounting(bm: BlockManager, tables: list[list[int]]) -> None:
    bm.check_invariants(tables)
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    assert bm.num_used_blocks == len({b for t in tables for b in t})


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


# ---------------------------------------------------------------------------------------------
# Example tests
# ---------------------------------------------------------------------------------------------


def test_constructor_rejects_empty_pool():
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_allocate_gives_blocks_for_every_token_and_free_returns_blocks_to_pool():
    bm = BlockManager(8, BS)
    seq = make_seq(list(range(10)))
    bm.allocate(seq)
    assert len(seq.block_table) == 3 and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == 5
    assert_accounting(bm, [seq.block_table])
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 8
    assert_accounting(bm, [])


def test_prefix_hit_reuses_computed_blocks_and_sets_num_computed_tokens():
    bm = BlockManager(16, BS)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "a")
    bm.allocate(a)
    compute_all(bm, a)
    b = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0], "b")
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert not set(b.block_table[2:]) & set(a.block_table)
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert bm.prefix_hits == 2
    assert [bm.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    assert_accounting(bm, [a.block_table, b.block_table])


def test_partial_prefix_match_hits_only_matching_leading_blocks():
    bm = BlockManager(16, BS)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    bm.allocate(a)
    compute_all(bm, a)
    b = make_seq([1, 2, 3, 4, 5, 6, 7, 0, 9], "b")  # second block differs in its last token
    bm.allocate(b)
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    assert b.num_computed_tokens == 4
    c = make_seq([0, 2, 3, 4, 5, 6, 7, 8, 9], "c")  # first block differs: nothing after it can hit
    bm.allocate(c)
    assert c.num_computed_tokens == 0 and not set(c.block_table) & set(a.block_table)
    assert_accounting(bm, [a.block_table, b.block_table, c.block_table])


def test_block_not_yet_computed_is_never_a_hit():
    bm = BlockManager(16, BS)
    prompt = list(range(13))
    a = make_seq(prompt, "a")
    bm.allocate(a)
    bm.cache_full_blocks(a)  # nothing computed yet: nothing registered
    assert bm.hash_to_block == {}
    b = make_seq(prompt, "b")
    bm.allocate(b)
    assert b.num_computed_tokens == 0 and not set(b.block_table) & set(a.block_table)

    a.num_computed_tokens = 6  # one full block and half of the next
    bm.cache_full_blocks(a)
    assert len(bm.hash_to_block) == 1
    c = make_seq(prompt, "c")
    bm.allocate(c)
    assert c.num_computed_tokens == 4 and c.block_table[0] == a.block_table[0]
    assert c.block_table[1] != a.block_table[1]
    assert_accounting(bm, [a.block_table, b.block_table, c.block_table])


def test_hits_only_after_cache_full_blocks():
    bm = BlockManager(16, BS)
    prompt = list(range(9))
    a = make_seq(prompt, "a")
    bm.allocate(a)
    a.num_computed_tokens = 9  # computed, but not yet registered
    b = make_seq(prompt, "b")
    bm.allocate(b)
    assert b.num_computed_tokens == 0
    bm.cache_full_blocks(a)
    c = make_seq(prompt, "c")
    bm.allocate(c)
    assert c.num_computed_tokens == 8 and c.block_table[:2] == a.block_table[:2]


def test_no_hits_when_prefix_caching_disabled():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    prompt = list(range(9))
    a = make_seq(prompt, "a")
    bm.allocate(a)
    compute_all(bm, a)
    assert bm.hash_to_block == {} and a.num_registered_blocks == 0
    b = make_seq(prompt, "b")
    bm.allocate(b)
    assert b.num_computed_tokens == 0 and not set(b.block_table) & set(a.block_table)
    assert bm.prefix_hits == 0


def test_hash_collision_with_different_tokens_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(block_manager_module, "chain_hash", lambda prev, tokens: b"\x01" * 16)
    bm = BlockManager(16, BS)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    bm.allocate(a)
    compute_all(bm, a)
    assert len(bm.hash_to_block) == 1  # every block hashes the same: one entry
    b = make_seq([5, 6, 7, 8, 1, 2, 3, 4, 9], "b")  # same hash chain, other tokens
    bm.allocate(b)
    assert b.num_computed_tokens == 0 and not set(b.block_table) & set(a.block_table)
    assert bm.prefix_hits == 0
    assert_accounting(bm, [a.block_table, b.block_table])


def test_hash_collision_with_equal_block_tokens_at_another_position_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(block_manager_module, "chain_hash", lambda prev, tokens: b"\x01" * 16)
    bm = BlockManager(16, BS)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    bm.allocate(a)
    compute_all(bm, a)
    # Block 0 of b rightly hits a's block 0. Block 1 of b holds tokens 1 2 3 4 at positions 4..7
    # after the prefix 1 2 3 4; a's block 0 holds the same tokens at positions 0..3 with no prefix,
    # so its K/V (RoPE position, attention context) are not b's.
    b = make_seq([1, 2, 3, 4, 1, 2, 3, 4, 9], "b")
    bm.allocate(b)
    assert b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[0], "block holding positions 0..3 served for positions 4..7"
    assert b.num_computed_tokens == 4


def test_block_with_last_token_is_never_shared():
    bm = BlockManager(16, BS)
    prompt = list(range(8))  # exact multiple of the block size
    a = make_seq(prompt, "a")
    bm.allocate(a)
    compute_all(bm, a)
    assert len(bm.hash_to_block) == 2  # both full blocks are cached
    b = make_seq(prompt, "b")
    bm.allocate(b)
    assert b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[1]  # the last block is computed afresh
    assert b.num_computed_tokens == 4 and b.num_remaining == 4
    c = make_seq(prompt + [99], "c")  # one more token: now both full blocks can be hits
    bm.allocate(c)
    assert c.block_table[:2] == a.block_table[:2] and c.num_computed_tokens == 8
    assert_accounting(bm, [a.block_table, b.block_table, c.block_table])


def test_single_block_prompt_never_hits():
    bm = BlockManager(4, BS)
    a = make_seq([1, 2, 3, 4], "a")
    bm.allocate(a)
    compute_all(bm, a)
    b = make_seq([1, 2, 3, 4], "b")
    bm.allocate(b)
    assert b.num_computed_tokens == 0 and b.block_table != a.block_table


def test_freed_cached_blocks_are_reused_by_later_identical_prompt():
    bm = BlockManager(8, BS)
    prompt = list(range(11))
    a = make_seq(prompt, "a")
    bm.allocate(a)
    compute_all(bm, a)
    old_table = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 8
    b = make_seq(prompt, "b")
    bm.allocate(b)
    assert b.block_table[:2] == old_table[:2]
    assert b.num_computed_tokens == 8
    assert bm.num_free_blocks == 8 - 3
    assert_accounting(bm, [b.block_table])


def test_free_releases_tail_first_so_head_blocks_are_evicted_last():
    bm = BlockManager(3, BS)
    a = make_seq(list(range(12)), "a")
    bm.allocate(a)
    compute_all(bm, a)
    table = list(a.block_table)
    bm.free(a)
    handed_out = []
    for i in range(3):
        x = make_seq([7, 7, 7, i], f"x{i}")
        bm.allocate(x)
        handed_out += x.block_table
    assert handed_out == table[::-1]


def test_eviction_removes_hash_entry():
    bm = BlockManager(3, BS)
    prompt = list(range(12))
    a = make_seq(prompt, "a")
    bm.allocate(a)
    compute_all(bm, a)
    table = list(a.block_table)
    hashes = list(a.block_hashes)
    assert {bm.hash_to_block[h] for h in hashes} == set(table)
    bm.free(a)  # blocks keep their hashes while free
    assert all(bm.hash_to_block[h] == b for h, b in zip(hashes, table))

    # The tail was released first, so it is handed out (evicted) first.
    x = make_seq([50, 51, 52, 53], "x")
    bm.allocate(x)
    assert x.block_table == [table[2]]
    assert hashes[2] not in bm.hash_to_block
    assert bm.blocks[table[2]].hash is None and bm.blocks[table[2]].token_ids == ()
    y = make_seq([60, 61, 62, 63], "y")
    bm.allocate(y)
    assert y.block_table == [table[1]]
    assert hashes[1] not in bm.hash_to_block and hashes[0] in bm.hash_to_block
    bm.free(x)
    bm.free(y)

    b = make_seq(prompt, "b")  # only the head block survived eviction
    bm.allocate(b)
    assert b.num_computed_tokens == 4 and b.block_table[0] == table[0]
    assert_accounting(bm, [b.block_table])


def test_shared_block_stays_used_until_last_reference_is_freed():
    bm = BlockManager(8, BS)
    a = make_seq(list(range(9)), "a")
    bm.allocate(a)
    compute_all(bm, a)
    b = make_seq(list(range(9)), "b")
    bm.allocate(b)
    shared = a.block_table[:2]
    bm.free(a)
    assert all(bm.blocks[i].ref_count == 1 for i in shared)
    assert bm.num_free_blocks == 8 - 3
    assert_accounting(bm, [b.block_table])
    bm.free(b)
    assert bm.num_free_blocks == 8
    assert_accounting(bm, [])


def test_double_free_asserts():
    bm = BlockManager(4, BS)
    ids = bm.allocate_blocks(8)
    bm.free_blocks(ids)
    with pytest.raises(AssertionError, match="double free"):
        bm.free_blocks(ids)
    seq = make_seq([1, 2, 3], "s")
    bm.allocate(seq)
    table = list(seq.block_table)
    bm.free(seq)
    with pytest.raises(AssertionError, match="double free"):
        bm.free_blocks(table)


def test_allocate_twice_asserts():
    bm = BlockManager(4, BS)
    seq = make_seq([1, 2, 3], "s")
    bm.allocate(seq)
    with pytest.raises(AssertionError):
        bm.allocate(seq)


def test_allocation_beyond_capacity_raises_and_leaks_nothing():
    bm = BlockManager(4, BS)
    with pytest.raises(RuntimeError):
        bm.allocate(make_seq(list(range(17))))
    with pytest.raises(RuntimeError):
        bm.allocate_blocks(17)
    assert bm.num_free_blocks == 4
    held = bm.allocate_blocks(12)
    big = make_seq(list(range(5)), "big")
    with pytest.raises(RuntimeError):
        bm.allocate(big)
    with pytest.raises(RuntimeError):
        bm.allocate_blocks(5)
    assert big.block_table == [] and bm.num_free_blocks == 1
    assert_accounting(bm, [held])
    bm.allocate_blocks(4)  # exactly the last block still works
    assert bm.num_free_blocks == 0


def test_can_allocate_is_conservative_about_prefix_hits():
    bm = BlockManager(3, BS)
    a = make_seq(list(range(9)), "a")
    bm.allocate(a)
    compute_all(bm, a)
    # b would need only one fresh block (two hits), but admission counts all three.
    assert not bm.can_allocate(9)
    with pytest.raises(RuntimeError):
        bm.allocate(make_seq(list(range(9)), "b"))


def test_append_slot_adds_a_block_only_at_a_boundary():
    bm = BlockManager(4, BS)
    seq = make_seq([1, 2, 3, 4], "s")
    bm.allocate(seq)
    seq.num_computed_tokens = 4
    seq.token_ids.append(5)
    assert bm.can_append(seq)
    bm.append_slot(seq)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 2
    seq.token_ids.append(6)
    bm.append_slot(seq)  # still inside the second block
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 2
    assert_accounting(bm, [seq.block_table])


def test_can_append_false_when_a_block_is_needed_and_pool_is_empty():
    bm = BlockManager(2, BS)
    seq = make_seq(list(range(8)), "s")
    bm.allocate(seq)
    assert bm.num_free_blocks == 0
    assert bm.can_append(seq)  # table covers every token
    seq.token_ids.append(8)
    assert not bm.can_append(seq)
