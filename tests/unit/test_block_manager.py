"""BlockManager examples: block accounting, prefix cache hits, eviction (the random-operation
property test is test_block_manager_machine.py)."""

from __future__ import annotations

import pytest

import engine.prefix_hash as prefix_hash
from engine.block_manager import BlockManager
from tests.unit.block_helpers import BS, allocated, assert_accounting, computed, make_seq

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
    seq = allocated(bm, list(range(10)))
    assert len(seq.block_table) == 3 and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == 5
    assert_accounting(bm, [seq.block_table])
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 8
    assert_accounting(bm, [])


def test_prefix_hit_reuses_computed_blocks_and_sets_num_computed_tokens():
    bm = BlockManager(16, BS)
    a = computed(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "a")
    b = allocated(bm, [1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0], "b")
    assert b.block_table[:2] == a.block_table[:2]
    assert not set(b.block_table[2:]) & set(a.block_table)
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert bm.prefix_hits == 2
    assert [bm.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    assert_accounting(bm, [a.block_table, b.block_table])


def test_partial_prefix_match_hits_only_matching_leading_blocks():
    bm = BlockManager(16, BS)
    a = computed(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    b = allocated(bm, [1, 2, 3, 4, 5, 6, 7, 0, 9], "b")  # second block differs in its last token
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    assert b.num_computed_tokens == 4
    c = allocated(bm, [0, 2, 3, 4, 5, 6, 7, 8, 9], "c")  # first block differs: nothing after it can hit
    assert c.num_computed_tokens == 0 and not set(c.block_table) & set(a.block_table)
    assert_accounting(bm, [a.block_table, b.block_table, c.block_table])


def test_block_not_yet_computed_is_never_a_hit():
    bm = BlockManager(16, BS)
    prompt = list(range(13))
    a = allocated(bm, prompt, "a")
    bm.cache_full_blocks(a)  # nothing computed yet: nothing registered
    assert bm.hash_to_block == {}
    b = allocated(bm, prompt, "b")
    assert b.num_computed_tokens == 0 and not set(b.block_table) & set(a.block_table)

    a.num_computed_tokens = 6  # one full block and half of the next
    bm.cache_full_blocks(a)
    assert len(bm.hash_to_block) == 1
    c = allocated(bm, prompt, "c")
    assert c.num_computed_tokens == 4 and c.block_table[0] == a.block_table[0]
    assert c.block_table[1] != a.block_table[1]
    assert_accounting(bm, [a.block_table, b.block_table, c.block_table])


def test_hits_only_after_cache_full_blocks():
    bm = BlockManager(16, BS)
    prompt = list(range(9))
    a = allocated(bm, prompt, "a")
    a.num_computed_tokens = 9  # computed, but not yet registered
    b = allocated(bm, prompt, "b")
    assert b.num_computed_tokens == 0
    bm.cache_full_blocks(a)
    c = allocated(bm, prompt, "c")
    assert c.num_computed_tokens == 8 and c.block_table[:2] == a.block_table[:2]


def test_no_hits_when_prefix_caching_disabled():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    prompt = list(range(9))
    a = computed(bm, prompt, "a")
    assert bm.hash_to_block == {} and a.num_registered_blocks == 0
    b = allocated(bm, prompt, "b")
    assert b.num_computed_tokens == 0 and not set(b.block_table) & set(a.block_table)
    assert bm.prefix_hits == 0


def test_hash_collision_with_different_tokens_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(prefix_hash, "chain_hash", lambda prev, tokens: b"\x01" * 16)
    bm = BlockManager(16, BS)
    a = computed(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    assert len(bm.hash_to_block) == 1  # every block hashes the same: one entry
    b = allocated(bm, [5, 6, 7, 8, 1, 2, 3, 4, 9], "b")  # same hash chain, other tokens
    assert b.num_computed_tokens == 0 and not set(b.block_table) & set(a.block_table)
    assert bm.prefix_hits == 0
    assert_accounting(bm, [a.block_table, b.block_table])


def test_hash_collision_with_equal_block_tokens_at_another_position_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(prefix_hash, "chain_hash", lambda prev, tokens: b"\x01" * 16)
    bm = BlockManager(16, BS)
    a = computed(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    # Block 0 of b rightly hits a's block 0. Block 1 of b holds tokens 1 2 3 4 at positions 4..7
    # after the prefix 1 2 3 4; a's block 0 holds the same tokens at positions 0..3 with no prefix,
    # so its K/V (RoPE position, attention context) are not b's.
    b = allocated(bm, [1, 2, 3, 4, 1, 2, 3, 4, 9], "b")
    assert b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[0], "block holding positions 0..3 served for positions 4..7"
    assert b.num_computed_tokens == 4


def test_block_with_last_token_is_never_shared():
    bm = BlockManager(16, BS)
    prompt = list(range(8))  # exact multiple of the block size
    a = computed(bm, prompt, "a")
    assert len(bm.hash_to_block) == 2  # both full blocks are cached
    b = allocated(bm, prompt, "b")
    assert b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[1]  # the last block is computed afresh
    assert b.num_computed_tokens == 4 and b.num_remaining == 4
    c = allocated(bm, prompt + [99], "c")  # one more token: now both full blocks can be hits
    assert c.block_table[:2] == a.block_table[:2] and c.num_computed_tokens == 8
    assert_accounting(bm, [a.block_table, b.block_table, c.block_table])


def test_single_block_prompt_never_hits():
    bm = BlockManager(4, BS)
    a = computed(bm, [1, 2, 3, 4], "a")
    b = allocated(bm, [1, 2, 3, 4], "b")
    assert b.num_computed_tokens == 0 and b.block_table != a.block_table


def test_freed_cached_blocks_are_reused_by_later_identical_prompt():
    bm = BlockManager(8, BS)
    prompt = list(range(11))
    a = computed(bm, prompt, "a")
    old_table = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 8
    b = allocated(bm, prompt, "b")
    assert b.block_table[:2] == old_table[:2]
    assert b.num_computed_tokens == 8
    assert bm.num_free_blocks == 8 - 3
    assert_accounting(bm, [b.block_table])


def test_free_releases_tail_first_so_head_blocks_are_evicted_last():
    bm = BlockManager(3, BS)
    a = computed(bm, list(range(12)), "a")
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
    a = computed(bm, prompt, "a")
    table = list(a.block_table)
    hashes = list(a.block_hashes)
    assert {bm.hash_to_block[h] for h in hashes} == set(table)
    bm.free(a)  # blocks keep their hashes while free
    assert all(bm.hash_to_block[h] == b for h, b in zip(hashes, table))

    # The tail was released first, so it is handed out (evicted) first.
    x = allocated(bm, [50, 51, 52, 53], "x")
    assert x.block_table == [table[2]]
    assert hashes[2] not in bm.hash_to_block
    assert bm.blocks[table[2]].hash is None and bm.blocks[table[2]].token_ids == ()
    y = allocated(bm, [60, 61, 62, 63], "y")
    assert y.block_table == [table[1]]
    assert hashes[1] not in bm.hash_to_block and hashes[0] in bm.hash_to_block
    bm.free(x)
    bm.free(y)

    b = allocated(bm, prompt, "b")  # only the head block survived eviction
    assert b.num_computed_tokens == 4 and b.block_table[0] == table[0]
    assert_accounting(bm, [b.block_table])


def test_shared_block_stays_used_until_last_reference_is_freed():
    bm = BlockManager(8, BS)
    a = computed(bm, list(range(9)), "a")
    b = allocated(bm, list(range(9)), "b")
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
    seq = allocated(bm, [1, 2, 3], "s")
    table = list(seq.block_table)
    bm.free(seq)
    with pytest.raises(AssertionError, match="double free"):
        bm.free_blocks(table)


def test_allocate_twice_asserts():
    bm = BlockManager(4, BS)
    seq = allocated(bm, [1, 2, 3], "s")
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
    computed(bm, list(range(9)), "a")
    # b would need only one fresh block (two hits), but admission counts all three.
    assert not bm.can_allocate(9)
    with pytest.raises(RuntimeError):
        bm.allocate(make_seq(list(range(9)), "b"))


def test_append_slot_adds_a_block_only_at_a_boundary():
    bm = BlockManager(4, BS)
    seq = allocated(bm, [1, 2, 3, 4], "s")
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
    seq = allocated(bm, list(range(8)), "s")
    assert bm.num_free_blocks == 0
    assert bm.can_append(seq)  # table covers every token
    seq.token_ids.append(8)
    assert not bm.can_append(seq)
