"""The sending half of the control plane (proto/kv_transfer.proto): a handshake per endpoint, one
SendLayers stream per transfer fed from a queue (`send_layer` never waits on the network), then
Commit or Abort. Every RPC has a deadline; every failure is a `KVTransferError` naming the RPC,
the endpoint, the status and the receiver's reason.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import torch

from engine.config import KV_LAYOUT_VERSION
from engine.sequence import TokenLogprobs
from kv_transfer.base import KVSender, KVTransferError, TransferTicket
from kv_transfer.planes import InlineSendPlane, Int8, SendPlane, inline_fields
from kv_transfer.streams import END, Handshake, Stream, Transfer, split_layer
from kv_transfer.wire import CHANNEL_OPTIONS, WIRE_DTYPES, rpc_error, target, wire_dtype
from proto import kv_transfer_pb2, kv_transfer_pb2_grpc
from proto.convert import logprob_to_proto


class ControlSender(KVSender):
    """Pushes layers to `ControlReceiver`s over `PLANE`; thread-safe. A handshake's refusal is cached
    per endpoint, a network failure retried by the next transfer. `timeout_s` bounds every RPC (a
    stream from its first layer until acknowledged); `options` go to the plane."""

    PLANE: type[SendPlane] = InlineSendPlane
    _ids = itertools.count()

    def __init__(self, compat_hash: str, timeout_s: float = 30.0, sender_id: str | None = None,
                 **options: Any) -> None:
        super().__init__(compat_hash)
        self.timeout_s = timeout_s
        self.sender_id = sender_id or f"prefill-{os.getpid()}-{next(self._ids)}"
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[grpc.Channel, kv_transfer_pb2_grpc.KVReceiverStub]] = {}
        self._handshakes: dict[str, Handshake] = {}
        self._transfers: dict[str, Transfer] = {}
        self._interceptors: list[Any] = []
        self._closed = False
        self.plane = self.PLANE(self, **options)

    @property
    def closed(self) -> bool:
        return self._closed

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
            channel = grpc.insecure_channel(target(endpoint), options=CHANNEL_OPTIONS)
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

    def _handshake(self, endpoint: str) -> Handshake:
        """Under self._lock: the endpoint's handshake, started (not awaited) on first use."""
        hs = self._handshakes.get(endpoint)
        if hs is not None and hs.error is None and hs.future.done():
            if hs.future.cancelled() or hs.future.exception() is not None:
                hs = None  # failed on the network, not refused: try again
        if hs is None:
            request = kv_transfer_pb2.HandshakeRequest(compat_hash=self.compat_hash, layout_version=KV_LAYOUT_VERSION,
                                                       sender_id=self.sender_id)
            self.plane.handshake_request(request)
            hs = Handshake(self._stub(endpoint).Handshake.future(request, timeout=self.timeout_s))
            self._handshakes[endpoint] = hs
        return hs

    @staticmethod
    def _response(hs: Handshake | None) -> kv_transfer_pb2.HandshakeResponse | None:
        f = hs.future if hs is not None else None
        if f is None or not f.done() or f.cancelled() or f.exception() is not None:
            return None
        return f.result()

    def accepted(self, endpoint: str) -> kv_transfer_pb2.HandshakeResponse | None:
        """The response of the endpoint's current handshake once it completed (never waits)."""
        with self._lock:
            return self._response(self._handshakes.get(endpoint))

    def _forget_handshake(self, endpoint: str,
                          made: Callable[[kv_transfer_pb2.HandshakeResponse], bool] | None = None) -> None:
        """Drop the endpoint's accepted handshake (the next layer handshakes anew); with `made`, only
        if its response is the one that made the channel being dropped (a newer one stays)."""
        with self._lock:
            hs = self._handshakes.get(endpoint)
            if hs is None or hs.error is not None:
                return  # none, or a refusal (kept: the layout still differs)
            if made is None or ((response := self._response(hs)) is not None and made(response)):
                del self._handshakes[endpoint]

    def _raise_if_refused(self, endpoint: str) -> None:
        """Raise the endpoint's cached refusal, or that this sender is closed (before a data plane
        stages a layer's bytes outside the message: segment, device copy, buffer)."""
        with self._lock:
            hs = self._handshakes.get(endpoint)
            if hs is not None and hs.error is not None:
                raise KVTransferError(hs.error)
            if self._closed:
                raise KVTransferError("KV sender is closed")

    def _await_handshake(self, endpoint: str, hs: Handshake, timeout: float) -> None:
        """Raise KVTransferError unless the endpoint accepted our layout (and suits the plane)."""
        if hs.error is not None:
            raise KVTransferError(hs.error)
        try:
            response = hs.future.result(timeout=max(timeout, 0.0))
        except BaseException as e:
            if isinstance(e, grpc.FutureTimeoutError) and not hs.future.done():
                raise rpc_error("handshake", endpoint, e) from None
            with self._lock:  # a network failure: the next transfer tries again
                if self._handshakes.get(endpoint) is hs:
                    del self._handshakes[endpoint]
            raise rpc_error("handshake", endpoint, e) from None
        if not response.ok:
            hs.error = f"KV receiver at {endpoint} refused the handshake: {response.reason}"
            raise KVTransferError(hs.error)
        problem = self.plane.accept(endpoint, response)
        if problem is not None:
            hs.error = problem
            raise KVTransferError(hs.error)

    # ------------------------------------------------------------------ streaming
    def _requests(self, endpoint: str, hs: Handshake, stream: Stream,
                  ticket: TransferTicket) -> Iterator[kv_transfer_pb2.KVLayer]:
        """Runs on gRPC's request thread: wait for the handshake, then send what the queue yields."""
        try:
            self._await_handshake(endpoint, hs, self.timeout_s)
        except KVTransferError as e:
            stream.error = str(e)
            return  # an empty stream: nothing reaches the receiver
        while True:
            item = stream.requests.get()
            if item is END:
                return
            yield self._layer_message(ticket, *item)

    def _payload(self, ticket: TransferTicket, layer: int, kv: torch.Tensor) -> Any:
        """On the caller's thread: what a layer's bytes travel as (staged by the plane)."""
        if self.plane.out_of_band:
            self._raise_if_refused(ticket.kv_endpoint)  # stage nothing for an endpoint already refused
            if kv.numel() == 0:
                return b""  # nothing to move: an empty inline payload
        return self.plane.stage(ticket, layer, kv)

    def _layer_message(
        self, ticket: TransferTicket, layer: int, dtype: str, shape: list[int], payload: Any, first_block: int = 0
    ) -> kv_transfer_pb2.KVLayer:
        """On the stream's request thread (or the commit's): the `KVLayer` for a queued layer."""
        fields = (inline_fields(payload) if isinstance(payload, (bytes, Int8))
                  else self.plane.fields(ticket, payload))
        return kv_transfer_pb2.KVLayer(transfer_id=ticket.transfer_id, auth_token=ticket.auth_token, layer=layer,
                                       dtype=dtype, shape=shape, first_block=first_block, **fields)

    def send_layer(self, ticket: TransferTicket, layer: int, kv: torch.Tensor) -> None:
        """Queue one layer; raises at once only for what is already known (an incompatible ticket, a
        refused handshake, an earlier failure of this transfer's stream), else in `flush` / `commit`."""
        self.check_ticket(ticket)
        endpoint = ticket.kv_endpoint
        dtype = wire_dtype(kv.dtype)
        if dtype not in WIRE_DTYPES:
            raise KVTransferError(f"layer {layer}: cannot send KV of dtype {kv.dtype}")
        parts = [(first, list(part.shape), self._payload(ticket, layer, part))
                 for first, part in split_layer(kv, self.plane.max_message_bytes)]
        with self._lock:
            hs = self._handshake(endpoint)
            if hs.error is not None:
                raise KVTransferError(hs.error)
            transfer = self._transfers.get(ticket.transfer_id)
            if transfer is None:
                transfer = self._transfers[ticket.transfer_id] = Transfer(endpoint)
            for stream in transfer.streams:
                failure = stream.failure(endpoint)
                if failure is not None:
                    raise failure
            items = [(layer, dtype, shape, payload, first) for first, shape, payload in parts]
            transfer.deferred.extend(item for item in items if self.plane.deferred(item[3]))
            self._stream_out(ticket, hs, transfer, [item for item in items if not self.plane.deferred(item[3])])
            transfer.layers_sent.add(layer)
            nbytes = sum(len(p.q) + len(p.scales) if isinstance(p, Int8) else 0 for _, _, p in parts) or kv.nbytes
            self._count_sent(self.plane.name, nbytes)

    def _stream_out(self, ticket: TransferTicket, hs: Handshake, transfer: Transfer, items: list[tuple]) -> None:
        """Under self._lock: queue layer items on the transfer's open stream (opened if need be)."""
        if not items:
            return
        stream = transfer.open
        if stream is None:
            stream = transfer.open = Stream(queue.SimpleQueue())
            transfer.streams.append(stream)
            stream.future = self._stub(transfer.endpoint).SendLayers.future(
                self._requests(transfer.endpoint, hs, stream, ticket), timeout=self.timeout_s
            )
            # once the call is over (failed early, cancelled), the request iterator must not block
            stream.future.add_done_callback(lambda _f, q=stream.requests: q.put(END))
        for item in items:
            stream.requests.put(item)

    def _close_streams(self, endpoint: str) -> None:
        """Under self._lock: end the open streams to `endpoint`, other transfers' too: each holds a
        server thread, and a commit must not wait behind them (a later layer opens a new stream)."""
        for transfer in self._transfers.values():
            if transfer.endpoint == endpoint and transfer.open is not None:
                transfer.open.requests.put(END)
                transfer.open = None

    def flush(self, ticket: TransferTicket, timeout: float | None = None) -> int:
        """Wait until the receiver acknowledged every layer sent so far; returns how many it took."""
        timeout = self.timeout_s if timeout is None else timeout
        try:
            received = self._flush(ticket, timeout)
        except BaseException:
            self.plane.flushed(ticket, False, timeout)
            raise
        self.plane.flushed(ticket, True, timeout)
        return received

    def _flush(self, ticket: TransferTicket, timeout: float) -> int:
        deadline = time.monotonic() + timeout
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
                error = error or rpc_error("SendLayers", endpoint, e)
                continue
            except BaseException as e:
                error = error or stream.failure(endpoint) or rpc_error("SendLayers", endpoint, e)
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
        layers = 0
        try:
            layers = self._commit(ticket, first_token, logprob)
        finally:
            self.plane.finished(ticket, layers)

    def _commit(self, ticket: TransferTicket, first_token: int, logprob: TokenLogprobs | None) -> int:
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
                transfer.cancel()  # after a failure: no stream of it may linger
        request = kv_transfer_pb2.KVCommit(transfer_id=ticket.transfer_id, auth_token=ticket.auth_token,
                                           first_token=first_token, num_layers=num_layers)
        if logprob is not None:
            request.first_token_logprob.CopyFrom(logprob_to_proto(logprob))
        request.layers.extend(self._layer_message(ticket, *item) for item in held)
        self._call(stub.Commit, "Commit", endpoint, request)
        return num_layers

    def abort(self, ticket: TransferTicket, reason: str) -> None:
        """Cancel the transfer's streams and tell the receiver to free its blocks (bounded)."""
        try:
            with self._lock:
                transfer = self._transfers.pop(ticket.transfer_id, None)
                stub = self._stub(ticket.kv_endpoint)
            if transfer is not None:
                transfer.cancel()
            request = kv_transfer_pb2.KVAbort(transfer_id=ticket.transfer_id, auth_token=ticket.auth_token,
                                              reason=reason)
            self._call(stub.Abort, "Abort", ticket.kv_endpoint, request)
        finally:
            self.plane.finished(ticket, 0)

    def _call(self, rpc: Any, what: str, endpoint: str, request: Any) -> None:
        try:
            ack = rpc(request, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise rpc_error(what, endpoint, e) from None
        if not ack.ok:
            raise KVTransferError(f"{what} to {endpoint} refused: {ack.error}")

    @property
    def num_in_flight(self) -> int:
        return len(self._transfers)

    def in_flight(self, transfer_id: str) -> bool:
        """Whether the transfer is still open (neither committed nor failed). A data plane may ask
        under its own lock: this sender never takes a plane's lock while holding its own."""
        with self._lock:
            return transfer_id in self._transfers

    def close(self) -> None:
        """Cancel streams in flight, close every channel, then the plane's own resources."""
        with self._lock:
            self._closed = True
            transfers, self._transfers = self._transfers, {}
            channels, self._channels = self._channels, {}
            self._handshakes.clear()
        for transfer in transfers.values():
            transfer.cancel()
        for channel, _ in channels.values():
            channel.close()
        self.plane.close()


class GrpcSender(ControlSender):
    """The grpc backend: each layer's bytes ride in its KVLayer message (`compression="int8"`: quantized)."""

    PLANE = InlineSendPlane
