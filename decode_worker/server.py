"""The decode worker process: a gRPC server around a `DecodeEngine` (decode_worker/service.py has
the DecodeWorker service and the engine loop it shares with the colocated worker).

Reserve holds blocks for a prompt's KV and answers with the ticket a prefill worker sends it with;
the KV receiver service runs on the same server. Reservations whose KV never commits expire after
`reservation_ttl_s` (their blocks are freed), so a dead prefill worker cannot strand blocks. A
Reserve with `run_prefill` (the router's local prefill of a short prompt, router/local_prefill.py)
is prefilled in this engine's mixed steps instead, and no KV moves.
"""

from __future__ import annotations

import logging
import time
import uuid

import grpc

from decode_worker.decode_engine import DecodeEngine
from decode_worker.rank_kv import DecodeRankKV
from kv_transfer import KVTransferError
from decode_worker.service import DecodeWorkerService
from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from proto import kv_transfer_pb2
from proto import worker_pb2 as wk

log = logging.getLogger("pdcluster.decode")
KV_SERVICE_NAME = kv_transfer_pb2.DESCRIPTOR.services_by_name["KVReceiver"].full_name


class DecodeWorkerServer(DecodeWorkerService):
    """A decode worker: KV arrives from prefill workers into blocks reserved for it."""

    role = wk.WORKER_ROLE_DECODE

    def __init__(self, engine_cfg: EngineConfig, worker_id: str | None = None, host: str = "127.0.0.1",
                 port: int = 0, kv_backend: str = "grpc", request_timeout_s: float = 600.0,
                 reservation_ttl_s: float = 120.0, cluster_secret: str | None = None,
                 kv_options: dict | None = None, direct_kv: bool = True, model: object | None = None,
                 kv_caches: list | None = None) -> None:
        """`model`, `kv_caches`: weights and KV cache tensors already in this process (a worker that
        changes role keeps its own; the caches are reused when they fit, or give way to shared memory).
        `cluster_secret`: required of every RPC to this worker, KV transfers included
        (proto/cluster_auth.py; None: none). `reservation_ttl_s`: the lease of a reservation whose KV
        has not committed. `kv_options`: more keyword arguments of the backend's receiver (shm/auto:
        in_place). `direct_kv`: with tensor parallelism, every rank receives its own KV heads (its own KV
        receiver; False: all through rank 0, the fallback)."""
        super().__init__(worker_id or f"decode-{uuid.uuid4().hex[:6]}", host, port, request_timeout_s,
                         cluster_secret)
        self.reservation_ttl_s = reservation_ttl_s
        # with tensor parallelism each rank receives its own KV heads (the direct path) unless direct_kv=False
        rank_kv = (DecodeRankKV(kv_backend, host, cluster_secret, dict(kv_options or {}))
                   if direct_kv and kv_backend != "inproc" else None)
        self.decode = DecodeEngine(Engine(engine_cfg, "decode", model=model, rank_kv=rank_kv, kv_caches=kv_caches), backend=kv_backend,
                                   server=self.server, endpoint=self.address, **(kv_options or {}))
        self._start(self.decode, [KV_SERVICE_NAME])

    def _reserve_for_kv(self, request: wk.ReserveRequest, ids: list[int], params: SamplingParams,
                        context: grpc.ServicerContext) -> wk.ReserveResponse | None:
        if request.run_prefill:
            return None
        rid = request.request_id
        try:
            ticket = self.decode.reserve(rid, ids, params, on_commit=lambda: self._committed(rid),
                                         transfer_id=request.transfer_id or None,
                                         output_offset=request.resume_offset,
                                         reuse_prefix=request.reuse_cached_prefix)
        except (ValueError, KVTransferError):  # a bad request; a rank that cannot take the transfer
            self._streams.pop(rid, None)
            raise
        if ticket is None:
            self._streams.pop(rid, None)
            log.debug("no free KV blocks for %d prompt tokens", len(ids))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free KV blocks on this decode worker")
        log.debug("reserved %d blocks (%d prompt tokens held already), transfer %s", len(ticket.block_ids),
                  ticket.cached_tokens, ticket.transfer_id)
        return wk.ReserveResponse(ticket=ticket.to_proto())

    def kv_endpoints(self) -> list[str]:
        """Where prefill workers send this worker's KV: each tensor-parallel rank's receiver, or the one."""
        return self.decode.rank_endpoints or [self.address]

    def _received_held(self) -> int:
        return self.decode.committed_cached_tokens

    def _committed(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.committed_at = time.monotonic()
        self._wake.set()

    def _expire_reservations(self) -> None:
        if not self.decode.num_reserved:
            return
        now = time.monotonic()
        for rid, stream in list(self._streams.items()):
            if stream.committed_at is None and now - stream.reserved_at > self.reservation_ttl_s:
                log.warning("KV never committed within %.0fs; freeing its blocks", self.reservation_ttl_s,
                            extra={"request_id": rid})
                self._abort(rid)
