"""The simulated cluster: its parts (router, prefill and decode workers) wired together, the shared
host's processor sharing, and the event loop: one heap of events (step ends, KV commits) merged
with the arrivals."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from planner.sim_decode import SimDecodeWorker
from planner.sim_prefill import SimPrefillWorker
from planner.sim_request import Outcomes, SimRequest
from planner.sim_router import SimRouter
from planner.sim_worker import SimWorker

if TYPE_CHECKING:
    from planner.simulator import ClusterSpec

STEP, COMMIT, CALL = 0, 1, 2  # events: a worker's step ends; a KV commit reaches its decode worker; a call


class SimCluster:
    def __init__(self, spec: ClusterSpec, out: Outcomes) -> None:
        self.spec, self.out = spec, out
        role = "colocated" if spec.mode == "colocated" else "decode"
        self.decode = [SimDecodeWorker(s, self, role) for s in spec.decode]
        self.prefill = [SimPrefillWorker(s, self) for s in spec.prefill]
        self.workers: list[SimWorker] = [*self.prefill, *self.decode]
        self.router = SimRouter(self)
        self.heap: list[tuple[float, int, int, Any]] = []  # (time, tie, STEP or COMMIT, worker or request)
        self.tie = 0
        self.events = 0

    def step_ends(self, t: float, w: SimWorker) -> None:
        self.tie += 1
        heapq.heappush(self.heap, (t, self.tie, STEP, w))

    def commit_arrives(self, t: float, s: SimRequest) -> None:
        """`s`'s KV has all arrived at its decode worker at `t`; the commit reaches it."""
        self.tie += 1
        heapq.heappush(self.heap, (t, self.tie, COMMIT, s))

    def at(self, t: float, fn: Any) -> None:
        """Call `fn(t)` at `t` (the controller's ticks, planner/sim_controller.py)."""
        self.tie += 1
        heapq.heappush(self.heap, (t, self.tie, CALL, fn))

    def host_slowdown(self, w: SimWorker) -> float:
        """The factor `w`'s step starting now is stretched by: processor sharing on the host, the
        engine threads then busy plus the serving path's demand (CPU per token x the tokens per
        second the decode workers stream now) over its cores; for a prefill step with a fitted
        load slope, that slope's share of the streamed tokens in place of the demand."""
        c = self.spec
        slope = w.spec.prefill_load_slope if w.batch is not None else 0.0
        if not (c.host_cores or slope):
            return 1.0
        tokens_per_s = sum(len(x.running) / x.step_dt for x in self.decode if x.running and x.step_dt > 0)
        busy = 1 + sum(1 for x in self.workers if x.busy and x is not w)
        if slope:
            return (1.0 + slope * tokens_per_s) * (max(1.0, busy / c.host_cores) if c.host_cores else 1.0)
        return max(1.0, (busy + c.host_cpu_per_token_s * tokens_per_s) / c.host_cores)

    def run(self, requests: Sequence[SimRequest]) -> None:
        """Every request, in arrival order (each reaches the router router_in_s after it arrives),
        until the events run out or `out.stop`."""
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
        out, heap, router_in_s = self.out, self.heap, self.spec.router_in_s
        nxt = 0
        t_prev = 0.0
        while not out.stop:
            t_arr = requests[order[nxt]].arrival + router_in_s if nxt < len(order) else math.inf
            if heap and heap[0][0] <= t_arr:
                t, _, kind, obj = heapq.heappop(heap)
                out.area += out.in_system * (t - t_prev)
                t_prev = t
                if kind == STEP:
                    obj.end_step(t)
                elif kind == COMMIT:
                    obj.d.commit(obj, t)
                else:
                    obj(t)
            elif nxt < len(order):
                s = requests[order[nxt]]
                nxt += 1
                out.area += out.in_system * (t_arr - t_prev)
                t_prev = t_arr
                out.in_system += 1
                self.router.arrive(s, t_arr)
            else:
                break
            self.events += 1
