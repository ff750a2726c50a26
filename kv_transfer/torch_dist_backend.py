"""torch.distributed backend: the KV bytes travel over a point-to-point process group channel.

Only the bytes move another way; everything else is the grpc backend's control plane, unchanged
(see kv_transfer.grpc_backend): the `KVReceiver` service, handshake, one SendLayers stream per
transfer carrying `KVLayer` metadata with the checksum (XXH3-64) of the bytes, Commit, Abort, deadlines and
status codes. The model followed is the shm backend.

Pairs: per (sender, receiver) a 2-rank process group, made without the global default group.
The receiver hosts a `torch.distributed.TCPStore` (master, its own port) and, at each handshake
from a torch_distributed sender, mints a pair key and starts building its side (rank 0) of a
group over `PrefixStore(key, store)` in a background thread; the handshake response carries
`dist_store` ("host:port"), `dist_pair` (the key) and `dist_backend`. The sender, once the
handshake is accepted, connects to the store and builds its side (rank 1): lazily, once per
endpoint, under its own lock (never the lock `send_layer` takes). A store or group that cannot be
reached within `timeout_s` is a refusal, cached per endpoint like a refused layout
(`TorchDistSender.connect(endpoint)` runs it at once, e.g. when a cluster starts).

Per layer: `send_layer` only copies the layer (to the group's device, contiguous) and queues it.
On the stream's thread the sender computes the checksum, takes the pair's next tag, posts
`send([tensor], dstRank=0, tag)` (asynchronous: the wait happens in `flush` / `commit`, never in
`send_layer`) and yields a `KVLayer` with `dist_pair`, `dist_tag`, dtype, shape and checksum
(no payload). The receiver checks transfer id, auth token, layer range, dtype and shape against
the ticket before posting the matching `recv` into a fresh buffer, waits for it (bounded by
`timeout_s`), checks its checksum (DATA_LOSS when it differs) and hands it to the shared checks,
which copy it into the reserved blocks.

A refused message leaves the sender's send unmatched, and a timed-out send or recv closes the
group (gloo closes the pair), so after any failure of a transfer whose sends are not all
complete the sender drops the pair and forgets the handshake: the next transfer to that endpoint
handshakes again and gets a new pair (the receiver drops older pairs of that sender then).
Transfers still in flight on the dropped pair fail. `close()` on either side shuts its groups
down (and the receiver's store).

Building a pair ends with one element sent from the sender to the receiver (`_first_exchange`):
groups connect lazily, so a pair that cannot work (NCCL refuses two ranks on one GPU) fails while
the handshake builds it -- `auto` then falls back to shm on that node -- not at a request's first
layer. Gloo between CPU caches is what is tested. "nccl" (both caches on CUDA) builds a
`ProcessGroupNCCL` and keeps the tensors on the GPU, but NCCL ignores tags and matches
point-to-point operations in order, so it is only safe with one transfer in flight per pair; it
is untested here. Inline payloads (a grpc sender) are accepted by the receiver too.
"""

from __future__ import annotations

import datetime
import itertools
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from engine.sequence import TokenLogprobs
from kv_transfer.base import KVSink, KVTransferError, TransferTicket
from kv_transfer.checksum import NAME as CHECKSUM
from kv_transfer.checksum import tensor_checksum
from kv_transfer.grpc_backend import (
    WIRE_DTYPES,
    GrpcReceiver,
    GrpcSender,
    _Corrupt,
    _target,
    wire_dtype,
)
from proto import kv_transfer_pb2

DIST_BACKENDS = ("gloo", "nccl")
_TAG_LIMIT = 1 << 31  # gloo tags are non-negative int32


def _split_host_port(address: str) -> tuple[str, int]:
    host, _, port = _target(address).rpartition(":")
    if not host or not port.isdigit():
        raise KVTransferError(f"bad address {address!r} (expected host:port)")
    return host.strip("[]"), int(port)


def _local_address_towards(host: str, port: int) -> str:
    """The address of this machine that packets to host:port leave from (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1" if host in ("127.0.0.1", "localhost") else socket.gethostname()


def _device_for(backend: str) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _make_group(backend: str, store: Any, rank: int, hostname: str, timeout_s: float) -> Any:
    """A 2-rank process group over `store` (blocks until both ranks joined, or raises)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    dist = torch.distributed
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
        return dist.ProcessGroupGloo(store, rank, 2, opts)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    raise KVTransferError(f"unknown torch.distributed backend {backend!r} (expected one of {DIST_BACKENDS})")


FIRST_TAG = 1 << 30  # the pair's first exchange (layers count their tags up from 0)


def _first_exchange(pg: Any, rank: int, device: torch.device, timeout_s: float) -> None:
    """One element from the sender (rank 1) to the receiver (rank 0), before any layer: NCCL and gloo
    set a group up lazily, at its first operation, so a pair that cannot work (e.g. two processes on
    one GPU: NCCL refuses a duplicate device) fails here, while the pair is being built, and not at
    a request's first layer. Raises on failure or after `timeout_s`."""
    t = torch.ones(1, device=device) if rank == 1 else torch.zeros(1, device=device)
    work = pg.send([t], 0, FIRST_TAG) if rank == 1 else pg.recv([t], 1, FIRST_TAG)
    work.wait(datetime.timedelta(seconds=timeout_s))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if rank == 0 and t.item() != 1.0:
        raise RuntimeError(f"the first exchange carried {t.item()}, not 1.0")


def _shutdown(pg: Any) -> None:
    for method in ("abort", "shutdown"):
        fn = getattr(pg, method, None)
        if fn is not None:
            try:
                fn()
                return
            except Exception:
                continue


def _check_dist_backend(backend: str) -> str:
    if backend not in DIST_BACKENDS:
        raise ValueError(f"dist_backend must be one of {DIST_BACKENDS}, not {backend!r}")
    if not torch.distributed.is_available():
        raise KVTransferError("the torch_distributed KV backend needs torch.distributed (not in this build of torch)")
    if backend == "gloo" and not torch.distributed.is_gloo_available():
        raise KVTransferError("the torch_distributed KV backend with gloo needs a torch built with gloo")
    if backend == "nccl" and not (torch.cuda.is_available() and torch.distributed.is_nccl_available()):
        raise KVTransferError("the torch_distributed KV backend with nccl needs CUDA and NCCL")
    return backend


# ------------------------------------------------------------------------------------------ sender
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


@dataclass(frozen=True)
class _Staged:
    """A layer copied by `send_layer`, waiting for the stream thread to post its send."""

    tensor: torch.Tensor


OFF = "off"  # a receiver's dist_backend when it hosts no process groups (auto without a GPU cache)
# phrases of TorchDistSender's refusals that mean "not between these two" (auto falls back on them)
PLACEMENT = ("does not take the torch_distributed backend", "runs torch_distributed over",
             "cannot reach the KV receiver's store", "cannot build the")


class TorchDistSender(GrpcSender):
    """Pushes layers to `TorchDistReceiver`s over a torch.distributed point-to-point channel. Thread-safe.

    `TorchDistSender(compat_hash, timeout_s=30.0, sender_id=None, *, dist_backend="gloo")`:
    `timeout_s` bounds every control RPC as for grpc, connecting to a receiver's store and
    building its group, and each wait for a send to complete.
    """

    BACKEND = "torch_distributed"
    max_message_bytes = None  # one point-to-point send per layer

    def __init__(
        self,
        compat_hash: str,
        timeout_s: float = 30.0,
        sender_id: str | None = None,
        *,
        dist_backend: str = "gloo",
    ) -> None:
        self.dist_backend = _check_dist_backend(dist_backend)
        super().__init__(compat_hash, timeout_s=timeout_s, sender_id=sender_id)
        self.device = _device_for(self.dist_backend)
        self._pair_lock = threading.Lock()  # builds groups; never held by send_layer
        self._pairs: dict[str, _SendPair] = {}  # endpoint -> its live pair
        self._retired: set[str] = set()  # keys of pairs dropped (a stale handshake must not revive them)

    # ------------------------------------------------------------------ handshake and pairs
    def _handshake_request(self, endpoint: str) -> kv_transfer_pb2.HandshakeRequest:
        request = super()._handshake_request(endpoint)
        request.dist_backend = self.dist_backend
        return request

    def _check_handshake(self, endpoint: str, response: kv_transfer_pb2.HandshakeResponse) -> str | None:
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
        try:
            self._pair(endpoint, response)
        except KVTransferError as e:
            return str(e)
        return None

    def _pair(self, endpoint: str, response: kv_transfer_pb2.HandshakeResponse) -> _SendPair:
        """The endpoint's pair for this handshake, built on first use (blocks up to timeout_s)."""
        with self._pair_lock:
            if self._closed:
                raise KVTransferError("KV sender is closed")
            key = response.dist_pair
            pair = self._pairs.get(endpoint)
            if pair is not None and pair.key == key:
                return pair
            if key in self._retired:
                raise KVTransferError(f"torch_distributed channel {key} to {endpoint} was reset")
            if pair is not None:  # an older pair: replaced by this handshake's
                self._drop_locked(pair, "replaced by a new handshake")
            host, port = _split_host_port(response.dist_store)
            timeout = datetime.timedelta(seconds=self.timeout_s)
            try:
                store = torch.distributed.TCPStore(host, port, None, False, timeout)
            except Exception as e:
                raise KVTransferError(
                    f"torch_distributed: cannot reach the KV receiver's store at {response.dist_store} "
                    f"(for {endpoint}) from here within {self.timeout_s:g}s: {e}"
                ) from None
            pg = None
            try:
                pg = _make_group(
                    self.dist_backend,
                    torch.distributed.PrefixStore(key, store),
                    1,
                    _local_address_towards(host, port),
                    self.timeout_s,
                )
                _first_exchange(pg, 1, self.device, self.timeout_s)
            except Exception as e:
                if pg is not None:
                    _shutdown(pg)
                del store
                raise KVTransferError(
                    f"torch_distributed: cannot build the {self.dist_backend} group {key} with the KV "
                    f"receiver at {endpoint} (store {response.dist_store}): {e}"
                ) from None
            pair = self._pairs[endpoint] = _SendPair(endpoint, key, pg, store, self.device)
            return pair

    def _drop_locked(self, pair: _SendPair, why: str) -> None:
        """Under self._pair_lock: retire a pair and shut its group down."""
        if pair.broken is None:
            pair.broken = why
        self._retired.add(pair.key)
        if self._pairs.get(pair.endpoint) is pair:
            del self._pairs[pair.endpoint]
        pair.works.clear()
        _shutdown(pair.pg)
        pair.store = None

    def _reset(self, pair: _SendPair, why: str) -> None:
        """Drop a pair whose channel may hold unmatched operations; the next transfer handshakes anew."""
        with self._pair_lock:
            self._drop_locked(pair, why)
        self._forget_handshake(pair.endpoint)

    # ------------------------------------------------------------------ transfers
    def _payload(self, ticket: TransferTicket, layer: int, kv: torch.Tensor) -> Any:
        """On the caller's thread: a private contiguous copy on the group's device (no network)."""
        self._raise_if_refused(ticket.kv_endpoint)  # do not copy for an endpoint already refused
        if kv.numel() == 0:
            return b""  # nothing to send: an empty inline payload
        tensor = kv.detach().to(device=self.device, copy=True, memory_format=torch.contiguous_format)
        return _Staged(tensor)

    def _layer_message(
        self, ticket: TransferTicket, layer: int, dtype: str, shape: list[int], payload: Any, first_block: int = 0
    ) -> kv_transfer_pb2.KVLayer:
        """On the stream's thread (after the handshake and its pair): post the send, describe it."""
        if not isinstance(payload, _Staged):
            return super()._layer_message(ticket, layer, dtype, shape, payload, first_block)
        checksum = tensor_checksum(payload.tensor)
        pair = self._pairs.get(ticket.kv_endpoint)
        if pair is None or pair.broken is not None:  # reset meanwhile: the receiver refuses it (no such pair)
            key, tag = (pair.key if pair is not None else "gone"), 0
        else:
            key, tag = pair.key, next(pair.tags) % _TAG_LIMIT
            try:
                work = self._post_send(pair, payload.tensor, tag)
            except Exception as e:  # the channel is closed (receiver gone): drop it, the receiver refuses this
                self._reset(pair, f"send failed: {e}")
            else:
                with self._pair_lock:
                    pair.works.setdefault(ticket.transfer_id, []).append((work, payload.tensor))
        return kv_transfer_pb2.KVLayer(
            transfer_id=ticket.transfer_id,
            auth_token=ticket.auth_token,
            layer=layer,
            dtype=dtype,
            shape=shape,
            checksum=checksum,
            dist_pair=key,
            dist_tag=tag,
        )

    def _post_send(self, pair: _SendPair, tensor: torch.Tensor, tag: int) -> Any:
        """Post the asynchronous point-to-point send (a test hook: bytes may be altered here)."""
        return pair.pg.send([tensor], 0, tag)

    def _settle(self, transfer_id: str, endpoint: str, ok: bool, timeout: float) -> None:
        """Wait for the transfer's sends (ok: the receiver took them all) or, after a failure,
        drop the pair if any of them may be left unmatched."""
        pair = self._pairs.get(endpoint)
        if pair is None:
            return
        with self._pair_lock:
            works = pair.works.pop(transfer_id, [])
        if not works:
            return
        if not ok:
            if not all(w.is_completed() for w, _ in works):
                self._reset(pair, f"transfer {transfer_id!r} failed with sends unmatched")
            return
        try:
            for w, _ in works:
                w.wait(datetime.timedelta(seconds=max(timeout, 0.001)))
        except Exception as e:
            self._reset(pair, f"send failed: {e}")
            raise KVTransferError(f"torch_distributed send to {endpoint} failed: {e}") from None

    def flush(self, ticket: TransferTicket, timeout: float | None = None) -> int:
        timeout = self.timeout_s if timeout is None else timeout
        try:
            received = super().flush(ticket, timeout)
        except BaseException:
            self._settle(ticket.transfer_id, ticket.kv_endpoint, False, timeout)
            raise
        self._settle(ticket.transfer_id, ticket.kv_endpoint, True, timeout)
        return received

    def commit(self, ticket: TransferTicket, first_token: int, logprob: TokenLogprobs | None) -> None:
        try:
            super().commit(ticket, first_token, logprob)
        finally:  # commit's flush settled the sends; after an early failure nothing may linger
            self._settle(ticket.transfer_id, ticket.kv_endpoint, False, 0.0)

    def abort(self, ticket: TransferTicket, reason: str) -> None:
        try:
            super().abort(ticket, reason)
        finally:
            self._settle(ticket.transfer_id, ticket.kv_endpoint, False, 0.0)

    @property
    def pairs(self) -> dict[str, str]:
        """endpoint -> key of its live pair."""
        with self._pair_lock:
            return {e: p.key for e, p in self._pairs.items()}

    def close(self) -> None:
        """Cancel streams in flight, close every channel and shut every group down."""
        super().close()
        with self._pair_lock:
            for pair in list(self._pairs.values()):
                self._drop_locked(pair, "sender closed")


# ---------------------------------------------------------------------------------------- receiver
@dataclass(eq=False)
class _RecvPair:
    key: str
    sender_id: str
    device: torch.device
    ready: threading.Event = field(default_factory=threading.Event)
    pg: Any = None
    error: str | None = None
    thread: threading.Thread | None = None


class TorchDistReceiver(GrpcReceiver):
    """Serves `KVReceiver` for a sink and receives layers' bytes over torch.distributed.

    `TorchDistReceiver(sink, server=None, endpoint=None, *, host="127.0.0.1", port=0,
    max_workers=16, store_host=None, store_port=0, dist_backend=None, timeout_s=30.0)`: as
    `GrpcReceiver`, plus the TCPStore it hosts (`store_host`: the endpoint's host unless given;
    `store_port` 0: any free port; `store_address` says which), the group backend (default: "nccl"
    when the sink's cache is on CUDA, else "gloo") and `timeout_s`, which bounds building a pair's
    group and each receive.
    """

    def __init__(
        self,
        sink: KVSink,
        server: grpc.Server | None = None,
        endpoint: str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_workers: int = 16,
        store_host: str | None = None,
        store_port: int = 0,
        dist_backend: str | None = None,
        timeout_s: float = 30.0,
        **kwargs: Any,
    ) -> None:
        """`kwargs`: for the next receiver in a cooperative subclass (auto: the tcp and shm ones)."""
        if dist_backend is None:
            dist_backend = "nccl" if self._sink_device(sink).type == "cuda" else "gloo"
        self.timeout_s = timeout_s
        self._pairs_lock = threading.Lock()
        self._pairs: dict[str, _RecvPair] = {}
        if dist_backend == OFF:  # (auto on a CPU cache) no store, no groups: senders fall back
            self.dist_backend, self.device, self._store = OFF, torch.device("cpu"), None
            self.store_host = self.store_address = ""
            super().__init__(sink, server, endpoint, host=host, port=port, max_workers=max_workers, **kwargs)
            return
        self.dist_backend = _check_dist_backend(dist_backend)
        self.device = _device_for(self.dist_backend)
        if store_host is None:
            store_host = _split_host_port(endpoint)[0] if endpoint else host
        try:
            self._store: Any = torch.distributed.TCPStore(
                store_host, store_port, None, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False
            )
        except Exception as e:
            raise KVTransferError(f"could not start a TCPStore for KV transfers on {store_host}:{store_port}: {e}") from None
        self.store_host = store_host
        self.store_address = f"{store_host}:{self._store.port}"
        try:
            super().__init__(sink, server, endpoint, host=host, port=port, max_workers=max_workers, **kwargs)
        except BaseException:
            self._store = None
            raise

    @staticmethod
    def _sink_device(sink: KVSink) -> torch.device:
        caches = getattr(getattr(getattr(sink, "engine", None), "runner", None), "kv_caches", None)
        if caches:
            return caches[0].device
        cache = getattr(sink, "cache", None)
        return cache.device if isinstance(cache, torch.Tensor) else torch.device("cpu")

    @classmethod
    def serve(
        cls, sink: KVSink, host: str = "127.0.0.1", port: int = 0, max_workers: int = 16
    ) -> TorchDistReceiver:
        return cls(sink, host=host, port=port, max_workers=max_workers)

    # ------------------------------------------------------------------ pairs
    def handshake_fields(self, request: kv_transfer_pb2.HandshakeRequest) -> dict[str, Any]:
        fields = super().handshake_fields(request)  # (auto: the tcp and shm receivers' fields)
        if not request.dist_backend or self.dist_backend == OFF:
            return fields  # a grpc / shm / tcp sender, or process groups off here
        if request.dist_backend != self.dist_backend or self.closed:
            return {**fields, "dist_backend": self.dist_backend}  # no store: the sender refuses, naming both
        sender = request.sender_id or "anonymous"
        key = f"{sender}/{secrets.token_hex(6)}"
        pair = _RecvPair(key, sender, self.device)
        with self._pairs_lock:
            if self._store is None:
                return {**fields, "dist_backend": self.dist_backend}
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
        return {**fields, "dist_store": self.store_address, "dist_pair": key, "dist_backend": self.dist_backend}

    def _build(self, pair: _RecvPair, store: Any) -> None:
        pg = None
        try:
            pg = _make_group(
                self.dist_backend, torch.distributed.PrefixStore(pair.key, store), 0, self.store_host, self.timeout_s
            )
            _first_exchange(pg, 0, pair.device, self.timeout_s)
        except Exception as e:
            if pg is not None:
                _shutdown(pg)
            pair.error = f"torch_distributed group {pair.key} was not built: {e}"
        else:
            with self._pairs_lock:
                dropped = self._pairs.get(pair.key) is not pair
                pair.pg = pg
            if dropped:
                _shutdown(pg)
                pair.error = f"torch_distributed group {pair.key} was dropped"
        finally:
            pair.ready.set()

    def _drop(self, pair: _RecvPair) -> None:
        with self._pairs_lock:
            if self._pairs.get(pair.key) is pair:
                del self._pairs[pair.key]
            pg, pair.pg = pair.pg, None
            if pair.error is None:
                pair.error = f"torch_distributed group {pair.key} was dropped"
        if pg is not None:
            _shutdown(pg)

    @property
    def pairs(self) -> list[str]:
        with self._pairs_lock:
            return sorted(self._pairs)

    # ------------------------------------------------------------------ layers
    def receive_layer(self, msg: kv_transfer_pb2.KVLayer) -> None:
        if not msg.dist_pair:
            return super().receive_layer(msg)  # inline payload (a grpc sender, or an empty layer)
        with self._lock:  # who is asking and what they claim, before a single recv is posted
            pending = self._get(msg.transfer_id, msg.auth_token)
            num_blocks = len(pending.ticket.block_ids)
        dtype, shape = self._check_dist_layer(msg, num_blocks)
        with self._pairs_lock:
            pair = self._pairs.get(msg.dist_pair)
        if pair is None:
            raise KVTransferError(f"layer {msg.layer}: unknown torch_distributed pair {msg.dist_pair!r}")
        if not pair.ready.wait(self.timeout_s):
            raise KVTransferError(f"layer {msg.layer}: torch_distributed group {pair.key} not built in time")
        pg = pair.pg
        if pair.error is not None or pg is None:
            raise KVTransferError(f"layer {msg.layer}: {pair.error or 'group gone'}")
        buf = torch.empty(shape, dtype=dtype, device=pair.device)
        try:
            pg.recv([buf], 1, msg.dist_tag).wait(datetime.timedelta(seconds=self.timeout_s))
        except Exception as e:
            self._drop(pair)  # gloo closes the pair on a timeout; no later message may use it
            raise KVTransferError(
                f"layer {msg.layer} of {msg.transfer_id!r}: torch_distributed recv (tag {msg.dist_tag}) "
                f"over {pair.key} failed: {e}"
            ) from None
        digest = tensor_checksum(buf)
        if digest != msg.checksum:
            raise _Corrupt(
                f"checksum mismatch for layer {msg.layer} of {msg.transfer_id!r}: "
                f"received {CHECKSUM} {digest:#018x}, message says {msg.checksum:#018x}"
            )
        self._on_layer(msg.transfer_id, msg.auth_token, msg.layer, buf)

    def _check_dist_layer(self, msg: kv_transfer_pb2.KVLayer, num_blocks: int) -> tuple[torch.dtype, tuple[int, ...]]:
        """The framing checks that can be made before the bytes arrive (their checksum comes after)."""
        if msg.payload:
            raise KVTransferError(f"layer {msg.layer}: both an inline payload and a torch_distributed send")
        if msg.HasField("compression"):
            raise KVTransferError(f"layer {msg.layer}: compression {msg.compression!r} is not supported")
        if msg.first_block != 0:
            raise KVTransferError(
                f"layer {msg.layer}: split layers (first_block={msg.first_block}) are not supported"
            )
        if not 0 <= msg.layer < self.sink.num_layers:
            raise KVTransferError(f"layer {msg.layer} out of range [0, {self.sink.num_layers})")
        dtype = WIRE_DTYPES.get(msg.dtype)
        if dtype is None or (self._dtype is not None and dtype != self._dtype):
            want = wire_dtype(self._dtype) if self._dtype is not None else " or ".join(WIRE_DTYPES)
            raise KVTransferError(f"layer {msg.layer}: dtype {msg.dtype!r}, expected {want}")
        shape = tuple(msg.shape)
        expected = tuple(self.sink.layer_shape(num_blocks))
        if shape != expected:
            raise KVTransferError(f"layer {msg.layer}: shape {shape}, expected {expected}")
        return dtype, shape

    def close(self) -> None:
        """Refuse further messages, shut every pair's group down and stop the store."""
        super().close()
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
                    _shutdown(pair.pg)
                    pair.pg = None
        del store
