"""Helpers shared by the scheduler tests: a real BlockManager, fake sampled tokens, no model."""

from __future__ import annotations

import zlib
from typing import Callable, NamedTuple

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import SeqStatus, Sequence

BS = 4
TOKEN = 7  # the fake sampled token (not an eos / stop token unless a test says so)


def make_seq(
    rid: str,
    prompt: list[int] | int,
    max_tokens: int = 4,
    eos: frozenset[int] = frozenset(),
    stop_token_ids: list[int] | None = None,
    ignore_eos: bool = False,
    max_model_len: int = 2048,
) -> Sequence:
    if isinstance(prompt, int):  # distinct per request id, so there are no accidental prefix hits
        prompt = [zlib.crc32(rid.encode()) % 100_000 * 100 + 10 + i for i in range(prompt)]
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, stop_token_ids=stop_token_ids or [], ignore_eos=ignore_eos
    )
    return Sequence(
        request_id=rid,
        token_ids=list(prompt),
        num_prompt_tokens=len(prompt),
        params=params,
        eos_token_ids=eos,
        max_model_len=max_model_len,
    )


def make_sched(
    num_blocks: int = 64,
    budget: int = 64,
    max_num_seqs: int = 16,
    caching: bool = True,
    handoff: bool = False,
    mixed: bool = True,
) -> Scheduler:
    bm = BlockManager(num_blocks, BS, caching)
    return Scheduler(bm, budget, max_num_seqs, handoff_after_prefill=handoff, mixed=mixed)


def check_state(sched: Scheduler) -> None:
    bm = sched.bm
    bm.check_invariants([s.block_table for s in sched.running])
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    for s in sched.running:
        assert s.status == SeqStatus.RUNNING
        assert len(s.block_table) * BS >= len(s.token_ids) - 1  # at most the newest token is not covered
    for s in sched.waiting:
        assert s.status == SeqStatus.WAITING
        assert s.block_table == [] and s.num_computed_tokens == 0


class Item(NamedTuple):
    """A scheduled item as it was before postprocess (ScheduledSeq.completes depends on the
    sequence's current state, so it is captured here)."""

    seq: Sequence
    num_tokens: int
    completes: bool
    computed_before: int
    outputs_before: int


def step(
    sched: Scheduler, token: Callable[[Sequence], int] = lambda s: TOKEN
) -> tuple[list[Item], list[Sequence]]:
    """One engine step with fake sampling. Returns (the batch, sequences that got a token)."""
    batch = sched.schedule()
    seqs = [item.seq for item in batch]
    assert len(set(map(id, seqs))) == len(seqs), "a sequence is scheduled twice in one step"
    items = []
    for item in batch:  # the model runner needs blocks for every position it writes
        seq = item.seq
        assert seq.status == SeqStatus.RUNNING and item.num_tokens >= 1
        assert seq.num_computed_tokens + item.num_tokens <= len(seq.token_ids)
        assert len(seq.block_table) * BS >= seq.num_computed_tokens + item.num_tokens
        before = (seq.num_computed_tokens, seq.num_output_tokens)
        items.append(Item(seq, item.num_tokens, item.completes, *before))
    completing = [i.seq for i in items if i.completes]
    tokens = [token(s) for s in completing]
    sampled = sched.postprocess(batch, tokens, [None] * len(tokens))
    assert sampled == completing
    for i in items:
        assert i.seq.num_computed_tokens == (0 if i.seq.is_finished else i.computed_before + i.num_tokens)
    check_state(sched)
    return items, sampled


def run_to_completion(sched: Scheduler, max_steps: int = 10_000, **kw) -> int:
    steps = 0
    while sched.has_work():
        step(sched, **kw)
        steps += 1
        assert steps <= max_steps, "scheduler made no progress (deadlock / livelock)"
    return steps


def assert_all_free(sched: Scheduler) -> None:
    assert sched.bm.num_free_blocks == sched.bm.num_blocks
    sched.bm.check_invariants([])


def added(sched: Scheduler, rid: str, prompt: list[int] | int, **kw) -> Sequence:
    """A sequence made as `make_seq` makes it, added to the scheduler's waiting queue."""
    seq = make_seq(rid, prompt, **kw)
    sched.add(seq)
    return seq
