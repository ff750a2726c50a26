"""The cluster secret: every RPC inside the cluster (router -> workers, prefill -> decode KV transfers,
controller -> workers) carries it as gRPC metadata, and every worker server refuses an RPC without it.

    secret = generate_secret()                          # at `pdcluster up`; handed to each actor by Ray
    server = grpc.server(..., interceptors=[RequireSecret(secret)])
    channel = with_secret(grpc.insecure_channel(addr), secret)

A server built without a secret (None) checks nothing: that is how workers started by hand in one
process (the tests) run. The standard health service (`grpc.health.v1.Health`) stays open, for load
balancers and probes; it tells only SERVING or NOT_SERVING. The secret is compared in constant time.
It travels in clear text over the cluster's internal network (see the README's trust model).
"""

from __future__ import annotations

import hmac
import secrets
from collections import namedtuple
from typing import Any, Callable

import grpc

HEADER = "x-pdcluster-secret"
OPEN_METHODS = ("/grpc.health.v1.Health/",)


def generate_secret() -> str:
    """A new random cluster secret (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


class RequireSecret(grpc.ServerInterceptor):
    """Refuses with UNAUTHENTICATED any RPC (health checks aside) whose metadata lacks the secret."""

    def __init__(self, secret: str, what: str = "this worker") -> None:
        if not secret:
            raise ValueError("the cluster secret must not be empty")
        self._secret = secret.encode()
        self._what = what

    def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        if details.method.startswith(OPEN_METHODS):
            return continuation(details)
        got = next((v for k, v in details.invocation_metadata or () if k == HEADER), "")
        if isinstance(got, str) and hmac.compare_digest(got.encode(), self._secret):
            return continuation(details)
        handler = continuation(details)
        if handler is None:  # an unknown method: gRPC answers UNIMPLEMENTED
            return None
        return _refusal(handler, f"{details.method} on {self._what} needs the cluster secret "
                                 f"(metadata {HEADER}); missing or wrong")


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    def streaming(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover

    kind = (handler.request_streaming, handler.response_streaming)
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[kind]
    # the request is never read: no deserializer, so not even a parse happens for an outsider
    return make(streaming if kind[1] else unary, request_deserializer=None,
                response_serializer=handler.response_serializer)


class _Details(namedtuple("_Details", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                                       "compression")), grpc.ClientCallDetails):
    pass


class CarrySecret(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                  grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the secret to the metadata of every call on a channel."""

    def __init__(self, secret: str) -> None:
        self._pair = (HEADER, secret)

    def _details(self, d: grpc.ClientCallDetails) -> _Details:
        metadata = [*(d.metadata or ()), self._pair]
        return _Details(d.method, d.timeout, metadata, d.credentials, getattr(d, "wait_for_ready", None),
                        getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


def with_secret(channel: grpc.Channel, secret: str | None) -> grpc.Channel:
    """`channel`, carrying `secret` on every call (unchanged when there is no secret)."""
    return grpc.intercept_channel(channel, CarrySecret(secret)) if secret else channel


def server_interceptors(secret: str | None, what: str) -> list[grpc.ServerInterceptor]:
    return [RequireSecret(secret, what)] if secret else []
