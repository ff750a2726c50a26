"""The decode worker process: a gRPC server around a `DecodeEngine` and its engine loop.

Threads: gRPC handlers (Reserve / Stream / Abort / Health / Stats, and the KV receiver service on
the same server) and one engine thread that steps the engine whenever there is work and hands each
new token to the stream of its request. In colocated mode the same server runs an `Engine` that
prefills too (`ReserveRequest.run_prefill`), so the router drives both modes the same way. A
decode worker takes `run_prefill` too: the router's local prefill of a short prompt
(router/local_prefill.py) runs in this engine's mixed steps, and no KV moves.

A request's stream is a queue created at Reserve; `Stream` drains it, so tokens produced before
the router opened the stream are not lost. Reservations whose KV never commits expire after
`reservation_ttl_s` (their blocks are freed), so a dead prefill worker cannot strand blocks.

Lines logged about a request carry its id (the gRPC handlers set it; the engine thread passes it).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

import grpc

from common.logs import request_context
from decode_worker.decode_engine import DecodeEngine
from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.step_stats import StepTotals
from proto import generate_pb2 as gen
from proto import kv_transfer_pb2
from proto import worker_pb2 as wk
from proto import worker_pb2_grpc as wk_grpc
from proto.cluster_auth import server_interceptors
from proto.convert import logprob_to_proto, sampling_from_proto, step_stats_to_proto
from proto.serving import add_health_and_reflection, bind_server

log = logging.getLogger("pdcluster.decode")
SERVICE_NAME = wk.DESCRIPTOR.services_by_name["DecodeWorker"].full_name  # "pdcluster.v1.DecodeWorker"
KV_SERVICE_NAME = kv_transfer_pb2.DESCRIPTOR.services_by_name["KVReceiver"].full_name
_DONE = object()


@dataclass
class _Stream:
    queue: "queue.Queue" = field(default_factory=queue.Queue)
    committed_at: float | None = None  # KV arrived (decode queue starts)
    reserved_at: float = field(default_factory=time.monotonic)
    sent: int = 0  # tokens emitted so far
    local: bool = False  # prefilled here (colocated, or a decode worker's local prefill)


class DecodeWorkerServer(wk_grpc.DecodeWorkerServicer):
    def __init__(
        self,
        engine_cfg: EngineConfig,
        worker_id: str | None = None,
        colocated: bool = False,
        host: str = "127.0.0.1",
        port: int = 0,
        kv_backend: str = "grpc",
        request_timeout_s: float = 600.0,
        reservation_ttl_s: float = 120.0,
        cluster_secret: str | None = None,
        kv_options: dict | None = None,
    ) -> None:
        """`cluster_secret`: required of every RPC to this worker, KV transfers included
        (proto/cluster_auth.py; None: none). `reservation_ttl_s`: the lease of a reservation whose KV
        has not committed. `kv_options`: more keyword arguments of the backend's receiver (shm/auto:
        in_place)."""
        self.worker_id = worker_id or f"decode-{uuid.uuid4().hex[:6]}"
        self.colocated = colocated
        self.request_timeout_s = request_timeout_s
        self.reservation_ttl_s = reservation_ttl_s
        self.server, self.address = bind_server(host, port, 256, f"decode worker {self.worker_id}",
                                                interceptors=server_interceptors(cluster_secret, self.worker_id))
        self.engine = Engine(engine_cfg, "colocated" if colocated else "decode")
        self.decode: DecodeEngine | None = None
        if not colocated:
            self.decode = DecodeEngine(self.engine, backend=kv_backend, server=self.server, endpoint=self.address,
                                       **(kv_options or {}))
        self._lock = threading.RLock()  # engine state (colocated mode; DecodeEngine has its own)
        self._streams: dict[str, _Stream] = {}
        self._queued_tokens = 0
        self._prompt_tokens = 0  # cumulative, prompts prefilled here (colocated; engine thread)
        self._cached_tokens = 0  # of which served from the prefix cache
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.step_totals = StepTotals()
        wk_grpc.add_DecodeWorkerServicer_to_server(self, self.server)
        services = [SERVICE_NAME, KV_SERVICE_NAME] if self.decode else [SERVICE_NAME]
        self.health = add_health_and_reflection(self.server, services)
        self.server.start()
        self.health.serving()
        self._thread = threading.Thread(target=self._loop, name=f"{self.worker_id}-engine", daemon=True)
        self._thread.start()
        self.role = wk.WORKER_ROLE_COLOCATED if colocated else wk.WORKER_ROLE_DECODE

    # ------------------------------------------------------------------ engine loop
    def _has_work(self) -> bool:
        return self.decode.has_work() if self.decode else self.engine.has_work()

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

    def _iteration(self) -> None:
        self._expire_reservations()
        # iterated here only (Stats would race it); Reserve adds to the queue under the engine's lock
        if self.decode:
            self._queued_tokens = self.decode.queued_prompt_tokens()
        else:
            with self._lock:
                self._queued_tokens = self.engine.queued_prompt_tokens()
        if not self._has_work():
            self._wake.wait(0.05)
            self._wake.clear()
            return
        t0 = time.perf_counter()
        if self.decode:
            seqs = self.decode.step()
        else:
            with self._lock:
                seqs = self.engine.step()
        for seq in seqs:
            self._emit(seq)
        self.step_totals.add(self.engine.last_step, time.perf_counter() - t0)

    def _emit(self, seq: Sequence) -> None:
        stream = self._streams.get(seq.request_id)
        if stream is None:
            return
        first = stream.sent
        new = seq.output_token_ids[first:]
        stream.sent += len(new)
        lps = seq.logprobs[first : first + len(new)] if seq.logprobs else []
        decode_queue_ms = 0.0
        if first == 0 and stream.local:  # queued until the prompt was first scheduled
            decode_queue_ms = seq.queue_ms
            self._prompt_tokens += seq.num_prompt_tokens
            self._cached_tokens += seq.num_cached_tokens
        elif first == 0 and stream.committed_at is not None:  # KV committed -> first decode step done
            decode_queue_ms = (time.monotonic() - stream.committed_at) * 1e3
        chunk = wk.TokenChunk(
            request_id=seq.request_id, start_index=first, token_ids=new,
            logprobs=[logprob_to_proto(lp) for lp in lps], finish_reason=seq.finish_reason or "",
            decode_queue_ms=decode_queue_ms,
        )
        stream.queue.put(chunk)
        if seq.finish_reason is not None:
            stream.queue.put(_DONE)
            log.debug("finished: %s, %d tokens", seq.finish_reason, stream.sent,
                      extra={"request_id": seq.request_id})

    def _fail_all(self, reason: str) -> None:
        for rid, stream in list(self._streams.items()):
            stream.queue.put(wk.TokenChunk(request_id=rid, finish_reason="abort"))
            self._abort(rid)  # frees the blocks and closes the stream after the abort chunk

    def _expire_reservations(self) -> None:
        if not self.decode or not self.decode.num_reserved:
            return
        now = time.monotonic()
        for rid, stream in list(self._streams.items()):
            if stream.committed_at is None and now - stream.reserved_at > self.reservation_ttl_s:
                log.warning("KV never committed within %.0fs; freeing its blocks", self.reservation_ttl_s,
                            extra={"request_id": rid})
                self._abort(rid)

    def _abort(self, request_id: str) -> bool:
        if self.decode:
            found = self.decode.abort_request(request_id)
        else:
            with self._lock:
                found = self.engine.abort(request_id) is not None
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.queue.put(_DONE)
        return found

    # ------------------------------------------------------------------ RPCs
    def Reserve(self, request: wk.ReserveRequest, context: grpc.ServicerContext) -> wk.ReserveResponse:
        with request_context(request.request_id):
            return self._reserve(request, context)

    def _reserve(self, request: wk.ReserveRequest, context: grpc.ServicerContext) -> wk.ReserveResponse:
        rid = request.request_id
        try:
            params = sampling_from_proto(request.sampling)
            ids = list(request.token_ids)
            with self._lock:
                if rid in self._streams:
                    raise ValueError(f"request id {rid!r} is already active on this worker")
                self._streams[rid] = _Stream()
            if self.decode and not request.run_prefill:
                try:
                    ticket = self.decode.reserve(rid, ids, params, on_commit=lambda: self._committed(rid),
                                                 transfer_id=request.transfer_id or None,
                                                 output_offset=request.resume_offset)
                except ValueError:
                    self._streams.pop(rid, None)
                    raise
                if ticket is None:
                    self._streams.pop(rid, None)
                    log.debug("no free KV blocks for %d prompt tokens", len(ids))
                    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free KV blocks on this decode worker")
                log.debug("reserved %d blocks, transfer %s", len(ticket.block_ids), ticket.transfer_id)
                return wk.ReserveResponse(ticket=ticket.to_proto())
            stream = self._streams[rid]  # prefilled here: no KV to wait for
            stream.committed_at, stream.local = time.monotonic(), True
            try:
                admitted = (self.decode.add_local if self.decode else self._add_colocated)(
                    rid, ids, params, request.resume_offset)
            except ValueError:
                self._streams.pop(rid, None)
                raise
            if not admitted:
                self._streams.pop(rid, None)
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free KV blocks on this worker")
            self._wake.set()
            log.debug("admitted: %d prompt tokens (%s)", len(ids), "colocated" if self.colocated else "local prefill")
            return wk.ReserveResponse()
        except ValueError as e:
            log.warning("refused: %s", e)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def _add_colocated(self, rid: str, ids: list[int], params: SamplingParams, output_offset: int) -> bool:
        with self._lock:
            return self.engine.try_add_request(rid, ids, params, output_offset)

    def _committed(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.committed_at = time.monotonic()
        self._wake.set()

    def Stream(self, request: wk.StreamRequest, context: grpc.ServicerContext):
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
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"request {rid} exceeded {self.request_timeout_s}s")
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
            ok=ok, reason="" if ok else "engine thread died", worker_id=self.worker_id, role=self.role,
            model=self.engine.cfg.model, compat_hash=self.engine.compat_hash,
        )

    def Stats(self, request: wk.StatsRequest, context: grpc.ServicerContext) -> wk.WorkerStats:
        return self.stats()

    def stats(self) -> wk.WorkerStats:
        """Lengths and block counts are read live; the queued-token sum comes from the engine thread."""
        load = self.engine.load()
        queued = load.waiting + (self.decode.num_reserved if self.decode else 0)
        return wk.WorkerStats(
            worker_id=self.worker_id, role=self.role, running=load.running, queued=queued,
            kv_blocks_used=load.blocks_used, kv_blocks_free=load.blocks_free,
            queued_prefill_tokens=self._queued_tokens, prefix_cache_hit_tokens=self._cached_tokens,
            prompt_tokens=self._prompt_tokens, **step_stats_to_proto(self.step_totals),
        )

    def stop(self, grace: float = 1.0) -> None:
        self.health.stopping()
        self._stop.set()
        self._wake.set()
        for rid in list(self._streams):
            self._abort(rid)
        self.server.stop(grace).wait(grace + 1)
        self._thread.join(timeout=5)
        if self.decode:
            self.decode.close()

