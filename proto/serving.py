"""Starting a gRPC server on host:port, shared by the router and the workers, with the standard
`grpc.health.v1.Health` and server reflection services on it; registering a servicer so that a request
whose bytes do not parse reaches its handler as `Malformed` (answered INVALID_ARGUMENT) instead of
failing inside gRPC with INTERNAL; handlers whose log lines carry their request's id."""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.logs import request_context

Handler = TypeVar("Handler", bound=Callable[..., Any])

MESSAGE_LIMIT_OPTIONS = [
    ("grpc.max_send_message_length", 512 * 2**20),
    ("grpc.max_receive_message_length", 512 * 2**20),
]


def bind_server(host: str, port: int, max_workers: int, what: str, max_message_bytes: int | None = None,
                interceptors: list[grpc.ServerInterceptor] | None = None,
                tls: tuple[bytes, bytes] | None = None) -> tuple[grpc.Server, str]:
    """A not-yet-started server bound to host:port (0: a free port) and its "host:port" address.
    Message limits are raised for KV layers, unless `max_message_bytes` caps them (a public API);
    `interceptors` run on every call (the cluster secret); `tls` = (certificate chain, private key),
    PEM bytes, serves TLS instead of plaintext. Raises RuntimeError naming `what` if the port is taken."""
    options = MESSAGE_LIMIT_OPTIONS if max_message_bytes is None else [
        ("grpc.max_send_message_length", max_message_bytes), ("grpc.max_receive_message_length", max_message_bytes)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=options,
                         interceptors=interceptors or None)
    if tls is not None:
        bound = server.add_secure_port(f"{host}:{port}", grpc.ssl_server_credentials([(tls[1], tls[0])]))
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"{what} cannot bind {host}:{port} (port in use?)")
    return server, f"{host}:{bound}"


def read_tls(cert: str | None, key: str | None) -> tuple[bytes, bytes] | None:
    """(certificate chain, private key) PEM bytes from their files; None when neither is given.
    Raises ValueError naming the file that is missing or unreadable, or when only one is given."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise ValueError("TLS needs both a certificate (tls_cert) and its private key (tls_key)")
    out = []
    for what, path in (("tls_cert", cert), ("tls_key", key)):
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise ValueError(f"{what}: cannot read {path}: {e.strerror}") from None
        if b"-----BEGIN" not in data:
            raise ValueError(f"{what}: {path} is not a PEM file")
        out.append(data)
    return out[0], out[1]


def in_request_context(handler: Handler) -> Handler:
    """A unary handler (servicer method) whose log lines carry its request's `request_id`."""

    @functools.wraps(handler)
    def wrapped(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        with request_context(request.request_id):
            return handler(self, request, context)

    return wrapped  # type: ignore[return-value]


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


@dataclass(frozen=True)
class Malformed:
    """What a handler registered by `add_servicer` receives for bytes that are not its request message."""

    message_type: str  # e.g. "pdcluster.v1.GenerateRequest"
    error: str

    def describe(self) -> str:
        return f"request: the bytes are not a valid {self.message_type} ({self.error})"


def _lenient(cls: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except Exception as e:  # DecodeError, invalid UTF-8 in a string field, ...
            return Malformed(cls.DESCRIPTOR.full_name, str(e) or type(e).__name__)

    return parse


_HANDLERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_servicer(server: grpc.Server, servicer: Any, service: Any, messages: ModuleType) -> None:
    """Register `servicer` for `service` (a ServiceDescriptor whose messages are in the module
    `messages`) as the generated add_*Servicer_to_server would, except that requests are parsed
    leniently: bytes that do not parse reach the handler as a `Malformed`."""
    handlers = {}
    for m in service.methods:
        request, response = getattr(messages, m.input_type.name), getattr(messages, m.output_type.name)
        handlers[m.name] = _HANDLERS[(m.client_streaming, m.server_streaming)](
            getattr(servicer, m.name), request_deserializer=_lenient(request),
            response_serializer=response.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
