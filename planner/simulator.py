"""A discrete-event simulator of the cluster: router, prefill batching, KV transfer, decode batching.

It replays requests (arrival time, prompt length, output length) through the same policies as the
real code, with step times from a cost model (cost_model.py) instead of forward passes:

    arrival (+ router_in_s) -> router (router/prefix_policy.py, the same policy): the decode worker
        holding the longest prefix of the prompt among the nearly least loaded, then the fewest
        requests in flight, then the most free KV blocks, reserves blocks for the prompt (blocks +
        running sequences must fit: the engine's rule, engine/admission_rule.py), sharing the
        leading blocks it holds; when no decode worker can, the request waits (FIFO) until blocks
        are freed -> the prefill worker of the least expected cost (prompt tokens not cached there
        plus queued ones); with neither caches nor block keys: the fewest queued prompt tokens
    prefill worker (engine/scheduler.py): one step at a time; unfinished prompt chunks first, then
        FCFS admissions under max_num_batched_tokens and max_num_seqs while blocks allow; a long
        prompt is chunked across steps. Step time = cost.prefill_time(...)
    KV transfer: the prompt tokens after those its decode worker holds x KV bytes per token over the link min(prefill, decode worker link);
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
        Conditional disaggregation (`local_prefill_uncached_tokens` > 0): so is a prompt whose part
        its decode worker does not hold is at most that long (RoutingPolicy.prefill_on_decode).

A decode worker's running sequences are kept as aggregates, so a step costs O(log n), not O(batch):
with k decode steps done, a sequence that joined at step j with c tokens has c + (k - j) now, so
sum(context) = sum(c - j) + batch * k. Their blocks are estimated as sum(context) / block_size +
batch / 2 (the expected partial blocks; the engine's exact count differs by at most batch / 2).

Shared host (`host_cores`, for workers that are cores of one machine): each step is stretched by
max(1, (busy engine threads + serving-path CPU demand) / cores), the demand being the CPU per
streamed token times the tokens per second the decode workers produce at that moment. A prefill
step of a worker with a fitted `prefill_load_slope` (live calibration) is stretched by
(1 + slope x those tokens per second) x max(1, busy engine threads / cores) instead.

Prefix cache (with `block_keys`: per request, a key per full block of its prompt, and optionally
of its answer after it, that stands for the whole prefix up to it, as the engine's chained hash;
planner/sim_cache.py): a prefill or colocated worker computes only the tokens after its longest
cached prefix (never the block of the last token) and keeps the full blocks it computed, least
recently used first out, up to its block count. A decode worker shares the cached leading blocks
at a reservation (no KV moves for them) and keeps a finished request's prompt and answer blocks,
as free blocks allow. With `keep_caches` the caches outlive a run (the same cluster replays several
runs). With `prefix_aware` off (router.prefix_aware: false) the router picks workers by load alone
and a decode worker's reservation shares nothing: every prompt's whole KV moves. With
`tier_blocks` (kv_cache.offload_mb) the blocks trimmed out of any worker's cache go to one offload
tier shared by all of them, and a prompt's blocks missing from a cache come back from it.

The parts mirror the cluster's, one file each:

    simulator.py    the specs (ClusterSpec, WorkerSpec), SimResult, Simulator.run
    sim_cluster.py  SimCluster: the parts wired together, the shared host, the event loop
    sim_router.py   SimRouter: decode worker choice, the reservation, local prefill, waiting requests
    sim_worker.py   SimWorker: queues, KV blocks, prefix cache, engine lock, prefill batching
    sim_prefill.py  SimPrefillWorker: KV transfer and commit of each finished prompt
    sim_decode.py   SimDecodeWorker: commits joining the batch, decode and mixed steps, preemption
    sim_request.py  SimRequest (one request's state), Outcomes (times, counters, the early stop)

Not modelled: the router's 10-200 ms reservation backoff
(a waiting request is retried as soon as blocks are freed), stop strings / EOS (outputs run to
their length, as with ignore_eos), failures and timeouts.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from planner.cost_model import CostModel
from planner.sim_cache import PrefixCache, TierCache
from planner.sim_cluster import SimCluster
from planner.sim_request import NAN, Outcomes, SimRequest

__all__ = ["NAN", "ClusterSpec", "SimResult", "Simulator", "WorkerSpec"]


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
    # router.prefix_aware: workers chosen by their cached prefixes too, and a decode worker's
    # reservation shares the blocks it holds (False: by load only, the whole KV moves)
    prefix_aware: bool = True
    # disaggregated: router.local_prefill_uncached_tokens (conditional disaggregation; 0: never)
    local_prefill_uncached_tokens: int = 0
    # kv_cache.offload_mb as blocks: an offload tier shared by every worker (one node's); 0: none
    tier_blocks: int = 0

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


class Simulator:
    """`Simulator(cluster).run(arrivals, prompts, outputs)`; optional early stop on SLO misses."""

    def __init__(self, cluster: ClusterSpec, keep_caches: bool = False) -> None:
        self.c = cluster
        self.keep_caches = keep_caches
        self._caches: dict[int, PrefixCache] = {}

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
        out = Outcomes(n, c.first_token_out_s, slo_ttft_s, slo_tpot_s, max_misses, count_from, on_progress)
        cluster = SimCluster(c, out)
        tier = TierCache(c.tier_blocks) if c.tier_blocks > 0 and block_keys is not None else None
        if block_keys is not None:
            for j, w in enumerate(cluster.workers):
                w.cache = self._caches.setdefault(j, PrefixCache()) if self.keep_caches else PrefixCache()
                w.cache.release_all()
                w.cache.tier = tier
        for w in cluster.decode:
            need_max = -(-max(p + o for p, o in zip(prompts, outputs)) // w.bs) if n else 0
            if w.num_blocks < need_max:
                raise ValueError(f"a worker's KV cache ({w.num_blocks} blocks of {w.bs}) cannot hold the "
                                 f"longest request ({need_max} blocks)")
        requests = [SimRequest(i, arrivals[i], prompts[i], outputs[i]) for i in range(n)]
        if block_keys is not None:
            for s in requests:
                s.keys = block_keys[s.i]
        cluster.run(requests)
        first = min(arrivals) if n else 0.0
        workers = cluster.workers
        return SimResult(
            out.ttft, out.tpot, out.e2e, out.finished, max(0.0, out.last - first), out.stop, out.preemptions,
            out.prefill_steps, out.decode_steps, max((w.max_batch for w in cluster.decode), default=0),
            cluster.events,
            {"busy_s": [w.busy_s for w in workers], "kv_blocks": [w.num_blocks for w in workers],
             "in_system_area": out.area, "cached_tokens": [w.cached_tokens for w in workers],
             "decode_step_s": out.decode_step_s, "decode_seqs": out.decode_seqs,
             "prefill_step_s": out.prefill_step_s, "local_prefills": out.local_prefills,
             "local_uncached": out.local_uncached, "kv_bytes_sent": out.kv_bytes_sent,
             "kv_bytes_held": out.kv_bytes_held, "prompt_tokens": sum(prompts),
             "tier_hit_blocks": tier.hit_blocks if tier is not None else 0})
