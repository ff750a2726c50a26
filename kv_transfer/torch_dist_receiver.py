"""The torch_distributed data plane, receiver side: it hosts the TCPStore, builds its side of each
sender's pair (kv_transfer/torch_dist_group.py) and receives a layer by a point-to-point recv,
posted only after the message passed the ticket's checks (a refused message never posts one), and
only in the pair's sequence: the recv of send n (the message's `dist_tag`) waits until those of
0 .. n-1 have been posted (`PairOrder.post_at`), so that NCCL, which matches by posting order,
pairs every recv with its own send however the messages of the transfers in flight interleave.

Each message naming a live pair stands for one send posted on it. So when such a message is
refused, its send is left unmatched and would shift every later match: the pair is dropped at once
(as it is after a failed recv, or a gap in the sequence that does not fill within `timeout_s`);
recvs waiting on it fail, and the sender's next transfer handshakes for a new pair.
"""

from __future__ import annotations

import datetime
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kv_transfer.base import KVTransferError, TransferTicket
from kv_transfer.checksum import tensor_checksum
from kv_transfer.control_receiver import ControlReceiver, sink_device
from kv_transfer.planes import ReceivePlane
from kv_transfer.torch_dist_group import (
    OFF,
    PairOrder,
    build_pair,
    check_dist_backend,
    device_for,
    gpu_identity,
    same_gpu,
    shutdown,
)
from kv_transfer.wire import check_digest, split_host_port
from proto import kv_transfer_pb2


@dataclass(eq=False)
class _RecvPair:
    key: str
    sender_id: str
    device: torch.device
    ready: threading.Event = field(default_factory=threading.Event)
    pg: Any = None
    error: str | None = None
    thread: threading.Thread | None = None
    order: PairOrder = field(default_factory=PairOrder)  # its recvs are posted in the sender's send order


class TorchDistReceivePlane(ReceivePlane):
    """The TCPStore it hosts (`store_host`: the endpoint's host unless given; `store_port` 0: any
    free port; `store_address` says which), the group backend (None: "nccl" when the sink's cache is
    on CUDA, else "gloo"; "off": no store and no groups, senders are refused) and `timeout_s`, which
    bounds building a pair's group, each wait for a recv's turn and each receive. A sender on this
    plane's GPU (`gpu_id`, from `gpu_identity`) is offered no pair: NCCL cannot pair two ranks on
    one device."""

    name = "torch_distributed"

    def __init__(self, control: ControlReceiver, *, store_host: str | None = None, store_port: int = 0,
                 dist_backend: str | None = None, timeout_s: float = 30.0) -> None:
        super().__init__(control)
        if dist_backend is None:
            dist_backend = "nccl" if sink_device(control.sink).type == "cuda" else "gloo"
        self.timeout_s = timeout_s
        self._pairs_lock = threading.Lock()
        self._pairs: dict[str, _RecvPair] = {}
        self._store: Any = None
        self.dist_backend, self.device = OFF, torch.device("cpu")
        self.store_host = self.store_address = self.gpu_id = ""
        if dist_backend == OFF:
            return
        self.dist_backend = check_dist_backend(dist_backend)
        self.device = device_for(self.dist_backend)
        self.gpu_id = gpu_identity(self.device)
        self.store_host = split_host_port(control.endpoint)[0] if store_host is None else store_host
        try:
            self._store = torch.distributed.TCPStore(
                self.store_host, store_port, None, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False
            )
        except Exception as e:
            raise KVTransferError(
                f"could not start a TCPStore for KV transfers on {self.store_host}:{store_port}: {e}"
            ) from None
        self.store_address = f"{self.store_host}:{self._store.port}"

    # ------------------------------------------------------------------ pairs
    def handshake_fields(self, request: kv_transfer_pb2.HandshakeRequest) -> dict[str, Any]:
        if not request.dist_backend or self.dist_backend == OFF:
            return {}  # another plane's sender, or process groups off here
        # no store: the sender refuses, naming both backends, or the one GPU
        refused = {"dist_backend": self.dist_backend, "gpu_id": self.gpu_id}
        if (request.dist_backend != self.dist_backend or self.control.closed
                or same_gpu(self.gpu_id, request.gpu_id)):
            return refused
        sender = request.sender_id or "anonymous"
        key = f"{sender}/{secrets.token_hex(6)}"
        pair = _RecvPair(key, sender, self.device)
        with self._pairs_lock:
            if self._store is None:
                return refused
            # a new handshake from a sender means it dropped its earlier pairs with us
            old = [p for p in self._pairs.values() if p.sender_id == sender]
            for p in old:
                del self._pairs[p.key]
            self._pairs[key] = pair
            pair.thread = threading.Thread(
                target=self._build, args=(pair, self._store), name=f"kv-dist-pair-{key}", daemon=True
            )
            pair.thread.start()
        for p in old:
            self._drop(p)
        return {**refused, "dist_store": self.store_address, "dist_pair": key}

    def _build(self, pair: _RecvPair, store: Any) -> None:
        try:
            pg = build_pair(self.dist_backend, store, pair.key, 0, self.store_host, pair.device, self.timeout_s)
        except Exception as e:
            pair.error = f"torch_distributed group {pair.key} was not built: {e}"
        else:
            with self._pairs_lock:
                dropped = self._pairs.get(pair.key) is not pair
                pair.pg = pg
            if dropped:
                shutdown(pg)
                pair.error = f"torch_distributed group {pair.key} was dropped"
        finally:
            pair.ready.set()

    def _drop(self, pair: _RecvPair, why: str = "") -> None:
        with self._pairs_lock:
            if self._pairs.get(pair.key) is pair:
                del self._pairs[pair.key]
            pg, pair.pg = pair.pg, None
            if pair.error is None:
                pair.error = f"torch_distributed group {pair.key} was dropped{why}"
        pair.order.close(pair.error)
        if pg is not None:
            shutdown(pg)

    @property
    def pairs(self) -> list[str]:
        with self._pairs_lock:
            return sorted(self._pairs)

    # ------------------------------------------------------------------ layers
    def claims(self, msg: kv_transfer_pb2.KVLayer) -> bool:
        return bool(msg.dist_pair)

    def receive(self, msg: kv_transfer_pb2.KVLayer) -> None:
        with self._pairs_lock:
            pair = self._pairs.get(msg.dist_pair)
        try:
            buf, work = self._post(msg, pair)
        except Exception as e:
            if pair is not None:  # its send is left unmatched: no later recv may take its bytes
                self._drop(pair, f" (layer {msg.layer} of {msg.transfer_id!r}, send {msg.dist_tag}, refused)")
            if isinstance(e, KVTransferError):
                raise
            raise KVTransferError(
                f"layer {msg.layer}: torch_distributed recv over {msg.dist_pair} failed: {e}"
            ) from None
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except Exception as e:
            self._drop(pair)  # gloo closes the pair on a timeout; no later message may use it
            raise KVTransferError(
                f"layer {msg.layer} of {msg.transfer_id!r}: torch_distributed recv (tag {msg.dist_tag}) "
                f"over {pair.key} failed: {e}"
            ) from None
        check_digest(msg, "received", tensor_checksum(buf))
        self.control._on_layer(msg.transfer_id, msg.auth_token, msg.layer, buf)

    def _post(self, msg: kv_transfer_pb2.KVLayer, pair: _RecvPair | None) -> tuple[torch.Tensor, Any]:
        """Check who is asking and what they claim, then post the recv in the pair's order; the
        buffer and the recv's work."""
        ticket = self.control.authorize(msg.transfer_id, msg.auth_token)
        dtype, shape = self._check(msg, ticket)
        if pair is None:
            raise KVTransferError(f"layer {msg.layer}: unknown torch_distributed pair {msg.dist_pair!r}")
        if not pair.ready.wait(self.timeout_s):
            raise KVTransferError(f"layer {msg.layer}: torch_distributed group {pair.key} not built in time")
        pg = pair.pg
        if pair.error is not None or pg is None:
            raise KVTransferError(f"layer {msg.layer}: {pair.error or 'group gone'}")
        buf = torch.empty(shape, dtype=dtype, device=pair.device)
        work = pair.order.post_at(msg.dist_tag, lambda: pg.recv([buf], 1, msg.dist_tag), self.timeout_s)
        return buf, work

    def _check(self, msg: kv_transfer_pb2.KVLayer, ticket: TransferTicket) -> tuple[torch.dtype, tuple[int, ...]]:
        """The framing checks that can be made before the bytes arrive (their checksum comes after)."""
        if msg.payload:
            raise KVTransferError(f"layer {msg.layer}: both an inline payload and a torch_distributed send")
        if msg.HasField("compression"):
            raise KVTransferError(f"layer {msg.layer}: compression {msg.compression!r} is not supported")
        if msg.first_block != 0:
            raise KVTransferError(f"layer {msg.layer}: split layers (first_block={msg.first_block}) are not supported")
        self.control.check_layer_index(msg.layer)
        dtype = self.control.check_dtype(msg)
        shape = tuple(msg.shape)
        expected = self.control.expected_shape(ticket, len(ticket.block_ids))
        if shape != expected:
            raise KVTransferError(f"layer {msg.layer}: shape {shape}, expected {expected}")
        return dtype, shape

    def close(self) -> None:
        """Shut every pair's group down and stop the store."""
        with self._pairs_lock:
            pairs = list(self._pairs.values())
            self._pairs.clear()
            store, self._store = self._store, None
        for pair in pairs:
            self._drop(pair)
        # a group still being built (its sender never came) holds the store until its rendezvous
        # times out (timeout_s): wait for it, so that nothing of ours is left listening
        deadline = time.monotonic() + self.timeout_s + 1.0
        for pair in pairs:
            if pair.thread is not None:
                pair.thread.join(timeout=max(deadline - time.monotonic(), 0.0))
                if pair.pg is not None:
                    shutdown(pair.pg)
                    pair.pg = None
        del store


class TorchDistReceiver(ControlReceiver):
    """The torch_distributed backend's receiver, also taking inline layers (options: its plane)."""

    PLANES = (TorchDistReceivePlane,)
