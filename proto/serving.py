"""Starting a gRPC server on host:port, shared by the router and the workers."""

from __future__ import annotations

from concurrent import futures

import grpc

MESSAGE_LIMIT_OPTIONS = [
    ("grpc.max_send_message_length", 512 * 2**20),
    ("grpc.max_receive_message_length", 512 * 2**20),
]


def bind_server(host: str, port: int, max_workers: int, what: str) -> tuple[grpc.Server, str]:
    """A not-yet-started server bound to host:port (0: a free port) and its "host:port" address.
    Message limits are raised for KV layers. Raises RuntimeError naming `what` if the port is taken."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=MESSAGE_LIMIT_OPTIONS)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"{what} cannot bind {host}:{port} (port in use?)")
    return server, f"{host}:{bound}"
