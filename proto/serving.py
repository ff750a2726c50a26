"""Starting a gRPC server on host:port, shared by the router and the workers, with the standard
`grpc.health.v1.Health` and server reflection services on it."""

from __future__ import annotations

from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

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


@dataclass
class HealthReporter:
    """The health status a server reports for "" (the whole server) and each of its services."""

    servicer: health.HealthServicer
    services: tuple[str, ...]

    def serving(self) -> None:
        for name in ("", *self.services):
            self.servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    def stopping(self) -> None:
        """NOT_SERVING for every service, for good (later `serving()` calls are ignored)."""
        self.servicer.enter_graceful_shutdown()


def add_health_and_reflection(server: grpc.Server, service_full_names: list[str]) -> HealthReporter:
    """Add `grpc.health.v1.Health` (every service NOT_SERVING until `serving()`) and reflection
    listing `service_full_names` (e.g. "pdcluster.v1.PDCluster"), health and reflection itself."""
    servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = tuple(service_full_names)
    for name in ("", *names):
        servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return HealthReporter(servicer, names)
