"""The router's Prometheus metrics: request latencies and outcomes it sees, and each worker's load
and cumulative counts from the `Stats` its `WorkerPool` polls (read at scrape time).

Each `RouterMetrics` owns its own `CollectorRegistry` (never prometheus_client's global one), so
several routers in one process do not collide. The `RouterServer` built last in a process is the
"current" one: `render()` without an argument renders its registry; that is what the HTTP
`GET /metrics` route serves. docs/observability.md lists every metric.

Per request, `RouterMetrics.request(arrival)` returns a `RequestMetrics` that the router calls at
each point of the request's life (queued -> running -> tokens ... -> finished | error); every
method is safe to call more than once and after the request ended.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.step_stats import bucket_label
from proto import generate_pb2 as gen
from proto import worker_pb2 as wk

# seconds: a few ms (router queue, a tiny prompt) up to the 10-minute request timeout
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                   1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# seconds between tokens: one decode step is ms to a few hundred ms
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                     0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
PHASES = ("router_queue", "prefill_queue", "prefill_compute", "kv_transfer", "decode_queue")
FINISH_REASONS = ("stop", "length", "abort")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # the classic text format every Prometheus reads

disable_created_metrics()  # no `*_created` series (a process-wide switch; they only clutter the text format)
_current: CollectorRegistry | None = None
_current_lock = threading.Lock()


def set_current(registry: CollectorRegistry) -> None:
    """Make `registry` the one `render()` serves (called by RouterServer at construction)."""
    global _current
    with _current_lock:
        _current = registry


def clear_current(registry: CollectorRegistry) -> None:
    """Forget `registry` if it is the current one (called by RouterServer.stop)."""
    global _current
    with _current_lock:
        if _current is registry:
            _current = None


def render(registry: CollectorRegistry | None = None) -> tuple[bytes, str]:
    """(body, content type) of the Prometheus text exposition of `registry`, by default the current
    router's. Raises LookupError when no router was built in this process (or it was stopped)."""
    if registry is None:
        registry = _current
    if registry is None:
        raise LookupError("no RouterServer in this process: nothing to render")
    return generate_latest(registry), CONTENT_TYPE


# ------------------------------------------------------------------------------------- workers
class WorkerView(Protocol):
    """What the worker collector reads of each worker (router.worker_pool.WorkerHandle)."""

    worker_id: str
    role: str
    healthy: bool
    stats: wk.WorkerStats | None


_WORKER_GAUGES = (  # (metric suffix, WorkerStats field, help)
    ("requests_running", "running", "Requests in the worker's running batch."),
    ("requests_queued", "queued", "Requests waiting on the worker (prefill queue / awaiting KV commit)."),
    ("kv_blocks_used", "kv_blocks_used", "KV cache blocks in use on the worker."),
    ("kv_blocks_free", "kv_blocks_free", "Free KV cache blocks on the worker."),
    ("queued_prefill_tokens", "queued_prefill_tokens", "Prompt tokens queued on the worker."),
    ("kv_tier_capacity_bytes", "tier_capacity_bytes", "Size of the KV offload tier the worker shares with its node."),
    ("kv_tier_used_bytes", "tier_used_bytes", "Bytes the worker's KV offload tier holds (as the worker sees it)."),
    ("kv_tier_blocks", "tier_blocks", "KV blocks the worker's offload tier holds (as the worker sees it)."),
)
_WORKER_COUNTERS = (
    ("prompt_tokens", "prompt_tokens", "Prompt tokens prefilled by the worker, cached ones included."),
    ("prefix_cache_hit_tokens", "prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache."),
    ("kv_bytes_not_sent", "kv_bytes_not_sent", ("KV bytes no transfer had to move to the decode worker: "
     "blocks it held already, and prompts it prefilled itself.")),
    ("local_prefills", "local_prefills", "Requests the decode worker prefilled itself."),
    ("kv_tier_saves", "tier_saves", "KV blocks the worker wrote to the offload tier (evicted from its prefix cache)."),
    ("kv_tier_hits", "tier_hits", "KV blocks the worker read back from the offload tier instead of computing them."),
    ("kv_tier_misses", "tier_misses", "KV blocks the worker looked up in the offload tier and did not find whole."),
    ("kv_tier_evictions", "tier_evictions", "KV blocks the worker removed from the offload tier to make room (LRU)."),
)

_STEP_COUNTERS = (  # engine loop iterations by phase (engine/step_stats.py)
    ("steps", "steps", "Engine steps run by the worker, by phase."),
    ("step_seconds", "seconds", "Wall time of the worker's engine steps (and handing out their tokens), by phase."),
    ("step_seqs", "seqs", "Sum of the batch sizes of the worker's engine steps, by phase."),
    ("step_tokens", "tokens", "Tokens computed by the worker's engine steps, by phase."),
    ("step_context_tokens", "context_tokens", "Sum over the worker's engine steps of the tokens attended to, by phase."),
)
BY_BATCH_SUFFIX = "_by_batch"  # the same counters per batch-size bucket: pdcluster_worker_steps_by_batch{batch="4-7"}


class WorkerStatsCollector(Collector):
    """Per-worker gauges and counters from the last `WorkerStats` of each worker, read at scrape
    time. Counters are the workers' own cumulative totals (they restart from 0 with the worker)."""

    def __init__(self, workers: Callable[[], Iterable[WorkerView]]) -> None:
        self._workers = workers

    def describe(self) -> list[Metric]:
        return []  # names are checked at collect time only (they never clash with RouterMetrics')

    def collect(self) -> Iterator[Metric]:
        labels = ["worker", "role"]
        up = GaugeMetricFamily("pdcluster_worker_up", "1 if the worker answered its last Stats poll.", labels=labels)
        gauges = [(f, GaugeMetricFamily(f"pdcluster_worker_{n}", h, labels=labels)) for n, f, h in _WORKER_GAUGES]
        counters = [(f, CounterMetricFamily(f"pdcluster_worker_{n}", h, labels=labels))
                    for n, f, h in _WORKER_COUNTERS]
        kv_bytes = CounterMetricFamily(
            "pdcluster_worker_kv_transfer_bytes", "KV cache bytes the worker sent, by transfer backend.",
            labels=[*labels, "backend"],
        )
        steps = [(f, CounterMetricFamily(f"pdcluster_worker_{n}", h, labels=[*labels, "phase"]))
                 for n, f, h in _STEP_COUNTERS]
        by_batch = [(f, CounterMetricFamily(f"pdcluster_worker_{n}{BY_BATCH_SUFFIX}",
                                            h.replace("by phase", "by phase and batch-size bucket"),
                                            labels=[*labels, "phase", "batch"]))
                    for n, f, h in _STEP_COUNTERS]
        for w in self._workers():
            values = [w.worker_id, w.role]
            up.add_metric(values, 1.0 if w.healthy else 0.0)
            if w.stats is None:
                continue
            for field, family in (*gauges, *counters):
                family.add_metric(values, float(getattr(w.stats, field)))
            for backend, nbytes in sorted(w.stats.kv_bytes_sent.items()):
                kv_bytes.add_metric([*values, backend], float(nbytes))
            for phase in w.stats.steps:
                for field, family in steps:
                    family.add_metric([*values, phase.phase], float(getattr(phase, field)))
            for phase in w.stats.steps_by_batch:
                if phase.batch_min < 1:  # not a bucket (the proto default): nothing to label it with
                    continue
                for field, family in by_batch:
                    family.add_metric([*values, phase.phase, bucket_label(phase.batch_min)],
                                      float(getattr(phase, field)))
        yield up
        for _, family in (*gauges, *counters, *steps, *by_batch):
            yield family
        yield kv_bytes


# ------------------------------------------------------------------------------------- requests
class RouterMetrics:
    """The router's metrics in a registry of their own (`.registry`); with `workers` (a callable
    listing the pool's workers) the per-worker metrics too. `mode` decides which request phases
    exist: "disaggregated" all of PHASES, "colocated" router_queue, prefill_compute, decode_queue."""

    def __init__(self, workers: Callable[[], Iterable[WorkerView]] | None = None,
                 mode: str = "disaggregated", registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.mode = mode

        def hist(name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(f"pdcluster_{name}", doc, labels, buckets=buckets, registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Arrival at the router to the first token.",
                         LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds",
                        "Gap between token arrivals at the router (a chunk of tokens is one arrival).",
                        TOKEN_GAP_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds",
                         "Per finished request of 2+ tokens: (last token - first token) / (tokens - 1).",
                         TOKEN_GAP_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival at the router to the final message.",
                        LATENCY_BUCKETS)
        self.phase = hist("request_phase_seconds", "Time a finished request spent in each phase.",
                          LATENCY_BUCKETS, ("phase",))
        self.running = Gauge("pdcluster_requests_running", "Requests holding a decode reservation.", registry=r)
        self.queued = Gauge("pdcluster_requests_queued", "Requests waiting for a decode reservation.", registry=r)
        self.finished = Counter("pdcluster_requests_finished", "Requests that ended with a final message.",
                                ["finish_reason"], registry=r)
        self.errors = Counter("pdcluster_request_errors", "Requests that ended with a gRPC error.",
                              ["code"], registry=r)
        self.retries = Counter("pdcluster_request_retries", "Times a request went on from its tokens already sent "
                               "on another pair of workers after a worker or KV transfer failure.", registry=r)
        self.local_prefills = Counter("pdcluster_local_prefills", "Disaggregated requests whose prompt was prefilled "
                                      "on their decode worker (router.local_prefill_uncached_tokens, router.local_prefill_max_tokens).", registry=r)
        self.prompt_tokens = Counter("pdcluster_prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=r)
        self.routed_prompt_tokens = Counter(
            "pdcluster_routed_prompt_tokens", "Prompt tokens of the requests the router sent to a worker of each role "
            "(retries included).", ["role"], registry=r)
        self.routed_requests = Counter(
            "pdcluster_routed_requests", "Requests the router sent to a worker of each role (retries included; "
            "a disaggregated request counts once as decode, where it reserves, and once as prefill).", ["role"],
            registry=r)
        self.routed_max_tokens = Counter(
            "pdcluster_routed_max_tokens", "The max_tokens of the requests the router sent to a worker of each role "
            "(retries included): what they may generate at most.", ["role"], registry=r)
        self.routed_cached_tokens = Counter(
            "pdcluster_routed_cached_tokens", "Of those, the tokens the router's prefix index expected the chosen "
            "worker to hold in its prefix cache (router/prefix_index.py).", ["role"], registry=r)
        self.generation_tokens = Counter("pdcluster_generation_tokens", "Tokens generated for finished requests.",
                                         registry=r)
        self.controller_decisions = Counter(
            "pdcluster_controller_decisions", "The SLO controller's decisions (docs/controller.md): the change of "
            "workers per role (e.g. 'prefill+1 decode-1') and its cause ('prefill pressed', 'idle', ...).",
            ["change", "cause"], registry=r)
        self.controller_target = Gauge("pdcluster_controller_target_workers",
                                       "Workers per role the SLO controller last decided on.", ["role"], registry=r)
        for reason in FINISH_REASONS:
            self.finished.labels(reason)
        for phase in self.phases:
            self.phase.labels(phase)
        if workers is not None:
            r.register(WorkerStatsCollector(workers))

    def routed(self, role: str, prompt_tokens: int, cached_tokens: int, max_tokens: int = 0) -> None:
        """A routing decision: a prompt sent to a worker of `role` expected to hold `cached_tokens`."""
        self.routed_prompt_tokens.labels(role).inc(prompt_tokens)
        self.routed_max_tokens.labels(role).inc(max_tokens)
        self.routed_requests.labels(role).inc()
        self.routed_cached_tokens.labels(role).inc(cached_tokens)

    def watch_admission(self, admission: object) -> None:
        """Gauges of admission control (router/admission.py), read at scrape time."""
        Gauge("pdcluster_admitted_requests", "Requests admitted and not finished (limit: router.max_requests).",
              registry=self.registry).set_function(lambda: admission.requests)
        Gauge("pdcluster_admitted_queued_prompt_tokens", "Prompt tokens of admitted requests without their first "
              "token yet (limit: router.max_queued_prompt_tokens).",
              registry=self.registry).set_function(lambda: admission.queued_prompt_tokens)

    @property
    def phases(self) -> tuple[str, ...]:
        return PHASES if self.mode != "colocated" else ("router_queue", "prefill_compute", "decode_queue")

    def request(self, arrival: float | None = None) -> RequestMetrics:
        """A request arrived (at `arrival`, time.monotonic()): it counts as queued until `running()`."""
        return RequestMetrics(self, time.monotonic() if arrival is None else arrival)


class RequestMetrics:
    """One request's recording: queued -> running() -> tokens() per arrival -> finished() | error().
    `close()` (always, at the end) counts a request that ended neither way as CANCELLED: the
    client went away mid-stream."""

    def __init__(self, metrics: RouterMetrics, arrival: float) -> None:
        self._m = metrics
        self.arrival = arrival
        self.e2e_s = 0.0
        self._state = "queued"
        self._last_token: float | None = None
        self._lock = threading.Lock()
        metrics.queued.inc()

    def _move(self, state: str) -> bool:
        """Go from queued/running to `state`; False if the request had already ended."""
        with self._lock:
            old, ended = self._state, self._state == "done"
            if not ended and old != state:
                self._state = state
        if ended or old == state:
            return False
        {"queued": self._m.queued, "running": self._m.running}[old].dec()
        if state == "running":
            self._m.running.inc()
        return True

    def running(self) -> None:
        """The request holds a decode reservation."""
        self._move("running")

    def tokens(self, now: float | None = None) -> None:
        """New tokens arrived at the router (one call per chunk)."""
        now = time.monotonic() if now is None else now
        if self._last_token is not None:
            self._m.itl.observe(max(0.0, now - self._last_token))
        self._last_token = now

    def finished(self, final: gen.GenerateResponse, now: float | None = None) -> None:
        """The final message is built: latencies, phases, finish reason and token counts."""
        now = time.monotonic() if now is None else now
        if not self._move("done"):
            return
        m, t = self._m, final.timing
        self.e2e_s = max(0.0, now - self.arrival)
        m.e2e.observe(self.e2e_s)
        if final.usage.completion_tokens:
            m.ttft.observe(t.ttft_ms / 1e3)
        if final.usage.completion_tokens > 1:
            m.tpot.observe(t.mean_tpot_ms / 1e3)
        for phase in m.phases:
            value = getattr(t, f"{phase}_ms")
            if phase != "decode_queue" or value > 0:  # 0: the request never reached a decode step
                m.phase.labels(phase).observe(value / 1e3)
        m.finished.labels(final.finish_reason or "abort").inc()
        m.prompt_tokens.inc(final.usage.prompt_tokens)
        m.generation_tokens.inc(final.usage.completion_tokens)

    def error(self, code: grpc.StatusCode) -> None:
        """The request ends with gRPC status `code` (counted once per request)."""
        if self._move("done"):
            self._m.errors.labels(code.name).inc()

    def close(self) -> None:
        self.error(grpc.StatusCode.CANCELLED)
