"""The SLO controller over a running in-process cluster (`LocalCluster`): every interval, what the
router and the workers show -> `scaling.policy.decide` (the simulator's decision, planner/
sim_controller.py) -> role flips (`LocalCluster.flip`). Here the signals are measured:

    TTFT / TPOT p90        the router's histograms, this interval's observations (at requests' ends)
    prompt tokens and requests arriving   the router's routed counters (decode role: one a request)
    queued prompt tokens   the router's count of prompt tokens at the prefill workers
    prefill capacity       the prefill workers' prefill steps: tokens per second of step time
    decode capacity        the decode workers' steps by batch bucket, a line through (sequences, step
                           time): the batch whose step reaches scale_up_at of the TPOT SLO (within
                           max_num_seqs), its sequences per step time, averaged over the workers with
                           two buckets seen or more (none: decode is judged by KV use and TPOT alone)
    mean output            tokens generated / requests finished over the last intervals
    KV used                the fullest decode worker's share of blocks in use

An in-process cluster starts no workers, so only flips are applied (`Bounds.max_total` is its
size). Every decision is logged ("pdcluster.controller"), kept in `decisions` and counted in the
router's /metrics (`pdcluster_controller_decisions_total{change, cause}`, and the target per role in
`pdcluster_controller_target_workers`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from router.metrics import FINISH_REASONS
from scaling.policy import HOLD, Bounds, ControllerConfig, Decision, Signals, State, decide

if TYPE_CHECKING:
    from pdcluster.local_cluster import LocalCluster

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


def _batch_at(by_batch: dict, limit_s: float, max_seqs: int) -> tuple[float, float] | None:
    """(sequences, step seconds) of the batch whose decode step takes `limit_s`, from the steps seen
    per batch bucket; None before any decode step."""
    points = [(t.seqs / t.steps, t.seconds / t.steps) for (phase, _), t in by_batch.items()
              if phase == "decode" and t.steps]
    if not points:
        return None
    if len(points) >= 2:
        n = len(points)
        mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
        var = sum((x - mx) ** 2 for x, _ in points)
        slope = sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0
        if slope > 0:
            base = my - slope * mx
            b = max(1.0, min(float(max_seqs), (limit_s - base) / slope))
            return b, base + slope * b
    return None  # one bucket seen (or no growth with the batch): no line, no estimate


class LiveController:
    """`LiveController(cluster, cfg).start()`; `tick()` decides once (the thread calls it every
    `cfg.interval_s`); `stop()`."""

    def __init__(self, cluster: LocalCluster, cfg: ControllerConfig) -> None:
        if cluster.decode_role == "colocated":
            raise ValueError("the controller moves workers between prefill and decode: a disaggregated cluster")
        assert cluster.router is not None
        self.cluster, self.cfg = cluster, cfg
        self.metrics = cluster.router.metrics
        self.state = State()
        self.decisions: list[Decision] = []
        self.last_flip = -math.inf
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
                "finished": sum(value("pdcluster_requests_finished_total", finish_reason=f) for f in FINISH_REASONS),
                "generated": value("pdcluster_generation_tokens_total")}

    def signals(self) -> Signals:
        c, now = self.cluster, self._reading()
        last, self._last = self._last, now
        dt = max(now["t"] - last["t"], 1e-9)
        self._finished.append((now["finished"] - last["finished"], now["generated"] - last["generated"]))
        done = sum(n for n, _ in self._finished)
        prefill_tps = 0.0
        for w in c.prefill_workers:
            totals = w.step_totals.snapshots()[0]["prefill"]
            prefill_tps += totals.tokens / totals.seconds if totals.seconds else 0.0
        kv, seen = 0.0, []
        limit = self.cfg.slo_tpot_ms / 1e3 * self.cfg.scale_up_at
        for w in c.decode_workers:
            b = _batch_at(w.step_totals.snapshots()[1], limit, w.engine.cfg.max_num_seqs)
            if b is not None:
                seen.append(b)
            load = w.engine.load()
            kv = max(kv, load.blocks_used / max(1, load.blocks_used + load.blocks_free))
        n = len(c.decode_workers)
        slots = sum(b for b, _ in seen) / len(seen) * n if seen else 0.0
        decode_tps = sum(b / s for b, s in seen) / len(seen) * n if seen else 0.0
        ttft, tpot = _p90(now["ttft"], last["ttft"]), _p90(now["tpot"], last["tpot"])
        return Signals(
            now_s=now["t"], prefill=len(c.prefill_workers), decode=len(c.decode_workers),
            ttft_p90_ms=ttft * 1e3 if ttft is not None else None, tpot_p90_ms=tpot * 1e3 if tpot is not None else None,
            queued_prompt_tokens=int(c.router.pool.prefill_queued() or 0), prefill_tokens_per_s=prefill_tps,
            prefill_demand_tokens_s=(now["prompt"] - last["prompt"]) / dt, decode_tokens_per_s=decode_tps,
            arrival_rate=(now["requests"] - last["requests"]) / dt,
            mean_output_tokens=sum(g for _, g in self._finished) / done if done else 0.0,
            decode_sequences=sum(w.engine.load().running for w in c.decode_workers), decode_slots=slots,
            kv_used=kv, youngest_worker_s=now["t"] - self.last_flip)

    def tick(self) -> Decision:
        c = self.cluster
        total = len(c.prefill_workers) + len(c.decode_workers)
        bounds = Bounds(1, total - 1, 1, total - 1, total, min_total=total)  # flips only
        signals = self.signals()
        decision, self.state = decide(self.cfg, bounds, signals, self.state)
        if decision.action == HOLD:
            return decision
        self.decisions.append(decision)
        change = " ".join(f"{role}{n - have:+d}" for role, n, have in (
            ("prefill", decision.prefill, signals.prefill), ("decode", decision.decode, signals.decode)) if n != have)
        self.metrics.controller_decisions.labels(change, decision.reason.split(" (")[0]).inc()
        self.metrics.controller_target.labels("prefill").set(decision.prefill)
        self.metrics.controller_target.labels("decode").set(decision.decode)
        log.info("decision: %s (%s); pressures prefill %.2f decode %.2f", decision.action, decision.reason,
                 decision.prefill_pressure, decision.decode_pressure)
        for _ in range(abs(decision.flips)):
            src = c.decode_workers if decision.flips > 0 else c.prefill_workers
            if len(src) < 2:
                break
            worker = min(src, key=lambda w: w.in_flight())
            flip = c.flip(worker.worker_id, "prefill" if decision.flips > 0 else "decode")
            log.info("flipped %s to %s: drained in %.0f ms, out of service %.0f ms", flip.worker_id, flip.role,
                     flip.drain_s * 1e3, flip.out_of_service_s * 1e3)
            self.last_flip = time.monotonic()
        return decision

    def start(self) -> LiveController:
        def loop() -> None:
            while not self._stop.wait(self.cfg.interval_s):
                try:
                    self.tick()
                except Exception:  # noqa: BLE001 (a failed tick must not stop the controller)
                    log.exception("controller tick failed")

        self._thread = threading.Thread(target=loop, name="slo-controller", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
