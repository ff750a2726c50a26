"""The router's view of the workers: gRPC stubs, health, and load for picking a pair.

Load is tracked by the router itself (requests and prompt tokens it has in flight per worker) and
refreshed from each worker's `Stats` (free KV blocks) by a background poll, so a pick costs no RPC.
The same poll keeps the prefix index (router/prefix_index.py): what each worker's prefix cache
holds; the choice between workers is `RoutingPolicy`'s (router/prefix_policy.py).
The last `WorkerStats` of each worker is kept on its handle (`stats`), for the router's metrics.
Each handle carries the stub the router calls that worker through (`Connect` makes it: gRPC by
default; the router's unit tests hand in fakes).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from proto import worker_pb2 as wk
from proto import worker_pb2_grpc as wk_grpc
from proto.cluster_auth import with_secret
from router.prefix_index import PrefixIndex, PromptBlocks
from router.prefix_policy import Candidate, RoutingPolicy

log = logging.getLogger("pdcluster.router")
GRPC_OPTIONS = [("grpc.max_send_message_length", 64 * 2**20), ("grpc.max_receive_message_length", 64 * 2**20)]
# (role, address) -> (channel, stub): the channel is closed when the pool closes; the stub answers
# the worker RPCs of router/orchestrator.py (`DecodeStub`, `PrefillStub`) and Stats
Connect = Callable[[str, str], "tuple[Any, Any]"]


_ROLES = {"prefill": wk.WORKER_ROLE_PREFILL, "decode": wk.WORKER_ROLE_DECODE,
          "colocated": wk.WORKER_ROLE_COLOCATED}


@dataclass
class WorkerHandle:
    worker_id: str
    role: str  # prefill | decode | colocated
    address: str
    channel: Any = field(repr=False)  # grpc.Channel
    stub: Any = field(repr=False)  # the worker's RPCs (a gRPC stub, or a test's fake)
    inflight: int = 0  # requests the router has on it
    inflight_tokens: int = 0  # prompt tokens the router has queued on it (prefill)
    local_tokens: int = 0  # prompt tokens it prefills locally with no first token yet (decode)
    kv_blocks_free: int = 0
    healthy: bool = True
    stats: wk.WorkerStats | None = field(default=None, repr=False)  # last answer to Stats (None: none yet)
    cache_cursor: int = 0  # where the prefix index stands in the worker's cache change list
    tier_cursor: int = 0  # and in its offload tier's


@dataclass(frozen=True)
class Taken:
    """A worker `WorkerPool.take_for` chose, and what it counted there."""

    worker: WorkerHandle
    cached_tokens: int  # leading prompt tokens its prefix cache is expected to hold
    counted_tokens: int  # prompt tokens counted on it until `release`


class WorkerPool:
    def __init__(self, stats_interval_s: float = 0.5, cluster_secret: str | None = None,
                 connect: Connect | None = None, policy: RoutingPolicy | None = None) -> None:
        self.policy = policy or RoutingPolicy()
        self.index = PrefixIndex()
        self._secret = cluster_secret  # sent with every RPC to a worker (proto/cluster_auth.py)
        self._connect = connect or self._grpc_connect
        self._workers: dict[str, WorkerHandle] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._interval = stats_interval_s
        self._pending_prefill_tokens = 0  # prompts bound for a prefill worker, not yet given to one
        self._thread = threading.Thread(target=self._poll, name="router-stats", daemon=True)
        self._thread.start()

    def set_workers(self, workers: list[tuple[str, str, str]]) -> None:
        """Replace membership with [(worker_id, role, address)]; existing channels are kept.
        A removed worker gets no new requests; requests already on it keep their handle (and
        channel) until they finish, which is how a worker being scaled away drains."""
        with self._lock:
            keep = {w[0] for w in workers}
            for wid in list(self._workers):
                if wid not in keep:
                    del self._workers[wid]
                    self.index.forget(wid)
            for wid, role, address in workers:
                if wid in self._workers and self._workers[wid].address == address:
                    continue
                channel, stub = self._connect(role, address)
                self._workers[wid] = WorkerHandle(wid, role, address, channel, stub)
                self.index.forget(wid)  # a new worker, or one restarted at a new address

    def _grpc_connect(self, role: str, address: str) -> tuple[grpc.Channel, Any]:
        channel = with_secret(grpc.insecure_channel(address, options=GRPC_OPTIONS), self._secret)
        return channel, wk_grpc.PrefillWorkerStub(channel) if role == "prefill" else wk_grpc.DecodeWorkerStub(channel)

    def update_worker(self, worker_id: str, role: str, address: str) -> None:
        """Add or replace one worker (a restarted one comes back at a new address), keep the rest."""
        with self._lock:
            current = [(w.worker_id, w.role, w.address) for w in self._workers.values() if w.worker_id != worker_id]
        self.set_workers([*current, (worker_id, role, address)])

    def workers(self, role: str | None = None) -> list[WorkerHandle]:
        with self._lock:
            return [w for w in self._workers.values() if role is None or w.role == role]

    def take(self, role: str, exclude: set[str] = frozenset(), avoid: set[str] = frozenset(),
             tokens: int = 0) -> WorkerHandle | None:
        """`take_for` with no prompt (load only), counted as carrying `tokens` prompt tokens."""
        taken = self._take(role, None, exclude, avoid, tokens)
        return taken.worker if taken is not None else None

    def take_for(self, role: str, prompt: PromptBlocks, exclude: set[str] = frozenset(),
                 avoid: set[str] = frozenset()) -> Taken | None:
        """The healthy worker of `role` not in `exclude` that the routing policy picks for `prompt`
        (those in `avoid` only when no other is left), counted as carrying one more request (and, a
        prefill worker, the prompt tokens it is not expected to hold) at once, in the same step as
        the choice and before any RPC to it: a request that arrives while an earlier one still
        waits for its Reserve or Prefill then sees that one's load instead of the same tie.
        Prefill: by expected cost (uncached prompt tokens plus queued ones), then requests in
        flight; decode and colocated: the longest cached prefix among the nearly least loaded, then
        requests in flight, then the most free KV blocks (as of the last Stats poll); a tie left
        after that goes to the first worker listed. The caller `release`s it with
        `Taken.counted_tokens`, also when the RPC fails."""
        return self._take(role, prompt, exclude, avoid, 0)

    def _take(self, role: str, prompt: PromptBlocks | None, exclude: set[str], avoid: set[str],
              tokens: int) -> Taken | None:
        with self._lock:
            c = self._pick(role, prompt, exclude | avoid, tokens) or self._pick(role, prompt, exclude, tokens)
            if c is None:
                return None
            if prompt is not None and role == "prefill":
                tokens = self.policy.uncached(len(prompt.token_ids), c.cached_tokens)
            c.worker.inflight += 1
            c.worker.inflight_tokens += tokens
            return Taken(c.worker, c.cached_tokens, tokens)

    def _pick(self, role: str, prompt: PromptBlocks | None, exclude: set[str], tokens: int) -> Candidate | None:
        cands = [Candidate(w, self.index.cached_tokens(w.worker_id, prompt) if prompt is not None else 0,
                           w.inflight_tokens, w.inflight, w.kv_blocks_free)
                 for w in self._workers.values() if w.role == role and w.healthy and w.worker_id not in exclude]
        if role != "prefill":
            return self.policy.pick_decode(cands)
        return self.policy.pick_prefill(len(prompt.token_ids) if prompt is not None else tokens, cands)

    def tier_source(self, w: WorkerHandle, prompt: PromptBlocks, cached_tokens: int) -> wk.TierSource | None:
        """A healthy worker of another node whose offload tier holds more of the prompt than `w`
        holds (`cached_tokens`), for `w` to read the blocks from (kv_transfer/tier_fetch.py); None
        when there is none, or `w` has no tier."""
        found = self.index.other_tier(w.worker_id, prompt, cached_tokens)
        if found is None:
            return None
        blocks, holders = found
        with self._lock:
            source = next((self._workers[h] for h in holders if h in self._workers and self._workers[h].healthy), None)
        if source is None:
            return None
        return wk.TierSource(address=source.address, blocks=blocks, role=_ROLES[source.role])

    def prefill_queued(self) -> int | None:
        """Prompt tokens queued on the least-loaded healthy prefill worker, with its share of those
        bound for the prefill workers and not yet given to one; None when no prefill worker is healthy."""
        with self._lock:
            queued = [w.inflight_tokens for w in self._workers.values() if w.role == "prefill" and w.healthy]
            return min(queued) + self._pending_prefill_tokens // len(queued) if queued else None

    def add_pending_prefill(self, tokens: int) -> None:
        """Count (or, negative, uncount) a prompt that will go to a prefill worker once its decode
        reservation is made: a request that arrives meanwhile sees it queued."""
        with self._lock:
            self._pending_prefill_tokens += tokens

    def add_local(self, w: WorkerHandle, tokens: int) -> None:
        """Count (or, negative, uncount) prompt tokens prefilled on decode worker `w`."""
        with self._lock:
            w.local_tokens += tokens

    def release(self, w: WorkerHandle, tokens: int = 0) -> None:
        with self._lock:
            w.inflight -= 1
            w.inflight_tokens -= tokens

    def check(self, w: WorkerHandle, timeout_s: float = 2.0) -> bool:
        """Ask `w` for its Stats now (the poll does it every interval; a request that saw `w` fail
        asks at once). A worker that does not answer is out of rotation until it answers again,
        and its prefix cache is unknown until then."""
        cursor, tier_cursor = w.cache_cursor, w.tier_cursor
        try:
            stats = w.stub.Stats(wk.StatsRequest(prefix_cache_events=self.policy.prefix_aware,
                                                 prefix_cache_cursor=cursor, tier_cursor=tier_cursor),
                                 timeout=timeout_s)
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                log.debug("Stats of worker %s failed: %s %s", w.worker_id, e.code(), e.details())
                return True  # it answered, with an error: still alive
            if w.healthy:
                log.warning("worker %s at %s is not answering (%s): out of rotation until it does",
                            w.worker_id, w.address, e.code().name)
            w.healthy = False
            with self._lock:
                w.cache_cursor = w.tier_cursor = 0
                self.index.forget(w.worker_id)
            return False
        if not w.healthy:
            log.warning("worker %s at %s answers again: back in rotation", w.worker_id, w.address)
        if stats.HasField("prefix_cache"):
            with self._lock:  # a change list older than one already applied is left out
                if w.cache_cursor == cursor and w.tier_cursor == tier_cursor:
                    self.index.apply(w.worker_id, stats.prefix_cache)
                    w.cache_cursor = stats.prefix_cache.cursor
                    w.tier_cursor = stats.prefix_cache.tier_cursor
        w.kv_blocks_free, w.healthy, w.stats = stats.kv_blocks_free, True, stats
        return True

    def _poll(self) -> None:
        while not self._stop.wait(self._interval):
            for w in self.workers():
                self.check(w)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            for w in self._workers.values():
                w.channel.close()
            self._workers.clear()
