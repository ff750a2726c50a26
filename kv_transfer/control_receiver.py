"""The receiving half of the control plane: a decode worker's `KVReceiver` gRPC service.

Refusals are gRPC status codes whose details carry the reason:

    NOT_FOUND            unknown transfer id (never reserved, already committed or aborted)
    PERMISSION_DENIED    bad auth token for the transfer
    DATA_LOSS            the bytes do not match the message's checksum (corrupted in transit)
    INVALID_ARGUMENT     layer out of range, wrong shape / dtype / payload size, unsupported
                         compression or split layer
    FAILED_PRECONDITION  commit before all layers arrived
    UNAVAILABLE          the receiver was closed (or a data plane's connection died)
    INTERNAL             the sink failed unexpectedly

SendLayers holds a server thread for as long as its stream is open (a prefill forward pass): a
server shared with other long-lived RPCs needs enough workers for the transfers in flight.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
import torch

from kv_transfer.base import KVReceiver, KVSink, KVTransferError, TransferTicket, sink_heads
from kv_transfer.checksum import checksum
from kv_transfer.compression import dequantize_int8
from kv_transfer.planes import ReceivePlane
from kv_transfer.wire import MESSAGE_OPTIONS, WIRE_DTYPES, check_digest, status_for, wire_dtype
from proto import kv_transfer_pb2, kv_transfer_pb2_grpc
from proto.convert import logprob_from_proto


def sink_dtype(sink: KVSink) -> torch.dtype | None:
    """The dtype a sink's KV cache holds (its `kv_dtype`, or a DecodeEngine's `engine.runner.cache_dtype`:
    the model's, or bytes for quantized pages), or None: then any wire dtype of the right size is
    accepted (the compatibility hash pins it)."""
    dtype = getattr(sink, "kv_dtype", None)
    if dtype is None:
        dtype = getattr(getattr(getattr(sink, "engine", None), "runner", None), "cache_dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def sink_device(sink: KVSink) -> torch.device:
    """Where a sink's KV cache lives (a DecodeEngine's runner caches, or a sink's `cache` tensor)."""
    caches = getattr(getattr(getattr(sink, "engine", None), "runner", None), "kv_caches", None)
    if caches:
        return caches[0].device
    cache = getattr(sink, "cache", None)
    return cache.device if isinstance(cache, torch.Tensor) else torch.device("cpu")


class _Servicer(kv_transfer_pb2_grpc.KVReceiverServicer):
    def __init__(self, receiver: ControlReceiver) -> None:
        self.r = receiver

    def _check_open(self, context: grpc.ServicerContext) -> None:
        if self.r.closed:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"KV receiver at {self.r.endpoint} is closed")

    def Handshake(self, request, context):
        self._check_open(context)
        try:
            self.r.check_compat(request.compat_hash)
        except KVTransferError as e:
            return kv_transfer_pb2.HandshakeResponse(ok=False, reason=str(e), compat_hash=self.r.sink.compat_hash)
        first, heads = sink_heads(self.r.sink)
        return kv_transfer_pb2.HandshakeResponse(
            ok=True, compat_hash=self.r.sink.compat_hash, first_kv_head=first, kv_heads=heads,
            **self.r.handshake_fields(request)
        )

    @staticmethod
    def _run(context: grpc.ServicerContext, what: str, step: Callable[[], None]) -> None:
        """Run `step`; a refusal aborts the RPC with its status, a sink failure with INTERNAL."""
        try:
            step()
        except KVTransferError as e:
            context.abort(status_for(e), str(e))
        except Exception as e:
            context.abort(grpc.StatusCode.INTERNAL, f"{what}: {e!r}")

    def SendLayers(self, request_iterator, context):
        self._check_open(context)
        received: set[tuple[str, int]] = set()
        for msg in request_iterator:
            self._check_open(context)
            self._run(context, f"layer {msg.layer} of {msg.transfer_id!r}", lambda m=msg: self.r.receive_layer(m))
            received.add((msg.transfer_id, msg.layer))
        return kv_transfer_pb2.KVAck(ok=True, layers_received=len(received))

    def Commit(self, request, context):
        self._check_open(context)
        lp = logprob_from_proto(request.first_token_logprob) if request.HasField("first_token_logprob") else None

        def commit() -> None:
            for msg in request.layers:  # layers whose messages rode in the commit: checked first
                self.r.receive_layer(msg)
            self.r._on_commit(request.transfer_id, request.auth_token, request.first_token, lp)

        self._run(context, f"commit of {request.transfer_id!r}", commit)
        return kv_transfer_pb2.KVAck(ok=True, layers_received=self.r.sink.num_layers)

    def Abort(self, request, context):
        self._check_open(context)
        self._run(context, f"abort of {request.transfer_id!r}",
                  lambda: self.r._on_abort(request.transfer_id, request.auth_token, request.reason))
        return kv_transfer_pb2.KVAck(ok=True)


class ControlReceiver(KVReceiver):
    """Serves `KVReceiver` for a sink, taking inline layers and those of its `PLANES`. On the caller's
    `server` (which it owns; `close()` then only refuses with UNAVAILABLE) senders dial `endpoint`;
    without one it starts its own on host:port (0: any free port) and stops it on `close()`. Other
    keyword arguments go to the planes that name them."""

    PLANES: tuple[type[ReceivePlane], ...] = ()

    def __init__(self, sink: KVSink, server: grpc.Server | None = None, endpoint: str | None = None, *,
                 host: str = "127.0.0.1", port: int = 0, max_workers: int = 16, **options: Any) -> None:
        known = {name for plane in self.PLANES for name in inspect.signature(plane).parameters}
        if set(options) - known:
            raise TypeError(f"{type(self).__name__} got unexpected keyword arguments {sorted(set(options) - known)}")
        super().__init__(sink)
        self.closed = False
        self._dtype = sink_dtype(sink)
        self._own_server = server is None
        self._executor: futures.ThreadPoolExecutor | None = None
        self.planes: dict[str, ReceivePlane] = {}
        if server is None:
            self._executor = futures.ThreadPoolExecutor(max_workers, thread_name_prefix="kv-receiver")
            server = grpc.server(self._executor, options=MESSAGE_OPTIONS)
            try:
                bound = server.add_insecure_port(f"{host}:{port}")
            except RuntimeError:  # grpc raises where older versions returned 0
                bound = 0
            if bound == 0:
                self._executor.shutdown(wait=False)
                raise KVTransferError(f"could not bind a KV receiver to {host}:{port}")
            endpoint = f"{host}:{bound}"
        elif not endpoint:
            raise ValueError(f"{type(self).__name__} on a caller's server needs its endpoint ('host:port')")
        self.server, self._endpoint = server, endpoint
        try:
            for plane in self.PLANES:
                names = inspect.signature(plane).parameters
                self.planes[plane.name] = plane(self, **{k: v for k, v in options.items() if k in names})
        except BaseException:
            self.close()
            raise
        kv_transfer_pb2_grpc.add_KVReceiverServicer_to_server(_Servicer(self), server)
        if self._own_server:
            server.start()

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def handshake_fields(self, request: kv_transfer_pb2.HandshakeRequest) -> dict[str, Any]:
        """The planes' fields for an accepted handshake's response."""
        fields: dict[str, Any] = {}
        for plane in self.planes.values():
            fields.update(plane.handshake_fields(request))
        return fields

    def _granted(self, ticket: TransferTicket) -> None:
        for plane in self.planes.values():
            plane.granted(ticket)

    def _revoked(self, ticket: TransferTicket) -> None:
        for plane in self.planes.values():
            plane.revoked(ticket)

    def receive_layer(self, msg: kv_transfer_pb2.KVLayer) -> None:
        """Check one `KVLayer` (its bytes inline, or on the plane that claims it) and hand it to the shared checks."""
        for plane in self.planes.values():
            if plane.claims(msg):
                return plane.receive(msg)
        self._on_layer(msg.transfer_id, msg.auth_token, msg.layer, self.decode_layer(msg), msg.first_block)

    def decode_layer(self, msg: kv_transfer_pb2.KVLayer) -> torch.Tensor:
        """Check an inline `KVLayer`'s framing (checksum, dtype, size) and view its payload as a tensor."""
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

    def check_dtype(self, msg: kv_transfer_pb2.KVLayer) -> torch.dtype:
        """The message's dtype, if it is a wire dtype and the sink's."""
        dtype = WIRE_DTYPES.get(msg.dtype)
        if dtype is None or (self._dtype is not None and dtype != self._dtype):
            want = wire_dtype(self._dtype) if self._dtype is not None else " or ".join(WIRE_DTYPES)
            raise KVTransferError(f"layer {msg.layer}: dtype {msg.dtype!r}, expected {want}")
        return dtype

    def check_layer(self, msg: kv_transfer_pb2.KVLayer, payload: Any) -> tuple[torch.dtype, tuple[int, ...]]:
        """Check a `KVLayer`'s framing against its bytes (a 1-D byte buffer); their dtype and shape."""
        int8 = msg.HasField("compression") and msg.compression == "int8"
        if msg.HasField("compression") and not int8:
            raise KVTransferError(f"layer {msg.layer}: compression {msg.compression!r} is not supported")
        if int8 and (msg.shm_name or msg.dist_pair or msg.tcp_conn):
            raise KVTransferError(f"layer {msg.layer}: int8 compression travels inline (grpc) only")
        check_digest(msg, "payload", checksum(payload, msg.scales) if int8 else checksum(payload))
        dtype = self.check_dtype(msg)
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
        """Refuse further messages; close the planes; stop the server if this receiver started it."""
        self.closed = True
        for plane in self.planes.values():
            plane.close()
        if self._own_server and self._executor is not None:
            self.server.stop(grace=None).wait()
            self._executor.shutdown(wait=True)
            self._executor = None


class GrpcReceiver(ControlReceiver):
    """The grpc backend's receiver: inline layers only."""
