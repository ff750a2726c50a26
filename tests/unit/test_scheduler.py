"""Scheduler policy, driven with a real BlockManager and fake sampled tokens (no model).

Each step: `schedule()`, then `postprocess()` with one fake token per item that `completes`.
After every step the block accounting is checked against the live block tables. Finishing,
aborting and the prefill/decode hand-off: test_scheduler_lifecycle.py.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from engine.sequence import SeqStatus
from tests.unit.scheduler_helpers import (
    BS,
    TOKEN,
    added,
    assert_all_free,
    make_sched,
    make_seq,
    run_to_completion,
    step,
)

# ---------------------------------------------------------------------------------------------
# Policy
# ---------------------------------------------------------------------------------------------


def test_prefill_first_new_prompts_run_before_decodes():
    sched = make_sched(mixed=False)
    a = added(sched, "a", 6, max_tokens=8)
    batch, sampled = step(sched)
    assert [(i.seq, i.num_tokens) for i in batch] == [(a, 6)] and sampled == [a]
    batch, _ = step(sched)
    assert [(i.seq, i.num_tokens) for i in batch] == [(a, 1)]  # decode
    b = added(sched, "b", 5, max_tokens=8)
    batch, _ = step(sched)
    assert [(i.seq, i.num_tokens) for i in batch] == [(b, 5)]  # a does not decode in a prefill step
    batch, _ = step(sched)
    assert [(i.seq, i.num_tokens) for i in batch] == [(a, 1), (b, 1)]
    run_to_completion(sched)
    assert_all_free(sched)


def test_mixed_steps_put_decode_rows_first_then_prompt_chunks():
    sched = make_sched(budget=8)
    a = added(sched, "a", 6, max_tokens=8)
    batch, _ = step(sched)
    assert [(i.seq, i.num_tokens) for i in batch] == [(a, 6)]
    b = added(sched, "b", 12, max_tokens=8)
    batch, _ = step(sched)  # a decodes in the same pass as b's first chunk, inside the budget
    assert [(i.seq, i.num_tokens) for i in batch] == [(a, 1), (b, 7)]
    batch, _ = step(sched)
    assert [(i.seq, i.num_tokens, i.completes) for i in batch] == [(a, 1, True), (b, 5, True)]
    batch, _ = step(sched)
    assert [(i.seq, i.num_tokens) for i in batch] == [(a, 1), (b, 1)]
    run_to_completion(sched)
    assert_all_free(sched)


def test_decode_step_schedules_every_running_sequence_one_token():
    sched = make_sched()
    seqs = [make_seq(f"s{i}", 3 + i, max_tokens=5) for i in range(4)]
    for s in seqs:
        sched.add(s)
    step(sched)
    batch, sampled = step(sched)
    assert [i.seq for i in batch] == seqs and all(i.num_tokens == 1 and i.completes for i in batch)
    assert sampled == seqs


def test_long_prompt_is_chunked_under_token_budget():
    sched = make_sched(budget=8)
    a = added(sched, "a", 21, max_tokens=2)
    chunks = []
    while a.num_output_tokens == 0:
        batch, _ = step(sched)
        assert sum(i.num_tokens for i in batch) <= 8
        chunks += [(i.num_tokens, i.completes) for i in batch if i.seq is a]
    assert chunks == [(8, False), (8, False), (5, True)]
    assert sum(n for n, _ in chunks) == 21
    run_to_completion(sched)
    assert a.finish_reason == "length" and a.num_output_tokens == 2
    assert_all_free(sched)


def test_chunk_leaving_one_token_finishes_in_a_later_step():
    sched = make_sched(budget=8)
    a = added(sched, "a", 9, max_tokens=1)
    chunks = []
    while not a.is_finished:
        batch, _ = step(sched)
        chunks += [(i.num_tokens, i.completes) for i in batch if i.seq is a]
    assert chunks == [(8, False), (1, True)]
    assert_all_free(sched)


def test_token_budget_is_shared_and_unfinished_chunks_go_first():
    sched = make_sched(budget=8)
    a = make_seq("a", 5, max_tokens=1)
    b = make_seq("b", 10, max_tokens=1)
    c = make_seq("c", 3, max_tokens=1)
    for s in (a, b, c):
        sched.add(s)
    batch, _ = step(sched)
    assert [(i.seq.request_id, i.num_tokens, i.completes) for i in batch] == [("a", 5, True), ("b", 3, False)]
    batch, _ = step(sched)  # b's unfinished prompt first, then c is admitted into what is left
    assert [(i.seq.request_id, i.num_tokens, i.completes) for i in batch] == [("b", 7, True), ("c", 1, False)]
    run_to_completion(sched)
    assert all(s.finish_reason == "length" for s in (a, b, c))
    assert_all_free(sched)


@given(
    prompts=st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=6),
    budget=st.integers(min_value=1, max_value=24),
)
@settings(max_examples=60, deadline=None)
@pytest.mark.parametrize("mixed", [True, False])
def test_every_step_respects_budget_and_chunks_sum_to_prompt(mixed, prompts, budget):
    sched = make_sched(num_blocks=128, budget=budget, mixed=mixed)
    seqs = [make_seq(f"s{i}", n, max_tokens=2) for i, n in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    prefill_chunks: dict[str, list[tuple[int, bool]]] = {s.request_id: [] for s in seqs}
    while sched.has_work():
        batch, _ = step(sched)
        # prompt chunks stay inside the budget left by the decode rows (one token per running sequence)
        decode_rows = sum(1 for i in batch if i.num_tokens == 1)
        chunks = sum(i.num_tokens for i in batch if i.num_tokens > 1)
        assert chunks <= max(0, budget - (decode_rows if mixed else 0))
        for i in batch:
            if i.outputs_before == 0:
                prefill_chunks[i.seq.request_id].append((i.num_tokens, i.completes))
    for s, n in zip(seqs, prompts):
        chunks = prefill_chunks[s.request_id]
        assert sum(k for k, _ in chunks) == n
        assert [c for _, c in chunks] == [False] * (len(chunks) - 1) + [True]
        assert s.num_output_tokens == 2
    assert_all_free(sched)


def test_max_num_seqs_caps_running_sequences():
    sched = make_sched(max_num_seqs=2)
    seqs = [make_seq(f"s{i}", 4, max_tokens=3) for i in range(5)]
    for s in seqs:
        sched.add(s)
    batch, _ = step(sched)
    assert [i.seq for i in batch] == seqs[:2]
    assert sched.running == seqs[:2] and list(sched.waiting) == seqs[2:]
    max_running = 0
    while sched.has_work():
        step(sched)
        max_running = max(max_running, len(sched.running))
    assert max_running == 2
    assert all(s.num_output_tokens == 3 for s in seqs)
    assert_all_free(sched)


def test_admission_is_fcfs_and_head_of_line_waits_for_blocks():
    sched = make_sched(num_blocks=8)
    a = added(sched, "a", 20, max_tokens=4)  # 5 blocks
    step(sched)
    b = make_seq("b", 16, max_tokens=1)  # 4 blocks: does not fit in the 3 left
    c = make_seq("c", 4, max_tokens=1)  # 1 block: would fit, but must not overtake b
    sched.add(b)
    sched.add(c)
    batch, _ = step(sched)
    assert [i.seq for i in batch] == [a]
    assert list(sched.waiting) == [b, c]
    order = []
    while sched.has_work():
        batch, _ = step(sched)
        order += [i.seq for i in batch if i.computed_before == 0]
    assert order.index(b) < order.index(c)
    assert all(s.is_finished for s in (a, b, c))
    assert_all_free(sched)


# ---------------------------------------------------------------------------------------------
# Preemption and deadlock freedom
# ---------------------------------------------------------------------------------------------


def test_preemption_picks_newest_running_and_requeues_it_at_head():
    sched = make_sched(num_blocks=6, caching=False)
    a, b, c = (make_seq(n, 8, max_tokens=3) for n in "abc")  # 2 blocks each: the cache is full
    d = make_seq("d", 4, max_tokens=1)
    for s in (a, b, c):
        sched.add(s)
    step(sched)
    assert sched.bm.num_free_blocks == 0 and all(len(s) == 9 for s in (a, b, c))
    sched.add(d)
    batch, _ = step(sched)  # every sequence needs a third block: c (newest) is preempted
    assert [i.seq for i in batch] == [a, b]
    assert sched.num_preemptions == 1
    assert sched.running == [a, b]
    assert list(sched.waiting) == [c, d]  # at the head, ahead of d
    assert c.status == SeqStatus.WAITING and c.block_table == [] and c.num_computed_tokens == 0
    assert c.token_ids[:8] == make_seq("c", 8).token_ids and len(c) == 9  # its sampled token is kept

    c_chunks = []
    while sched.has_work():
        batch, _ = step(sched)
        c_chunks += [i.num_tokens for i in batch if i.seq is c]
    # on resumption c recomputes all of its tokens (prompt and the generated one) in one chunk
    assert c_chunks[0] == 9
    assert c.finish_reason == "length" and c.output_token_ids == [TOKEN] * 3
    assert all(s.finish_reason == "length" for s in (a, b, d))
    assert_all_free(sched)


def test_preempted_sequence_resumes_from_its_own_cached_blocks():
    sched = make_sched(num_blocks=7)
    a, b = make_seq("a", 12, max_tokens=8), make_seq("b", 12, max_tokens=8)
    for s in (a, b):
        sched.add(s)
    preempted_at = None
    while sched.has_work():
        batch, _ = step(sched)
        if sched.num_preemptions and preempted_at is None:
            preempted_at = len(b)
            assert list(sched.waiting) == [b]
        if preempted_at is not None and any(i.seq is b and i.num_tokens > 1 for i in batch):
            resumed = [i for i in batch if i.seq is b][0]
            assert b.num_cached_tokens > 0 and resumed.computed_before == b.num_cached_tokens
            assert resumed.completes  # the rest of b's tokens (prompt and generated) in one chunk
            assert resumed.num_tokens == preempted_at - b.num_cached_tokens
            break
    assert preempted_at is not None
    run_to_completion(sched)
    assert a.output_token_ids == b.output_token_ids == [TOKEN] * 8
    assert_all_free(sched)


def test_no_deadlock_with_tiny_cache():
    # 8 blocks of 4 = 32 slots; each sequence needs up to 7 of the 8 blocks.
    sched = make_sched(num_blocks=8, budget=16, max_num_seqs=8)
    seqs = [make_seq(f"s{i}", 10 + i % 4, max_tokens=14, max_model_len=32) for i in range(8)]
    for s in seqs:
        sched.add(s)
    # Run one at a time, the 8 sequences need about 8 * (14 decode + 1 prefill) steps; preemption and
    # recomputation add a few. 300 steps is a generous bound that still catches a livelock.
    run_to_completion(sched, max_steps=300)
    assert sched.num_preemptions > 0  # the cache really was too small
    for s in seqs:
        assert s.is_finished and s.finish_reason == "length" and s.num_output_tokens == 14
        assert s.output_token_ids == [TOKEN] * 14
    assert_all_free(sched)


@given(
    data=st.data(),
    num_blocks=st.integers(min_value=2, max_value=10),
    budget=st.integers(min_value=1, max_value=20),
    max_num_seqs=st.integers(min_value=1, max_value=6),
    caching=st.booleans(),
)
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_workloads_always_finish_and_free_every_block(data, num_blocks, budget, max_num_seqs, caching):
    max_model_len = num_blocks * BS  # the runner guarantees one sequence always fits
    sched = make_sched(num_blocks=num_blocks, budget=budget, max_num_seqs=max_num_seqs, caching=caching)
    n = data.draw(st.integers(min_value=1, max_value=6))
    seqs = []
    for i in range(n):
        prompt = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=max_model_len - 1))
        max_tokens = data.draw(st.integers(min_value=1, max_value=max_model_len))
        seqs.append(make_seq(f"s{i}", prompt, max_tokens=max_tokens, max_model_len=max_model_len))
    for s in seqs:
        sched.add(s)
    total = sum(len(s) + s.params.max_tokens for s in seqs)
    run_to_completion(sched, max_steps=50 * total)
    for s in seqs:
        assert s.is_finished and s.finish_reason == "length"
        assert s.num_output_tokens == min(s.params.max_tokens, max_model_len - s.num_prompt_tokens)
    assert_all_free(sched)


# ---------------------------------------------------------------------------------------------
