"""What the control sender keeps per endpoint and per transfer: the handshake, and a transfer's
SendLayers streams (a layer's messages are queued on the open one; a commit closes it)."""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from kv_transfer.base import KVTransferError
from kv_transfer.wire import rpc_error

END = object()  # closes a stream's request queue


@dataclass
class Handshake:
    future: grpc.Future
    error: str | None = None  # set once refused (cached): the endpoint's layout differs from ours


@dataclass(eq=False)
class Stream:
    requests: queue.SimpleQueue[Any]
    future: grpc.Future | None = None
    error: str | None = None  # set by the request iterator when the handshake failed

    def failure(self, endpoint: str) -> KVTransferError | None:
        """The finished stream's error, without waiting."""
        if self.error is not None:
            return KVTransferError(self.error)
        f = self.future
        if f is None or not f.done():
            return None
        if f.cancelled():
            return KVTransferError(f"SendLayers to {endpoint} was cancelled")
        e = f.exception()
        return rpc_error("SendLayers", endpoint, e) if e is not None else None


@dataclass
class Transfer:
    endpoint: str
    streams: list[Stream] = field(default_factory=list)
    open: Stream | None = None  # the stream new layers go to; None: the next layer opens one
    layers_sent: set[int] = field(default_factory=set)
    # layer messages held back (SendPlane.deferred): sent by the next flush, or in the commit
    deferred: list[tuple] = field(default_factory=list)

    def cancel(self) -> None:
        for stream in self.streams:
            stream.requests.put(END)
            if stream.future is not None:
                stream.future.cancel()  # a no-op once the stream finished


def split_layer(kv: torch.Tensor, limit: int | None) -> list[tuple[int, torch.Tensor]]:
    """A layer as (first block, run of blocks) messages of at most `limit` bytes each (at least one
    block each): HTTP/2 moves one huge message far slower than several, and a layer may be larger
    than a gRPC message can be."""
    if limit is None or kv.dim() < 2 or kv.nbytes <= limit or kv.shape[1] < 2:
        return [(0, kv)]
    step = max(1, limit // max(1, kv.nbytes // kv.shape[1]))
    return [(first, kv[:, first : first + step]) for first in range(0, kv.shape[1], step)]
