"""`auto` backend: per decode worker, shared memory on this node, else a TCP data connection, else gRPC.

The receiver is a tcp receiver that is also a shm receiver (and, as both are, takes inline gRPC
payloads), so any prefill worker can reach it. The sender decides once per KV endpoint: it tries
the shm handshake (same node, same /dev/shm, same layout); when that is refused for placement it
tries the tcp handshake and data connection (the receiver advertises a data port, it can be
reached from here and takes the token); when that fails too, gRPC. Any other refusal (incompatible
layout, bad endpoint) is raised as it is. The choice itself is `choose_backend`, a pure function.

Both KV caches on CUDA -> torch_distributed over NCCL is part of the decision but not probed: the
receiver would have to host a TCPStore and build NCCL groups as well, which nothing here can test
without GPUs, so `AutoSender` always passes `both_cuda=False`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from engine.sequence import TokenLogprobs
from kv_transfer import shm_backend, tcp_backend
from kv_transfer.base import KVSender, KVTransferError, TransferTicket
from kv_transfer.grpc_backend import GrpcSender
from kv_transfer.shm_backend import ShmReceiver, ShmSender
from kv_transfer.tcp_backend import TcpReceiver, TcpSender


@dataclass(frozen=True)
class Placement:
    """What a sender found out about one KV endpoint."""

    same_node: bool  # the shm handshake proved one node and one /dev/shm
    tcp: bool = False  # the receiver advertised a data port, and connecting + authenticating worked
    both_cuda: bool = False  # both KV caches on CUDA, and the receiver could build an NCCL group


def choose_backend(p: Placement) -> str:
    """The backend for an endpoint: the fastest one that works between the two."""
    if p.both_cuda:
        return "torch_distributed"  # GPU to GPU, no host copy (not probed yet, see above)
    if p.same_node:
        return "shm"
    if p.tcp:
        return "tcp"
    return "grpc"


class AutoReceiver(TcpReceiver, ShmReceiver):
    """A data port for tcp senders, shared memory for shm senders, inline payloads for grpc ones."""


class AutoSender(KVSender):
    def __init__(self, compat_hash: str, timeout_s: float = 30.0, sender_id: str | None = None) -> None:
        super().__init__(compat_hash)
        self.timeout_s = timeout_s
        self.shm = ShmSender(compat_hash, timeout_s=timeout_s, sender_id=sender_id)
        self.tcp = TcpSender(compat_hash, timeout_s=timeout_s, sender_id=sender_id)
        self.grpc = GrpcSender(compat_hash, timeout_s=timeout_s, sender_id=sender_id)
        self._senders: dict[str, GrpcSender] = {"shm": self.shm, "tcp": self.tcp, "grpc": self.grpc}
        for s in self._senders.values():
            s.bytes_sent = self.bytes_sent  # one tally, keyed "shm" / "tcp" / "grpc"
        self._choice: dict[str, str] = {}
        self._lock = threading.Lock()

    def add_channel_interceptor(self, interceptor: object) -> None:
        for s in self._senders.values():
            s.add_channel_interceptor(interceptor)

    @staticmethod
    def _works(sender: GrpcSender, endpoint: str, placement: tuple[str, ...]) -> bool:
        """Whether `sender` can reach `endpoint`; False on a placement refusal, raises on any other."""
        try:
            sender.connect(endpoint)
        except KVTransferError as e:
            if not any(p in str(e) for p in placement):
                raise
            return False
        return True

    def backend_for(self, endpoint: str) -> str:
        """"shm", "tcp" or "grpc": which one carries transfers to `endpoint` (decided on first use)."""
        with self._lock:
            if endpoint not in self._choice:
                same_node = self._works(self.shm, endpoint, shm_backend.PLACEMENT)
                tcp = not same_node and self._works(self.tcp, endpoint, tcp_backend.PLACEMENT)
                self._choice[endpoint] = choose_backend(Placement(same_node, tcp))
            return self._choice[endpoint]

    def connect(self, endpoint: str, timeout: float | None = None) -> None:
        """Choose the backend for `endpoint` and handshake with it now (see GrpcSender.connect)."""
        if self.backend_for(endpoint) == "grpc":
            self.grpc.connect(endpoint, timeout)

    def _sender(self, ticket: TransferTicket) -> KVSender:
        return self._senders[self.backend_for(ticket.kv_endpoint)]

    def send_layer(self, ticket: TransferTicket, layer: int, kv: torch.Tensor) -> None:
        self.check_ticket(ticket)
        self._sender(ticket).send_layer(ticket, layer, kv)

    def commit(self, ticket: TransferTicket, first_token: int, logprob: TokenLogprobs | None) -> None:
        self._sender(ticket).commit(ticket, first_token, logprob)

    def abort(self, ticket: TransferTicket, reason: str) -> None:
        self._sender(ticket).abort(ticket, reason)

    def close(self) -> None:
        for s in self._senders.values():
            s.close()
