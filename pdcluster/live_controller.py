"""The SLO controller over a running cluster: every interval, what the router and the workers
show -> `scaling.policy.decide` (the simulator's decision, planner/sim_controller.py) -> role flips
in place, and new workers or workers given back. The cluster is a `Fleet`: `LocalCluster` (in
process; it only flips, `Bounds.max_total` is its size) or `pdcluster.ray_fleet.RayFleet` (the
controller of `pdcluster up`, in the router's actor; flips, and workers started or stopped within
the pools' min_replicas / max_replicas). Here the signals are measured:

    TTFT / TPOT p90        the router's histograms, this interval's observations (at requests' ends)
    prompt tokens and requests arriving   the router's routed counters (decode role: one a request)
    queued prompt tokens   the router's count of prompt tokens at the prefill workers
    prefill capacity       the prefill workers' prefill steps: tokens per second of step time
    decode capacity        the decode workers' steps by batch bucket, a line through (sequences, step
                           time): the batch whose step reaches scale_up_at of the TPOT SLO (within
                           max_num_seqs), its sequences per step time, averaged over the workers with
                           two buckets seen or more (none: decode is judged by KV use and TPOT alone)
                           (pdcluster/worker_signals.py)
    mean output            tokens generated / requests finished over the last intervals, at most the
                           mean max_tokens of the requests routed in this one
    KV used                the fullest decode worker's share of blocks its sequences use
    waiting for decode     requests the router holds until a decode worker has blocks (they count as
                           decode sequences; late first tokens with some waiting press decode)

Every decision is logged ("pdcluster.controller"), kept in `decisions`, counted in the router's
/metrics (`pdcluster_controller_decisions_total{change, cause}`, and the target per role in
`pdcluster_controller_target_workers`) and handed to the fleet's `record` (`pdcluster status`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Protocol

from pdcluster.worker_signals import WorkerSignals
from router.metrics import FINISH_REASONS
from scaling.policy import HOLD, Bounds, ControllerConfig, Decision, Signals, State, decide

if TYPE_CHECKING:
    from pdcluster.role_flip import Flip
    from router.server import RouterServer

log = logging.getLogger("pdcluster.controller")


def _histogram(registry: object, name: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of a histogram's buckets, +Inf last."""
    for metric in registry.collect():  # type: ignore[attr-defined]
        if metric.name == name:
            return [(float(s.labels["le"]), s.value) for s in metric.samples if s.name.endswith("_bucket")]
    return []


def _p90(now: list[tuple[float, float]], before: list[tuple[float, float]]) -> float | None:
    """The 90th percentile (a bucket's upper bound) of the observations between two readings."""
    old = dict(before)
    delta = [(le, count - old.get(le, 0.0)) for le, count in now]
    total = delta[-1][1] if delta else 0.0
    if total <= 0:
        return None
    for le, count in delta:
        if count >= 0.9 * total:
            return le if math.isfinite(le) else delta[-2][0] if len(delta) > 1 else None
    return None


class Fleet(Protocol):
    """What the controller changes: a cluster's workers, and its router (in this process)."""

    router: RouterServer

    def read_workers(self, limit_s: float) -> list[WorkerSignals]: ...

    def bounds(self) -> Bounds: ...

    def flip(self, worker_id: str, role: str) -> Flip: ...

    def resize(self, role: str, workers: int) -> None: ...

    def record(self, decision: Decision, signals: Signals) -> None: ...


class LiveController:
    """`LiveController(fleet, cfg).start()`; `tick()` decides once (the thread calls it every
    `cfg.interval_s`); `stop()`."""

    def __init__(self, fleet: Fleet, cfg: ControllerConfig) -> None:
        fleet.bounds()  # a ValueError for a fleet that cannot be controlled (colocated)
        self.fleet, self.cfg = fleet, cfg
        self.metrics = fleet.router.metrics
        self.state = State()
        self.decisions: list[Decision] = []
        self.last_change = -math.inf
        self._last = self._reading()
        self._finished: deque[tuple[float, float]] = deque(maxlen=6)  # (requests, tokens) per interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _reading(self) -> dict:
        r = self.metrics.registry
        value = lambda name, **labels: r.get_sample_value(name, labels) or 0.0  # noqa: E731
        return {"t": time.monotonic(), "ttft": _histogram(r, "pdcluster_time_to_first_token_seconds"),
                "tpot": _histogram(r, "pdcluster_time_per_output_token_seconds"),
                "prompt": value("pdcluster_routed_prompt_tokens_total", role="prefill"),
                "requests": value("pdcluster_routed_requests_total", role="decode"),
                "max_tokens": value("pdcluster_routed_max_tokens_total", role="decode"),
                "finished": sum(value("pdcluster_requests_finished_total", finish_reason=f) for f in FINISH_REASONS),
                "generated": value("pdcluster_generation_tokens_total")}

    def signals(self, workers: list[WorkerSignals] | None = None) -> Signals:
        """This interval's signals (`workers`: the fleet's reading, else read now)."""
        if workers is None:
            workers = self.fleet.read_workers(self.cfg.slo_tpot_ms / 1e3 * self.cfg.scale_up_at)
        now = self._reading()
        last, self._last = self._last, now
        dt = max(now["t"] - last["t"], 1e-9)
        self._finished.append((now["finished"] - last["finished"], now["generated"] - last["generated"]))
        done = sum(n for n, _ in self._finished)
        prefill = [w for w in workers if w.role == "prefill"]
        decode = [w for w in workers if w.role == "decode"]
        seen = [w.batch for w in decode if w.batch is not None]
        slots = sum(b for b, _ in seen) / len(seen) * len(decode) if seen else 0.0
        decode_tps = sum(b / s for b, s in seen) / len(seen) * len(decode) if seen else 0.0
        ttft, tpot = _p90(now["ttft"], last["ttft"]), _p90(now["tpot"], last["tpot"])
        waiting = int(self.metrics.queued._value.get())  # requests waiting for a decode reservation
        return Signals(
            now_s=now["t"], prefill=len(prefill), decode=len(decode),
            ttft_p90_ms=ttft * 1e3 if ttft is not None else None, tpot_p90_ms=tpot * 1e3 if tpot is not None else None,
            queued_prompt_tokens=int(self.fleet.router.pool.prefill_queued() or 0),
            prefill_tokens_per_s=sum(w.prefill_tokens_per_s for w in prefill),
            prefill_demand_tokens_s=(now["prompt"] - last["prompt"]) / dt, decode_tokens_per_s=decode_tps,
            arrival_rate=(now["requests"] - last["requests"]) / dt,
            mean_max_tokens=(now["max_tokens"] - last["max_tokens"]) / max(1.0, now["requests"] - last["requests"]),
            mean_output_tokens=sum(g for _, g in self._finished) / done if done else 0.0,
            decode_sequences=sum(w.running for w in decode) + waiting, waiting_for_decode=waiting, decode_slots=slots,
            kv_used=max((w.kv_used for w in decode), default=0.0), youngest_worker_s=now["t"] - self.last_change)

    def tick(self) -> Decision:
        workers = self.fleet.read_workers(self.cfg.slo_tpot_ms / 1e3 * self.cfg.scale_up_at)
        signals = self.signals(workers)
        decision, self.state = decide(self.cfg, self.fleet.bounds(), signals, self.state)
        if decision.action == HOLD:
            log.debug("hold (%s); pressures prefill %.2f decode %.2f; %s", decision.reason, decision.prefill_pressure,
                      decision.decode_pressure, signals)
            return decision
        self.decisions.append(decision)
        change = " ".join(f"{role}{n - have:+d}" for role, n, have in (
            ("prefill", decision.prefill, signals.prefill), ("decode", decision.decode, signals.decode)) if n != have)
        self.metrics.controller_decisions.labels(change, decision.reason.split(" (")[0]).inc()
        self.metrics.controller_target.labels("prefill").set(decision.prefill)
        self.metrics.controller_target.labels("decode").set(decision.decode)
        log.info("decision: %s (%s); pressures prefill %.2f decode %.2f", decision.action, decision.reason,
                 decision.prefill_pressure, decision.decode_pressure)
        self.fleet.record(decision, signals)
        src = [w for w in workers if w.role == ("decode" if decision.flips > 0 else "prefill")]
        movable = sorted((w for w in src if w.can_flip), key=lambda w: w.in_flight)
        for w in movable[:min(abs(decision.flips), len(src) - 1)]:
            flip = self.fleet.flip(w.worker_id, "prefill" if decision.flips > 0 else "decode")
            log.info("flipped %s to %s: drained in %.0f ms, out of service %.0f ms", flip.worker_id, flip.role,
                     flip.drain_s * 1e3, flip.out_of_service_s * 1e3)
            self.last_change = time.monotonic()
        for role, add in (("prefill", decision.add_prefill), ("decode", decision.add_decode)):
            if add:
                self.fleet.resize(role, signals.prefill + decision.flips + add if role == "prefill"
                                  else signals.decode - decision.flips + add)
                self.last_change = time.monotonic()
        return decision

    def start(self) -> LiveController:
        def loop() -> None:
            # ticks at a fixed rate: reading the workers takes time of its own (Ray calls under
            # load), which waiting a whole interval after each tick added to every decision's lag
            due = time.monotonic()
            while True:
                due += self.cfg.interval_s
                if self._stop.wait(max(0.0, due - time.monotonic())):
                    return
                t0 = time.monotonic()
                try:
                    self.tick()
                except Exception:  # noqa: BLE001 (a failed tick must not stop the controller)
                    log.exception("controller tick failed")
                took = time.monotonic() - t0
                if took > self.cfg.interval_s:
                    log.debug("controller tick took %.0f ms, over the %.0f ms interval", took * 1e3,
                              self.cfg.interval_s * 1e3)
                due = max(due, time.monotonic() - self.cfg.interval_s)  # late: no burst of catch-up ticks

        self._thread = threading.Thread(target=loop, name="slo-controller", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
