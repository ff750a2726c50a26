"""Continuous batching: which sequences run in the next forward pass.

A request moves through

    waiting --(blocks free: allocate, prefix hits skip compute)--> running --(finish/abort)--> freed
       ^                                                              |
       +-------------------(out of blocks: preempt, recompute)--------+

Sequences whose K/V arrived from a prefill worker enter `running` directly (`add_running`).

Policy, `mixed` (the default, as vLLM's chunked prefill): every step takes one token of each
running sequence that is generating (decode rows first), then fills the rest of
`max_num_batched_tokens` with prompt chunks (unfinished prompts first, then newly admitted ones; a
long prompt is split across steps). Decode tokens then ride in the large, efficient matmuls of
prefill passes instead of waiting behind them. Not mixed (prefill first, as in nano-vllm): a step
is either a prefill step or, when there is no prefill work, a decode step. Admission is
first-come first-served by free blocks. When a decode step runs out of blocks the newest
running sequence is preempted (blocks freed, put back at the head of the queue to be recomputed),
which always leaves the oldest sequence able to progress: no deadlock, given
`num_blocks * block_size >= max_model_len` (checked by the model runner).

Sliding windows (`kv_window`, when every layer of the model is windowed): before each step every
running sequence gives back its leading blocks that no query to come can see
(BlockManager.release_outside_window). Not in the prefill role, whose KV sender ships every block of
a prompt after the pass that completes it, nor for a sequence whose other choices are still to be
forked from its prompt (a decode worker releases a received prompt's blocks at its first step).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from engine.block_manager import BlockManager
from engine.model_runner import ScheduledSeq
from engine.sequence import SeqStatus, Sequence, TokenLogprobs


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        handoff_after_prefill: bool = False,
        mixed: bool = True,
        copy_blocks: Callable[[list[tuple[int, int]]], None] | None = None,
        kv_window: int | None = None,
        kv_sink_blocks: int = 0,
    ) -> None:
        self.bm = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        # Prefill role: a sequence leaves (and frees its blocks) once its first token is sampled.
        self.handoff_after_prefill = handoff_after_prefill
        self.mixed = mixed
        self.copy_blocks = copy_blocks  # (source, destination) block pairs whose KV to copy (forks)
        # positions any layer looks back (KVSpec.kv_window); None: some layer sees every key
        self.kv_window = None if handoff_after_prefill else kv_window
        self.kv_sink_blocks = kv_sink_blocks  # leading blocks every query sees (a KV bound's sinks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------ membership
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence that already holds blocks with its K/V computed (remote prefill)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        if seq.forks and not self.handoff_after_prefill:
            self._fork(seq)
        if seq.finish_reason is not None:  # choice 0 ended with its first token: only its forks run
            self.finish(seq)

    def _fork(self, seq: Sequence) -> None:
        """The other choices of `seq`'s request (SamplingParams.n / best_of), once its prompt is
        computed: each shares the prompt's blocks (BlockManager.fork) and joins the running batch,
        where it recomputes the prompt's last token and samples its own first token. One without a
        free block or a place in the batch waits, and is prefilled as a preempted sequence is."""
        seq.forked = True
        copies: list[tuple[int, int]] = []
        waiting: list[Sequence] = []
        for k in range(1, seq.params.num_choices):
            child = seq.fork(k)
            pair = self.bm.fork(seq, child) if len(self.running) < self.max_num_seqs else None
            if pair is None:
                child.status = SeqStatus.WAITING
                waiting.append(child)
                continue
            copies.append(pair)
            child.status = SeqStatus.RUNNING
            self.running.append(child)
        self.waiting.extendleft(reversed(waiting))  # ahead of new requests: theirs is admitted
        if copies:
            assert self.copy_blocks is not None, "forking needs the engine's copy_blocks"
            self.copy_blocks(copies)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
            self.bm.cache_full_blocks(seq)
            self.bm.free(seq)
        elif seq.status == SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def abort(self, request_id: str, index: int | None = None) -> Sequence | None:
        """Finish the request's sequences (all its choices, or choice `index`); returns the first, or None."""
        found = [seq for seq in (*self.running, *self.waiting)
                 if seq.request_id == request_id and index in (None, seq.index)]
        for seq in found:
            seq.finish_reason = seq.finish_reason or "abort"
            self.finish(seq)
        return found[0] if found else None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ------------------------------------------------------------------ policy
    def schedule(self) -> list[ScheduledSeq]:
        """The next batch: decode rows (one token each) first, then prompt chunks."""
        if self.kv_window is not None:
            for seq in self.running:
                if not seq.forks:
                    self.bm.release_outside_window(seq, self.kv_window, self.kv_sink_blocks)
        if self.mixed:
            batch = self._schedule_decode()
            return batch + self._schedule_prefill(self.max_num_batched_tokens - len(batch))
        batch = self._schedule_prefill(self.max_num_batched_tokens)
        return batch if batch else self._schedule_decode()

    def _schedule_prefill(self, budget: int) -> list[ScheduledSeq]:
        batch: list[ScheduledSeq] = []
        for seq in self.running:  # unfinished chunked prompts first
            if seq.num_remaining > 1 and budget > 0:
                n = min(seq.num_remaining, budget)
                batch.append(ScheduledSeq(seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.bm.can_allocate(len(seq.token_ids)):
                break
            self.waiting.popleft()
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.bm.allocate(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_remaining, budget)
            batch.append(ScheduledSeq(seq, n))
            budget -= n
        return batch

    def _schedule_decode(self) -> list[ScheduledSeq]:
        """One token for every running sequence with one token left (generating, or the last token of
        a prompt); to make room, the newest running sequence is preempted, never one already taken."""
        batch: list[ScheduledSeq] = []
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.num_remaining > 1:  # a prompt still being prefilled (mixed steps): its chunk comes later
                i += 1
                continue
            while not self.bm.can_append(seq):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.bm.append_slot(seq)
                batch.append(ScheduledSeq(seq, 1))
                i += 1
        return batch

    def postprocess(
        self, batch: list[ScheduledSeq], tokens: list[int], logprobs: list[TokenLogprobs | None]
    ) -> list[Sequence]:
        """Advance computed counts, append sampled tokens, retire finished sequences.

        Returns the sequences that received a token, in order (finished ones included)."""
        sampled: list[Sequence] = []
        samples = iter(zip(tokens, logprobs))
        for item in batch:
            seq = item.seq
            completes = item.completes
            seq.num_computed_tokens += item.num_tokens
            if not completes:
                self.bm.cache_full_blocks(seq)
                continue
            token, lp = next(samples)
            if seq.forks and not self.handoff_after_prefill:
                self._fork(seq)  # before its first token: the choices start from the prompt
            seq.append_token(token)
            if lp is not None:
                seq.logprobs.append(lp)
            sampled.append(seq)
            if seq.finish_reason is not None or self.handoff_after_prefill:
                self.finish(seq)
            else:
                self.bm.cache_full_blocks(seq)
        return sampled
