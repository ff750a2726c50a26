"""The torch_distributed data plane, sender side: a layer goes by a point-to-point send over the
pair's process group (kv_transfer/torch_dist_group.py); the wait happens in `flush` / `commit`.

A refused message leaves its send unmatched and a timed-out send closes the group, so after any
failure of a transfer whose sends are not all complete the pair is dropped with its handshake: the
next transfer to that endpoint handshakes again and gets a new pair.
"""

from __future__ import annotations

import datetime
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from kv_transfer.base import KVTransferError, TransferTicket
from kv_transfer.checksum import tensor_checksum
from kv_transfer.control_sender import ControlSender
from kv_transfer.planes import Channels, SendPlane
from kv_transfer.torch_dist_group import (
    TAG_LIMIT,
    build_pair,
    check_dist_backend,
    device_for,
    local_address_towards,
    shutdown,
)
from kv_transfer.wire import split_host_port
from proto import kv_transfer_pb2

# phrases of the refusals that mean "not between these two" (auto falls back on them)
PLACEMENT = ("does not take the torch_distributed backend", "runs torch_distributed over",
             "cannot reach the KV receiver's store", "cannot build the")


@dataclass(eq=False)
class _SendPair:
    endpoint: str
    key: str
    pg: Any
    store: Any
    device: torch.device
    tags: itertools.count[int] = field(default_factory=itertools.count)
    broken: str | None = None
    # transfer id -> the sends posted for it, with the tensors they read from
    works: dict[str, list[tuple[Any, torch.Tensor]]] = field(default_factory=dict)

    def shut(self) -> None:
        self.works.clear()
        shutdown(self.pg)
        self.store = None


@dataclass(frozen=True)
class _Staged:
    """A layer copied by `send_layer`, waiting for the stream thread to post its send."""

    tensor: torch.Tensor


class TorchDistSendPlane(SendPlane):
    """`dist_backend`: "gloo" (CPU tensors) or "nccl" (CUDA); the control's `timeout_s` also bounds
    connecting to a receiver's store, building its group, and each wait for a send to complete."""

    name = "torch_distributed"
    max_message_bytes = None  # one point-to-point send per layer

    def __init__(self, control: ControlSender, *, dist_backend: str = "gloo") -> None:
        self.dist_backend = check_dist_backend(dist_backend)
        super().__init__(control)
        self.device = device_for(self.dist_backend)
        self.channels = Channels(control, lambda e, key: f"torch_distributed channel {key} to {e} was reset")
        self._pairs: dict[str, _SendPair] = self.channels.live

    def handshake_request(self, request: kv_transfer_pb2.HandshakeRequest) -> None:
        request.dist_backend = self.dist_backend

    def accept(self, endpoint: str, response: kv_transfer_pb2.HandshakeResponse) -> str | None:
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
        """After the handshake and its pair: post the send, name it."""
        digest = tensor_checksum(staged.tensor)
        pair = self._pairs.get(ticket.kv_endpoint)
        if pair is None or pair.broken is not None:  # reset meanwhile: the receiver refuses it (no such pair)
            key, tag = (pair.key if pair is not None else "gone"), 0
        else:
            key, tag = pair.key, next(pair.tags) % TAG_LIMIT
            try:
                work = self._post_send(pair, staged.tensor, tag)
            except Exception as e:  # the channel is closed (receiver gone): drop it, the receiver refuses this
                self.channels.reset(pair, f"send failed: {e}")
            else:
                with self.channels.lock:
                    pair.works.setdefault(ticket.transfer_id, []).append((work, staged.tensor))
        return {"checksum": digest, "dist_pair": key, "dist_tag": tag}

    def _post_send(self, pair: _SendPair, tensor: torch.Tensor, tag: int) -> Any:
        """Post the asynchronous point-to-point send (a test hook: bytes may be altered here)."""
        return pair.pg.send([tensor], 0, tag)

    def flushed(self, ticket: TransferTicket, ok: bool, timeout: float) -> None:
        """Wait for the transfer's sends (ok: the receiver took them all) or, after a failure,
        drop the pair if any of them may be left unmatched."""
        pair = self._pairs.get(ticket.kv_endpoint)
        if pair is None:
            return
        with self.channels.lock:
            works = pair.works.pop(ticket.transfer_id, [])
        if not works:
            return
        if not ok:
            if not all(w.is_completed() for w, _ in works):
                self.channels.reset(pair, f"transfer {ticket.transfer_id!r} failed with sends unmatched")
            return
        try:
            for w, _ in works:
                w.wait(datetime.timedelta(seconds=max(timeout, 0.001)))
        except Exception as e:
            self.channels.reset(pair, f"send failed: {e}")
            raise KVTransferError(f"torch_distributed send to {ticket.kv_endpoint} failed: {e}") from None

    def finished(self, ticket: TransferTicket, layers: int) -> None:
        self.flushed(ticket, False, 0.0)  # commit's flush settled the sends; after a failure nothing may linger

    @property
    def pairs(self) -> dict[str, str]:
        """endpoint -> key of its live pair."""
        return self.channels.keys()

    def close(self) -> None:
        """Shut every pair's group down."""
        self.channels.close()


class TorchDistSender(ControlSender):
    """The torch_distributed backend's sender (options: `TorchDistSendPlane`)."""

    PLANE = TorchDistSendPlane
