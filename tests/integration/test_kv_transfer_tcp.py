"""What is particular to the tcp KV transfer backend (bytes over an authenticated TCP data connection,
control over a real gRPC server on loopback, into a real DecodeEngine): only metadata crosses gRPC;
a connection without the handshake's token is closed before a byte is read; a connection dropped
inside a frame fails the transfer within the timeout and the abort frees its blocks; a frame that
never comes, or that nobody claims, is dropped in time; a restarted receiver is found again; the
cluster secret and fault injection apply; int8 compression is refused.

The conformance tests every backend passes are in tests/integration/test_kv_transfer_conformance.py.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import time
from concurrent import futures

import grpc
import pytest

from decode_worker import DecodeEngine
from kv_transfer import KVFaults, KVTransferError, create_sender
from kv_transfer.tcp_receiver import ACCEPTED, FRAME, HELLO, MAGIC
from kv_transfer.wire import MESSAGE_OPTIONS
from proto import kv_transfer_pb2, kv_transfer_pb2_grpc
from proto.cluster_auth import CarrySecret, generate_secret, server_interceptors
from tests.integration.kv_helpers import (
    PARAMS,
    cache_is_zero,
    clean,
    decode_engine,
    grpc_server,
    layer,
    port_is_closed,
    spy_on_messages,
)

pytestmark = pytest.mark.slow
TIMEOUT_S = 1.5  # the receiver's: frame waits, unclaimed frames


@pytest.fixture(autouse=True)
def no_leftovers():
    with clean("tcp"):
        yield


@contextlib.contextmanager
def tcp_decode(checkpoint, srv, endpoint):
    d = DecodeEngine(decode_engine(checkpoint), backend="tcp", server=srv, endpoint=endpoint, timeout_s=TIMEOUT_S)
    srv.start()
    try:
        yield d
    finally:
        d.close()
        assert not d.receiver.planes["tcp"].connections and d.receiver.planes["tcp"].buffered_bytes == 0
        assert port_is_closed(d.receiver.planes["tcp"].data_port)


@pytest.fixture
def decode(checkpoint):
    with grpc_server() as (srv, endpoint), tcp_decode(checkpoint, srv, endpoint) as d:
        yield d


@pytest.fixture
def sender(decode):
    s = create_sender("tcp", decode.compat_hash, timeout_s=5.0)
    yield s
    s.close()
    assert not s.plane.links


def _send_all(decode, sender, ticket, seed=0):
    layers = [layer(decode, ticket, seed=seed + i) for i in range(decode.num_layers)]
    for i, kv in enumerate(layers):
        sender.send_layer(ticket, i, kv)
    sender.commit(ticket, 7, None)
    cache = decode.engine.kv_caches
    assert all((cache[i][:, ticket.block_ids] == kv).all() for i, kv in enumerate(layers))


def _handshake(decode) -> kv_transfer_pb2.HandshakeResponse:
    with grpc.insecure_channel(decode.receiver.endpoint, options=MESSAGE_OPTIONS) as channel:
        stub = kv_transfer_pb2_grpc.KVReceiverStub(channel)
        return stub.Handshake(kv_transfer_pb2.HandshakeRequest(compat_hash=decode.compat_hash, tcp=True,
                                                               sender_id="probe"), timeout=5)


def _hello(port: int, conn_id: bytes, token: bytes) -> bytes:
    """Say hello on a new data connection, then push a frame; what the receiver answered."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(HELLO.pack(MAGIC, conn_id, token))
        try:
            s.sendall(FRAME.pack(0, 1 << 16) + b"\x55" * (1 << 16))
        except OSError:
            pass  # closed already
        return _answer(s)


def _answer(s: socket.socket) -> bytes:
    """The receiver's one-byte answer; b"" when it closed the connection (a reset: it left bytes unread)."""
    try:
        return s.recv(1)
    except ConnectionResetError:
        return b""


# ------------------------------------------------------------------------------------ tcp only
def test_only_metadata_crosses_grpc(decode, sender):
    seen = spy_on_messages(sender)
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    _send_all(decode, sender, ticket)
    assert len(seen) == decode.num_layers
    assert all(not m.payload and m.tcp_conn and m.checksum for m in seen)
    assert len({m.tcp_tag for m in seen}) == decode.num_layers
    assert sender.bytes_sent == {"tcp": decode.num_layers * layer(decode, ticket).nbytes}


def test_a_connection_without_the_token_is_closed_before_a_byte_is_read(decode):
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    response = _handshake(decode)
    assert response.ok and len(response.tcp_token) == 32
    assert response.tcp_port == decode.receiver.planes["tcp"].data_port
    conn_id = bytes.fromhex(response.tcp_conn)
    assert _hello(response.tcp_port, conn_id, secrets.token_bytes(32)) == b""  # a guessed token
    assert _hello(response.tcp_port, secrets.token_bytes(16), response.tcp_token) == b""  # another id
    with socket.create_connection(("127.0.0.1", response.tcp_port), timeout=5) as s:  # no hello at all
        s.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"\x00" * 100)
        assert _answer(s) == b""
    assert decode.receiver.planes["tcp"].buffered_bytes == 0
    assert cache_is_zero(decode) and decode.num_reserved == 1
    assert response.tcp_conn in decode.receiver.planes["tcp"].connections  # the real one is still to be made
    assert _hello(response.tcp_port, conn_id, response.tcp_token) == ACCEPTED
    assert _hello(response.tcp_port, conn_id, response.tcp_token) == b""  # an id takes one connection
    assert ticket.transfer_id in decode.receiver._pending


def test_a_connection_dropped_inside_a_frame_fails_the_transfer_in_time_and_abort_frees(decode, sender):
    bm = decode.engine.block_manager
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    sender.send_layer(ticket, 0, layer(decode, ticket))
    assert sender.flush(ticket) == 1

    def half_then_drop(link, tag, staged):  # half of the frame's bytes, then the connection is gone
        link.sock.sendall(FRAME.pack(tag, staged.nbytes) + b"".join(map(bytes, staged.views))[: staged.nbytes // 2])
        link.sock.shutdown(socket.SHUT_RDWR)

    sender.plane._queue_frame = half_then_drop
    start = time.monotonic()
    sender.send_layer(ticket, 1, layer(decode, ticket))
    with pytest.raises(KVTransferError, match="UNAVAILABLE: layer 1 .*data connection .* closed inside frame"):
        sender.flush(ticket)
    assert time.monotonic() - start < TIMEOUT_S + 1.0
    sender.abort(ticket, "data connection lost")
    assert bm.num_used_blocks == 0 and decode.num_reserved == 0
    assert decode.receiver.planes["tcp"].buffered_bytes == 0
    del sender.plane._queue_frame
    ticket2 = decode.reserve("r2", list(range(3, 40)), PARAMS)  # the next transfer connects anew
    _send_all(decode, sender, ticket2)
    assert len(decode.receiver.planes["tcp"].connections) == 1


def test_a_frame_that_never_comes_or_nobody_claims_is_dropped_in_time(decode, sender):
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    sender.plane._queue_frame = lambda link, tag, staged: None  # the metadata goes, the bytes never do
    sender.send_layer(ticket, 0, layer(decode, ticket))
    with pytest.raises(KVTransferError, match="DEADLINE_EXCEEDED: layer 0 .* did not arrive within"):
        sender.flush(ticket)
    del sender.plane._queue_frame
    (link,) = sender.plane._links.values()
    staged = sender._payload(ticket, 0, layer(decode, ticket))
    link.frames.put((10_000, staged))  # bytes that no KVLayer names
    deadline = time.monotonic() + 5.0
    while decode.receiver.planes["tcp"].buffered_bytes == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert decode.receiver.planes["tcp"].buffered_bytes > 0
    while decode.receiver.planes["tcp"].buffered_bytes and time.monotonic() < deadline:
        time.sleep(0.1)
    assert decode.receiver.planes["tcp"].buffered_bytes == 0 and cache_is_zero(decode)
    sender.abort(ticket, "done")
    assert decode.engine.block_manager.num_used_blocks == 0


def test_a_restarted_receiver_is_found_again(checkpoint):
    with grpc_server() as (srv, endpoint), tcp_decode(checkpoint, srv, endpoint) as decode:
        sender = create_sender("tcp", decode.compat_hash, timeout_s=5.0)
        try:
            _send_all(decode, sender, decode.reserve("r1", list(range(3, 40)), PARAMS))
            (first,) = sender.plane.links.values()
            decode.close()
            srv.stop(grace=None).wait()
            executor = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="test-restarted")
            srv2 = grpc.server(executor, options=MESSAGE_OPTIONS)
            assert srv2.add_insecure_port(endpoint) == int(endpoint.rsplit(":", 1)[1])
            try:
                with tcp_decode(checkpoint, srv2, endpoint) as again:
                    _send_all(again, sender, again.reserve("r2", list(range(3, 40)), PARAMS), seed=5)
                    assert list(sender.plane.links.values()) != [first]
                    assert len(again.receiver.planes["tcp"].connections) == 1
            finally:
                srv2.stop(grace=None).wait()
                executor.shutdown(wait=True)
        finally:
            sender.close()


def test_fault_injection_corrupt_is_caught_by_the_checksum(decode):
    sender = create_sender("tcp", decode.compat_hash, timeout_s=5.0, faults=KVFaults(corrupt=1.0, on=("layer",)))
    try:
        ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
        sender.send_layer(ticket, 0, layer(decode, ticket))
        with pytest.raises(KVTransferError, match="DATA_LOSS: checksum mismatch for layer 0"):
            sender.flush(ticket)
        assert cache_is_zero(decode) and sender.fault_injector.injected[("layer", "corrupt")] == 1
    finally:
        sender.close()


def test_the_cluster_secret_guards_the_handshake_and_so_the_data_port(checkpoint):
    secret = generate_secret()
    executor = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="test-secret")
    srv = grpc.server(executor, options=MESSAGE_OPTIONS, interceptors=server_interceptors(secret, "decode-0"))
    endpoint = f"127.0.0.1:{srv.add_insecure_port('127.0.0.1:0')}"
    try:
        with tcp_decode(checkpoint, srv, endpoint) as decode:
            stranger = create_sender("tcp", decode.compat_hash, timeout_s=5.0)
            member = create_sender("tcp", decode.compat_hash, timeout_s=5.0)
            member.add_channel_interceptor(CarrySecret(secret))
            try:
                with pytest.raises(KVTransferError, match="UNAUTHENTICATED"):
                    stranger.connect(endpoint)
                assert not decode.receiver.planes["tcp"].connections  # no token was handed out
                _send_all(decode, member, decode.reserve("r1", list(range(3, 40)), PARAMS))
            finally:
                stranger.close()
                member.close()
    finally:
        srv.stop(grace=None).wait()
        executor.shutdown(wait=True)


def test_int8_compression_is_refused():
    with pytest.raises(ValueError, match="grpc backend only"):
        create_sender("tcp", "hash", compression="int8")
