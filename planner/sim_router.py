"""The simulated router: worker choice, the reservation, local prefill, and the requests waiting
for KV blocks.

A request reserves blocks on the decode worker with the fewest requests in flight, then the most
free blocks, under the engine's own fit rule (engine/admission_rule.py); the router counts it on
that worker as it chooses it (WorkerPool.take). The Reserve completes when the worker's engine lock
is free. When no decode worker has room, the request waits (FIFO) and is retried as soon as blocks
are freed. The prompt then goes to the prefill worker with the fewest queued prompt tokens, or, by
the router's own local-prefill rule (router/local_prefill.py), to its decode worker.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from engine.admission_rule import blocks_needed, prompt_fits
from planner.sim_request import SimRequest
from router.local_prefill import LocalPrefillPolicy

if TYPE_CHECKING:
    from planner.sim_cluster import SimCluster
    from planner.sim_decode import SimDecodeWorker


class SimRouter:
    def __init__(self, cluster: SimCluster) -> None:
        self.cluster = cluster
        self.colocated = cluster.spec.mode == "colocated"
        self.policy = LocalPrefillPolicy(0 if self.colocated else cluster.spec.local_prefill_max_tokens)
        self.waiting: deque[SimRequest] = deque()  # no decode worker had room, in arrival order

    def arrive(self, s: SimRequest, now: float) -> None:
        if self.waiting or not self.try_reserve(s, now):
            self.waiting.append(s)

    def retry(self, now: float) -> None:
        """Blocks were freed: the waiting requests reserve in order while they fit."""
        while self.waiting and self.try_reserve(self.waiting[0], now):
            self.waiting.popleft()

    def decode_choice(self) -> list[SimDecodeWorker]:
        decode = self.cluster.decode
        return sorted(decode, key=lambda w: (w.inflight, -w.free_blocks())) if len(decode) > 1 else decode

    def try_reserve(self, s: SimRequest, now: float) -> bool:
        for w in self.decode_choice():
            if not prompt_fits(s.prompt, w.bs, len(w.running), w.free_blocks()):
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
        if self.colocated or (self.policy.enabled and self.policy.local(
                s.prompt, min(x.inflight_tokens for x in prefill), w.local_tokens)):
            w.prefill_here(s, now)
            return
        p = min(prefill, key=lambda x: (x.inflight_tokens, x.inflight)) if len(prefill) > 1 else prefill[0]
        p.add(s, now)

    def finish(self, s: SimRequest, t: float) -> None:
        """`s`'s last token reaches the client at `t`; it no longer counts on its decode worker."""
        s.d.inflight -= 1
        self.cluster.out.finish(s, t)
