"""What every simulated worker has: a queue of prompts, KV blocks, a prefix cache, the engine lock
and the prefill part of a step (engine/scheduler.py's chunked, FCFS prefill batching).

A step runs from `start_step` (the batch is chosen and the step's time drawn from the cost model)
to `end_step` (an event at the step's end: its effects land). The engine lock is held from one to
the other; the Reserves and KV commits that wait for it run between two steps, in arrival order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

from planner.sim_cache import PrefixCache
from planner.sim_request import SimRequest

if TYPE_CHECKING:
    from planner.sim_cluster import SimCluster
    from planner.simulator import WorkerSpec


class SimWorker:
    """One engine of a simulated worker. Subclasses: SimPrefillWorker, SimDecodeWorker (a decode
    or colocated worker); each says what its step runs and what a finished prompt does next."""

    role = "prefill"

    def __init__(self, spec: WorkerSpec, cluster: SimCluster) -> None:
        self.spec, self.cost, self.cluster = spec, spec.cost, cluster
        self.bs = spec.block_size
        self.num_blocks = spec.cost.kv_capacity_tokens // spec.block_size
        self.budget, self.max_seqs = spec.max_num_batched_tokens, spec.max_num_seqs
        self.waiting: deque[SimRequest] = deque()  # to prefill: new prompts, or preempted for recompute
        self.chunked: list[SimRequest] = []  # prompt partly computed
        self.prefill_blocks = 0  # blocks held by prefills in progress
        self.busy = False  # a step runs, or the engine thread waits (commits)
        self.locked = False  # a step is running (it holds the engine lock)
        self.lock_waiters: list[tuple[Callable[[SimRequest, float], None], SimRequest]] = []
        self.inflight = 0  # requests the router counts on this worker
        self.link_free = 0.0  # when this worker's KV link is next free
        self.batch: list[tuple[SimRequest, int]] | None = None  # the prefill step in progress
        self.step_start = 0.0
        self.step_dt = 0.0
        self.busy_s = 0.0
        self.cache: PrefixCache | None = None  # with block keys (planner.sim_cache)
        self.cached_tokens = 0  # prompt tokens not prefilled: its cache held them
        # its steps are stretched by processor sharing on the host (SimCluster.host_slowdown)
        self.shares_host = bool(cluster.spec.host_cores or spec.prefill_load_slope)

    # ------------------------------------------------------------------ KV blocks and prefix cache
    @property
    def n_running(self) -> int:
        return len(self.chunked)

    def used_blocks(self) -> float:
        return self.prefill_blocks

    def free_blocks(self) -> float:
        return self.num_blocks - self.used_blocks()

    def held_prefix(self, s: SimRequest) -> int:
        """Tokens of `s`'s prompt in this worker's cache (whole blocks, never the last token's), as
        the router's picture of it (nothing is touched)."""
        if self.cache is None or not s.keys:
            return 0
        return self.cache.prefix_blocks(s.keys, (s.prompt - 1) // self.bs) * self.bs

    def cached_prefix(self, s: SimRequest) -> int:
        """Tokens of `s`'s prompt its prefill here takes from the cache (whole blocks, never the
        last token's); they become the most recently used."""
        if self.cache is None or not s.keys:
            return 0
        return self.cache.use_prefix(s.keys, (s.tokens - 1) // self.bs) * self.bs

    def remember(self, s: SimRequest) -> None:
        """Keep the full blocks of `s`'s computed prompt, least recently used out first."""
        if self.cache is not None:
            self.cache.store(s.keys[:s.prompt // self.bs], self.num_blocks)

    def block_keys(self, s: SimRequest, start: int, end: int) -> list[Hashable]:
        """The keys of `s`'s blocks start..end-1; past the keys it was given, keys of its own."""
        keys = list(s.keys[start:end])
        return keys + [object() for _ in range(max(start, len(s.keys)), end)]

    # ------------------------------------------------------------------ steps
    def wake(self, now: float) -> None:
        if not self.busy:
            self.start_step(now)

    def start_step(self, now: float) -> None:
        dt = self.schedule(now)
        if dt is None:
            self.busy = False
            return
        cluster = self.cluster
        if self.shares_host:
            dt *= cluster.host_slowdown(self)
        self.busy = self.locked = True
        self.step_start = now
        self.step_dt = dt
        self.busy_s += dt
        if self.batch is None:
            cluster.out.decode_step_s += dt
        else:
            cluster.out.prefill_step_s += dt
        cluster.step_ends(now + dt, self)

    def schedule(self, now: float) -> float | None:
        """Choose the next step's batch; its time, or None when there is nothing to run."""
        return self.schedule_prefill()

    def schedule_prefill(self, budget: int | None = None) -> float | None:
        """Unfinished chunks first, then FCFS admissions under the token budget and max_num_seqs while
        blocks allow (a prompt computes only what its cached prefix does not hold)."""
        budget = self.budget if budget is None else budget
        batch: list[tuple[SimRequest, int]] = []
        for s in self.chunked:
            if budget <= 0:
                break
            m = min(s.tokens - s.computed, budget)
            batch.append((s, m))
            budget -= m
        while self.waiting and budget > 0 and self.n_running < self.max_seqs:
            s = self.waiting[0]
            need = -(-s.tokens // self.bs)
            if need > self.free_blocks():
                break
            self.waiting.popleft()
            s.blocks = need
            s.computed = self.cached_prefix(s) if s.done == 0 else 0
            self.cached_tokens += s.computed
            self.prefill_blocks += need
            self.chunked.append(s)
            m = min(s.tokens - s.computed, budget)
            batch.append((s, m))
            budget -= m
        if not batch:
            return None
        sum_new = sum_attn = sum_prior = done = 0
        for s, m in batch:
            sum_new += m
            sum_prior += s.computed
            sum_attn += m * (s.computed + m)
            done += s.computed + m == s.tokens
        self.batch = batch
        self.cluster.out.prefill_steps += 1
        return self.cost.prefill_time(sum_new, sum_attn, sum_prior, done)

    def end_step(self, now: float) -> None:
        self.end_prefill_step(now)

    def end_prefill_step(self, now: float) -> None:
        """The prefill batch's chunks are computed; each completed prompt samples a token and goes on."""
        batch, self.batch = self.batch, None
        for s, m in batch:
            s.computed += m
            if s.computed < s.tokens:
                continue
            self.chunked.remove(s)
            self.prefill_blocks -= s.blocks
            s.blocks = 0
            if s.done == 0:
                self.remember(s)
            s.done += 1
            s.tokens += 1
            self.prompt_done(s, now)
        self.after_step(now)

    def prompt_done(self, s: SimRequest, now: float) -> None:
        """`s`'s prompt is computed and its next token sampled at `now`."""
        raise NotImplementedError

    def after_step(self, now: float) -> None:
        self.release_lock(now)
        self.start_step(now)

    def release_lock(self, now: float) -> None:
        """Between two steps the waiting Reserves and commits get the lock, in arrival order
        (the worker is still marked busy, so none of them starts a step itself)."""
        self.locked = False
        waiters, self.lock_waiters = self.lock_waiters, []
        for run, s in waiters:
            run(s, now)
        self.busy = False
