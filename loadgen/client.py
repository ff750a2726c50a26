"""One streamed `POST /v1/completions` per request, timed on the client.

Per request: the send time, the arrival time of every content-bearing chunk (the first is the first
token: TTFT; the gaps are inter-token latencies), the end, the output tokens, and success or why not.
Tokens per chunk come from the chunk's `logprobs` or `token_ids` (return_token_ids, which multi-turn
runs ask for to rebuild the history), else from a cumulative `usage` in content chunks
(vLLM's continuous usage stats), else a chunk counts as one token; the final usage chunk
(`stream_options.include_usage`) gives the request's output tokens when the server sends it.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from loadgen.sse import Chunk, SSEDecoder, parse_chunk
from loadgen.workload import Request


@dataclass
class EndpointConfig:
    url: str  # http://HOST:PORT, optionally with a path prefix and/or a trailing /v1
    label: str = ""
    model: str | None = None  # None: the first of GET /v1/models
    api_key: str | None = None
    ignore_eos: bool = False
    request_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        url = self.url if "://" in self.url else f"http://{self.url}"
        url = url.rstrip("/")
        self.url = url.removesuffix("/v1")
        self.label = self.label or self.url.split("://", 1)[1]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class RequestRecord:
    """Times are seconds from the start of the run (time.perf_counter based)."""

    index: int
    scheduled_s: float
    expected_prompt_tokens: int = 0
    expected_output_tokens: int = 0
    start_s: float | None = None
    end_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)  # arrival of each content-bearing chunk
    chunk_tokens: list[int] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None  # the server's usage, when sent
    output_tokens_from: str = "chunks"  # usage (the server's count) | chunks (the sum of chunk_tokens)
    chunk_tokens_from: str = "assumed"  # logprobs | token_ids | usage (cumulative) | assumed (one per chunk)
    chunks_match_usage: bool | None = None  # sum(chunk_tokens) == usage; None: no usage sent
    outcome: str = "not_sent"  # ok | failed | unfinished (cut at the time limit) | not_sent
    status: int | None = None
    error_kind: str | None = None
    error: str | None = None
    finish_reason: str | None = None
    conversation: int | None = None  # multi-turn workloads: the conversation and the turn in it (0 = first)
    turn: int | None = None

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    @property
    def ttft(self) -> float | None:
        return self.chunk_s[0] - self.start_s if self.chunk_s and self.start_s is not None else None

    @property
    def e2e(self) -> float | None:
        return self.end_s - self.start_s if self.end_s is not None and self.start_s is not None else None

    @property
    def tpot(self) -> float | None:
        """(e2e - ttft) / (output tokens - 1); None for one-token answers."""
        ttft, e2e = self.ttft, self.e2e
        if ttft is None or e2e is None or self.output_tokens < 2:
            return None
        return (e2e - ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between content chunks; a chunk of k tokens gives k gaps of gap / k."""
        out: list[float] = []
        for prev, t, k in zip(self.chunk_s, self.chunk_s[1:], self.chunk_tokens[1:]):
            out.extend([(t - prev) / max(1, k)] * max(1, k))
        return out

    def fail(self, kind: str, message: str, status: int | None = None) -> None:
        self.outcome, self.error_kind, self.error, self.status = "failed", kind, message, status

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(ttft_s=self.ttft, e2e_s=self.e2e, tpot_s=self.tpot)
        return d


def error_message(raw: bytes) -> str:
    """The OpenAI error body's message, else the body's start."""
    text = raw.decode("utf-8", errors="replace")
    try:
        err = json.loads(text).get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if err:
            return str(err)
    except (ValueError, AttributeError):
        pass
    return text[:300] or "(empty body)"


class CompletionsClient:
    """An httpx.AsyncClient for one endpoint; use as `async with`."""

    def __init__(self, endpoint: EndpointConfig, return_token_ids: bool = False) -> None:
        self.endpoint = endpoint
        self.return_token_ids = return_token_ids  # ask for the answer's and the prompt's token ids (vLLM's field)
        self.http: httpx.AsyncClient | None = None

    async def __aenter__(self) -> CompletionsClient:  # noqa: PYI034
        timeout = httpx.Timeout(self.endpoint.request_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.http = httpx.AsyncClient(timeout=timeout, limits=limits, headers=self.endpoint.headers)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.http is not None:
            await self.http.aclose()

    def body(self, req: Request, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len,
                                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        if self.endpoint.ignore_eos:
            body["ignore_eos"] = True
        if self.return_token_ids:
            body["return_token_ids"] = True
        return body

    async def send(self, req: Request, rec: RequestRecord, t0: float, model: str) -> StreamState | None:
        """Fill `rec` for one request; the stream's state (its text and token ids) when it was read.
        Never raises but CancelledError (then `rec` says unfinished)."""
        rec.start_s = time.perf_counter() - t0
        rec.outcome = "unfinished"
        state = None
        try:
            state = await _within(self._stream(req, rec, t0, model), self.endpoint.request_timeout_s)
        except (asyncio.TimeoutError, httpx.TimeoutException):
            limit = self.endpoint.request_timeout_s
            rec.fail("timeout", f"no complete answer within --request-timeout-s {limit:g}")
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
            rec.fail("connection", f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
        except httpx.HTTPError as e:
            rec.fail("http error", f"{type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 -- anything else (a bad URL, a bug) fails this request, not the run
            rec.fail("client error", f"{type(e).__name__}: {e}")
        if rec.end_s is None and rec.outcome != "unfinished":
            rec.end_s = time.perf_counter() - t0
        return state

    async def _stream(self, req: Request, rec: RequestRecord, t0: float, model: str) -> StreamState | None:
        assert self.http is not None, "use CompletionsClient as `async with`"
        url = f"{self.endpoint.url}/v1/completions"
        async with self.http.stream("POST", url, json=self.body(req, model)) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                rec.fail(f"http {resp.status_code}", error_message(await resp.aread()), resp.status_code)
                return None
            dec, state = SSEDecoder(), StreamState()
            async for piece in resp.aiter_bytes():
                now = time.perf_counter() - t0
                if any(state.take(parse_chunk(p), now, rec) for p in dec.feed(piece)):
                    break
            else:
                for p in dec.close():
                    state.take(parse_chunk(p), time.perf_counter() - t0, rec)
            state.finish(rec, time.perf_counter() - t0)
            return state


async def _within(coro: Any, timeout_s: float) -> Any:
    """Await `coro` for at most `timeout_s` (asyncio.TimeoutError after). On Python 3.11+ with
    asyncio.timeout, since there `wait_for` can lose a cancellation that arrives as `coro` completes
    (the caller's task then runs on: a stopped load generator that keeps sending)."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(timeout_s):
            return await coro
    return await asyncio.wait_for(coro, timeout_s)  # Python 3.10


class StreamState:
    """What one stream has shown so far."""

    def __init__(self) -> None:
        self.done = False
        self.error: str | None = None
        self.usage_tokens: int | None = None
        self.end: float | None = None
        self.text = ""  # the answer
        self.token_ids: list[int] | None = None  # the answer's ids, when the chunks carry them
        self.prompt_token_ids: list[int] | None = None

    def take(self, c: Chunk, now: float, rec: RequestRecord) -> bool:
        """Account one chunk; True when the stream is over."""
        if c.error:
            self.error, self.end = c.error, now
            return False
        self.text += c.text
        if c.token_ids is not None:
            self.token_ids = [*(self.token_ids or []), *c.token_ids]
        self.prompt_token_ids = c.prompt_token_ids or self.prompt_token_ids
        if c.content:
            k, by = c.tokens, c.tokens_from
            if k is None and c.usage and c.usage.get("completion_tokens") is not None:
                k, by = max(1, int(c.usage["completion_tokens"]) - sum(rec.chunk_tokens)), "usage"
            rec.chunk_s.append(now)
            rec.chunk_tokens.append(k or 1)
            if k is None or rec.chunk_tokens_from == "assumed" and len(rec.chunk_s) > 1:
                by = "assumed"  # one chunk without evidence makes the whole request's split assumed
            rec.chunk_tokens_from = by
        if c.finish_reason:
            rec.finish_reason = c.finish_reason
        if c.usage:
            if c.usage.get("completion_tokens") is not None:
                self.usage_tokens = int(c.usage["completion_tokens"])
            if c.usage.get("prompt_tokens") is not None:
                rec.prompt_tokens = int(c.usage["prompt_tokens"])
        if c.done:
            self.done, self.end = True, now
        return c.done

    def finish(self, rec: RequestRecord, now: float) -> None:
        rec.end_s = self.end if self.end is not None else now
        counted = sum(rec.chunk_tokens)
        if self.usage_tokens is not None:
            rec.output_tokens, rec.output_tokens_from = self.usage_tokens, "usage"
            rec.chunks_match_usage = counted == self.usage_tokens
        else:
            rec.output_tokens, rec.output_tokens_from = counted, "chunks"
        if self.error:
            rec.fail("stream error", self.error, rec.status)
        elif not self.done and rec.finish_reason is None:
            rec.fail("incomplete stream", "the stream ended without a finish reason or [DONE]", rec.status)
        else:
            if not rec.chunk_s and rec.output_tokens:
                # tokens whose text never completed (e.g. one token, an incomplete UTF-8 byte): an answer,
                # not a failure; its tokens count as arriving when the stream ended (TTFT = end to end)
                rec.chunk_s, rec.chunk_tokens, rec.chunk_tokens_from = [rec.end_s], [rec.output_tokens], "usage"
            rec.outcome = "ok"


async def fetch_model(endpoint: EndpointConfig, timeout_s: float = 10.0) -> str:
    """The first model id of GET /v1/models (for endpoints given without --model)."""
    async with httpx.AsyncClient(timeout=timeout_s, headers=endpoint.headers) as http:
        try:
            resp = await http.get(f"{endpoint.url}/v1/models")
        except httpx.HTTPError as e:
            raise RuntimeError(f"{endpoint.label}: GET /v1/models failed ({type(e).__name__}: {e}); "
                               "is the server up? (or pass --model)") from None
        if resp.status_code != 200:
            raise RuntimeError(f"{endpoint.label}: GET /v1/models -> {resp.status_code}: "
                               f"{error_message(resp.content)} (pass --model)")
        data = resp.json().get("data") or []
        if not data:
            raise RuntimeError(f"{endpoint.label}: GET /v1/models lists no model (pass --model)")
        return str(data[0]["id"])
