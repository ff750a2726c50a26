"""Python client of a running cluster's public gRPC API."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import grpc

from engine.sampling_params import SamplingParams
from proto import generate_pb2 as gen
from proto import generate_pb2_grpc as gen_grpc
from proto.convert import sampling_to_proto

DEFAULT_ADDRESS = "127.0.0.1:50051"


@dataclass
class Completion:
    request_id: str
    index: int = 0  # which choice (SamplingParams.n / best_of)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timing: dict[str, float] = field(default_factory=dict)


class Client:
    """`Client("127.0.0.1:50051").complete("Hello", max_tokens=16)`; `.stream(...)` yields chunks."""

    def __init__(self, address: str = DEFAULT_ADDRESS, api_key: str | None = None, timeout_s: float = 600.0,
                 tls_ca: str | None = None) -> None:
        """`tls_ca`: a PEM file of the certificate(s) to trust; given, the channel is TLS (the router's
        `router.tls_cert`); else plaintext."""
        self.address = address
        self.timeout_s = timeout_s
        self._metadata = [("x-api-key", api_key)] if api_key else None
        if tls_ca is not None:
            with open(tls_ca, "rb") as f:
                creds = grpc.ssl_channel_credentials(root_certificates=f.read())
            self._channel = grpc.secure_channel(address, creds)
        else:
            self._channel = grpc.insecure_channel(address)
        self._stub = gen_grpc.PDClusterStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None) -> gen.GenerateRequest:
        req = gen.GenerateRequest(sampling=sampling_to_proto(params))
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
        if request_id:
            req.request_id = request_id
        return req

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None,
               request_id: str | None = None, **kwargs: object) -> Iterator[gen.GenerateResponse]:
        """Server-streamed chunks; the last one has finish_reason, usage and timing.
        Keyword arguments build SamplingParams (max_tokens=..., temperature=...)."""
        params = params or SamplingParams(**kwargs)  # type: ignore[arg-type]
        call = self._stub.Generate(self._request(prompt, params, request_id), timeout=self.timeout_s,
                                   metadata=self._metadata)
        try:
            yield from call
        finally:
            call.cancel()  # no-op when finished; frees the request's blocks if the caller stops early

    def complete(self, prompt: str | list[int], params: SamplingParams | None = None,
                 request_id: str | None = None, **kwargs: object) -> Completion:
        """The answer (its first choice: see `complete_choices` for n > 1)."""
        return self.complete_choices(prompt, params, request_id, **kwargs)[0]

    def complete_choices(self, prompt: str | list[int], params: SamplingParams | None = None,
                         request_id: str | None = None, **kwargs: object) -> list[Completion]:
        """Every choice of the answer (SamplingParams.n), by index."""
        outs: dict[int, Completion] = {}
        for chunk in self.stream(prompt, params, request_id, **kwargs):
            out = outs.setdefault(chunk.index, Completion(chunk.request_id, chunk.index))
            out.token_ids.extend(chunk.token_ids)
            out.text += chunk.text
            if chunk.finish_reason:
                out.finish_reason = chunk.finish_reason
                out.prompt_tokens = chunk.usage.prompt_tokens
                out.completion_tokens = chunk.usage.completion_tokens
                out.timing = {f.name: v for f, v in chunk.timing.ListFields()}
        return [outs[k] for k in sorted(outs)] or [Completion(request_id or "")]

    def abort(self, request_id: str) -> bool:
        return self._stub.Abort(gen.AbortRequest(request_id=request_id), timeout=10,
                                metadata=self._metadata).found
