"""The OpenAI-compatible HTTP API: FastAPI on uvicorn, in front of the router's own gRPC service.

Every generation goes to the router's `PDCluster.Generate` handler (router/server.py), which stays
the one place for validation, API keys, cancellation and orchestration: in the same process when
the API is given the router (`router=`: router/local_call.py runs the handler there, no loopback
gRPC hop; how `pdcluster up` and LocalCluster serve it), else over a loopback grpc.aio channel; this module serves the routes and translates: router/openai_protocol.py reads
requests, router/openai_responses.py shapes answers, router/http_stream.py relays a generation.

    POST /v1/completions, /v1/chat/completions   (stream: true -> server-sent events)
    GET  /v1/models, /v1/models/{model}          the served model
    POST /tokenize, /detokenize                  vLLM's shape (router/openai_tokenize.py)
    GET  /health                                 200 {"status": "ok"} / 503 with the reason
    GET  /metrics                                the router's metrics (`metrics=`, e.g. router_metrics(server))

A client that goes away (mid-stream, or while a non-streaming answer is being generated) cancels
the gRPC call, which makes the router abort the request on its workers and free its KV blocks.
`HttpApi.start()` serves from a background thread with its own event loop; `stop()` is bounded.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from proto import generate_pb2_grpc as gen_grpc
from router.http_choices import ChoiceRun, collect_all
from router.http_stream import ClientGone, events, unless_disconnected
from router.local_call import LocalStub
from router.openai_choices import usage
from router.openai_protocol import ApiError, bad, chat_messages, parse_chat, parse_completion
from router.openai_responses import LogprobFormatter, response_of
from router.openai_tokenize import detokenize, tokenize

log = logging.getLogger("pdcluster.http")
MAX_BODY_BYTES = 8 << 20  # the router's gRPC API takes at most 8 MiB per request too
Readiness = Callable[[], "str | None"]  # None: ready; else why not


def router_readiness(server: Any) -> Readiness:
    """/health's check for an in-process RouterServer: a healthy worker of each role its mode needs."""

    def check() -> str | None:
        roles = ("colocated",) if server.mode == "colocated" else ("prefill", "decode")
        missing = [r for r in roles if not any(w.healthy for w in server.pool.workers(r))]
        return f"no healthy {' or '.join(missing)} worker registered" if missing else None

    return check


def router_metrics(server: Any) -> Callable[[], tuple[bytes, str]]:
    """/metrics for an in-process RouterServer: its own registry in Prometheus text format."""
    from router.metrics import render

    return lambda: render(server.metrics.registry)


class HttpApi:
    def __init__(self, router_grpc_address: str, model_name: str, tokenizer: Any = None,
                 host: str = "127.0.0.1", port: int = 0, api_keys: list[str] | None = None,
                 request_timeout_s: float = 600.0, readiness: Readiness | None = None,
                 metrics: Callable[[], tuple[bytes, str]] | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, max_model_len: int | None = None, router: Any = None) -> None:
        """`tokenizer`: a Hugging Face tokenizer, or a checkpoint path / "builtin:NAME" to load one from
        (used for chat templates and logprob token strings). `api_keys`: empty = no authentication
        here (the router still checks its own keys: the caller's key is forwarded). `tls_cert` /
        `tls_key`: PEM files; with both, HTTPS only. `router`: the in-process RouterServer whose
        Generate handler serves the generations directly (router/local_call.py)."""
        if isinstance(tokenizer, (str, Path)):
            from engine.builtin_model import resolve_model_path
            from engine.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(resolve_model_path(str(tokenizer)))
        self.router_address, self.model_name, self.tokenizer = router_grpc_address, model_name, tokenizer
        self.host, self.port = host, port
        self.tls_cert, self.tls_key = tls_cert, tls_key
        self.api_keys = set(api_keys or [])
        self.request_timeout_s = request_timeout_s
        self.readiness = readiness
        self.max_model_len = max_model_len  # reported by /tokenize
        self.metrics = metrics  # () -> (body, content type) for /metrics; None: 404
        self.router = router
        self.created = int(time.time())
        self._bos = _template_bos(tokenizer)
        self._token_text = functools.lru_cache(maxsize=65536)(self._decode_token)
        self._stub: Any = None
        self._channel: grpc.aio.Channel | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.app = self._build_app()

    # ------------------------------------------------------------------ lifecycle
    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        """Serve in a background thread; `port=0` picks a free port (see `address`)."""
        import uvicorn

        family = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise RuntimeError(f"HTTP API cannot bind {self.host}:{self.port} ({e.strerror}; port in use?)"
                               ) from None
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_config=None, log_level="warning", access_log=False,
                                lifespan="on", loop="asyncio", http="h11", timeout_graceful_shutdown=2,
                                ssl_certfile=self.tls_cert, ssl_keyfile=self.tls_key)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=lambda: asyncio.run(self._server.serve(sockets=[sock])),
                                        name="http-api", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"HTTP API did not start on {self.address}")
            time.sleep(0.02)
        log.info("OpenAI API at http://%s/v1", self.address)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving (bounded): open connections get 2 s to finish, then are cancelled, which cancels
        their gRPC calls (the router aborts those requests)."""
        if self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("HTTP API thread did not stop within %.0fs", 2 * timeout_s)
        self._thread = None

    @asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        # bound to this thread's loop; takes what the router may send (a first message with prompt logprobs)
        self._channel = grpc.aio.insecure_channel(self.router_address, options=[
            ("grpc.max_receive_message_length", MAX_BODY_BYTES)])
        self._stub = LocalStub(self.router) if self.router is not None else gen_grpc.PDClusterStub(self._channel)
        try:
            yield
        finally:
            await self._channel.close(grace=None)

    # ------------------------------------------------------------------ app
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="pdcluster OpenAI-compatible API", lifespan=self._lifespan, docs_url=None,
                      redoc_url=None, openapi_url=None)
        app.add_exception_handler(ApiError, _api_error)
        app.add_exception_handler(RequestValidationError, _validation_error)
        app.add_exception_handler(HTTPException, _http_error)
        app.add_exception_handler(Exception, _internal_error)

        async def completions(request: Request) -> Response:
            return await self._generate(request, chat=False)

        async def chat_completions(request: Request) -> Response:
            return await self._generate(request, chat=True)

        app.post("/v1/completions")(completions)
        app.post("/v1/chat/completions")(chat_completions)
        app.get("/v1/models")(self._models)
        app.get("/v1/models/{model:path}")(self._model)
        app.post("/tokenize")(self._tokenize)
        app.post("/detokenize")(self._detokenize)
        app.get("/health")(self._health)
        app.get("/metrics")(self._metrics)
        return app

    def _authorize(self, request: Request) -> str | None:
        """The caller's API key (Authorization: Bearer KEY or x-api-key), checked when keys are set."""
        auth = request.headers.get("authorization", "")
        bearer = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        key = request.headers.get("x-api-key") or bearer
        if self.api_keys and key not in self.api_keys:
            raise ApiError(401, "missing or invalid API key (send Authorization: Bearer KEY or "
                                "x-api-key: KEY)", type="authentication_error", code="invalid_api_key")
        return key

    async def _models(self, request: Request) -> dict[str, Any]:
        self._authorize(request)
        return {"object": "list", "data": [self._model_card()]}

    async def _model(self, request: Request, model: str) -> dict[str, Any]:
        self._authorize(request)
        if model != self.model_name:
            raise ApiError(404, f"model {model!r} is not served here; this cluster serves "
                                f"{self.model_name!r}", param="model", code="model_not_found")
        return self._model_card()

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "pdcluster"}

    async def _tokenize(self, request: Request) -> dict[str, Any]:
        self._authorize(request)
        render = lambda messages: self._render(chat_messages(messages))
        return tokenize(await self._json(request), self.tokenizer, render, self.max_model_len)

    async def _detokenize(self, request: Request) -> dict[str, Any]:
        self._authorize(request)
        return detokenize(await self._json(request), self.tokenizer)

    async def _health(self) -> Response:
        reason = None
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout=2.0)
        except (asyncio.TimeoutError, grpc.RpcError):
            reason = f"router gRPC at {self.router_address} does not answer"
        if reason is None and self.readiness is not None:
            reason = self.readiness()
        if reason:
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def _metrics(self) -> Response:
        if self.metrics is None:
            raise ApiError(404, "no metrics here: this API was built without a router's metrics", type="not_found_error")
        body, content_type = self.metrics()
        return Response(body, media_type=content_type)

    # ------------------------------------------------------------------ generation
    async def _generate(self, request: Request, chat: bool) -> Response:
        key = self._authorize(request)
        body = await self._json(request)
        # the router's own encoding, for return_token_ids' prompt_token_ids of a text prompt
        tokenize = (lambda text: self.tokenizer.encode(text)) if self.tokenizer is not None else None
        if chat:
            req = parse_chat(body, self.model_name, self._render, tokenize)
        else:
            req = parse_completion(body, self.model_name, tokenize)
        if req.echo:  # a token-id prompt's text, for the echo
            for p in req.prompts:
                if p.text is None:
                    p.text = self.tokenizer.decode(p.ids) if self.tokenizer is not None else ""
        metadata = (("authorization", f"Bearer {key}"),) if key else None
        gone = asyncio.Event()
        run = ChoiceRun(self._stub, req, metadata, self.request_timeout_s, gone)
        fmt = LogprobFormatter(self._token_text)
        try:
            if not req.stream:
                outs = await unless_disconnected(request, collect_all(run))
                run.cancel()
                return JSONResponse(response_of(req, list(enumerate(outs)), fmt, usage(req, outs)))
            messages = run.messages()
            first = await unless_disconnected(request, anext(messages))
        except ClientGone:
            run.cancel()
            return Response(status_code=499)
        except BaseException:
            run.cancel()
            raise
        return StreamingResponse(events(request, run, gone, req, fmt, first, messages),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _json(self, request: Request) -> Any:
        """The request body's JSON (400 when it is not JSON, or holds what no UTF-8 string can carry)."""
        raw = await _read_body(request, MAX_BODY_BYTES)
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise bad(None, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        try:
            where = _lone_surrogate(body)
        except RecursionError:
            raise bad(None, "the request body is nested too deeply", code="invalid_json") from None
        if where is not None:  # valid JSON ("\ud800"), but no UTF-8 string can carry it on to the router
            raise bad(where or None, "a string holds a lone UTF-16 surrogate escape, which is not a character",
                      code="invalid_json")
        return body

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ApiError(400, f"model {self.model_name!r} has no chat template; use /v1/completions "
                                "with a prompt", param="messages", code="no_chat_template")
        try:
            text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 (a template may refuse an order of roles: raise_exception)
            raise bad("messages", f"the model's chat template refused these messages: {e}") from None
        if self._bos and text.startswith(self._bos):  # the router's tokenizer adds it again
            text = text[len(self._bos):]
        return text

    def _decode_token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"<{token_id}>"
        return self.tokenizer.decode([token_id], skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)


def _template_bos(tokenizer: Any) -> str | None:
    """The bos text a chat template may render, when the tokenizer also adds bos itself."""
    bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
    if tokenizer is None or not bos or bos_id is None:
        return None
    return bos if tokenizer.encode("a")[:1] == [bos_id] else None


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past `limit` bytes (before reading it, when Content-Length says so)."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise ApiError(413, f"the request body has {length} bytes; at most {limit} are accepted",
                       code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is over {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _lone_surrogate(value: Any, path: str = "") -> str | None:
    """The path of the first string (key or value) in a JSON value that cannot be UTF-8, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        sub = f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}" if path else str(k)
        if isinstance(k, str) and _lone_surrogate(k) is not None:
            return sub
        found = _lone_surrogate(v, sub)
        if found is not None:
            return found
    return None


async def _api_error(request: Request, e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers or None)


async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    return await _api_error(request, bad(None, f"invalid request: {e.errors()}"))


async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
    kind = {401: "authentication_error", 404: "not_found_error"}.get(e.status_code, "invalid_request_error")
    return await _api_error(request, ApiError(e.status_code, str(e.detail), type=kind))


async def _internal_error(request: Request, e: Exception) -> JSONResponse:
    log.exception("internal error serving %s", request.url.path)
    err = ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")
    return await _api_error(request, err)
