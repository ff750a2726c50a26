"""A simulated decode worker (or a colocated one): reservations, committed KV joining the running
batch, decode steps, preemption, its own prefills and mixed steps.

A decode step runs every running sequence, one token each (cost.decode_time). Out of blocks, the
newest running sequence is preempted and recomputed by a prefill step on this worker, which samples
its next token. A colocated worker prefills whenever a prompt waits and fits, stalling decode; with
`mixed_steps` a decode worker runs its prefills (local prompts, recomputed sequences) in the
running batch's step: the batch's tokens plus prompt chunks in the rest of the token budget.

Prefix cache (with block keys, planner.sim_cache): with `prefix_aware` (ReserveRequest.
reuse_cached_prefix) a reservation shares the leading prompt blocks this worker holds, and no KV
moves for them; a prefill here (local, conditional) takes what the cache holds. A committed or
prefilled prompt's full blocks are held while its sequence is here; when it finishes, its prompt's
and answer's full blocks (all but the last token's) stay cached, free, least recently used out
first as free blocks are taken. A colocated worker keeps what its prefills compute, and its
answers, up to its block count.

The running sequences are kept as aggregates, so a step costs O(log n), not O(batch): with k decode
steps done, a sequence that joined at step j with c tokens has c + (k - j) now, so
sum(context) = sum(c - j) + batch * k. Their blocks are estimated as sum(context) / block_size +
batch / 2 (the expected partial blocks; the engine's exact count differs by at most batch / 2).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from planner.sim_request import SimRequest
from planner.sim_worker import SimWorker

if TYPE_CHECKING:
    from planner.sim_cluster import SimCluster
    from planner.simulator import WorkerSpec


class SimDecodeWorker(SimWorker):
    def __init__(self, spec: WorkerSpec, cluster: SimCluster, role: str = "decode") -> None:
        super().__init__(spec, cluster)
        self.role = role  # decode | colocated
        self.mixes = cluster.spec.mixed_steps and role == "decode"  # its prefills ride in decode steps
        self.committed: list[SimRequest] = []  # KV arrived, joins at the next step
        self.running: dict[int, SimRequest] = {}  # decoding, in join order
        self.finishes: list[tuple[int, int, int, SimRequest]] = []  # heap of (finish step, ver, i, seq)
        self.k = 0  # decode steps done
        self.sum_ctx_term = 0  # sum(tokens at join - join step) over running
        self.reserved = 0  # blocks reserved for KV on its way
        self.local_tokens = 0  # prompt tokens prefilled here (local prefill), no first token yet
        self.mixed = False  # the step in progress also advances the running batch (mixed_steps)
        self.max_batch = 0
        self.instant = bool(getattr(spec.cost, "instant", False))  # decodes in no time (an ideal worker)

    # ------------------------------------------------------------------ KV blocks
    @property
    def n_running(self) -> int:
        return len(self.running) + len(self.chunked)

    def used_blocks(self) -> float:
        b = len(self.running)
        run = (self.sum_ctx_term + b * self.k) / self.bs + b / 2 if b else 0.0
        return self.reserved + self.prefill_blocks + run

    # ------------------------------------------------------------------ prefix cache
    def share(self, s: SimRequest) -> int:
        """`s`'s reservation here shares the leading prompt blocks this worker holds: their tokens."""
        if self.cache is None or not s.keys or not self.cluster.spec.prefix_aware:
            return 0
        n = self.cache.use_prefix(s.keys, (s.prompt - 1) // self.bs)
        self.cache.hold(s.keys[:n])
        s.held = n
        self.cache.trim(int(self.free_blocks()))
        return n * self.bs

    def remember(self, s: SimRequest) -> None:
        """`s`'s prompt was computed here: a decode worker holds its full blocks while `s` is here."""
        if self.role == "decode":
            self.land(s)
        else:
            super().remember(s)
            s.landed = True

    def land(self, s: SimRequest) -> None:
        """`s`'s prompt KV is here (committed, or prefilled here)."""
        s.landed = True
        if self.cache is not None:
            end = s.prompt // self.bs
            self.cache.hold(s.keys[s.held:end])
            s.held = max(s.held, min(end, len(s.keys)))

    def release(self, s: SimRequest) -> None:
        """`s` is done here: the blocks it held are freed, and (if its KV got here) its prompt's and
        answer's full blocks stay cached."""
        cache = self.cache
        if cache is None:
            return
        if self.role == "decode":
            cache.release(s.keys[:s.held])
        s.held = 0
        if s.landed:
            end = (s.tokens - 1) // self.bs
            cache.store(self.block_keys(s, 0, end), self.num_blocks if self.role == "colocated"
                        else int(self.free_blocks()))

    # ------------------------------------------------------------------ requests
    def prefill_here(self, s: SimRequest, now: float) -> None:
        """`s`'s prompt is prefilled on this worker: colocated, or the router's local prefill (then
        its reservation is given back: no transfer)."""
        if self.role != "colocated":
            self.reserved -= s.need
            s.need = 0
            s.local = True
            self.local_tokens += s.prompt - s.dhit  # what it computes
            self.cluster.out.local_prefills += 1
        self.waiting.append(s)
        self.wake(now)

    def commit(self, s: SimRequest, now: float, in_step: bool = False) -> None:
        """`s`'s KV commit reaches this worker; it needs the engine lock, which a step holds.
        `in_step`: done by the prefill step that just ended (transfer_in_step), lock wait included."""
        p = s.p
        if self.locked and not in_step:  # in a step: the commit waits for the engine lock
            self.lock_waiters.append((self.commit, s))
            return
        p.committed(s)
        self.cluster.out.first_token(s, now)
        self.reserved -= s.need
        self.land(s)
        if self.instant:  # an ideal decode worker (the planner's phase-by-phase search): done at once
            self.cluster.router.finish(s, now)
        else:
            self.committed.append(s)
            self.wake(now)
        if in_step:
            return
        p.commit_returned(now)

    # ------------------------------------------------------------------ the running batch
    def join(self, s: SimRequest) -> None:
        s.join_k = self.k
        s.ctx_term = s.tokens - self.k
        s.ver += 1
        self.sum_ctx_term += s.ctx_term
        self.running[s.i] = s
        heapq.heappush(self.finishes, (self.k + s.out - s.done, s.ver, s.i, s))

    def leave(self, s: SimRequest) -> None:
        del self.running[s.i]
        self.sum_ctx_term -= s.ctx_term
        steps = self.k - s.join_k
        s.done += steps
        s.tokens += steps
        s.ver += 1

    def preempt(self) -> None:
        s = self.running[next(reversed(self.running))]
        self.leave(s)
        self.waiting.appendleft(s)  # recomputed first (prefill first), all its tokens
        self.cluster.out.preemptions += 1

    def advance_decode(self, now: float) -> None:
        """The running batch got a token each (a decode step, or a mixed step's decode rows)."""
        self.k += 1
        freed = False
        router = self.cluster.router
        while self.finishes and self.finishes[0][0] <= self.k:
            _, ver, _, s = heapq.heappop(self.finishes)
            if ver != s.ver or s.i not in self.running:
                continue
            self.leave(s)
            router.finish(s, now + self.cluster.spec.token_out_s)
            freed = True
        if freed:
            router.retry(now)

    # ------------------------------------------------------------------ steps
    def schedule(self, now: float) -> float | None:
        # sequences whose KV arrived join the batch while it has room (max_num_seqs, preempted ones
        # waiting to be recomputed counted; DecodeEngine.step); the rest wait
        joined = 0
        for s in self.committed:
            if self.n_running + len(self.waiting) >= self.max_seqs:
                break
            self.join(s)
            joined += 1
        del self.committed[:joined]
        if self.cache is not None and self.role == "decode":
            self.cache.trim(int(self.free_blocks()))  # cached free blocks give way to those taken
        dt = None
        if self.mixes and self.running and (self.waiting or self.chunked):
            dt = self.schedule_mixed()
        if dt is None:
            dt = self.schedule_prefill()
        if dt is None:
            dt = self.schedule_decode()
        return dt

    def schedule_mixed(self) -> float | None:
        """Decode rows first, then prompt chunks in the rest of the budget (engine/scheduler.py);
        one pass: the decode step's time plus the chunks' variable prefill cost."""
        b = self.decode_rows()
        if not b or b >= self.budget:
            return None
        dt_p = self.schedule_prefill(self.budget - b)
        if dt_p is None:
            return None
        self.mixed = True
        return self.decode_step_time(b) + dt_p - self.cost.prefill_time(0, 0)

    def schedule_decode(self) -> float | None:
        if not self.running:
            return None
        b = self.decode_rows()
        if not b:
            return self.schedule_prefill()
        self.batch = None
        return self.decode_step_time(b)

    def decode_rows(self) -> int:
        """The running sequences a step can decode: the newest are preempted until every one has a
        slot for its next token."""
        while self.running and self.used_blocks() + len(self.running) / self.bs > self.num_blocks:
            self.preempt()
        return len(self.running)

    def decode_step_time(self, b: int) -> float:
        """A step decodes `b` running sequences (counted), one token each: its time."""
        self.max_batch = max(self.max_batch, b)
        out = self.cluster.out
        out.decode_steps += 1
        out.decode_seqs += b
        dt = self.cost.decode_time(b, self.sum_ctx_term + b * self.k)
        out.decode_token_s += dt * b
        return dt

    def end_step(self, now: float) -> None:
        if self.batch is None:  # decode step
            self.advance_decode(now)
            self.release_lock(now)
            self.start_step(now)
            return
        if self.mixed:
            self.mixed = False
            self.advance_decode(now)
        self.end_prefill_step(now)

    def prompt_done(self, s: SimRequest, now: float) -> None:
        """A prompt prefilled here (colocated, local, or a preempted sequence recomputed)."""
        c, router = self.cluster.spec, self.cluster.router
        if s.done == 1:
            self.cluster.out.first_token(s, now)
            if s.local:
                self.local_tokens -= s.prompt - s.dhit
                s.local = False
        if s.done >= s.out:
            router.finish(s, (now + c.first_token_out_s) if s.done == 1 else (now + c.token_out_s))
            router.retry(now)
        else:
            self.join(s)
