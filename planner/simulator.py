"""A discrete-event simulator of the cluster: router, prefill batching, KV transfer, decode batching.

It replays requests (arrival time, prompt length, output length) through the same policies as the
real code, with step times from a cost model (cost_model.py) instead of forward passes:

    arrival (+ router_in_s) -> router: decode worker with the fewest requests in flight, then the
        most free KV blocks, reserves blocks for the prompt (blocks + running sequences must fit,
        as DecodeEngine.reserve); when no decode worker can, the request waits (FIFO) until
        blocks are freed -> prefill worker with the fewest queued prompt tokens
    prefill worker (engine/scheduler.py): one step at a time; unfinished prompt chunks first, then
        FCFS admissions under max_num_batched_tokens and max_num_seqs while blocks allow; a long
        prompt is chunked across steps. Step time = cost.prefill_time(...)
    KV transfer: prompt_len x KV bytes per token over the link min(prefill, decode worker link);
        each worker's link carries one transfer at a time (contention). Layer-wise: the first
        layer may leave after 1/L of the step, the last one after the step. The prefill worker
        commits each finished prompt's transfer before its next step (PrefillEngine.step does).
        Commit = the first token (TTFT ends first_token_out_s later) and the sequence joins the
        decode worker's batch at its next step. With `transfer_in_step` (prefill step costs
        measured on serving workers, whose step counters include the sends and the commit) a
        prompt is committed when its step ends, nothing added; with `commit_waits_lock` as well
        (those step costs had the commit's wait for the decode worker's lock taken out:
        calibrate_bench) the commit then waits for the decode step in progress, as below.
    engine lock: a decode (or colocated) worker holds its engine's lock for a whole step, and a
        Reserve and a KV commit need it: they complete when the step in progress ends. The router
        counts a request on a worker as it chooses it (WorkerPool.take), so requests that arrive
        while its Reserve waits see it.
    decode worker: a decode step runs every running sequence, one token each (cost.decode_time);
        preempted sequences (out of blocks: the newest goes) are recomputed by a prefill step on
        that worker (prefill first: no mixed steps), which samples their next token.
    colocated: one engine per worker does both: prefill steps (stalling decode) whenever a prompt
        waits and fits, else a decode step.
    local prefill (disaggregated, `local_prefill_max_tokens` > 0): the router's rule
        (router/local_prefill.py, the same code) sends a short prompt to its decode worker when the
        least-loaded prefill worker has at least as many prompt tokens queued as the decode worker
        already prefills plus this prompt; it is prefilled there as a preempted sequence is.

A decode worker's running sequences are kept as aggregates, so a step costs O(log n), not O(batch):
with k decode steps done, a sequence that joined at step j with c tokens has c + (k - j) now, so
sum(context) = sum(c - j) + batch * k. Their blocks are estimated as sum(context) / block_size +
batch / 2 (the expected partial blocks; the engine's exact count differs by at most batch / 2).

Shared host (`host_cores`, for workers that are cores of one machine): each step is stretched by
max(1, (busy engine threads + serving-path CPU demand) / cores), the demand being the CPU per
streamed token times the tokens per second the decode workers produce at that moment. A prefill
step of a worker with a fitted `prefill_load_slope` (live calibration) is stretched by
(1 + slope x those tokens per second) x max(1, busy engine threads / cores) instead.

Prefix cache (with `block_keys`: per request, a key per full prompt block that stands for the
whole prefix up to it, as the engine's chained hash): a prefill or colocated worker computes only
the tokens after its longest cached prefix (never the block of the last token) and keeps the full
blocks it computed, least recently used first out, up to its block count. With `keep_caches` the
caches outlive a run (the same cluster replays several runs). Decode workers share no blocks.

Not modelled: the router's 10-200 ms reservation backoff
(a waiting request is retried as soon as blocks are freed), stop strings / EOS (outputs run to
their length, as with ignore_eos), failures and timeouts.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from planner.cost_model import CostModel
from router.local_prefill import LocalPrefillPolicy

NAN = float("nan")


@dataclass
class WorkerSpec:
    cost: CostModel
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    block_size: int = 16
    link_gbps: float = 1.0  # this worker's KV transfer link (NIC or memory path), GB/s
    name: str = ""
    # a live-calibrated prefill step is this much longer per decode token/s the cluster streams
    # meanwhile (the serving path's CPU per streamed token lands on the prefill worker's core;
    # planner.calibrate_serving fits it); 0: the host's processor-sharing model instead
    prefill_load_slope: float = 0.0


@dataclass
class ClusterSpec:
    mode: str  # disaggregated | colocated
    prefill: list[WorkerSpec]  # empty in colocated mode
    decode: list[WorkerSpec]  # decode workers, or the colocated workers
    kv_latency_s: float = 0.0  # per transfer (handshake/commit)
    layerwise: bool = True  # layer l leaves once layer l is computed
    num_layers: int = 1
    router_in_s: float = 0.0  # arrival -> the router's decision and the worker's queue
    first_token_out_s: float = 0.0  # first token sampled/committed -> at the client
    token_out_s: float = 0.0  # any later token -> at the client
    # Workers that share a host's CPU cores with the serving path (router, HTTP API, client):
    # None = no sharing (accelerators; the host has cores to spare)
    host_cores: int | None = None
    host_cpu_per_token_s: float = 0.0  # serving-path CPU per streamed token
    # The prefill step costs were measured on serving workers, whose step counters include sending
    # the KV and the commit (PrefillEngine.step): a prompt is committed when its step ends.
    transfer_in_step: bool = False
    # with transfer_in_step: the measured steps had the commit's wait for the decode worker's lock
    # taken out (calibrate_bench), so the simulator makes it: the commit waits for the step in progress
    commit_waits_lock: bool = False
    local_prefill_max_tokens: int = 0  # disaggregated: router.local_prefill_max_tokens (0: never)
    # decode workers run their prefills (local prompts, recomputed sequences) in mixed steps: the
    # running batch's tokens plus prompt chunks in the rest of the token budget, one forward pass
    mixed_steps: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ("disaggregated", "colocated"):
            raise ValueError(f"mode must be disaggregated or colocated, got {self.mode!r}")
        if not self.decode or (self.mode == "disaggregated" and not self.prefill):
            raise ValueError(f"{self.mode} needs at least one worker of each role")


@dataclass
class SimResult:
    """Per request (in input order): seconds from arrival; NaN when not reached (early stop)."""

    ttft: list[float]
    tpot: list[float]  # NaN for one-token outputs
    e2e: list[float]
    finished: int
    duration_s: float  # first arrival to last finish
    stopped_early: bool = False
    preemptions: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    max_decode_batch: int = 0
    events: int = 0
    stats: dict = field(default_factory=dict)


class _Seq:
    __slots__ = (
        "arrival",
        "blocks",
        "computed",
        "ctx_term",
        "d",
        "done",
        "first_t",
        "i",
        "join_k",
        "keys",
        "local",
        "need",
        "out",
        "p",
        "prompt",
        "tokens",
        "ver",
    )

    def __init__(self, i: int, arrival: float, prompt: int, out: int) -> None:
        self.i, self.arrival, self.prompt, self.out = i, arrival, prompt, out
        self.tokens = prompt  # prompt + generated
        self.done = 0  # output tokens generated
        self.computed = 0  # tokens of the current prefill whose KV is computed
        self.blocks = 0  # blocks held for a prefill in progress
        self.need = 0  # blocks reserved on the decode worker (disaggregated)
        self.local = False  # prefilled on its decode worker (local prefill), first token not yet out
        self.join_k = 0
        self.ctx_term = 0
        self.ver = 0
        self.p: _Worker | None = None
        self.d: _Worker | None = None
        self.first_t = NAN
        self.keys: Sequence[Hashable] = ()


class _Worker:
    def __init__(self, spec: WorkerSpec, role: str) -> None:
        self.spec, self.cost, self.role = spec, spec.cost, role
        self.bs = spec.block_size
        self.num_blocks = spec.cost.kv_capacity_tokens // spec.block_size
        self.budget, self.max_seqs = spec.max_num_batched_tokens, spec.max_num_seqs
        self.waiting: deque[_Seq] = deque()  # to prefill: new prompts, or preempted for recompute
        self.chunked: list[_Seq] = []  # prompt partly computed
        self.committed: list[_Seq] = []  # decode: KV arrived, joins at the next step
        self.running: dict[int, _Seq] = {}  # decoding, in join order
        self.finish: list[tuple[int, int, int, _Seq]] = []  # (finish step, ver, i, seq)
        self.k = 0  # decode steps done
        self.sum_ctx_term = 0  # sum(tokens at join - join step) over running
        self.prefill_blocks = 0
        self.reserved = 0
        self.busy = False
        self.inflight = 0
        self.inflight_tokens = 0
        self.local_tokens = 0  # decode: prompt tokens prefilled here (local prefill), no first token yet
        self.link_free = 0.0
        self.pending_commits = 0  # prefill: finished prompts whose KV commit has not returned
        self.lock_wait_from = 0.0  # prefill (commit_waits_lock): when its commits began to wait
        self.lock_waiters: list = []  # Reserves and commits waiting for the step in progress
        self.locked = False  # a step is running (it holds the engine lock)
        self.batch: list[tuple[_Seq, int]] | None = None  # the prefill step in progress
        self.mixed = False  # the step in progress also advances the running batch (mixed_steps)
        self.step_start = 0.0
        self.step_dt = 0.0
        self.max_batch = 0
        self.busy_s = 0.0
        self.instant = bool(getattr(spec.cost, "instant", False))  # decodes in no time (an ideal worker)
        self.cache: OrderedDict | None = None  # prefix cache: block key -> None, least recent first
        self.cached_tokens = 0

    def cached_prefix(self, s: _Seq) -> int:
        """Tokens of `s`'s prompt in this worker's cache (whole blocks, never the last token's)."""
        if self.cache is None or not s.keys:
            return 0
        n = 0
        for key in s.keys[:(s.tokens - 1) // self.bs]:
            if key not in self.cache:
                break
            self.cache.move_to_end(key)
            n += 1
        return n * self.bs

    def remember(self, s: _Seq) -> None:
        if self.cache is None:
            return
        for key in s.keys[:s.prompt // self.bs]:
            self.cache[key] = None
            self.cache.move_to_end(key)
        while len(self.cache) > self.num_blocks:
            self.cache.popitem(last=False)

    @property
    def n_running(self) -> int:
        return len(self.running) + len(self.chunked)

    def used_blocks(self) -> float:
        b = len(self.running)
        run = (self.sum_ctx_term + b * self.k) / self.bs + b / 2 if b else 0.0
        return self.reserved + self.prefill_blocks + run

    def free_blocks(self) -> float:
        return self.num_blocks - self.used_blocks()

    def has_work(self) -> bool:
        return bool(self.waiting or self.chunked or self.committed or self.running)


class Simulator:
    """`Simulator(cluster).run(arrivals, prompts, outputs)`; optional early stop on SLO misses."""

    def __init__(self, cluster: ClusterSpec, keep_caches: bool = False) -> None:
        self.c = cluster
        self.keep_caches = keep_caches
        self._caches: dict[int, OrderedDict] = {}

    def run(self, arrivals: Sequence[float], prompts: Sequence[int], outputs: Sequence[int],
            slo_ttft_s: float | None = None, slo_tpot_s: float | None = None,
            max_misses: int | None = None, on_progress: Callable[[int], None] | None = None,
            count_from: int = 0, block_keys: Sequence[Sequence[Hashable]] | None = None) -> SimResult:
        """Simulate; with `max_misses`, stop once more than that many requests (of index >=
        `count_from`) miss the TTFT bound, or more than that many miss the TPOT bound."""
        c = self.c
        n = len(arrivals)
        if not (len(prompts) == len(outputs) == n):
            raise ValueError("arrivals, prompts and outputs must have the same length")
        order = sorted(range(n), key=lambda i: arrivals[i])
        decode = [_Worker(s, "colocated" if c.mode == "colocated" else "decode") for s in c.decode]
        prefill = [_Worker(s, "prefill") for s in c.prefill]
        workers = prefill + decode
        if block_keys is not None:
            for j, w in enumerate(prefill + (decode if c.mode == "colocated" else [])):
                w.cache = self._caches.setdefault(j, OrderedDict()) if self.keep_caches else OrderedDict()
        for w in decode:
            need_max = -(-max(p + o for p, o in zip(prompts, outputs)) // w.bs) if n else 0
            if w.num_blocks < need_max:
                raise ValueError(f"a worker's KV cache ({w.num_blocks} blocks of {w.bs}) cannot hold the "
                                 f"longest request ({need_max} blocks)")
        ttft, tpot, e2e = [NAN] * n, [NAN] * n, [NAN] * n
        heap: list[tuple[float, int, int, object]] = []  # (time, tie, kind, obj)
        tie = 0
        STEP, COMMIT, RESERVED = 0, 1, 2  # events; RESERVED only waits on a worker's lock
        waiting_reserve: deque[_Seq] = deque()
        st = {"finished": 0, "ttft_miss": 0, "tpot_miss": 0, "preempt": 0, "psteps": 0, "dsteps": 0, "dseqs": 0,
              "dstep_s": 0.0, "pstep_s": 0.0, "last": 0.0, "in_system": 0, "area": 0.0, "local": 0}  # area: integral of requests in the system over time
        colocated = c.mode == "colocated"
        policy = LocalPrefillPolicy(0 if colocated else c.local_prefill_max_tokens)
        stop = False

        def push(t: float, kind: int, obj: object) -> None:
            nonlocal tie
            tie += 1
            heapq.heappush(heap, (t, tie, kind, obj))

        def finish_seq(s: _Seq, t: float) -> None:
            nonlocal stop
            e2e[s.i] = t - s.arrival
            if s.out > 1:
                tpot[s.i] = (t - s.first_t) / (s.out - 1)
                if slo_tpot_s is not None and tpot[s.i] > slo_tpot_s and s.i >= count_from:
                    st["tpot_miss"] += 1
                    if max_misses is not None and st["tpot_miss"] > max_misses:
                        stop = True
            st["finished"] += 1
            st["in_system"] -= 1
            st["last"] = max(st["last"], t)
            w = s.d
            w.inflight -= 1
            if on_progress is not None:
                on_progress(1)

        def first_token(s: _Seq, t: float) -> None:
            nonlocal stop
            s.first_t = t + c.first_token_out_s
            ttft[s.i] = s.first_t - s.arrival
            if slo_ttft_s is not None and ttft[s.i] > slo_ttft_s and s.i >= count_from:
                st["ttft_miss"] += 1
                if max_misses is not None and st["ttft_miss"] > max_misses:
                    stop = True

        # ------------------------------------------------------------------ router
        def pick_decode() -> list[_Worker]:
            return sorted(decode, key=lambda w: (w.inflight, -w.free_blocks()))

        def try_reserve(s: _Seq, now: float) -> bool:
            for w in (pick_decode() if len(decode) > 1 else decode):
                need = -(-s.prompt // w.bs)
                if need + len(w.running) > w.free_blocks():
                    continue
                s.d = w
                w.inflight += 1  # the router counts it on w as it chooses (WorkerPool.take)
                if not colocated:
                    s.need = need
                    w.reserved += need
                # the Reserve RPC returns once it has the worker's engine lock, which a step holds
                # (DecodeEngine.step, the colocated server's loop)
                if w.locked:
                    w.lock_waiters.append((RESERVED, s))
                else:
                    reserved(s, now)
                return True
            return False

        def reserved(s: _Seq, now: float) -> None:
            w = s.d
            if colocated or (policy.enabled and policy.local(
                    s.prompt, min(x.inflight_tokens for x in prefill), w.local_tokens)):
                if not colocated:  # the router's local prefill: no reservation, no transfer
                    w.reserved -= s.need
                    s.need = 0
                    s.local = True
                    w.local_tokens += s.prompt
                    st["local"] += 1
                w.waiting.append(s)
                wake(w, now)
                return
            p = min(prefill, key=lambda x: (x.inflight_tokens, x.inflight)) if len(prefill) > 1 else prefill[0]
            s.p = p
            p.inflight += 1
            p.inflight_tokens += s.prompt
            p.waiting.append(s)
            wake(p, now)

        def retry_reservations(now: float) -> None:
            while waiting_reserve and try_reserve(waiting_reserve[0], now):
                waiting_reserve.popleft()

        def wake(w: _Worker, now: float) -> None:
            if not w.busy:
                start_step(w, now)

        # ------------------------------------------------------------------ steps
        def start_step(w: _Worker, now: float) -> None:
            # decode: sequences whose KV arrived join the batch while it has room (max_num_seqs,
            # preempted ones waiting to be recomputed counted; DecodeEngine.step); the rest wait
            joined = 0
            for s in w.committed:
                if w.n_running + len(w.waiting) >= w.max_seqs:
                    break
                join(w, s)
                joined += 1
            del w.committed[:joined]
            dt = None
            if c.mixed_steps and w.role == "decode" and w.running and (w.waiting or w.chunked):
                dt = schedule_mixed(w, now)
            if dt is None:
                dt = schedule_prefill(w)
            if dt is None:
                dt = schedule_decode(w, now)
            if dt is None:
                w.busy = False
                return
            dt *= host_slowdown(w)
            w.busy = w.locked = True
            w.step_start = now
            w.step_dt = dt
            w.busy_s += dt
            st["dstep_s" if w.batch is None else "pstep_s"] += dt
            push(now + dt, STEP, w)

        def host_slowdown(w: _Worker) -> float:
            """The factor `w`'s step starting now is stretched by: processor sharing on the host, the
            engine threads then busy plus the serving path's demand (CPU per token x the tokens per
            second the decode workers stream now) over its cores; for a prefill step with a fitted
            load slope, that slope's share of the streamed tokens in place of the demand."""
            slope = w.spec.prefill_load_slope if w.batch is not None else 0.0
            if not (c.host_cores or slope):
                return 1.0
            tokens_per_s = sum(len(x.running) / x.step_dt for x in decode if x.running and x.step_dt > 0)
            busy = 1 + sum(1 for x in workers if x.busy and x is not w)
            if slope:
                return (1.0 + slope * tokens_per_s) * (max(1.0, busy / c.host_cores) if c.host_cores else 1.0)
            return max(1.0, (busy + c.host_cpu_per_token_s * tokens_per_s) / c.host_cores)

        def schedule_mixed(w: _Worker, now: float) -> float | None:
            """Decode rows first, then prompt chunks in the rest of the budget (engine/scheduler.py);
            one pass: the decode step's time plus the chunks' variable prefill cost."""
            while w.running and w.used_blocks() + len(w.running) / w.bs > w.num_blocks:
                preempt(w, now)
            b = len(w.running)
            if not b or b >= w.budget:
                return None
            dt_p = schedule_prefill(w, w.budget - b)
            if dt_p is None:
                return None
            w.mixed = True
            w.max_batch = max(w.max_batch, b)
            st["dsteps"] += 1
            st["dseqs"] += b
            return w.cost.decode_time(b, w.sum_ctx_term + b * w.k) + dt_p - w.cost.prefill_time(0, 0)

        def schedule_prefill(w: _Worker, budget: int | None = None) -> float | None:
            budget = w.budget if budget is None else budget
            batch: list[tuple[_Seq, int]] = []
            for s in w.chunked:
                if budget <= 0:
                    break
                m = min(s.tokens - s.computed, budget)
                batch.append((s, m))
                budget -= m
            while w.waiting and budget > 0 and w.n_running < w.max_seqs:
                s = w.waiting[0]
                need = -(-s.tokens // w.bs)
                if need > w.free_blocks():
                    break
                w.waiting.popleft()
                s.blocks = need
                s.computed = w.cached_prefix(s) if s.done == 0 else 0
                w.cached_tokens += s.computed
                w.prefill_blocks += need
                w.chunked.append(s)
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
            w.batch = batch
            st["psteps"] += 1
            return w.cost.prefill_time(sum_new, sum_attn, sum_prior, done)

        def schedule_decode(w: _Worker, now: float) -> float | None:
            if not w.running:
                return None
            while w.running and w.used_blocks() + len(w.running) / w.bs > w.num_blocks:
                preempt(w, now)
            b = len(w.running)
            if not b:
                return schedule_prefill(w)
            w.batch = None
            w.max_batch = max(w.max_batch, b)
            st["dsteps"] += 1
            st["dseqs"] += b
            return w.cost.decode_time(b, w.sum_ctx_term + b * w.k)

        def join(w: _Worker, s: _Seq) -> None:
            s.join_k = w.k
            s.ctx_term = s.tokens - w.k
            s.ver += 1
            w.sum_ctx_term += s.ctx_term
            w.running[s.i] = s
            heapq.heappush(w.finish, (w.k + s.out - s.done, s.ver, s.i, s))

        def leave(w: _Worker, s: _Seq) -> None:
            del w.running[s.i]
            w.sum_ctx_term -= s.ctx_term
            steps = w.k - s.join_k
            s.done += steps
            s.tokens += steps
            s.ver += 1

        def preempt(w: _Worker, now: float) -> None:
            s = w.running[next(reversed(w.running))]
            leave(w, s)
            w.waiting.appendleft(s)  # recomputed first (prefill first), all its tokens
            st["preempt"] += 1

        def advance_decode(w: _Worker, now: float) -> None:
            """The running batch got a token each (a decode step, or a mixed step's decode rows)."""
            w.k += 1
            freed = False
            while w.finish and w.finish[0][0] <= w.k:
                _, ver, _, s = heapq.heappop(w.finish)
                if ver != s.ver or s.i not in w.running:
                    continue
                leave(w, s)
                finish_seq(s, now + c.token_out_s)
                freed = True
            if freed and waiting_reserve:
                retry_reservations(now)

        def end_step(w: _Worker, now: float) -> None:
            if w.batch is None:  # decode step
                advance_decode(w, now)
                release_lock(w, now)
                start_step(w, now)
                return
            if w.mixed:
                w.mixed = False
                advance_decode(w, now)
            batch, w.batch = w.batch, None
            for s, m in batch:
                s.computed += m
                if s.computed < s.tokens:
                    continue
                w.chunked.remove(s)
                w.prefill_blocks -= s.blocks
                s.blocks = 0
                if s.done == 0:
                    w.remember(s)
                s.done += 1
                s.tokens += 1
                if w.role == "prefill":
                    handoff(w, s, now)
                    continue
                if s.done == 1:
                    first_token(s, now)
                    if s.local:
                        w.local_tokens -= s.prompt
                        s.local = False
                if s.done >= s.out:
                    finish_seq(s, (now + c.first_token_out_s) if s.done == 1 else (now + c.token_out_s))
                    if waiting_reserve:
                        retry_reservations(now)
                else:
                    join(w, s)
            if w.pending_commits:
                w.busy = True  # the engine thread waits in KVSender.commit until they are done
            else:
                release_lock(w, now)
                start_step(w, now)

        def release_lock(w: _Worker, now: float) -> None:
            """Between two steps the waiting Reserves and commits get the lock, in arrival order
            (the worker is still marked busy, so none of them starts a step itself)."""
            w.locked = False
            waiters, w.lock_waiters = w.lock_waiters, []
            for kind, s in waiters:
                (reserved if kind == RESERVED else commit)(s, now)
            w.busy = False

        def handoff(w: _Worker, s: _Seq, now: float) -> None:
            """Prefill worker: KV transfer of a finished prompt, committed before the next step."""
            d = s.d
            if s.out <= 1:  # the first token ends it: the reservation is dropped
                d.reserved -= s.need
                first_token(s, now)
                finish_seq(s, now + c.first_token_out_s)
                w.inflight -= 1
                w.inflight_tokens -= s.prompt
                if waiting_reserve:
                    retry_reservations(now)
                return
            if c.transfer_in_step:  # sent and committed within the measured step
                if c.commit_waits_lock and d.locked:  # ... all but the wait for the decode worker's lock
                    if not w.pending_commits:
                        w.lock_wait_from = now
                    w.pending_commits += 1
                    d.lock_waiters.append((COMMIT, s))
                    return
                commit(s, now, in_step=True)
                return
            nbytes = s.prompt * w.cost.kv_bytes_per_token
            gbps = min(w.spec.link_gbps, d.spec.link_gbps)
            dur = nbytes / (gbps * 1e9)
            if c.layerwise and c.num_layers > 1:
                ready = w.step_start + (now - w.step_start) / c.num_layers
                start = max(ready, w.link_free, d.link_free)
                end = max(start + dur, now + dur / c.num_layers)
            else:
                start = max(now, w.link_free, d.link_free)
                end = start + dur
            w.link_free = d.link_free = end
            w.pending_commits += 1
            push(end + c.kv_latency_s, COMMIT, s)

        def commit(s: _Seq, now: float, in_step: bool = False) -> None:
            """`in_step`: done by the prefill step that just ended (transfer_in_step), lock wait included."""
            p, d = s.p, s.d
            if d.locked and not in_step:  # the decode worker is in a step: the commit waits for its engine lock
                d.lock_waiters.append((COMMIT, s))
                return
            p.inflight -= 1
            p.inflight_tokens -= s.prompt
            first_token(s, now)
            d.reserved -= s.need
            if d.instant:  # an ideal decode worker (the planner's phase-by-phase search): done at once
                finish_seq(s, now)
            else:
                d.committed.append(s)
                wake(d, now)
            if in_step:
                return
            p.pending_commits -= 1
            if not p.pending_commits:  # the prefill engine thread goes on
                if c.transfer_in_step:  # the wait for the lock: part of the step, as the worker counts it
                    p.busy_s += now - p.lock_wait_from
                    st["pstep_s"] += now - p.lock_wait_from
                start_step(p, now)

        # ------------------------------------------------------------------ main loop
        seqs = [_Seq(i, arrivals[i], prompts[i], outputs[i]) for i in range(n)]
        if block_keys is not None:
            for s in seqs:
                s.keys = block_keys[s.i]
        nxt = 0
        events = 0
        t_prev = 0.0
        while not stop:
            t_arr = arrivals[order[nxt]] + c.router_in_s if nxt < n else math.inf
            if heap and heap[0][0] <= t_arr:
                t, _, kind, obj = heapq.heappop(heap)
                st["area"] += st["in_system"] * (t - t_prev)
                t_prev = t
                if kind == STEP:
                    end_step(obj, t)  # type: ignore[arg-type]
                else:
                    commit(obj, t)  # type: ignore[arg-type]
            elif nxt < n:
                s = seqs[order[nxt]]
                nxt += 1
                st["area"] += st["in_system"] * (t_arr - t_prev)
                t_prev = t_arr
                st["in_system"] += 1
                if waiting_reserve or not try_reserve(s, t_arr):
                    waiting_reserve.append(s)
            else:
                break
            events += 1
        first = min(arrivals) if n else 0.0
        return SimResult(
            ttft, tpot, e2e, st["finished"], max(0.0, st["last"] - first), stop, st["preempt"], st["psteps"],
            st["dsteps"], max((w.max_batch for w in decode), default=0), events,
            {"busy_s": [w.busy_s for w in workers], "kv_blocks": [w.num_blocks for w in workers],
             "in_system_area": st["area"], "cached_tokens": [w.cached_tokens for w in workers],
             "decode_step_s": st["dstep_s"], "decode_seqs": st["dseqs"], "prefill_step_s": st["pstep_s"],
             "local_prefills": st["local"]})
