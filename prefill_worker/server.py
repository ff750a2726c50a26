"""The prefill worker process: a gRPC server around a `PrefillEngine` and its engine loop.

`Prefill` is unary: the handler queues the request for the engine thread and waits (bounded) for
its result, which arrives after the KV has been pushed and committed to the decode worker named
in the ticket. The engine thread batches whatever is queued at each step. A Prefill with
`ticket_follows` gets its ticket in `AttachTicket` (queued for the engine thread as well).

`Stats` also reports cumulative counts (prompt tokens prefilled, prefix-cache hits, KV bytes sent
per backend) that the router exposes as metrics; lines logged about a request carry its id.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

from engine.config import EngineConfig
from engine.engine import Engine
from engine.prefix_hash import block_hashes
from engine.sampling_params import SamplingParams
from engine.step_stats import StepTotals
from kv_transfer import TransferTicket
from kv_transfer.tier_fetch import TierFetcher, serve_blocks
from prefill_worker.prefill_engine import PrefillEngine, PrefillResult
from prefill_worker.rank_kv import PrefillRankKV, SenderSettings, connect_all
from proto import generate_pb2 as gen
from proto import worker_pb2 as wk
from proto import worker_pb2_grpc as wk_grpc
from proto.cluster_auth import server_interceptors
from proto.convert import (
    choice_sampling_from_proto,
    logprob_to_proto,
    prefix_cache_to_proto,
    step_stats_to_proto,
    tier_stats_to_proto,
)
from proto.serving import add_health_and_reflection, bind_server, in_request_context

log = logging.getLogger("pdcluster.prefill")
SERVICE_NAME = wk.DESCRIPTOR.services_by_name["PrefillWorker"].full_name  # "pdcluster.v1.PrefillWorker"


@dataclass
class _Pending:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    ticket: TransferTicket | None  # None: it follows (AttachTicket)
    output_offset: int = 0  # a resumed request's completion tokens generated before
    done: threading.Event = field(default_factory=threading.Event)
    result: PrefillResult | None = None


@dataclass
class _Attach:
    request_id: str
    ticket: TransferTicket


class PrefillWorkerServer(wk_grpc.PrefillWorkerServicer):
    """A prefill worker: prefills prompts and sends their KV to the decode worker each ticket names."""

    def __init__(self, engine_cfg: EngineConfig, worker_id: str | None = None, host: str = "127.0.0.1",
                 port: int = 0, kv_backend: str = "grpc", kv_timeout_s: float = 30.0,
                 request_timeout_s: float = 600.0, kv_compression: str = "none", kv_faults: str | None = None,
                 cluster_secret: str | None = None, kv_options: dict | None = None, direct_kv: bool = True,
                 model: object | None = None, kv_caches: list | None = None) -> None:
        """`model`, `kv_caches`: weights and KV cache tensors already in this process (a worker that
        changes role keeps its own; the caches are reused when they fit).
        `kv_faults`: a fault-injection spec for this worker's KV sender (kv_transfer/faults.py;
        None: off, unless $PDCLUSTER_KV_FAULTS is set). `kv_options`: more keyword arguments of the
        backend's sender (shm/auto: in_place, verify_in_place). `cluster_secret`: required of every RPC to
        this worker, and sent with every KV transfer (proto/cluster_auth.py; None: none). `direct_kv`: with
        tensor parallelism, each rank sends its own KV heads (False: through rank 0, the fallback)."""
        self.worker_id = worker_id or f"prefill-{uuid.uuid4().hex[:6]}"
        self.request_timeout_s = request_timeout_s
        settings = SenderSettings(kv_backend, kv_timeout_s, kv_compression, kv_faults, cluster_secret,
                                  dict(kv_options or {}))
        # with tensor parallelism each rank has a KV sender of its own (the direct path) unless direct_kv=False
        self.engine = Engine(engine_cfg, "prefill", model=model, kv_caches=kv_caches,
                             rank_kv=PrefillRankKV(settings) if direct_kv else None)
        self.prefill = PrefillEngine(self.engine, settings.make(self.engine.compat_hash))
        # blocks of another node's offload tier, read into this node's before a prompt is queued
        self.tier_fetcher = (TierFetcher(self.engine.tier, cluster_secret, kv_timeout_s)
                             if self.engine.tier is not None else None)
        self._inbox: queue.Queue[_Pending | _Attach | str] = queue.Queue()  # requests, tickets, ids to abort
        self._pending: dict[str, _Pending] = {}
        self._queued_tokens = 0
        self._prompt_tokens = 0  # cumulative, successful prefills (engine thread)
        self._cached_tokens = 0  # of which served from the prefix cache
        self._stop = threading.Event()
        self.on_fatal: Callable[[str], None] | None = None  # the engine broke for good: a Ray actor exits
        self.step_totals = StepTotals()
        self.server, self.address = bind_server(host, port, 256, f"prefill worker {self.worker_id}",
                                                interceptors=server_interceptors(cluster_secret, self.worker_id))
        wk_grpc.add_PrefillWorkerServicer_to_server(self, self.server)
        self.health = add_health_and_reflection(self.server, [SERVICE_NAME])
        self.server.start()
        self.health.serving()
        self._thread = threading.Thread(target=self._loop, name=f"{self.worker_id}-engine", daemon=True)
        self._thread.start()

    def in_flight(self) -> int:
        """Requests this worker holds: queued, computing, or waiting for their ticket."""
        return len(self._pending) + self._inbox.qsize()

    def connect_kv(self, endpoints: list[str], timeout_s: float) -> dict[str, str]:
        """Handshake with each decode worker's KV receiver now (at start-up); returns endpoint ->
        reason for those that cannot take this worker's transfers (layout, node, backend, network)."""
        errors = connect_all(self.prefill.sender, endpoints, timeout_s)
        if self.engine.rank_kv is not None:  # each tensor-parallel rank sends its own heads: its own handshakes
            replies = self.engine.call_ranks({"op": "connect", "endpoints": endpoints, "timeout_s": timeout_s})
            for rank, reply in enumerate(replies, 1):
                for endpoint, why in reply.get("errors", {}).items():
                    errors.setdefault(endpoint, f"tensor-parallel rank {rank}: {why}")
                if "error" in reply:
                    errors.update({e: f"tensor-parallel rank {rank}: {reply['error']}" for e in endpoints})
        return errors

    # ------------------------------------------------------------------ engine loop
    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(item, str):
                if self.prefill.abort(item, "aborted by the router"):
                    self._finish(item, None)
            elif isinstance(item, _Attach):
                self._attach(item)
            else:
                try:
                    self.prefill.add(item.request_id, item.token_ids, item.params, item.ticket, item.output_offset)
                    self._pending[item.request_id] = item
                except Exception as e:  # bad ticket / request: answer it at once
                    item.result = PrefillResult(item.request_id, 0, None, None, 0, error=str(e))
                    item.done.set()
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _attach(self, item: _Attach) -> None:
        try:
            result = self.prefill.attach(item.request_id, item.ticket)
        except Exception as e:  # a ticket that does not fit the prompt: that request fails
            self.prefill.abort(item.request_id, f"ticket refused: {e}")
            result = PrefillResult(item.request_id, 0, None, None, 0, error=f"ticket refused: {e}")
        if result is not None:
            self._finish(item.request_id, result)

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self.engine.check_broken() is not None:  # a tensor-parallel rank is gone: the worker goes down whole
                self._down(self.engine.broken)
                return
            self._drain_inbox(block=not self.prefill.has_work())
            self._queued_tokens = self.prefill.num_queued_tokens  # read by Stats (engine thread only)
            if not self.prefill.has_work():
                continue
            t0 = time.perf_counter()
            try:
                results = self.prefill.step()
            except Exception:
                log.exception("prefill step failed")
                for rid in list(self._pending):
                    self.prefill.abort(rid, "prefill engine error")
                    self._finish(rid, PrefillResult(rid, 0, None, None, 0, error="prefill engine error"))
                continue
            for r in results:
                self._finish(r.request_id, r)
            self.step_totals.add(self.engine.last_step, time.perf_counter() - t0)

    def _down(self, reason: str) -> None:
        """The engine cannot step any more: answer what waits, stop serving (NOT_SERVING; Prefill
        answers UNAVAILABLE), and `on_fatal` (a Ray actor exits, so Ray restarts the worker whole)."""
        log.error("worker down: %s", reason)
        self.health.stopping()
        for rid in list(self._pending):
            self.prefill.abort(rid, reason)
            self._finish(rid, PrefillResult(rid, 0, None, None, 0, error=f"worker down: {reason}"))
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if not isinstance(item, str):
                item.result = PrefillResult(item.request_id, 0, None, None, 0, error=f"worker down: {reason}")
                item.done.set()
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def _finish(self, request_id: str, result: PrefillResult | None) -> None:
        p = self._pending.pop(request_id, None)
        if p is None:
            return
        if result is not None and result.error is None:
            self._prompt_tokens += len(p.token_ids)
            self._cached_tokens += result.num_cached_tokens
        p.result = result
        p.done.set()

    # ------------------------------------------------------------------ RPCs
    @in_request_context
    def Prefill(self, request: wk.PrefillRequest, context: grpc.ServicerContext) -> wk.PrefillResponse:
        rid = request.request_id
        if self.engine.broken is not None:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"worker down: {self.engine.broken}")
        try:
            params = choice_sampling_from_proto(request.sampling)
            ids = list(request.token_ids)
            self.engine.validate(ids, params)
        except ValueError as e:
            log.warning("refused: %s", e)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if request.HasField("tier_source") and self.tier_fetcher is not None:
            self._fetch_tier_blocks(request.tier_source, ids)
        ticket = None if request.ticket_follows else TransferTicket.from_proto(request.ticket)
        pending = _Pending(rid, ids, params, ticket, request.resume_offset)
        context.add_callback(lambda: None if pending.done.is_set() else self._inbox.put(rid))
        self._inbox.put(pending)
        log.debug("queued: %d prompt tokens, KV to %s", len(ids), ticket.kv_endpoint if ticket else "(ticket follows)")
        remaining = context.time_remaining()
        timeout = self.request_timeout_s if remaining is None else min(remaining, self.request_timeout_s)
        if not pending.done.wait(timeout):
            self._inbox.put(rid)
            log.warning("prefill did not finish in %.0fs", timeout)
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"prefill of {rid} did not finish in {timeout:.0f}s")
        r = pending.result
        if r is None:
            log.debug("aborted")
            context.abort(grpc.StatusCode.CANCELLED, f"prefill of {rid} was aborted")
        if r.error is not None:
            log.warning("failed: %s", r.error)
            context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill of {rid} failed: {r.error}")
        log.debug("prefilled: %d cached tokens; queue %.1f ms, compute %.1f ms, kv commit %.1f ms",
                  r.num_cached_tokens, r.queue_ms, r.compute_ms, r.commit_ms)
        response = wk.PrefillResponse(
            request_id=rid, first_token=r.first_token, num_prompt_tokens=len(ids),
            num_cached_tokens=r.num_cached_tokens, finish_reason=r.finish_reason or "",
            prefill_queue_ms=r.queue_ms, prefill_compute_ms=r.compute_ms, kv_transfer_ms=r.commit_ms,
        )
        if r.logprob is not None:
            response.first_token_logprob.CopyFrom(logprob_to_proto(r.logprob))
        response.prompt_logprobs.extend(logprob_to_proto(x) for x in r.prompt_logprobs)
        return response

    def _fetch_tier_blocks(self, source: wk.TierSource, ids: list[int]) -> None:
        """Read the prompt's leading blocks that neither this engine's prefix cache nor this node's
        tier holds from the tier of `source`'s node (kv_transfer/tier_fetch.py)."""
        bs = self.engine.block_size
        n = min(source.blocks, (len(ids) - 1) // bs)  # the last token's block is always computed
        hashes = block_hashes(ids[: n * bs], bs)
        first = next((i for i, h in enumerate(hashes) if not self.engine.in_prefix_cache(h)), len(hashes))
        if first < len(hashes):
            self.tier_fetcher.fetch(source, hashes[first:])

    def ReadTier(self, request: wk.ReadTierRequest, context: grpc.ServicerContext) -> Iterator[wk.TierBlock]:
        return serve_blocks(self.engine.tier, request)

    def AttachTicket(self, request: wk.AttachTicketRequest, context: grpc.ServicerContext) -> gen.AbortResponse:
        found = request.request_id in self._pending
        self._inbox.put(_Attach(request.request_id, TransferTicket.from_proto(request.ticket)))
        return gen.AbortResponse(found=found)

    def Abort(self, request: gen.AbortRequest, context: grpc.ServicerContext) -> gen.AbortResponse:
        found = request.request_id in self._pending
        self._inbox.put(request.request_id)
        return gen.AbortResponse(found=found)

    def Health(self, request: wk.HealthRequest, context: grpc.ServicerContext) -> wk.HealthResponse:
        ok = self._thread.is_alive()
        return wk.HealthResponse(
            ok=ok, reason="" if ok else self.engine.check_broken() or "engine thread died", worker_id=self.worker_id,
            role=wk.WORKER_ROLE_PREFILL, model=self.engine.cfg.model, compat_hash=self.engine.compat_hash,
        )

    def Stats(self, request: wk.StatsRequest, context: grpc.ServicerContext) -> wk.WorkerStats:
        return self.stats(request)

    def engine_ranks(self) -> list[int]:
        """The engine's processes: this one, then its other tensor-parallel ranks."""
        return self.engine.rank_pids()

    def stats(self, request: wk.StatsRequest | None = None) -> wk.WorkerStats:
        """Lengths and block counts are read live; the queued-token sum, which iterates the engine's
        queues, is taken by the engine thread after each step (iterating here would race it)."""
        load = self.engine.load()
        return wk.WorkerStats(
            worker_id=self.worker_id, role=wk.WORKER_ROLE_PREFILL, running=load.running,
            queued=load.waiting + self._inbox.qsize(), kv_blocks_used=load.blocks_used,
            kv_blocks_free=load.blocks_free, queued_prefill_tokens=self._queued_tokens,
            kv_bytes_sent=self.prefill.bytes_sent(), prefix_cache_hit_tokens=self._cached_tokens,
            prompt_tokens=self._prompt_tokens, **step_stats_to_proto(self.step_totals),
            **prefix_cache_to_proto(request or wk.StatsRequest(), self.engine.prefix_cache_changes,
                                    self.engine.block_size, self.engine.tier_changes, self.engine.tier_id),
            **tier_stats_to_proto(self.engine.tier_id, self.engine.tier_stats()),
        )

    def stop(self, grace: float = 1.0) -> None:
        self.health.stopping()
        self._stop.set()
        self.server.stop(grace).wait(grace + 1)
        self._thread.join(timeout=5)
        if self.tier_fetcher is not None:
            self.tier_fetcher.close()
        self.prefill.close()
