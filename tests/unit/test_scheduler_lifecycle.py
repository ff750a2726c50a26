"""Scheduler lifecycle: finishing (max tokens, eos, stop ids, max model len), aborting, the
prefill/decode hand-off and remote-prefilled sequences (real BlockManager, fake tokens, no model)."""

from __future__ import annotations

from engine.sequence import Sequence
from tests.unit.scheduler_helpers import (
    TOKEN,
    added,
    assert_all_free,
    check_state,
    make_sched,
    make_seq,
    run_to_completion,
    step,
)

# Finishing, aborting, handoff
# ---------------------------------------------------------------------------------------------


def test_finish_on_max_tokens_frees_blocks():
    sched = make_sched()
    a = added(sched, "a", 6, max_tokens=3)
    for _ in range(2):
        step(sched)
        assert not a.is_finished and a.block_table
    _, sampled = step(sched)
    assert sampled == [a]  # the finishing token is still reported
    assert a.is_finished and a.finish_reason == "length" and a.num_output_tokens == 3
    assert a.block_table == [] and a not in sched.running and not sched.has_work()
    assert_all_free(sched)


def test_finish_on_eos_frees_blocks():
    sched = make_sched()
    a = added(sched, "a", 6, max_tokens=10, eos=frozenset({2}))
    step(sched)
    step(sched, token=lambda s: 2)
    assert a.finish_reason == "stop" and a.output_token_ids == [TOKEN, 2]
    assert a.is_finished and a.block_table == []
    assert_all_free(sched)


def test_ignore_eos_keeps_generating():
    sched = make_sched()
    a = added(sched, "a", 6, max_tokens=3, eos=frozenset({2}), ignore_eos=True)
    run_to_completion(sched, token=lambda s: 2)
    assert a.finish_reason == "length" and a.output_token_ids == [2, 2, 2]
    assert_all_free(sched)


def test_finish_on_stop_token_ids_frees_blocks():
    sched = make_sched()
    a = make_seq("a", 6, max_tokens=10, stop_token_ids=[42])
    b = make_seq("b", 6, max_tokens=10, stop_token_ids=[43])
    sched.add(a)
    sched.add(b)
    step(sched)
    _, sampled = step(sched, token=lambda s: 42)
    assert sampled == [a, b]
    assert a.finish_reason == "stop" and a.is_finished and a.block_table == []
    assert b.finish_reason is None and b in sched.running
    sched.abort("b")
    assert_all_free(sched)


def test_finish_on_max_model_len():
    sched = make_sched()
    a = added(sched, "a", 6, max_tokens=100, max_model_len=9)
    run_to_completion(sched)
    assert a.finish_reason == "length" and len(a) == 9
    assert_all_free(sched)


def test_abort_frees_blocks():
    sched = make_sched(num_blocks=8)
    a = make_seq("a", 12, max_tokens=10)
    b = make_seq("b", 12, max_tokens=10)
    c = make_seq("c", 12, max_tokens=10)  # does not fit: stays waiting
    for s in (a, b, c):
        sched.add(s)
    step(sched)
    assert [s.request_id for s in sched.running] == ["a", "b"] and list(sched.waiting) == [c]
    assert sched.abort("a") is a
    assert a.finish_reason == "abort" and a.is_finished and a.block_table == []
    assert a not in sched.running
    assert sched.abort("c") is c
    assert c.finish_reason == "abort" and c.is_finished and not sched.waiting
    assert sched.abort("nope") is None
    check_state(sched)
    assert sched.bm.num_used_blocks == len(b.block_table)
    assert sched.abort("b") is b
    assert not sched.has_work()
    assert_all_free(sched)


def test_abort_mid_chunked_prefill_frees_blocks_and_caches_computed_prefix():
    sched = make_sched(budget=8)
    prompt = list(range(20, 40))
    added(sched, "a", prompt, max_tokens=2)
    step(sched)  # 8 of 20 tokens computed
    sched.abort("a")
    assert_all_free(sched)
    b = added(sched, "b", prompt, max_tokens=1)
    batch, _ = step(sched)
    assert b.num_cached_tokens == 8 and batch[0].num_tokens == 8  # 20 - 8 cached, under budget 8
    run_to_completion(sched)
    assert_all_free(sched)


def test_handoff_after_prefill_releases_sequence_after_first_token():
    sched = make_sched(budget=8, handoff=True)
    prompt = list(range(20, 32))
    a = added(sched, "a", prompt, max_tokens=10)
    _, sampled = step(sched)
    assert sampled == [] and a in sched.running
    _, sampled = step(sched)
    assert sampled == [a]
    assert a.output_token_ids == [TOKEN] and a.finish_reason is None
    assert a.is_finished and a.block_table == [] and not sched.has_work()
    assert_all_free(sched)
    # its computed full blocks stay in the prefix cache for the next identical prompt
    b = added(sched, "b", prompt, max_tokens=10)
    batch, _ = step(sched)
    assert b.num_cached_tokens == 8 and batch[0].num_tokens == 4 and b.output_token_ids == [TOKEN]
    assert_all_free(sched)


def test_remote_prefilled_sequence_joins_running_and_decodes():
    sched = make_sched(num_blocks=8)
    bm = sched.bm
    prompt = list(range(8))  # exact multiple of the block size: the first decode needs a new block
    a = make_seq("a", prompt, max_tokens=3)
    a.block_table = bm.allocate_blocks(len(prompt))
    a.num_computed_tokens = len(prompt)
    a.append_token(TOKEN)  # first token, sampled by the prefill worker
    sched.add_running(a)
    batch, _ = step(sched)
    assert [(i.seq, i.num_tokens) for i in batch] == [(a, 1)]
    assert len(a.block_table) == 3
    run_to_completion(sched)
    assert a.finish_reason == "length" and a.num_output_tokens == 3
    assert_all_free(sched)


def test_prefix_hit_skips_computed_tokens():
    sched = make_sched(budget=8)
    prompt = list(range(100, 116))
    a = added(sched, "a", prompt, max_tokens=1)
    step(sched)  # a[0:8] computed and cached
    b = added(sched, "b", prompt, max_tokens=1)
    batch, _ = step(sched)  # a's last chunk uses the whole budget: b waits
    assert [i.seq for i in batch] == [a] and list(sched.waiting) == [b]
    batch, _ = step(sched)
    assert [(i.seq, i.num_tokens, i.completes) for i in batch] == [(b, 4, True)]
    assert b.num_cached_tokens == 12 and sched.bm.prefix_hits == 3
    assert_all_free(sched)


def test_all_blocks_free_after_mixed_workload():
    sched = make_sched(num_blocks=12, budget=10, max_num_seqs=3)
    seqs = [
        make_seq(f"s{i}", 3 + 5 * i, max_tokens=4 + i, eos=frozenset({2}), max_model_len=48) for i in range(6)
    ]
    for s in seqs:
        sched.add(s)

    def sample(s: Sequence) -> int:
        return 2 if s.request_id == "s3" and s.num_output_tokens == 1 else TOKEN

    steps = 0
    while sched.has_work():
        step(sched, token=sample)
        steps += 1
        if steps == 3:
            sched.abort("s5")
        assert steps < 1000
    assert seqs[3].finish_reason == "stop" and seqs[5].finish_reason == "abort"
    assert all(s.finish_reason == "length" for i, s in enumerate(seqs) if i not in (3, 5))
    assert_all_free(sched)


def test_queue_time_ends_when_a_sequence_is_first_scheduled_and_not_after_preemption():
    from engine.block_manager import BlockManager as _BM
    from engine.sampling_params import SamplingParams as _SP
    from engine.scheduler import Scheduler as _Sched
    from engine.sequence import Sequence as _Seq

    sched = _Sched(_BM(8, 4), max_num_batched_tokens=64, max_num_seqs=8)
    seq = _Seq("q", list(range(3, 9)), 6, _SP(max_tokens=4))
    sched.add(seq)
    assert seq.first_scheduled_time is None and seq.queue_ms >= 0
    sched.schedule()
    first = seq.first_scheduled_time
    assert first is not None and seq.queue_ms == (first - seq.arrival_time) * 1e3
    sched._preempt(seq)
    sched.schedule()  # readmitted: the queue time it reports does not grow
    assert seq.first_scheduled_time == first
