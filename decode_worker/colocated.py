"""The colocated worker process: one engine runs both phases of every request in mixed steps (decode
tokens first, then prompt chunks under a token budget); no KV moves. It serves the same
DecodeWorker service as a decode worker (decode_worker/service.py), so the router drives both the
same way; every Reserve is prefilled here.
"""

from __future__ import annotations

import uuid

from decode_worker.locked_engine import LockedEngine
from decode_worker.service import DecodeWorkerService
from engine.config import EngineConfig
from engine.engine import Engine
from proto import worker_pb2 as wk


class ColocatedWorkerServer(DecodeWorkerService):
    """A colocated worker: prefills and decodes its requests itself."""

    role = wk.WORKER_ROLE_COLOCATED
    prefilled_as = "colocated"

    def __init__(self, engine_cfg: EngineConfig, worker_id: str | None = None, host: str = "127.0.0.1",
                 port: int = 0, request_timeout_s: float = 600.0, cluster_secret: str | None = None) -> None:
        """`cluster_secret`: required of every RPC to this worker (proto/cluster_auth.py; None: none)."""
        super().__init__(worker_id or f"decode-{uuid.uuid4().hex[:6]}", host, port, request_timeout_s,
                         cluster_secret)
        self._start(LockedEngine(Engine(engine_cfg, "colocated")), [])
