"""The simulated router: worker choice, the reservation, local prefill, and the requests waiting
for KV blocks.

Workers are chosen by the router's own policy (router/prefix_policy.py, the same object), each
described by what the simulated workers hold (no lag: the router's picture of a cache is the cache,
and a prefill worker is expected to hold the prompts sent to it). A request reserves blocks on the
decode worker the policy picks (the longest cached prefix among the nearly least loaded, then fewer
requests in flight, then more free blocks) under the engine's own fit rule
(engine/admission_rule.py); the router counts it on that worker as it chooses it (WorkerPool.take).
The Reserve completes when the worker's engine lock is free, and shares the prompt's leading blocks
the worker holds. When no decode worker has room, the request waits (FIFO) and is retried as soon
as blocks are freed. The prompt is then prefilled on its decode worker when the part of it the
worker lacks is short (conditional disaggregation) or by the router's local-prefill rule
(router/local_prefill.py); otherwise it goes to the prefill worker of the least expected cost
(uncached prompt tokens plus queued ones), counted there by its uncached tokens.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from engine.admission_rule import blocks_needed, prompt_fits
from planner.sim_request import SimRequest
from router.local_prefill import LocalPrefillPolicy
from router.prefix_policy import Candidate, RoutingPolicy

if TYPE_CHECKING:
    from planner.sim_cluster import SimCluster


class SimRouter:
    def __init__(self, cluster: SimCluster) -> None:
        self.cluster = cluster
        self.colocated = cluster.spec.mode == "colocated"
        spec = cluster.spec
        self.policy = LocalPrefillPolicy(0 if self.colocated else spec.local_prefill_max_tokens)
        self.routing = RoutingPolicy(spec.prefix_aware,
                                     0 if self.colocated else spec.local_prefill_uncached_tokens)
        self.waiting: deque[SimRequest] = deque()  # no decode worker had room, in arrival order

    def arrive(self, s: SimRequest, now: float) -> None:
        if self.waiting or not self.try_reserve(s, now):
            self.waiting.append(s)

    def retry(self, now: float) -> None:
        """Blocks were freed: the waiting requests reserve in order while they fit."""
        while self.waiting and self.try_reserve(self.waiting[0], now):
            self.waiting.popleft()

    def try_reserve(self, s: SimRequest, now: float) -> bool:
        cands = [Candidate(w, w.held_prefix(s), inflight=w.inflight, free_blocks=w.free_blocks())
                 for w in self.cluster.decode]
        while cands:
            c = self.routing.pick_decode(cands)
            w = c.worker
            if not prompt_fits(s.prompt, w.bs, len(w.running), c.free_blocks):
                cands = [x for x in cands if x is not c]
                continue
            s.d = w
            w.inflight += 1  # the router counts it on w as it chooses (WorkerPool.take)
            if not self.colocated:
                s.need = blocks_needed(s.prompt, w.bs)
                w.reserved += s.need
            # the Reserve RPC returns once it has the worker's engine lock, which a step holds
            # (DecodeEngine.step, the colocated server's loop)
            if w.locked:
                w.lock_waiters.append((self.reserved, s))
            else:
                self.reserved(s, now)
            return True
        return False

    def reserved(self, s: SimRequest, now: float) -> None:
        """`s`'s Reserve returned: its prompt goes to a prefill worker, or is prefilled on its
        decode worker."""
        w, prefill = s.d, self.cluster.prefill
        if self.colocated:
            w.prefill_here(s, now)
            return
        s.dhit = w.share(s)
        if self.routing.prefill_on_decode(s.prompt, s.dhit):
            self.cluster.out.local_uncached += 1
            w.prefill_here(s, now)
            return
        if self.policy.enabled and self.policy.local(s.prompt - s.dhit, min(x.inflight_tokens for x in prefill),
                                                     w.local_tokens):
            w.prefill_here(s, now)
            return
        c = self.routing.pick_prefill(s.prompt, [Candidate(p, p.expected_prefix(s), p.inflight_tokens, p.inflight)
                                                 for p in prefill])
        c.worker.add(s, now, self.routing.uncached(s.prompt, c.cached_tokens))

    def finish(self, s: SimRequest, t: float) -> None:
        """`s`'s last token reaches the client at `t`; it no longer counts on its decode worker."""
        s.d.inflight -= 1
        s.d.release(s)
        self.cluster.out.finish(s, t)
