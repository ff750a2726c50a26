"""`auto` backend: per decode worker, shared memory when it is on this node, else gRPC.

The receiver is a shm receiver, which also takes inline (gRPC) payloads, so any prefill worker can
reach it. The sender decides once per KV endpoint: it tries the shm handshake (same node, same
/dev/shm, same layout); a refusal because of placement falls back to gRPC, any other refusal
(incompatible layout, bad endpoint) is raised as it is.
"""

from __future__ import annotations

import threading

import torch

from engine.sequence import TokenLogprobs
from kv_transfer.base import KVSender, KVTransferError, TransferTicket
from kv_transfer.grpc_backend import GrpcSender
from kv_transfer.shm_backend import ShmReceiver, ShmSender

# phrases of ShmSender's placement refusals (see ShmSender._check_handshake)
_PLACEMENT = ("needs both workers on one node", "does not take the shm backend")

AutoReceiver = ShmReceiver


class AutoSender(KVSender):
    def __init__(self, compat_hash: str, timeout_s: float = 30.0, sender_id: str | None = None) -> None:
        super().__init__(compat_hash)
        self.timeout_s = timeout_s
        self.shm = ShmSender(compat_hash, timeout_s=timeout_s, sender_id=sender_id)
        self.grpc = GrpcSender(compat_hash, timeout_s=timeout_s, sender_id=sender_id)
        self.shm.bytes_sent = self.grpc.bytes_sent = self.bytes_sent  # one tally, keyed "shm" / "grpc"
        self._choice: dict[str, KVSender] = {}
        self._lock = threading.Lock()

    def add_channel_interceptor(self, interceptor: object) -> None:
        self.shm.add_channel_interceptor(interceptor)
        self.grpc.add_channel_interceptor(interceptor)

    def backend_for(self, endpoint: str) -> str:
        """"shm" or "grpc": which one carries transfers to `endpoint` (decided on first use)."""
        with self._lock:
            if endpoint not in self._choice:
                try:
                    self.shm.connect(endpoint)
                    self._choice[endpoint] = self.shm
                except KVTransferError as e:
                    if not any(p in str(e) for p in _PLACEMENT):
                        raise
                    self._choice[endpoint] = self.grpc
            return "shm" if self._choice[endpoint] is self.shm else "grpc"

    def connect(self, endpoint: str, timeout: float | None = None) -> None:
        """Choose the backend for `endpoint` and handshake with it now (see GrpcSender.connect)."""
        if self.backend_for(endpoint) == "grpc":
            self.grpc.connect(endpoint, timeout)

    def _sender(self, ticket: TransferTicket) -> KVSender:
        self.backend_for(ticket.kv_endpoint)
        return self._choice[ticket.kv_endpoint]

    def send_layer(self, ticket: TransferTicket, layer: int, kv: torch.Tensor) -> None:
        self.check_ticket(ticket)
        self._sender(ticket).send_layer(ticket, layer, kv)

    def commit(self, ticket: TransferTicket, first_token: int, logprob: TokenLogprobs | None) -> None:
        self._sender(ticket).commit(ticket, first_token, logprob)

    def abort(self, ticket: TransferTicket, reason: str) -> None:
        self._sender(ticket).abort(ticket, reason)

    def close(self) -> None:
        self.shm.close()
        self.grpc.close()
