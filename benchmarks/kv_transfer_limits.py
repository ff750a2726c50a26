"""The machine's limits for moving a prompt's KV between two processes, the same bytes as a
transfer: plain TCP on loopback, grpc-python's own ceiling (a client stream of raw bytes) and an
in-process memcpy; with the receiving ends the receiving process runs for the first two."""

from __future__ import annotations

import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from benchmarks.kv_transfer_peer import Peer

RAW_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


def socket_time(layer: torch.Tensor, layers: int, peer: Peer) -> float:
    """Seconds to move `layers` copies of `layer`'s bytes over loopback TCP into the receiving
    process's preallocated buffer."""
    view = memoryview(layer.contiguous().view(-1).view(torch.uint8).numpy())
    port = peer.call("socket", total=len(view) * layers)["port"]
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(layers):
            c.sendall(view)
        c.recv(1)
    elapsed = time.perf_counter() - start
    peer.call("socket_done")
    return elapsed


def grpc_raw_time(layer: torch.Tensor, layers: int, port: int) -> float:
    """Seconds to client-stream `layers` copies of `layer`'s bytes (in <= 8 MiB messages) to the
    receiving process's counting handler: grpc-python's own ceiling, nothing of ours on the path."""
    import grpc

    data = layer.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    step = 8 << 20
    parts = [data[i : i + step] for i in range(0, len(data), step)] * layers
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=RAW_OPTIONS) as channel:
        call = channel.stream_unary("/pdcluster.bench.Raw/Count")
        start = time.perf_counter()
        got = int.from_bytes(call(iter(parts), timeout=600), "little")
        elapsed = time.perf_counter() - start
    if got != len(data) * layers:
        raise RuntimeError(f"grpc-raw: {got} bytes arrived of {len(data) * layers}")
    return elapsed


def grpc_raw_sink() -> Any:
    """Receiving process: a gRPC server whose one method counts the bytes of a client stream."""
    from concurrent import futures

    import grpc

    def count(messages: Any, context: Any) -> bytes:
        return sum(len(m) for m in messages).to_bytes(8, "little")

    server = grpc.server(futures.ThreadPoolExecutor(2), options=RAW_OPTIONS)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "pdcluster.bench.Raw", {"Count": grpc.stream_unary_rpc_method_handler(count)})])
    server.port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server


def socket_sink(total: int) -> tuple[socket.socket, threading.Thread]:
    """Receiving process: a listening socket and a thread that takes `total` bytes, then acks."""
    sink = bytearray(total)
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            buf, got = memoryview(sink), 0
            while got < total:
                n = conn.recv_into(buf[got:], total - got)
                if n == 0:
                    break
                got += n
            conn.sendall(b"\x01")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, t


def memcpy_time(layer: torch.Tensor, layers: int) -> float:
    dst = [torch.zeros_like(layer) for _ in range(layers)]  # touched: no page faults in the timing
    start = time.perf_counter()
    for d in dst:
        d.copy_(layer)
    return time.perf_counter() - start
