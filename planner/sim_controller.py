"""The SLO controller in the simulator (`pdcluster plan simulate --controller`): a decision function
called every `interval_s` on the signals the simulated cluster shows, its decisions applied as a
cluster applies them. The controller's own (scaling/policy.py, the code a cluster runs), or a rule
in the style of Dynamo's load mode (`load_rule`) for comparison, in the same simulator.

Every worker slot exists in both roles (a simulated prefill and decode worker of the same hardware);
the router sees the slots serving a role. A flip takes the worker off the router's list at once,
its requests run to their end (drain), then after `flip_s` it serves the other role with the same
weights. A new worker serves `start_s` after the decision (a process, its weights); a removed one
drains and goes. Worker-seconds count every slot from its start to its removal, draining included.

Signals per interval, as a cluster's router shows them: TTFT p90 of the first tokens in the
interval; the mean inter-token gap of the decode steps in it (a step's time, weighted by the
sequences it advanced; the router sees the gaps themselves); prompt tokens queued at the prefill
workers and what they compute per second at a full token budget (the cost model); the fullest
decode worker's share of KV blocks used; the age of the newest worker.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from planner.sim_cluster import SimCluster
from planner.sim_request import Outcomes, SimRequest
from planner.simulator import ClusterSpec, WorkerSpec
from scaling.policy import HOLD, Bounds, ControllerConfig, Decision, Signals, State, decide, pressures

Rule = Callable[[ControllerConfig, Bounds, Signals, State], "tuple[Decision, State]"]


def load_rule(cfg: ControllerConfig, b: Bounds, s: Signals, state: State) -> tuple[Decision, State]:
    """Dynamo's load mode as its docs describe it: each role on its own, +1 worker per tick when
    the role is over its SLO (pressure 1.0), -1 when under `scale_down_at`; no flips, no sizing, no
    settling or cooldown beyond the tick (workers still starting count as there)."""
    p, d = pressures(cfg, s)
    have = {"prefill": s.prefill + s.pending_prefill, "decode": s.decode + s.pending_decode}
    add = dict.fromkeys(have, 0)
    for role, level in (("prefill", p), ("decode", d)):
        if level >= 1.0 and have[role] < getattr(b, f"max_{role}") and sum(have.values()) < b.max_total:
            add[role] = 1
        elif level < cfg.scale_down_at and have[role] > getattr(b, f"min_{role}"):
            add[role] = -1
    if not any(add.values()):
        return Decision(HOLD, have["prefill"], have["decode"], "within", p, d), state
    action = ", ".join(f"{'add' if n > 0 else 'remove'} 1 {r}" for r, n in add.items() if n)
    return Decision(action, have["prefill"] + add["prefill"], have["decode"] + add["decode"], "load rule", p, d,
                    0, add["prefill"], add["decode"]), state


@dataclass
class Interval:
    t: float
    prefill: int
    decode: int
    slots: int  # workers started and not yet gone (draining and starting included)
    decision: str
    reason: str
    prefill_pressure: float
    decode_pressure: float


@dataclass
class ControlledResult:
    ttft: list[float]  # per request, as Simulator's
    tpot: list[float]
    intervals: list[Interval] = field(default_factory=list)
    worker_seconds: float = 0.0
    decisions: int = 0


class _Slot:
    def __init__(self, i: int, cluster: SimCluster) -> None:
        self.prefill, self.decode = cluster.prefill[i], cluster.decode[i]
        self.role: str | None = None  # serving: prefill / decode; None: off, draining or starting
        self.next: str | None = None  # the role it takes once drained or started ("off": none)
        self.ready_at = math.inf
        self.since = -math.inf  # when it began serving its role
        self.started = math.inf  # when it began to count (worker-seconds); inf: not counting
        self.used_s = 0.0  # worker-seconds of its earlier lives (started, then removed)

    def drained(self) -> bool:
        p, d = self.prefill, self.decode
        return (p.inflight == 0 and not p.busy and not p.waiting and p.pending_commits == 0
                and d.inflight == 0 and not d.running and not d.busy)


class _Meter:
    """The signals of the interval since the last reading, as a router shows them (the module's doc)."""

    def __init__(self, sim: ControlledSimulator, arrivals: Sequence[float], prompts: Sequence[int],
                 outputs: Sequence[int]) -> None:
        self.sim = sim
        order = sorted(range(len(arrivals)), key=lambda i: arrivals[i])
        self.times = [arrivals[i] for i in order]
        self.prompt_sums = list(itertools.accumulate((prompts[i] for i in order), initial=0))
        self.output_sums = list(itertools.accumulate((outputs[i] for i in order), initial=0))  # their max_tokens
        w = sim.worker
        budget = w.max_num_batched_tokens
        self.prefill_rate = budget / max(w.cost.prefill_time(budget, budget * budget // 2), 1e-9)  # one worker
        self.t, self.token_s, self.seqs, self.arrived = 0.0, 0.0, 0, 0
        self.recent: deque[list[tuple[int, int]]] = deque(maxlen=6)  # (prompt, output) of the last intervals' finishes

    def signals(self, t: float, cluster: SimCluster, slots: list[_Slot]) -> Signals:
        out = cluster.out
        ttfts = sorted(out.ttft_log)
        out.ttft_log.clear()
        self.recent.append(list(out.finish_log))
        out.finish_log.clear()
        done = [x for batch in self.recent for x in batch]
        context = sum(p + o / 2 for p, o in done) / len(done) if done else 1024.0
        seqs = out.decode_seqs - self.seqs
        arrived = bisect.bisect_right(self.times, t)
        dt = max(t - self.t, 1e-9)
        per_worker, step = self.sim._decode_slots(context)
        s = Signals(
            now_s=t, prefill=len(cluster.prefill), decode=len(cluster.decode),
            ttft_p90_ms=ttfts[int(0.9 * (len(ttfts) - 1))] * 1e3 if ttfts else None,
            tpot_p90_ms=(out.decode_token_s - self.token_s) / seqs * 1e3 if seqs else None,
            queued_prompt_tokens=sum(w.inflight_tokens for w in cluster.prefill),
            prefill_tokens_per_s=self.prefill_rate * len(cluster.prefill),
            prefill_demand_tokens_s=(self.prompt_sums[arrived] - self.prompt_sums[self.arrived]) / dt,
            decode_tokens_per_s=per_worker / step * len(cluster.decode), decode_slots=per_worker * len(cluster.decode),
            decode_sequences=sum(len(w.running) for w in cluster.decode) + len(cluster.router.waiting),
            waiting_for_decode=len(cluster.router.waiting),
            arrival_rate=(arrived - self.arrived) / dt,
            mean_max_tokens=(self.output_sums[arrived] - self.output_sums[self.arrived]) / max(1, arrived - self.arrived),
            mean_output_tokens=sum(o for _, o in done) / len(done) if done else 0.0,
            kv_used=max((w.used_blocks() / max(w.num_blocks, 1) for w in cluster.decode), default=0.0),
            youngest_worker_s=min((t - s.since for s in slots if s.role is not None), default=math.inf),
            pending_prefill=sum(1 for s in slots if s.role is None and s.next == "prefill"),
            pending_decode=sum(1 for s in slots if s.role is None and s.next == "decode"))
        self.t, self.token_s, self.seqs, self.arrived = t, out.decode_token_s, out.decode_seqs, arrived
        return s


class ControlledSimulator:
    """`ControlledSimulator(worker, bounds, start).run(arrivals, prompts, outputs)`: one worker spec
    for every slot, `bounds` (at most `bounds.max_total` slots), `start` = (prefill, decode)."""

    def __init__(self, spec: ClusterSpec, worker: WorkerSpec, bounds: Bounds, start: tuple[int, int],
                 cfg: ControllerConfig, rule: Rule = decide, flip_s: float = 1.0, start_s: float = 60.0) -> None:
        n = bounds.max_total
        self.spec = dataclasses.replace(spec, mode="disaggregated", prefill=[worker] * n, decode=[worker] * n)
        self.worker, self.bounds, self.start, self.cfg, self.rule = worker, bounds, start, cfg, rule
        self.flip_s, self.start_s = flip_s, start_s

    def run(self, arrivals: Sequence[float], prompts: Sequence[int], outputs: Sequence[int],
            on_progress: Callable[[int], None] | None = None) -> ControlledResult:
        """`on_progress(k)`: k more requests finished."""
        n = len(arrivals)
        out = Outcomes(n, self.spec.first_token_out_s, None, None, None, 0, on_progress)
        out.ttft_log, out.finish_log = [], []
        cluster = SimCluster(self.spec, out)
        slots = [_Slot(i, cluster) for i in range(self.bounds.max_total)]
        cluster.prefill, cluster.decode = [], []  # what the router sees: slots serving a role
        for i, role in enumerate(["prefill"] * self.start[0] + ["decode"] * self.start[1]):
            self._serve(cluster, slots[i], role, -math.inf)
            slots[i].started = 0.0
        res = ControlledResult(out.ttft, out.tpot)
        meter = _Meter(self, arrivals, prompts, outputs)
        state = State()

        def tick(t: float) -> None:
            nonlocal state
            self._transitions(cluster, slots, t)
            if t - meter.t >= self.cfg.interval_s - 1e-9:
                decision, state = self.rule(self.cfg, self.bounds, meter.signals(t, cluster, slots), state)
                if decision.action != HOLD:
                    self._apply(cluster, slots, decision, t)
                    res.decisions += 1
                res.intervals.append(Interval(t, len(cluster.prefill), len(cluster.decode),
                                              sum(1 for s in slots if s.started <= t), decision.action,
                                              decision.reason, decision.prefill_pressure, decision.decode_pressure))
            if out.finished < n and not out.stop:
                cluster.at(t + min(1.0, self.cfg.interval_s), tick)

        cluster.at(0.0, tick)
        requests = [SimRequest(i, arrivals[i], prompts[i], outputs[i]) for i in range(n)]
        need = -(-max((p + o for p, o in zip(prompts, outputs)), default=0) // self.worker.block_size)
        if slots[0].decode.num_blocks < need:
            raise ValueError(f"a worker's KV cache ({slots[0].decode.num_blocks} blocks) cannot hold the longest "
                             f"request ({need} blocks)")
        cluster.run(requests)
        end = max(out.last, max(arrivals, default=0.0))
        res.worker_seconds = sum(s.used_s + (max(0.0, end - s.started) if s.started < math.inf else 0.0)
                                 for s in slots)
        return res

    def _decode_slots(self, context: float) -> tuple[int, float]:
        """(sequences, step seconds) of one decode worker running sequences of `context` tokens at
        the largest batch whose step stays under the TPOT trigger (scale_up_at of the SLO: nearer
        it the step's time would press decode by itself) and whose KV fits (the cost model)."""
        cost, slo = self.worker.cost, self.cfg.slo_tpot_ms / 1e3 * self.cfg.scale_up_at
        lo, hi = 1, max(1, min(self.worker.max_num_seqs, cost.kv_capacity_tokens // max(1, int(context))))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if cost.decode_time(mid, int(mid * context)) <= slo else (lo, mid - 1)
        return lo, cost.decode_time(lo, int(lo * context))

    # ------------------------------------------------------------------ decisions, as a cluster makes them
    def _serve(self, cluster: SimCluster, slot: _Slot, role: str, t: float) -> None:
        slot.role, slot.next, slot.ready_at, slot.since = role, None, math.inf, t
        (cluster.prefill if role == "prefill" else cluster.decode).append(getattr(slot, role))
        if role == "decode":
            cluster.router.retry(t)  # requests waiting for KV blocks may fit now

    def _apply(self, cluster: SimCluster, slots: list[_Slot], d: Decision, t: float) -> None:
        """Flips first (in place), then new workers and workers given back."""
        for _ in range(abs(d.flips)):
            self._leave(cluster, slots, "decode" if d.flips > 0 else "prefill", "prefill" if d.flips > 0 else "decode", t)
        for role, n in (("prefill", d.add_prefill), ("decode", d.add_decode)):
            for _ in range(max(0, n)):
                slot = next((s for s in slots if s.role is None and s.next is None), None)
                if slot is not None:
                    slot.next, slot.ready_at, slot.started = role, t + self.start_s, t
            for _ in range(max(0, -n)):
                self._leave(cluster, slots, role, "off", t)

    def _leave(self, cluster: SimCluster, slots: list[_Slot], role: str, then: str, t: float) -> None:
        """A worker leaves `role` for `then` (a role, or "off"): one still on its way into it turns
        round first; else the one serving with the least to drain leaves the router's list and takes
        `then` once drained. The last one serving a role stays."""
        coming = [s for s in slots if s.role is None and s.next == role]
        if coming:
            s = coming[-1]
            if then == "off":
                s.next, s.ready_at = None, math.inf
                s.used_s, s.started = s.used_s + t - s.started, math.inf
            else:
                s.next, s.ready_at = then, (s.ready_at if s.ready_at < math.inf and s.started == t else math.inf)
            return
        serving = [s for s in slots if s.role == role]
        if len(serving) < 2:
            return
        slot = min(serving, key=lambda s: getattr(s, role).inflight)
        (cluster.prefill if role == "prefill" else cluster.decode).remove(getattr(slot, role))
        slot.role, slot.next, slot.ready_at = None, then, math.inf

    def _transitions(self, cluster: SimCluster, slots: list[_Slot], t: float) -> None:
        for s in slots:
            if s.role is not None or s.next is None:
                continue
            if s.ready_at == math.inf and s.drained():  # drained: gone, or its flip begins
                if s.next == "off":
                    s.next, s.used_s, s.started = None, s.used_s + t - s.started, math.inf
                    continue
                s.ready_at = t + self.flip_s
            if t >= s.ready_at:
                self._serve(cluster, s, s.next, t)
