"""The torch_distributed data plane, sender side: a layer goes by a point-to-point send over the
pair's process group (kv_transfer/torch_dist_group.py), numbered in the pair's sequence as it is
posted (`PairOrder.post_next`: numbers and posting order agree, whichever stream thread posts); the
number is the tag, and the receiver posts its recvs in that order. The wait happens in `flush` /
`commit`.

A send is known to be matched only once the receiver acknowledged its message (a flush returned).
So when a transfer fails or is aborted with sends not yet acknowledged (a refused message leaves
its send unmatched, a lost one leaves a gap; the receiver drops its side of the pair then), their
pair is dropped with its handshake: the next transfer to that endpoint handshakes again and gets a
new pair, and no later recv can take an unmatched send's bytes. Transfers still in flight on the
dropped pair fail with it. To keep that to one pair, a transfer's unacknowledged sends all go over
one pair, and none follows a message of it that posted none (the receiver stops reading a stream
at its first refused message).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch

from kv_transfer.base import KVTransferError, TransferTicket
from kv_transfer.checksum import tensor_checksum
from kv_transfer.control_sender import ControlSender
from kv_transfer.planes import Channels, SendPlane
from kv_transfer.torch_dist_group import (
    PairOrder,
    build_pair,
    check_dist_backend,
    device_for,
    gpu_identity,
    local_address_towards,
    same_gpu,
    shutdown,
)
from kv_transfer.wire import split_host_port
from proto import kv_transfer_pb2

# phrases of the refusals that mean "not between these two" (auto falls back on them)
PLACEMENT = ("does not take the torch_distributed backend", "runs torch_distributed over",
             "cannot reach the KV receiver's store", "cannot build the", "on this worker's GPU")


@dataclass(eq=False)
class _SendPair:
    endpoint: str
    key: str
    pg: Any
    store: Any
    device: torch.device
    order: PairOrder = field(default_factory=PairOrder)  # numbers the sends as they are posted
    broken: str | None = None

    def shut(self) -> None:
        self.order.close(self.broken or f"torch_distributed pair {self.key} was shut")
        shutdown(self.pg)
        self.store = None


@dataclass(eq=False)
class _Unacknowledged:
    """A transfer's sends posted since its last acknowledged flush: over one pair only, and none
    after a message that posted none (the receiver refuses that one and reads no further)."""

    pair: _SendPair | None
    works: list[tuple[Any, torch.Tensor]] = field(default_factory=list)  # with the tensors they read from
    stopped: bool = False


@dataclass(frozen=True)
class _Staged:
    """A layer copied by `send_layer`, waiting for the stream thread to post its send."""

    tensor: torch.Tensor


class TorchDistSendPlane(SendPlane):
    """`dist_backend`: "gloo" (CPU tensors) or "nccl" (CUDA); the control's `timeout_s` also bounds
    connecting to a receiver's store, building its group, and each wait for a send to complete. A
    receiver on this plane's GPU (`gpu_id`) is refused at the handshake, before any group is built."""

    name = "torch_distributed"
    max_message_bytes = None  # one point-to-point send per layer

    def __init__(self, control: ControlSender, *, dist_backend: str = "gloo") -> None:
        self.dist_backend = check_dist_backend(dist_backend)
        super().__init__(control)
        self.device = device_for(self.dist_backend)
        self.gpu_id = gpu_identity(self.device)
        self.channels = Channels(control, lambda e, key: f"torch_distributed channel {key} to {e} was reset")
        self._pairs: dict[str, _SendPair] = self.channels.live
        self._sent: dict[str, _Unacknowledged] = {}  # transfer id -> ...; under channels.lock

    def handshake_request(self, request: kv_transfer_pb2.HandshakeRequest) -> None:
        request.dist_backend = self.dist_backend
        request.gpu_id = self.gpu_id

    def accept(self, endpoint: str, response: kv_transfer_pb2.HandshakeResponse) -> str | None:
        if same_gpu(self.gpu_id, response.gpu_id):
            return (
                f"KV receiver at {endpoint} has its KV cache on this worker's GPU ({self.gpu_id}): "
                "NCCL cannot pair two ranks on one device; use shm between them (auto does)"
            )
        if not response.dist_store or not response.dist_pair:
            if response.dist_backend:
                return (
                    f"KV receiver at {endpoint} runs torch_distributed over {response.dist_backend}, this "
                    f"prefill worker over {self.dist_backend} (both caches must be on the same kind of device)"
                )
            return (
                f"KV receiver at {endpoint} does not take the torch_distributed backend (its handshake "
                "names no store; a grpc or shm receiver?): use the same kv_transfer backend on both sides"
            )
        if response.dist_backend != self.dist_backend:
            return (
                f"KV receiver at {endpoint} runs torch_distributed over {response.dist_backend!r}, this "
                f"prefill worker over {self.dist_backend!r}"
            )
        return self.channels.refusal(endpoint, response.dist_pair, lambda: self._build(endpoint, response))

    def _build(self, endpoint: str, response: kv_transfer_pb2.HandshakeResponse) -> _SendPair:
        """Connect to the receiver's store and build this side of the pair (blocks up to timeout_s)."""
        timeout_s, key = self.control.timeout_s, response.dist_pair
        host, port = split_host_port(response.dist_store)
        try:
            store = torch.distributed.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))
        except Exception as e:
            raise KVTransferError(
                f"torch_distributed: cannot reach the KV receiver's store at {response.dist_store} "
                f"(for {endpoint}) from here within {timeout_s:g}s: {e}"
            ) from None
        try:
            pg = build_pair(self.dist_backend, store, key, 1, local_address_towards(host, port), self.device,
                            timeout_s)
        except Exception as e:
            del store
            raise KVTransferError(
                f"torch_distributed: cannot build the {self.dist_backend} group {key} with the KV "
                f"receiver at {endpoint} (store {response.dist_store}): {e}"
            ) from None
        return _SendPair(endpoint, key, pg, store, self.device)

    def stage(self, ticket: TransferTicket, layer: int, kv: torch.Tensor) -> Any:
        """A private contiguous copy on the group's device (no network)."""
        return _Staged(kv.detach().to(device=self.device, copy=True, memory_format=torch.contiguous_format))

    def fields(self, ticket: TransferTicket, staged: _Staged) -> dict[str, Any]:
        """After the handshake and its pair: post the send as the pair's next, name it. A message
        whose send was not posted names no pair, and the receiver refuses it: the transfer is over,
        the endpoint has no live pair now, the transfer's unacknowledged sends went over another
        (since dropped), or an earlier message of the transfer posted none. So a failed transfer
        never leaves a send unmatched on a pair that lives on."""
        digest = tensor_checksum(staged.tensor)
        gone = {"checksum": digest, "dist_pair": "gone", "dist_tag": 0}
        pair = self._pairs.get(ticket.kv_endpoint)
        with self.channels.lock:
            if not self.control.in_flight(ticket.transfer_id):  # committed or failed meanwhile
                return gone
            sent = self._sent.setdefault(ticket.transfer_id, _Unacknowledged(pair))
            sent.stopped = sent.stopped or pair is None or sent.pair is not pair or pair.broken is not None
            if sent.stopped:
                return gone
        try:
            tag, work = pair.order.post_next(lambda seq: self._post_send(pair, staged.tensor, seq))
        except Exception as e:
            if not isinstance(e, KVTransferError):  # the channel is closed (receiver gone): drop it
                self._reset(pair, f"send failed: {e}")
            sent.stopped = True  # (else dropped meanwhile)
            return gone
        with self.channels.lock:
            settled = self._sent.get(ticket.transfer_id) is not sent
            if not settled:
                sent.works.append((work, staged.tensor))
        if settled:  # the transfer failed meanwhile and `flushed` did not see this send: maybe unmatched
            self._reset(pair, f"transfer {ticket.transfer_id!r} failed while a send was posted")
        return {"checksum": digest, "dist_pair": pair.key, "dist_tag": tag}

    def _post_send(self, pair: _SendPair, tensor: torch.Tensor, tag: int) -> Any:
        """Post the asynchronous point-to-point send (a test hook: bytes may be altered here)."""
        return pair.pg.send([tensor], 0, tag)

    def flushed(self, ticket: TransferTicket, ok: bool, timeout: float) -> None:
        """Wait for the transfer's sends (ok: the receiver took them all) or, after a failure, drop
        their pair if it is still live: any of them may be left unmatched (a send that completed is
        no proof: NCCL may complete a small send before its recv is posted)."""
        with self.channels.lock:
            sent = self._sent.pop(ticket.transfer_id, None)
        if sent is None or sent.pair is None or not sent.works:
            return
        if not ok:
            self._reset(sent.pair, f"transfer {ticket.transfer_id!r} failed with sends not acknowledged")
            return
        try:
            for w, _ in sent.works:
                w.wait(datetime.timedelta(seconds=max(timeout, 0.001)))
        except Exception as e:
            self._reset(sent.pair, f"send failed: {e}")
            raise KVTransferError(f"torch_distributed send to {ticket.kv_endpoint} failed: {e}") from None

    def _reset(self, pair: _SendPair, why: str) -> None:
        """Drop `pair` and the handshake that made it (not a newer one), unless dropped already."""
        if pair.broken is None:
            self.channels.reset(pair, why, lambda response: response.dist_pair == pair.key)

    def finished(self, ticket: TransferTicket, layers: int) -> None:
        self.flushed(ticket, False, 0.0)  # commit's flush settled the sends; after a failure nothing may linger

    @property
    def pairs(self) -> dict[str, str]:
        """endpoint -> key of its live pair."""
        return self.channels.keys()

    def close(self) -> None:
        """Shut every pair's group down."""
        self.channels.close()
        with self.channels.lock:
            self._sent.clear()


class TorchDistSender(ControlSender):
    """The torch_distributed backend's sender (options: `TorchDistSendPlane`)."""

    PLANE = TorchDistSendPlane
