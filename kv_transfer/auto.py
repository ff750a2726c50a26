"""`auto` backend: per decode worker, NCCL between two GPU caches on two GPUs, shared memory on this
node (two workers sharing one GPU included), else a TCP data connection, else gRPC
(`choose_backend`, a pure function). Both sides compose planes; a refusal other than placement
(incompatible layout, bad endpoint) is raised as it is.
`dist_backend="gloo"` joins CPU caches over torch.distributed (the same path, testable without
GPUs); "off": never.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from engine.sequence import TokenLogprobs
from kv_transfer import shm_sender, tcp_sender, torch_dist_sender
from kv_transfer.base import KVSender, KVSink, KVTransferError, TransferTicket
from kv_transfer.control_receiver import ControlReceiver, sink_device
from kv_transfer.control_sender import ControlSender, GrpcSender
from kv_transfer.shm_receiver import ShmReceivePlane
from kv_transfer.shm_sender import ShmSender
from kv_transfer.tcp_receiver import TcpReceivePlane
from kv_transfer.tcp_sender import TcpSender
from kv_transfer.torch_dist_group import OFF
from kv_transfer.torch_dist_receiver import TorchDistReceivePlane
from kv_transfer.torch_dist_sender import TorchDistSender


@dataclass(frozen=True)
class Placement:
    """What a sender found out about one KV endpoint."""

    same_node: bool  # the shm handshake proved one node and one /dev/shm
    tcp: bool = False  # the receiver advertised a data port, and connecting + authenticating worked
    # both KV caches on CUDA, and a group with the receiver was built (NCCL); never on one GPU (two
    # workers with num_gpus 0.5): the torch_distributed handshake refuses that pair before any group
    both_cuda: bool = False


def choose_backend(p: Placement) -> str:
    """The backend for an endpoint: the fastest one that works between the two."""
    if p.both_cuda:
        return "torch_distributed"  # GPU to GPU, no host copy
    if p.same_node:
        return "shm"
    if p.tcp:
        return "tcp"
    return "grpc"


class AutoReceiver(ControlReceiver):
    """Process groups for torch_distributed senders (a CUDA cache only, unless `dist_backend` says),
    a data port for tcp senders, shared memory for shm senders, inline layers for grpc ones. Other
    keyword arguments go to the planes that name them (`timeout_s`, `in_place`, ...)."""

    PLANES = (TorchDistReceivePlane, TcpReceivePlane, ShmReceivePlane)

    def __init__(self, sink: KVSink, server: grpc.Server | None = None, endpoint: str | None = None, *,
                 dist_backend: str | None = None, **kwargs: Any) -> None:
        if dist_backend is None:
            dist_backend = "nccl" if sink_device(sink).type == "cuda" else OFF
        super().__init__(sink, server, endpoint, dist_backend=dist_backend, **kwargs)


class AutoSender(KVSender):
    def __init__(self, compat_hash: str, timeout_s: float = 30.0, sender_id: str | None = None,
                 dist_backend: str | None = None, in_place: bool = True, verify_in_place: bool = False) -> None:
        super().__init__(compat_hash)
        self.timeout_s = timeout_s
        if dist_backend is None:
            dist_backend = "nccl" if torch.cuda.is_available() else OFF
        self.dist = (None if dist_backend == OFF else
                     TorchDistSender(compat_hash, timeout_s=timeout_s, sender_id=sender_id, dist_backend=dist_backend))
        self.shm = ShmSender(compat_hash, timeout_s=timeout_s, sender_id=sender_id, in_place=in_place,
                             verify_in_place=verify_in_place)
        self.tcp = TcpSender(compat_hash, timeout_s=timeout_s, sender_id=sender_id)
        self.grpc = GrpcSender(compat_hash, timeout_s=timeout_s, sender_id=sender_id)
        self._senders: dict[str, ControlSender] = {"shm": self.shm, "tcp": self.tcp, "grpc": self.grpc}
        if self.dist is not None:
            self._senders["torch_distributed"] = self.dist
        for s in self._senders.values():
            s.bytes_sent = self.bytes_sent  # one tally, keyed "shm" / "tcp" / "grpc"
        self._choice: dict[str, str] = {}
        self._lock = threading.Lock()

    def add_channel_interceptor(self, interceptor: object) -> None:
        for s in self._senders.values():
            s.add_channel_interceptor(interceptor)

    @staticmethod
    def _works(sender: ControlSender, endpoint: str, placement: tuple[str, ...]) -> bool:
        """Whether `sender` can reach `endpoint`; False on a placement refusal, raises on any other."""
        try:
            sender.connect(endpoint)
        except KVTransferError as e:
            if not any(p in str(e) for p in placement):
                raise
            return False
        return True

    def backend_for(self, endpoint: str) -> str:
        """"torch_distributed", "shm", "tcp" or "grpc": which one carries transfers to `endpoint`
        (decided on first use)."""
        with self._lock:
            if endpoint not in self._choice:
                # one GPU: the torch_distributed handshake is refused before any group is built
                dist = self.dist is not None and self._works(self.dist, endpoint, torch_dist_sender.PLACEMENT)
                same_node = not dist and self._works(self.shm, endpoint, shm_sender.PLACEMENT)
                tcp = not (dist or same_node) and self._works(self.tcp, endpoint, tcp_sender.PLACEMENT)
                self._choice[endpoint] = choose_backend(Placement(same_node, tcp, both_cuda=dist))
            return self._choice[endpoint]

    def connect(self, endpoint: str, timeout: float | None = None) -> None:
        """Choose the backend for `endpoint` and handshake with it now (see ControlSender.connect)."""
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
