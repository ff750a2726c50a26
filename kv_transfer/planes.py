"""Data planes: how a layer's bytes move under the one control plane (docs/kv_transfer.md).

A `SendPlane` adds its fields to the handshake, stages a layer's bytes and names them in the
`KVLayer`; a `ReceivePlane` answers the handshake and fetches the bytes a message names before the
shared checks copy them into the blocks. The inline plane (the grpc backend) is here. An empty
layer always travels inline, and every receiver takes inline layers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kv_transfer.base import KVTransferError, TransferTicket
from kv_transfer.checksum import checksum
from kv_transfer.compression import COMPRESSIONS, quantize_int8
from kv_transfer.wire import MAX_MESSAGE_BYTES
from proto import kv_transfer_pb2

if TYPE_CHECKING:
    from kv_transfer.control_receiver import ControlReceiver
    from kv_transfer.control_sender import ControlSender


class SendPlane:
    """The sender side of a data plane, serving one `ControlSender` (`control`)."""

    name = "grpc"  # the backend's name, which its bytes are counted under (`KVSender.bytes_sent`)
    # a layer larger than this travels as several KVLayer messages (runs of blocks); None: one message
    max_message_bytes: int | None = 8 << 20
    out_of_band = True  # the bytes leave outside the message: refused endpoints and empty layers stage nothing

    def __init__(self, control: ControlSender) -> None:
        self.control = control

    def handshake_request(self, request: kv_transfer_pb2.HandshakeRequest) -> None:
        """Under the control's lock: add this plane's fields to the handshake."""

    def accept(self, endpoint: str, response: kv_transfer_pb2.HandshakeResponse) -> str | None:
        """Why an accepted handshake still does not suit this plane (cached like a refusal), or None;
        may connect the plane to the endpoint (blocking, bounded by the timeout)."""
        return None

    def stage(self, ticket: TransferTicket, layer: int, kv: torch.Tensor) -> Any:
        """On the caller's thread, no network: the layer's bytes staged for the stream."""
        raise NotImplementedError

    def deferred(self, staged: Any) -> bool:
        """Whether the layer's message waits for the next flush or rides in the commit instead of
        going on a stream now (shm's layers written in place: the bytes are already there)."""
        return False

    def fields(self, ticket: TransferTicket, staged: Any) -> dict[str, Any]:
        """On the stream's thread, after the handshake: send the staged bytes; the KVLayer fields naming them."""
        raise NotImplementedError

    def flushed(self, ticket: TransferTicket, ok: bool, timeout: float) -> None:
        """A flush of the transfer returned (ok) or raised."""

    def finished(self, ticket: TransferTicket, layers: int) -> None:
        """The transfer is over: committed with `layers` layers, or failed or aborted (0)."""

    def close(self) -> None:
        """After the control plane closed: release what the plane holds."""


class ReceivePlane:
    """The receiver side of a data plane, serving one `ControlReceiver` (`control`)."""

    name = ""

    def __init__(self, control: ControlReceiver) -> None:
        self.control = control

    def handshake_fields(self, request: kv_transfer_pb2.HandshakeRequest) -> dict[str, Any]:
        """Fields of an accepted handshake's response for this plane."""
        return {}

    def claims(self, msg: kv_transfer_pb2.KVLayer) -> bool:
        """Whether `msg`'s bytes travel over this plane."""
        return False

    def receive(self, msg: kv_transfer_pb2.KVLayer) -> None:
        """Fetch and check the bytes `msg` names, and hand them to the shared checks."""

    def granted(self, ticket: TransferTicket) -> None:
        """The ticket's blocks are now its transfer's."""

    def revoked(self, ticket: TransferTicket) -> None:
        """The transfer is over; called before the sink is told."""

    def close(self) -> None:
        """After the control plane closed."""


class Channels:
    """A sender plane's live channel per endpoint, each made by one handshake (a tcp data connection,
    a process-group pair: anything with `endpoint`, `key`, `broken` and `shut()`), and the keys of
    those dropped, so that a stale handshake never revives one."""

    def __init__(self, control: ControlSender, reset_message: Callable[[str, str], str]) -> None:
        self.control = control
        self.reset_message = reset_message  # (endpoint, key) -> why a retired key is refused
        self.lock = threading.Lock()  # makes channels; never held by send_layer
        self.live: dict[str, Any] = {}  # endpoint -> its live channel
        self.retired: set[str] = set()

    def get(self, endpoint: str, key: str, make: Callable[[], Any]) -> Any:
        """The endpoint's channel `key`, made by `make()` (under the lock, blocking) on first use;
        an older channel of the endpoint is replaced."""
        with self.lock:
            if self.control.closed:
                raise KVTransferError("KV sender is closed")
            channel = self.live.get(endpoint)
            if channel is not None and channel.key == key:
                return channel
            if key in self.retired:
                raise KVTransferError(self.reset_message(endpoint, key))
            if channel is not None:
                self._drop_locked(channel, "replaced by a new handshake")
            channel = self.live[endpoint] = make()
            return channel

    def refusal(self, endpoint: str, key: str, make: Callable[[], Any]) -> str | None:
        """None once the endpoint's channel `key` is live (see `get`), else why it cannot be."""
        try:
            self.get(endpoint, key, make)
        except KVTransferError as e:
            return str(e)
        return None

    def _drop_locked(self, channel: Any, why: str) -> None:
        if channel.broken is None:
            channel.broken = why
        self.retired.add(channel.key)
        if self.live.get(channel.endpoint) is channel:
            del self.live[channel.endpoint]
        channel.shut()

    def reset(self, channel: Any, why: str, made: Callable[[Any], bool] | None = None) -> None:
        """Drop a channel and the handshake that made it (with `made`: if its response says so):
        the next layer to the endpoint handshakes anew. The handshake goes first: a stream checking
        it in between would find the channel retired and cache that as the endpoint's refusal."""
        self.control._forget_handshake(channel.endpoint, made)
        with self.lock:
            self._drop_locked(channel, why)

    def keys(self) -> dict[str, str]:
        """endpoint -> key of its live channel."""
        with self.lock:
            return {e: c.key for e, c in self.live.items()}

    def close(self) -> list[Any]:
        """Drop every channel; returns them."""
        with self.lock:
            channels = list(self.live.values())
            for channel in channels:
                self._drop_locked(channel, "sender closed")
        return channels


# ------------------------------------------------------------------------------------------ inline
@dataclass
class Int8:
    """A layer quantized for the wire: int8 values and float32 per-block scales (2, num_blocks)."""

    q: bytes
    scales: bytes


class InlineSendPlane(SendPlane):
    """The bytes ride in the KVLayer message (the grpc backend): raw C-contiguous bytes, or, with
    int8 compression, the quantized bytes and their scales, under one checksum."""

    out_of_band = False

    def __init__(self, control: ControlSender, compression: str = "none") -> None:
        if compression not in COMPRESSIONS:
            raise ValueError(f"unknown KV compression {compression!r}; allowed: {', '.join(COMPRESSIONS)}")
        super().__init__(control)
        self.compression = compression

    def stage(self, ticket: TransferTicket, layer: int, kv: torch.Tensor) -> Any:
        if self.compression == "int8":
            q, scales = quantize_int8(kv.detach().cpu())
            return Int8(q.reshape(-1).view(torch.uint8).numpy().tobytes(), scales.numpy().tobytes())
        payload = kv.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        if len(payload) > MAX_MESSAGE_BYTES - (1 << 20):
            raise KVTransferError(
                f"layer {layer} of {ticket.transfer_id!r} is {len(payload)} bytes, over the "
                f"{MAX_MESSAGE_BYTES}-byte message limit (one block of it is larger than a message may be)"
            )
        return payload


def inline_fields(payload: bytes | Int8) -> dict[str, Any]:
    """The KVLayer fields of bytes that ride in the message."""
    if isinstance(payload, Int8):
        return {"checksum": checksum(payload.q, payload.scales), "payload": payload.q, "compression": "int8",
                    "scales": payload.scales}
    return {"checksum": checksum(payload), "payload": payload}
