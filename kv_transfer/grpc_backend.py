"""gRPC backend: the prefill worker streams each layer's KV to the decode worker's `KVReceiver` service.

Wire protocol (proto/kv_transfer.proto), per transfer:

    Handshake      once per (sender, endpoint): the compatibility hashes must match, else refused
    SendLayers     one client stream per transfer carrying its `KVLayer`s (raw C-contiguous tensor
                   bytes + XXH3-64 checksum; never pickled); the stream is fed from a queue in the background,
                   so `send_layer` returns at once and the forward pass never waits on the network
    Commit         after the stream is acknowledged: the first token (and its logprob)
    Abort          cancels the stream, then tells the receiver to free the blocks

Receiver-side refusals are gRPC status codes whose details carry the reason:

    NOT_FOUND            unknown transfer id (never reserved, already committed or aborted)
    PERMISSION_DENIED    bad auth token for the transfer
    DATA_LOSS            payload checksum does not match the message's checksum (corrupted in transit)
    INVALID_ARGUMENT     layer out of range, wrong shape / dtype / payload size, unsupported
                         compression or split layer
    FAILED_PRECONDITION  commit before all layers arrived
    UNAVAILABLE          the receiver was closed
    INTERNAL             the sink failed unexpectedly

Nothing is written into the cache before every check passed (the checks in `KVReceiver._on_layer`
are shared with the other backends). The sender turns every failure into a `KVTransferError` naming
the RPC, the endpoint, the status and the receiver's reason. Every RPC has a deadline.

Threading: the receiver's server runs SendLayers on a pool thread for as long as the stream is
open, i.e. for the length of the prefill forward pass that produces the layers. A server shared with
other long-lived RPCs needs enough workers for the KV transfers in flight at once.
"""

from __future__ import annotations

import itertools
import math
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from engine.config import KV_LAYOUT_VERSION
from engine.sequence import TokenLogprobs
from kv_transfer.base import KVReceiver, KVSender, KVSink, KVTransferError, TransferTicket
from kv_transfer.checksum import NAME as CHECKSUM
from kv_transfer.checksum import checksum
from kv_transfer.compression import COMPRESSIONS, dequantize_int8, quantize_int8
from proto import generate_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc

MAX_MESSAGE_BYTES = 512 * 1024 * 1024
MESSAGE_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# a restarted decode worker is found again within seconds, not gRPC's default of up to two minutes
CHANNEL_OPTIONS = [*MESSAGE_OPTIONS, ("grpc.max_reconnect_backoff_ms", 5000)]

# received payloads are viewed in place (torch.frombuffer over the message's bytes) and only read
warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning, r"kv_transfer\.")

# wire dtype names, as in the proto ("bfloat16"): str(torch dtype) without the "torch." prefix
WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def wire_dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _target(endpoint: str) -> str:
    return endpoint.removeprefix("grpc://")


def sink_dtype(sink: KVSink) -> torch.dtype | None:
    """The dtype a sink's KV cache holds, or None when it does not say.

    `KVSink` has no dtype attribute; a sink may declare `kv_dtype`, and the decode worker's
    `DecodeEngine` is recognised by its `engine.runner.dtype`. Without either, any known wire dtype
    of the right size is accepted (the compatibility hash already pins the dtype).
    """
    dtype = getattr(sink, "kv_dtype", None)
    if dtype is None:
        dtype = getattr(getattr(getattr(sink, "engine", None), "runner", None), "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _status_for(error: KVTransferError) -> grpc.StatusCode:
    """Map the shared validation's refusals (kv_transfer.base) onto gRPC status codes (an error
    carrying its own `status`, as a backend's transport failures do, keeps it)."""
    status = getattr(error, "status", None)
    if isinstance(status, grpc.StatusCode):
        return status
    message = str(error)
    if message.startswith("unknown transfer id"):
        return grpc.StatusCode.NOT_FOUND
    if message.startswith("bad auth token"):
        return grpc.StatusCode.PERMISSION_DENIED
    if message.startswith("commit of") and "before layers" in message:
        return grpc.StatusCode.FAILED_PRECONDITION
    if message.startswith("incompatible"):
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.INVALID_ARGUMENT


def logprob_to_proto(lp: TokenLogprobs) -> generate_pb2.TokenLogprob:
    return generate_pb2.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top=[generate_pb2.Logprob(token_id=t, logprob=p) for t, p in lp.top],
    )


def logprob_from_proto(msg: generate_pb2.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(msg.token_id, msg.logprob, [(t.token_id, t.logprob) for t in msg.top])


# ---------------------------------------------------------------------------------------- receiver
class _Servicer(kv_transfer_pb2_grpc.KVReceiverServicer):
    def __init__(self, receiver: GrpcReceiver) -> None:
        self.r = receiver

    def _check_open(self, context: grpc.ServicerContext) -> None:
        if self.r.closed:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"KV receiver at {self.r.endpoint} is closed")

    def Handshake(self, request, context):
        self._check_open(context)
        try:
            self.r.check_compat(request.compat_hash)
        except KVTransferError as e:
            return kv_transfer_pb2.HandshakeResponse(
                ok=False, reason=str(e), compat_hash=self.r.sink.compat_hash
            )
        return kv_transfer_pb2.HandshakeResponse(
            ok=True, compat_hash=self.r.sink.compat_hash, **self.r.handshake_fields(request)
        )

    def SendLayers(self, request_iterator, context):
        self._check_open(context)
        received: set[tuple[str, int]] = set()
        for msg in request_iterator:
            self._check_open(context)
            try:
                self.r.receive_layer(msg)
            except _Corrupt as e:
                context.abort(grpc.StatusCode.DATA_LOSS, str(e))
            except KVTransferError as e:
                context.abort(_status_for(e), str(e))
            except Exception as e:  # the sink failed: report it, never leave the stream hanging
                context.abort(grpc.StatusCode.INTERNAL, f"layer {msg.layer} of {msg.transfer_id!r}: {e!r}")
            received.add((msg.transfer_id, msg.layer))
        return kv_transfer_pb2.KVAck(ok=True, layers_received=len(received))

    def Commit(self, request, context):
        self._check_open(context)
        lp = None
        if request.HasField("first_token_logprob"):
            lp = logprob_from_proto(request.first_token_logprob)
        try:
            for msg in request.layers:  # layers whose messages rode in the commit: checked first
                self.r.receive_layer(msg)
            self.r._on_commit(request.transfer_id, request.auth_token, request.first_token, lp)
        except _Corrupt as e:
            context.abort(grpc.StatusCode.DATA_LOSS, str(e))
        except KVTransferError as e:
            context.abort(_status_for(e), str(e))
        except Exception as e:
            context.abort(grpc.StatusCode.INTERNAL, f"commit of {request.transfer_id!r}: {e!r}")
        return kv_transfer_pb2.KVAck(ok=True, layers_received=self.r.sink.num_layers)

    def Abort(self, request, context):
        self._check_open(context)
        try:
            self.r._on_abort(request.transfer_id, request.auth_token, request.reason)
        except KVTransferError as e:
            context.abort(_status_for(e), str(e))
        except Exception as e:
            context.abort(grpc.StatusCode.INTERNAL, f"abort of {request.transfer_id!r}: {e!r}")
        return kv_transfer_pb2.KVAck(ok=True)


class _Corrupt(KVTransferError):
    """The payload does not match its checksum."""


class GrpcReceiver(KVReceiver):
    """Serves `KVReceiver` for a sink.

    `GrpcReceiver(sink, server, endpoint)` registers on the caller's server (best before
    `server.start()`; the caller owns the server, its port and its lifetime, and `close()` only
    makes this servicer refuse with UNAVAILABLE; `endpoint` is the "host:port" senders should
    dial and goes into every ticket). Without a server (`GrpcReceiver(sink)`, or
    `GrpcReceiver.serve(sink, host, port)`) it starts its own on host:port (0: any free port) and
    stops it on `close()`.
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
    ) -> None:
        super().__init__(sink)
        self.closed = False
        self._dtype = sink_dtype(sink)
        self._own_server = server is None
        self._executor: futures.ThreadPoolExecutor | None = None
        if server is None:
            self._executor = futures.ThreadPoolExecutor(max_workers, thread_name_prefix="kv-receiver")
            server = grpc.server(self._executor, options=MESSAGE_OPTIONS)
            kv_transfer_pb2_grpc.add_KVReceiverServicer_to_server(_Servicer(self), server)
            try:
                bound = server.add_insecure_port(f"{host}:{port}")
            except RuntimeError:  # grpc raises where older versions returned 0
                bound = 0
            if bound == 0:
                self._executor.shutdown(wait=False)
                raise KVTransferError(f"could not bind a KV receiver to {host}:{port}")
            server.start()
            endpoint = f"{host}:{bound}"
        else:
            if not endpoint:
                raise ValueError("GrpcReceiver on a caller's server needs its endpoint ('host:port')")
            kv_transfer_pb2_grpc.add_KVReceiverServicer_to_server(_Servicer(self), server)
        self.server = server
        self._endpoint = endpoint

    @classmethod
    def serve(
        cls, sink: KVSink, host: str = "127.0.0.1", port: int = 0, max_workers: int = 16
    ) -> GrpcReceiver:
        return cls(sink, host=host, port=port, max_workers=max_workers)

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def handshake_fields(self, request: kv_transfer_pb2.HandshakeRequest) -> dict[str, Any]:
        """Extra fields for an accepted handshake's response (an extension point; none here)."""
        return {}

    def receive_layer(self, msg: kv_transfer_pb2.KVLayer) -> None:
        """Check one `KVLayer` and hand it to the shared checks (an extension point for other transports)."""
        self._on_layer(msg.transfer_id, msg.auth_token, msg.layer, self.decode_layer(msg), msg.first_block)

    def decode_layer(self, msg: kv_transfer_pb2.KVLayer) -> torch.Tensor:
        """Check a `KVLayer`'s framing (checksum, dtype, size) and view its payload as a tensor."""
        payload = msg.payload
        dtype, shape = self.check_layer(msg, payload)
        if math.prod(shape) == 0:
            return torch.empty(shape, dtype=dtype)
        # views of the message's immutable bytes, not copies: nothing writes through them (the
        # sink copies them into the cache; int8 dequantizes into a new tensor)
        if msg.compression == "int8":
            q = torch.frombuffer(payload, dtype=torch.int8).view(shape)
            scales = torch.frombuffer(msg.scales, dtype=torch.float32).view(shape[0], shape[1])
            return dequantize_int8(q, scales, dtype)
        return torch.frombuffer(payload, dtype=dtype).view(shape)

    def check_layer(self, msg: kv_transfer_pb2.KVLayer, payload: Any) -> tuple[torch.dtype, tuple[int, ...]]:
        """Check a `KVLayer`'s framing against its bytes (any 1-D byte buffer): compression, split,
        checksum, dtype, size. Returns the dtype and shape the bytes hold."""
        int8 = msg.HasField("compression") and msg.compression == "int8"
        if msg.HasField("compression") and not int8:
            raise KVTransferError(f"layer {msg.layer}: compression {msg.compression!r} is not supported")
        if int8 and (msg.shm_name or msg.dist_pair or msg.tcp_conn):
            raise KVTransferError(f"layer {msg.layer}: int8 compression travels inline (grpc) only")
        digest = checksum(payload, msg.scales) if int8 else checksum(payload)  # int8: the scales too
        if digest != msg.checksum:
            raise _Corrupt(
                f"checksum mismatch for layer {msg.layer} of {msg.transfer_id!r}: "
                f"payload {CHECKSUM} {digest:#018x}, message says {msg.checksum:#018x}"
            )
        dtype = WIRE_DTYPES.get(msg.dtype)
        if dtype is None or (self._dtype is not None and dtype != self._dtype):
            want = wire_dtype(self._dtype) if self._dtype is not None else " or ".join(WIRE_DTYPES)
            raise KVTransferError(f"layer {msg.layer}: dtype {msg.dtype!r}, expected {want}")
        shape = tuple(msg.shape)
        if not shape or any(d < 0 for d in shape):
            raise KVTransferError(f"layer {msg.layer}: bad shape {shape}")
        size = math.prod(shape) * (1 if int8 else dtype.itemsize)
        if int8 and (len(shape) != 5 or len(msg.scales) != shape[0] * shape[1] * 4):
            raise KVTransferError(f"layer {msg.layer}: int8 scales of {len(msg.scales)} bytes do not fit shape {shape}")
        if size != len(payload):
            raise KVTransferError(
                f"layer {msg.layer}: shape {shape} of {msg.dtype} is {size} bytes, payload has {len(payload)}"
            )
        return dtype, shape

    def close(self) -> None:
        """Refuse further messages; stop the server if this receiver started it."""
        self.closed = True
        if self._own_server and self._executor is not None:
            self.server.stop(grace=None).wait()
            self._executor.shutdown(wait=True)
            self._executor = None


# ------------------------------------------------------------------------------------------ sender
_END = object()  # closes a stream's request queue


@dataclass
class _Int8:
    """A layer quantized for the wire: int8 values and float32 per-block scales (2, num_blocks)."""

    q: bytes
    scales: bytes


@dataclass
class _Handshake:
    future: grpc.Future
    error: str | None = None  # set once refused (cached): the endpoint's layout differs from ours


@dataclass(eq=False)
class _Stream:
    requests: queue.SimpleQueue[Any]
    future: grpc.Future | None = None
    error: str | None = None  # set by the request iterator when the handshake failed


@dataclass
class _Transfer:
    endpoint: str
    streams: list[_Stream] = field(default_factory=list)
    open: _Stream | None = None  # the stream new layers go to; None: the next layer opens one
    layers_sent: set[int] = field(default_factory=set)
    # layer messages held back (see GrpcSender._deferred): sent by the next flush, or in the commit
    deferred: list[tuple] = field(default_factory=list)


def _rpc_error(what: str, endpoint: str, e: BaseException) -> KVTransferError:
    if isinstance(e, grpc.RpcError) and hasattr(e, "code"):
        return KVTransferError(f"{what} to {endpoint} failed: {e.code().name}: {e.details()}")
    if isinstance(e, (grpc.FutureTimeoutError, TimeoutError)):
        return KVTransferError(f"{what} to {endpoint} timed out")
    if isinstance(e, (grpc.FutureCancelledError, futures.CancelledError)):
        return KVTransferError(f"{what} to {endpoint} was cancelled")
    return KVTransferError(f"{what} to {endpoint} failed: {e!r}")


class GrpcSender(KVSender):
    """Pushes layers to `GrpcReceiver`s. Thread-safe; any number of transfers may be in flight.

    One channel per endpoint (created on first use, reused), one handshake per endpoint (its
    refusal is cached; a network failure is retried by the next transfer), one SendLayers stream
    per transfer. `timeout_s` bounds every RPC: the handshake, a stream (from its first layer until
    it is acknowledged), the commit and the abort.
    """

    _ids = itertools.count()
    BACKEND = "grpc"  # the name its bytes are counted under (`bytes_sent`)
    # a layer larger than this travels as several KVLayer messages (runs of blocks); None: one message
    max_message_bytes: int | None = 8 << 20

    def __init__(self, compat_hash: str, timeout_s: float = 30.0, sender_id: str | None = None,
                 compression: str = "none") -> None:
        super().__init__(compat_hash)
        if compression not in COMPRESSIONS:
            raise ValueError(f"unknown KV compression {compression!r}; allowed: {', '.join(COMPRESSIONS)}")
        self.compression = compression
        self.timeout_s = timeout_s
        self.sender_id = sender_id or f"prefill-{os.getpid()}-{next(self._ids)}"
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[grpc.Channel, kv_transfer_pb2_grpc.KVReceiverStub]] = {}
        self._handshakes: dict[str, _Handshake] = {}
        self._transfers: dict[str, _Transfer] = {}
        self._interceptors: list[Any] = []
        self._closed = False

    # ------------------------------------------------------------------ connections
    def add_channel_interceptor(self, interceptor: object) -> None:
        with self._lock:
            self._interceptors.append(interceptor)

    def _stub(self, endpoint: str) -> kv_transfer_pb2_grpc.KVReceiverStub:
        """Under self._lock."""
        if self._closed:
            raise KVTransferError("KV sender is closed")
        entry = self._channels.get(endpoint)
        if entry is None:
            channel = grpc.insecure_channel(_target(endpoint), options=CHANNEL_OPTIONS)
            if self._interceptors:
                channel = grpc.intercept_channel(channel, *self._interceptors)
            entry = self._channels[endpoint] = (channel, kv_transfer_pb2_grpc.KVReceiverStub(channel))
        return entry[1]

    def connect(self, endpoint: str, timeout: float | None = None) -> None:
        """Handshake with `endpoint` now (at start-up, say); raises KVTransferError if it cannot take
        this backend's transfers from here: unreachable, another KV layout, and for shm another node
        or no shared /dev/shm, for torch_distributed no process group between the two."""
        with self._lock:
            hs = self._handshake(endpoint)
        self._await_handshake(endpoint, hs, self.timeout_s if timeout is None else timeout)

    def _handshake(self, endpoint: str) -> _Handshake:
        """Under self._lock: the endpoint's handshake, started (not awaited) on first use."""
        hs = self._handshakes.get(endpoint)
        if hs is not None and hs.error is None and hs.future.done():
            if hs.future.cancelled() or hs.future.exception() is not None:
                hs = None  # failed on the network, not refused: try again
        if hs is None:
            request = self._handshake_request(endpoint)
            hs = _Handshake(self._stub(endpoint).Handshake.future(request, timeout=self.timeout_s))
            self._handshakes[endpoint] = hs
        return hs

    def _forget_handshake(self, endpoint: str,
                          made: Callable[[kv_transfer_pb2.HandshakeResponse], bool] | None = None) -> None:
        """Drop the endpoint's accepted handshake (the next layer handshakes anew); with `made`, only
        if its response is the one that made the channel being dropped (a newer one stays)."""
        with self._lock:
            hs = self._handshakes.get(endpoint)
            if hs is None or hs.error is not None:
                return  # none, or a refusal (kept: the layout still differs)
            if made is not None:
                f = hs.future
                if not f.done() or f.cancelled() or f.exception() is not None or not made(f.result()):
                    return
            del self._handshakes[endpoint]

    def _handshake_request(self, endpoint: str) -> kv_transfer_pb2.HandshakeRequest:
        """Under self._lock: what this sender opens an endpoint with (an extension point)."""
        return kv_transfer_pb2.HandshakeRequest(
            compat_hash=self.compat_hash, layout_version=KV_LAYOUT_VERSION, sender_id=self.sender_id
        )

    def _raise_if_refused(self, endpoint: str) -> None:
        """Raise the endpoint's cached refusal, or that this sender is closed: a backend checks
        before it stages a layer's bytes outside the message (segment, device copy, buffer)."""
        with self._lock:
            hs = self._handshakes.get(endpoint)
            if hs is not None and hs.error is not None:
                raise KVTransferError(hs.error)
            if self._closed:
                raise KVTransferError("KV sender is closed")

    def _check_handshake(self, endpoint: str, response: kv_transfer_pb2.HandshakeResponse) -> str | None:
        """Why an accepted handshake still does not suit this sender, or None (an extension point).
        A reason is cached like a refusal."""
        return None

    def _await_handshake(self, endpoint: str, hs: _Handshake, timeout: float) -> None:
        """Raise KVTransferError unless the endpoint accepted our layout."""
        if hs.error is not None:
            raise KVTransferError(hs.error)
        try:
            response = hs.future.result(timeout=max(timeout, 0.0))
        except BaseException as e:
            if isinstance(e, grpc.FutureTimeoutError) and not hs.future.done():
                raise _rpc_error("handshake", endpoint, e) from None
            with self._lock:  # a network failure: the next transfer tries again
                if self._handshakes.get(endpoint) is hs:
                    del self._handshakes[endpoint]
            raise _rpc_error("handshake", endpoint, e) from None
        if not response.ok:
            hs.error = f"KV receiver at {endpoint} refused the handshake: {response.reason}"
            raise KVTransferError(hs.error)
        problem = self._check_handshake(endpoint, response)
        if problem is not None:
            hs.error = problem
            raise KVTransferError(hs.error)

    # ------------------------------------------------------------------ streaming
    def _requests(
        self, endpoint: str, hs: _Handshake, stream: _Stream, ticket: TransferTicket
    ) -> Iterator[kv_transfer_pb2.KVLayer]:
        """Runs on gRPC's request thread: wait for the handshake, then send what the queue yields."""
        try:
            self._await_handshake(endpoint, hs, self.timeout_s)
        except KVTransferError as e:
            stream.error = str(e)
            return  # an empty stream: nothing reaches the receiver
        while True:
            item = stream.requests.get()
            if item is _END:
                return
            yield self._layer_message(ticket, *item)

    def _payload(self, ticket: TransferTicket, layer: int, kv: torch.Tensor) -> Any:
        """On the caller's thread: what a layer's bytes travel as (an extension point; here the
        raw C-contiguous bytes, sent inline; with int8 compression, the quantized bytes and scales)."""
        if self.compression == "int8":
            q, scales = quantize_int8(kv.detach().cpu())
            return _Int8(q.reshape(-1).view(torch.uint8).numpy().tobytes(), scales.numpy().tobytes())
        payload = kv.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        if len(payload) > MAX_MESSAGE_BYTES - (1 << 20):
            raise KVTransferError(
                f"layer {layer} of {ticket.transfer_id!r} is {len(payload)} bytes, over the "
                f"{MAX_MESSAGE_BYTES}-byte message limit (one block of it is larger than a message may be)"
            )
        return payload

    def _layer_message(
        self, ticket: TransferTicket, layer: int, dtype: str, shape: list[int], payload: Any, first_block: int = 0
    ) -> kv_transfer_pb2.KVLayer:
        """On the stream's request thread: the `KVLayer` for a queued layer (an extension point)."""
        if isinstance(payload, _Int8):
            return kv_transfer_pb2.KVLayer(
                transfer_id=ticket.transfer_id, auth_token=ticket.auth_token, layer=layer, dtype=dtype,
                shape=shape, checksum=checksum(payload.q, payload.scales), payload=payload.q,
                compression="int8", scales=payload.scales, first_block=first_block,
            )
        return kv_transfer_pb2.KVLayer(
            transfer_id=ticket.transfer_id,
            auth_token=ticket.auth_token,
            layer=layer,
            dtype=dtype,
            shape=shape,
            checksum=checksum(payload),
            payload=payload,
            first_block=first_block,
        )

    @staticmethod
    def _failure(endpoint: str, stream: _Stream) -> KVTransferError | None:
        """A finished stream's error, without waiting."""
        if stream.error is not None:
            return KVTransferError(stream.error)
        f = stream.future
        if f is None or not f.done():
            return None
        if f.cancelled():
            return KVTransferError(f"SendLayers to {endpoint} was cancelled")
        e = f.exception()
        return _rpc_error("SendLayers", endpoint, e) if e is not None else None

    def send_layer(self, ticket: TransferTicket, layer: int, kv: torch.Tensor) -> None:
        """Queue one layer for the background stream; returns without waiting for the network.

        Raises at once only for what is already known: an incompatible ticket, a refused
        handshake, or an earlier failure of this transfer's stream. Anything else surfaces in
        `flush` / `commit`.
        """
        self.check_ticket(ticket)
        endpoint = ticket.kv_endpoint
        dtype = wire_dtype(kv.dtype)
        if dtype not in WIRE_DTYPES:
            raise KVTransferError(f"layer {layer}: cannot send KV of dtype {kv.dtype}")
        parts = [(first, list(part.shape), self._payload(ticket, layer, part)) for first, part in self._split(kv)]
        with self._lock:
            hs = self._handshake(endpoint)
            if hs.error is not None:
                raise KVTransferError(hs.error)
            transfer = self._transfers.get(ticket.transfer_id)
            if transfer is None:
                transfer = self._transfers[ticket.transfer_id] = _Transfer(endpoint)
            for stream in transfer.streams:
                failure = self._failure(endpoint, stream)
                if failure is not None:
                    raise failure
            items = [(layer, dtype, shape, payload, first) for first, shape, payload in parts]
            transfer.deferred.extend(item for item in items if self._deferred(item[3]))
            self._stream_out(ticket, hs, transfer, [item for item in items if not self._deferred(item[3])])
            transfer.layers_sent.add(layer)
            nbytes = sum(len(p.q) + len(p.scales) if isinstance(p, _Int8) else 0 for _, _, p in parts) or kv.nbytes
            self._count_sent(self.BACKEND, nbytes)

    def _stream_out(self, ticket: TransferTicket, hs: _Handshake, transfer: _Transfer, items: list[tuple]) -> None:
        """Under self._lock: queue layer items on the transfer's open stream (opened if need be)."""
        if not items:
            return
        stream = transfer.open
        if stream is None:
            stream = transfer.open = _Stream(queue.SimpleQueue())
            transfer.streams.append(stream)
            stream.future = self._stub(transfer.endpoint).SendLayers.future(
                self._requests(transfer.endpoint, hs, stream, ticket), timeout=self.timeout_s
            )
            # once the call is over (failed early, cancelled), the request iterator must not block
            stream.future.add_done_callback(lambda _f, q=stream.requests: q.put(_END))
        for item in items:
            stream.requests.put(item)

    def _deferred(self, payload: Any) -> bool:
        """Whether a layer's message waits for the next flush or rides in the commit instead of
        going on a stream now (an extension point: shm's layers written in place, whose bytes are
        already there, so a stream per transfer would only add round trips)."""
        return False

    def _split(self, kv: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """A layer as (first block, run of blocks) messages of at most `max_message_bytes` each (at
        least one block each): HTTP/2 moves one huge message far slower than several, and a layer
        may be larger than a gRPC message can be."""
        limit = self.max_message_bytes
        if limit is None or kv.dim() < 2 or kv.nbytes <= limit or kv.shape[1] < 2:
            return [(0, kv)]
        per_block = max(1, kv.nbytes // kv.shape[1])
        step = max(1, limit // per_block)
        return [(first, kv[:, first : first + step]) for first in range(0, kv.shape[1], step)]

    def _close_streams(self, endpoint: str) -> None:
        """Under self._lock: end the open streams to `endpoint` (their layers are all queued).

        A server thread serves each open stream, so a commit waiting for its own stream must not
        wait behind other transfers' open streams: they are closed too. A later layer of theirs
        opens a new stream; the receiver collects layers per transfer, not per stream.
        """
        for transfer in self._transfers.values():
            if transfer.endpoint == endpoint and transfer.open is not None:
                transfer.open.requests.put(_END)
                transfer.open = None

    def flush(self, ticket: TransferTicket, timeout: float | None = None) -> int:
        """Wait until the receiver acknowledged every layer sent so far; returns how many it took.

        Raises KVTransferError with the receiver's reason for any refused layer.
        """
        deadline = time.monotonic() + (self.timeout_s if timeout is None else timeout)
        endpoint = ticket.kv_endpoint
        with self._lock:
            transfer = self._transfers.get(ticket.transfer_id)
            if transfer is None:
                return 0
            if transfer.deferred:
                held, transfer.deferred = transfer.deferred, []
                self._stream_out(ticket, self._handshake(endpoint), transfer, held)
            self._close_streams(endpoint)
            streams = list(transfer.streams)
        received, error = 0, None
        for stream in streams:
            try:
                ack = stream.future.result(timeout=max(deadline - time.monotonic(), 0.0))
            except grpc.FutureTimeoutError as e:
                stream.future.cancel()
                error = error or _rpc_error("SendLayers", endpoint, e)
                continue
            except BaseException as e:
                error = error or self._failure(endpoint, stream) or _rpc_error("SendLayers", endpoint, e)
                continue
            if stream.error is not None:
                error = error or KVTransferError(stream.error)
            elif not ack.ok:
                error = error or KVTransferError(f"SendLayers to {endpoint} refused: {ack.error}")
            else:
                received += ack.layers_received
        with self._lock:  # reported once: a failure does not poison the transfer's later layers
            transfer.streams = [s for s in transfer.streams if s not in streams]
        if error is not None:
            raise error
        return received

    def commit(self, ticket: TransferTicket, first_token: int, logprob: TokenLogprobs | None) -> None:
        self.check_ticket(ticket)
        endpoint = ticket.kv_endpoint
        held: list[tuple] = []
        try:
            with self._lock:  # held-back layer messages ride in the commit (one round trip for them)
                transfer = self._transfers.get(ticket.transfer_id)
                if transfer is not None:
                    held, transfer.deferred = transfer.deferred, []
            self.flush(ticket)
            with self._lock:
                hs = self._handshake(endpoint)
                transfer = self._transfers.get(ticket.transfer_id)
                num_layers = len(transfer.layers_sent) if transfer is not None else 0
                stub = self._stub(endpoint)
            self._await_handshake(endpoint, hs, self.timeout_s)
        finally:
            with self._lock:
                transfer = self._transfers.pop(ticket.transfer_id, None)
            if transfer is not None:
                self._cancel(transfer)  # after a failure: no stream of it may linger
        request = kv_transfer_pb2.KVCommit(
            transfer_id=ticket.transfer_id,
            auth_token=ticket.auth_token,
            first_token=first_token,
            num_layers=num_layers,
        )
        if logprob is not None:
            request.first_token_logprob.CopyFrom(logprob_to_proto(logprob))
        request.layers.extend(self._layer_message(ticket, *item) for item in held)
        try:
            ack = stub.Commit(request, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise _rpc_error("Commit", endpoint, e) from None
        if not ack.ok:
            raise KVTransferError(f"Commit to {endpoint} refused: {ack.error}")

    def abort(self, ticket: TransferTicket, reason: str) -> None:
        """Cancel the transfer's streams and tell the receiver to free its blocks (bounded)."""
        endpoint = ticket.kv_endpoint
        with self._lock:
            transfer = self._transfers.pop(ticket.transfer_id, None)
            stub = self._stub(endpoint)
        if transfer is not None:
            self._cancel(transfer)
        request = kv_transfer_pb2.KVAbort(
            transfer_id=ticket.transfer_id, auth_token=ticket.auth_token, reason=reason
        )
        try:
            ack = stub.Abort(request, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise _rpc_error("Abort", endpoint, e) from None
        if not ack.ok:
            raise KVTransferError(f"Abort to {endpoint} refused: {ack.error}")

    @staticmethod
    def _cancel(transfer: _Transfer) -> None:
        for stream in transfer.streams:
            stream.requests.put(_END)
            if stream.future is not None:
                stream.future.cancel()  # a no-op once the stream finished

    @property
    def num_in_flight(self) -> int:
        return len(self._transfers)

    def close(self) -> None:
        """Cancel streams in flight and close every channel."""
        with self._lock:
            self._closed = True
            transfers, self._transfers = self._transfers, {}
            channels, self._channels = self._channels, {}
            self._handshakes.clear()
        for transfer in transfers.values():
            self._cancel(transfer)
        for channel, _ in channels.values():
            channel.close()
