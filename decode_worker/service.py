"""The `pdcluster.v1.DecodeWorker` gRPC service, served by both roles that stream tokens: the decode
worker (decode_worker/server.py: KV arrives from prefill workers) and the colocated worker
(decode_worker/colocated.py: every prompt is prefilled here). The router drives both the same way.

Threads: gRPC handlers (Reserve / Stream / Abort / Health / Stats) and one engine thread that steps
the engine whenever there is work and hands each new token to the stream of its request. A request
prefilled here (`ReserveRequest.run_prefill`, or any request of a colocated worker) joins the
engine's queue at Reserve and runs in its mixed steps, and no KV moves.

A request's stream is a queue created at Reserve; `Stream` drains it, so tokens produced before
the router opened the stream are not lost. Lines logged about a request carry its id (the gRPC
handlers set it; the engine thread passes it).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

from common.logs import request_context
from decode_worker.locked_engine import LockedEngine
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.step_stats import StepTotals
from kv_transfer.tier_fetch import serve_blocks
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

log = logging.getLogger("pdcluster.decode")
SERVICE_NAME = wk.DESCRIPTOR.services_by_name["DecodeWorker"].full_name  # "pdcluster.v1.DecodeWorker"
_DONE = object()


@dataclass
class _Stream:
    queue: queue.Queue = field(default_factory=queue.Queue)
    committed_at: float | None = None  # KV arrived (decode queue starts)
    reserved_at: float = field(default_factory=time.monotonic)
    sent: int = 0  # tokens emitted so far
    local: bool = False  # prefilled here (colocated, or a decode worker's local prefill)


class DecodeWorkerService(wk_grpc.DecodeWorkerServicer):
    """A role's server: `__init__` binds the port, the role builds its engine (a decode engine's KV
    receiver registers on `self.server`), then `_start` serves."""

    role: int = wk.WORKER_ROLE_UNSPECIFIED  # the role's wk.WorkerRole
    prefilled_as = "local prefill"  # how a request prefilled here is logged

    def __init__(self, worker_id: str, host: str, port: int, request_timeout_s: float,
                 cluster_secret: str | None) -> None:
        self.worker_id = worker_id
        self.request_timeout_s = request_timeout_s
        self.server, self.address = bind_server(host, port, 256, f"decode worker {worker_id}",
                                                interceptors=server_interceptors(cluster_secret, worker_id))
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._queued_tokens = 0
        self._prompt_tokens = 0  # cumulative, prompts prefilled here (engine thread)
        self._cached_tokens = 0  # of which served from the prefix cache
        self._local_prefills = 0  # requests a decode worker prefilled itself (engine thread)
        self._local_blocks = 0  # their prompts' blocks: KV no prefill worker had to send
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.step_totals = StepTotals()
        self.on_fatal: Callable[[str], None] | None = None  # the engine broke for good (see _fatal)

    def in_flight(self) -> int:
        """Requests this worker holds: streaming, running, or reserved and not yet committed."""
        return len(self._streams) + self.engine.load().running + self.locked.num_reserved

    def _start(self, engine: LockedEngine, services: list[str]) -> None:
        """Serve `services` (this one and the role's own) and start the engine thread."""
        self.locked = engine
        self.engine = engine.engine
        wk_grpc.add_DecodeWorkerServicer_to_server(self, self.server)
        self.health = add_health_and_reflection(self.server, [SERVICE_NAME, *services])
        self.server.start()
        self.health.serving()
        self._thread = threading.Thread(target=self._loop, name=f"{self.worker_id}-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ engine loop
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._iteration()
            except Exception:  # a bug must not kill the engine thread silently: fail the running requests
                log.exception("engine step failed")
                try:
                    self._fail_all("engine error")
                except Exception:
                    log.exception("failing the running requests failed")
                if self.engine.broken:  # a tensor-parallel rank is gone: the worker goes down whole
                    self._fatal(self.engine.broken)
                    return

    def _fatal(self, reason: str) -> None:
        """The engine cannot step any more: stop serving (health NOT_SERVING, Health ok=false), and
        `on_fatal` (a Ray actor: exit, so Ray restarts the worker with all its ranks)."""
        log.error("worker down: %s", reason)
        self.health.stopping()
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def _iteration(self) -> None:
        broken = self.engine.check_broken()
        if broken is not None:  # a tensor-parallel rank exited while the worker was idle
            raise RuntimeError(broken)
        self._expire_reservations()
        # iterated here only (Stats would race it); Reserve adds to the queue under the engine's lock
        self._queued_tokens = self.locked.queued_prompt_tokens()
        if not self.locked.has_work():
            self._wake.wait(0.05)
            self._wake.clear()
            return
        t0 = time.perf_counter()
        for seq in self.locked.step():
            self._emit(seq)
        self.step_totals.add(self.engine.last_step, time.perf_counter() - t0)

    def _expire_reservations(self) -> None:
        """Free the reservations whose KV did not arrive in time (a role that takes KV)."""

    def _emit(self, seq: Sequence) -> None:
        stream = self._streams.get(seq.request_id)
        if stream is None:
            return
        opening, first = stream.sent == 0, stream.sent
        if opening and not stream.local and stream.committed_at is not None and seq.output_token_ids:
            first = 1  # the first token came with the prefill worker's reply: the router has it, it crosses once
        new = seq.output_token_ids[first:]
        stream.sent = first + len(new)
        lps = seq.logprobs[first : first + len(new)] if seq.logprobs else []
        decode_queue_ms = 0.0
        if opening and stream.local:  # queued until the prompt was first scheduled
            decode_queue_ms = seq.queue_ms
            self._prompt_tokens += seq.num_prompt_tokens
            self._cached_tokens += seq.num_cached_tokens
            if self.role == wk.WORKER_ROLE_DECODE:
                self._local_prefills += 1
                self._local_blocks += -(-seq.num_prompt_tokens // self.engine.block_size)
        elif opening and stream.committed_at is not None:  # KV committed -> first decode step done
            decode_queue_ms = (time.monotonic() - stream.committed_at) * 1e3
        chunk = wk.TokenChunk(
            request_id=seq.request_id, start_index=first, token_ids=new,
            logprobs=[logprob_to_proto(lp) for lp in lps], finish_reason=seq.finish_reason or "",
            decode_queue_ms=decode_queue_ms,
        )
        if opening and stream.local:
            chunk.prompt_logprobs.extend(logprob_to_proto(lp) for lp in seq.prompt_logprobs)
        stream.queue.put(chunk)
        if seq.finish_reason is not None:
            stream.queue.put(_DONE)
            log.debug("finished: %s, %d tokens", seq.finish_reason, stream.sent,
                      extra={"request_id": seq.request_id})

    def _fail_all(self, reason: str) -> None:
        for rid, stream in list(self._streams.items()):
            stream.queue.put(wk.TokenChunk(request_id=rid, finish_reason="abort"))
            self._abort(rid)  # frees the blocks and closes the stream after the abort chunk

    def _abort(self, request_id: str) -> bool:
        found = self.locked.abort_request(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.queue.put(_DONE)
        return found

    # ------------------------------------------------------------------ RPCs
    @in_request_context
    def Reserve(self, request: wk.ReserveRequest, context: grpc.ServicerContext) -> wk.ReserveResponse:
        rid, ids = request.request_id, list(request.token_ids)
        if self.engine.broken is not None:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"worker down: {self.engine.broken}")
        try:
            params = choice_sampling_from_proto(request.sampling)
            with self._streams_lock:
                if rid in self._streams:
                    raise ValueError(f"request id {rid!r} is already active on this worker")
                self._streams[rid] = _Stream()
            reserved = self._reserve_for_kv(request, ids, params, context)
            if reserved is not None:
                return reserved
            stream = self._streams[rid]  # prefilled here: no KV to wait for
            stream.committed_at, stream.local = time.monotonic(), True
            try:
                admitted = self.locked.add_local(rid, ids, params, request.resume_offset)
            except ValueError:
                self._streams.pop(rid, None)
                raise
            if not admitted:
                self._streams.pop(rid, None)
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free KV blocks on this worker")
            self._wake.set()
            log.debug("admitted: %d prompt tokens (%s)", len(ids), self.prefilled_as)
            return wk.ReserveResponse()
        except ValueError as e:
            log.warning("refused: %s", e)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def _reserve_for_kv(self, request: wk.ReserveRequest, ids: list[int], params: SamplingParams,
                        context: grpc.ServicerContext) -> wk.ReserveResponse | None:
        """The answer to a Reserve whose KV will arrive from a prefill worker; None: the prompt is
        prefilled here (always, for a role that takes no KV)."""
        return None

    def Stream(self, request: wk.StreamRequest, context: grpc.ServicerContext) -> Iterator[wk.TokenChunk]:
        rid = request.request_id
        stream = self._streams.get(rid)
        if stream is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no active request {rid!r} on this worker")
        context.add_callback(lambda: self._on_disconnect(rid, stream))
        deadline = time.monotonic() + self.request_timeout_s
        with request_context(rid):
            while True:
                try:
                    item = stream.queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    self._abort(rid)
                    log.warning("exceeded %.0fs; aborted", self.request_timeout_s)
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"request {rid} exceeded {self.request_timeout_s}s")
                if item is _DONE:
                    self._streams.pop(rid, None)
                    return
                yield item

    def _on_disconnect(self, rid: str, stream: _Stream) -> None:
        if self._streams.get(rid) is stream:  # still running: the client went away
            self._abort(rid)

    def Abort(self, request: gen.AbortRequest, context: grpc.ServicerContext) -> gen.AbortResponse:
        return gen.AbortResponse(found=self._abort(request.request_id))

    def Health(self, request: wk.HealthRequest, context: grpc.ServicerContext) -> wk.HealthResponse:
        ok = self._thread.is_alive()
        return wk.HealthResponse(
            ok=ok, reason="" if ok else self.engine.check_broken() or "engine thread died", worker_id=self.worker_id, role=self.role,
            model=self.engine.cfg.model, compat_hash=self.engine.compat_hash,
        )

    def Stats(self, request: wk.StatsRequest, context: grpc.ServicerContext) -> wk.WorkerStats:
        return self.stats(request)

    def ReadTier(self, request: wk.ReadTierRequest, context: grpc.ServicerContext) -> Iterator[wk.TierBlock]:
        """Blocks of this node's offload tier, for a prefill worker of another node."""
        return serve_blocks(self.engine.tier, request)

    def engine_ranks(self) -> list[int]:
        """The engine's processes: this one, then its other tensor-parallel ranks."""
        return self.engine.rank_pids()

    def _received_held(self) -> int:
        """Prompt tokens of requests whose KV came from prefill workers that this worker held
        already, so no KV moved for them (none for a role that takes no KV)."""
        return 0

    def stats(self, request: wk.StatsRequest | None = None) -> wk.WorkerStats:
        """Lengths and block counts are read live; the queued-token sum comes from the engine thread.
        Prompt tokens and prefix-cache hits count the prompts prefilled here, as a prefill worker's
        do; the blocks of received prompts that were held already count in kv_bytes_not_sent."""
        load = self.engine.load()
        held = self._received_held()
        not_sent = (held // self.engine.block_size + self._local_blocks) * self.engine.kv_bytes_per_block
        return wk.WorkerStats(
            worker_id=self.worker_id, role=self.role, running=load.running,
            queued=load.waiting + self.locked.num_reserved,
            kv_blocks_used=load.blocks_used, kv_blocks_free=load.blocks_free,
            queued_prefill_tokens=self._queued_tokens, prefix_cache_hit_tokens=self._cached_tokens,
            prompt_tokens=self._prompt_tokens, kv_bytes_not_sent=not_sent,
            local_prefills=self._local_prefills, **step_stats_to_proto(self.step_totals),
            **prefix_cache_to_proto(request or wk.StatsRequest(), self.engine.prefix_cache_changes,
                                    self.engine.block_size, self.engine.tier_changes, self.engine.tier_id),
            **tier_stats_to_proto(self.engine.tier_id, self.engine.tier_stats()),
        )

    def stop(self, grace: float = 1.0) -> None:
        self.health.stopping()
        self._stop.set()
        self._wake.set()
        for rid in list(self._streams):
            self._abort(rid)
        self.server.stop(grace).wait(grace + 1)
        self._thread.join(timeout=5)
        self.locked.close()
