"""A simulated prefill worker: prefill steps (SimWorker), then each finished prompt's KV transfer
to its decode worker and the commit, which the engine thread waits for before its next step
(PrefillEngine.step).

KV transfer: the prompt's tokens after those its decode worker already held at the reservation x KV
bytes per token, over the link min(prefill, decode worker link); each worker's link carries one
transfer at a time. Layer-wise, the first layer may leave after 1/L of
the step, the last one after the step. With `transfer_in_step` the measured step included the
sends and the commit: the prompt is committed when its step ends; with `commit_waits_lock` as well,
the commit then waits for the decode step in progress.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

from planner.sim_request import SimRequest
from planner.sim_worker import SimWorker

if TYPE_CHECKING:
    from planner.sim_cluster import SimCluster
    from planner.simulator import WorkerSpec


class SimPrefillWorker(SimWorker):
    role = "prefill"

    def __init__(self, spec: WorkerSpec, cluster: SimCluster) -> None:
        super().__init__(spec, cluster)
        self.inflight_tokens = 0  # prompt tokens the router counts on this worker
        self.pending_commits = 0  # finished prompts whose KV commit has not returned
        self.lock_wait_from = 0.0  # (commit_waits_lock) when its commits began to wait
        self.coming: dict[Hashable, int] = {}  # full-block keys of the prompts sent here, not yet computed

    def expected_prefix(self, s: SimRequest) -> int:
        """Tokens of `s`'s prompt the router expects here: in the cache, or of a prompt sent here
        and not yet computed (router/prefix_index.py: `expect`)."""
        if self.cache is None or not s.keys:
            return 0
        n = 0
        for key in s.keys[:(s.prompt - 1) // self.bs]:
            if key not in self.coming and not self.cache.holds(key):
                break
            n += 1
        return n * self.bs

    def add(self, s: SimRequest, now: float, counted: int) -> None:
        """The router sends `s`'s prompt here, counting `counted` of its tokens queued."""
        s.p = self
        s.counted = counted
        self.inflight += 1
        self.inflight_tokens += counted
        if self.cache is not None:
            for key in s.keys[:s.prompt // self.bs]:
                self.coming[key] = self.coming.get(key, 0) + 1
        self.waiting.append(s)
        self.wake(now)

    def remember(self, s: SimRequest) -> None:
        super().remember(s)
        coming = self.coming
        for key in s.keys[:s.prompt // self.bs]:
            n = coming.pop(key) - 1
            if n:
                coming[key] = n

    def after_step(self, now: float) -> None:
        if self.pending_commits:
            self.busy = True  # the engine thread waits in KVSender.commit until they are done
        else:
            super().after_step(now)

    def prompt_done(self, s: SimRequest, now: float) -> None:
        """The KV transfer of a finished prompt, committed before the next step."""
        c, d, router = self.cluster.spec, s.d, self.cluster.router
        if s.out <= 1:  # the first token ends it: the reservation is dropped
            d.reserved -= s.need
            self.cluster.out.first_token(s, now)
            router.finish(s, now + c.first_token_out_s)
            self.inflight -= 1
            self.inflight_tokens -= s.counted
            router.retry(now)
            return
        out, kvb = self.cluster.out, self.cost.kv_bytes_per_token
        out.kv_bytes_sent += (s.prompt - s.dhit) * kvb
        out.kv_bytes_held += s.dhit * kvb
        if c.transfer_in_step:  # sent and committed within the measured step
            if c.commit_waits_lock and d.locked:  # ... all but the wait for the decode worker's lock
                if not self.pending_commits:
                    self.lock_wait_from = now
                self.pending_commits += 1
                d.lock_waiters.append((d.commit, s))
                return
            d.commit(s, now, in_step=True)
            return
        nbytes = (s.prompt - s.dhit) * kvb
        gbps = min(self.spec.link_gbps, d.spec.link_gbps)
        dur = nbytes / (gbps * 1e9)
        if c.layerwise and c.num_layers > 1:
            ready = self.step_start + (now - self.step_start) / c.num_layers
            start = max(ready, self.link_free, d.link_free)
            end = max(start + dur, now + dur / c.num_layers)
        else:
            start = max(now, self.link_free, d.link_free)
            end = start + dur
        self.link_free = d.link_free = end
        self.pending_commits += 1
        self.cluster.commit_arrives(end + c.kv_latency_s, s)

    def committed(self, s: SimRequest) -> None:
        """`s`'s KV is committed on its decode worker: the router's count of it here ends."""
        self.inflight -= 1
        self.inflight_tokens -= s.counted

    def commit_returned(self, now: float) -> None:
        """A commit the engine thread waited for returned; the last one lets it go on."""
        self.pending_commits -= 1
        if not self.pending_commits:
            # with transfer_in_step the wait for the lock is part of the step, as the worker counts it
            if self.cluster.spec.transfer_in_step:
                self.busy_s += now - self.lock_wait_from
                self.cluster.out.prefill_step_s += now - self.lock_wait_from
            self.start_step(now)
