"""Releasing the blocks outside a model's sliding window (BlockManager.release_outside_window, from
the scheduler) keeps the block manager's accounting exact: shared prefix-cache blocks stay with
their other holders, preemption and recompute free only what a sequence still holds, and the
prefill role never releases (its KV sender ships every block of a prompt)."""

from __future__ import annotations

from engine.block_manager import RELEASED, BlockManager
from engine.scheduler import Scheduler
from tests.unit.scheduler_helpers import BS, check_state, make_seq, step

WINDOW = 6  # keys a query sees, itself included


def _sched(num_blocks: int = 64, caching: bool = True, handoff: bool = False, budget: int = 64,
           window: int = WINDOW) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS, caching), budget, 16, handoff_after_prefill=handoff,
                     kv_window=window)


def _run(sched: Scheduler) -> None:
    while sched.has_work():
        step(sched)
        for s in sched.running:  # every block a query to come can see is held
            first_key = max(0, s.num_computed_tokens - sched.kv_window + 1)
            assert RELEASED not in s.block_table[first_key // BS:]


def test_a_shared_prefix_block_stays_with_its_other_holder():
    sched = _sched()
    prompt = list(range(100, 124))  # 6 full blocks
    a = make_seq("a", prompt, max_tokens=30)
    sched.add(a)
    step(sched)
    step(sched)  # a releases its leading blocks
    released = a.num_released_blocks
    assert released >= 3 and a.block_table[:released] == [RELEASED] * released
    b = make_seq("b", prompt, max_tokens=2)
    sched.add(b)
    step(sched)  # b hits the prompt's cached blocks, the released ones included
    assert b.num_cached_tokens == 20 and RELEASED not in b.block_table
    bm = sched.bm
    assert all(bm.blocks[block].ref_count == 1 for block in b.block_table[:released])  # b's alone
    _run(sched)
    assert bm.num_free_blocks == bm.num_blocks


def test_preemption_and_recompute_with_released_blocks():
    sched = _sched(num_blocks=10, budget=16, window=12)  # three windows of 12 keys do not fit at once
    seqs = [make_seq(f"s{i}", 9 + i, max_tokens=40) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    _run(sched)
    assert all(s.num_output_tokens == 40 for s in seqs)
    assert sched.num_preemptions > 0
    assert sched.bm.num_free_blocks == sched.bm.num_blocks


def test_without_the_prefix_cache_and_with_a_window_inside_one_block():
    sched = _sched(num_blocks=32, caching=False, window=2)
    seq = make_seq("a", 13, max_tokens=30)
    sched.add(seq)
    held = []
    while sched.has_work():
        step(sched)
        held.append(len(seq.block_table) - seq.num_released_blocks)
    assert max(held[1:-1]) <= 2


def test_the_prefill_role_releases_nothing():
    sched = _sched(handoff=True, budget=8)
    seq = make_seq("a", 30, max_tokens=1)
    sched.add(seq)
    while not seq.is_finished:
        step(sched)
        assert seq.num_released_blocks == 0
    check_state(sched)
