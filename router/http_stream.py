"""One generation over HTTP, from the router's gRPC stream to the client: the relay of its messages
(a gRPC error becomes the OpenAI error to answer with), the server-sent events of a streaming
answer, and the watch on the client that cancels the gRPC call as soon as it disconnects (which
makes the router abort the request on its workers). `router/http_api.py` serves the routes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import grpc.aio
from fastapi import Request

from proto import generate_pb2 as gen
from router.admission import RETRY_AFTER_METADATA
from router.openai_choices import usage
from router.openai_protocol import ApiError, OpenAIRequest, grpc_error
from router.openai_responses import LogprobFormatter, StreamShaper, usage_chunk


class ClientGone(Exception):
    """The HTTP client disconnected; its gRPC call has been cancelled."""


async def relay(call: Any, req: OpenAIRequest, gone: asyncio.Event, choices: int = 1,
                ) -> AsyncIterator[gen.GenerateResponse]:
    """The router's messages until `choices` have finished; a gRPC error becomes the ApiError to answer with."""
    try:
        async for msg in call:
            yield msg
            if msg.finish_reason:
                choices -= 1
                if not choices:
                    return
    except grpc.aio.AioRpcError as e:
        raise grpc_error(e.code().name, e.details() or "", req, _retry_after(e)) from None
    except asyncio.CancelledError:
        if gone.is_set():
            raise ClientGone from None
        raise
    raise ApiError(502, "the router ended the stream without a final message", type="server_error")


async def events(request: Request, call: Any, gone: asyncio.Event, req: OpenAIRequest, fmt: LogprobFormatter,
                 first: tuple[int, gen.GenerateResponse],
                 messages: AsyncIterator[tuple[int, gen.GenerateResponse]]) -> AsyncIterator[str]:
    """The event stream of (choice index, message)s, then (stream_options.include_usage) one usage
    chunk over every choice. A watcher cancels the gRPC call(s) (`call`: anything with cancel()) as
    soon as the client disconnects, even while no token is due (Starlette only notices a
    disconnect on its own schedule)."""
    def on_disconnect(task: asyncio.Task) -> None:
        if not task.cancelled():
            gone.set()
            call.cancel()

    watch = asyncio.ensure_future(_disconnected(request))
    watch.add_done_callback(on_disconnect)
    shapers: dict[int, StreamShaper] = {}

    def shaped(index: int, msg: gen.GenerateResponse) -> list[dict[str, Any]]:
        if index not in shapers:
            shapers[index] = StreamShaper(req, fmt.fresh() if shapers else fmt, index)
        return shapers[index].chunks(msg)

    try:
        for c in shaped(*first):
            yield _event(c)
        async for index, msg in messages:
            for c in shaped(index, msg):
                yield _event(c)
        if req.include_usage:
            yield _event(usage_chunk(req, usage(req, [shapers[i].total for i in sorted(shapers)])))
        yield "data: [DONE]\n\n"
    except ApiError as e:
        yield _event(e.body())
        yield "data: [DONE]\n\n"
    except ClientGone:
        return
    finally:
        watch.cancel()
        call.cancel()


async def unless_disconnected(request: Request, aw: Awaitable[Any]) -> Any:
    """`aw`'s result, unless the client disconnects first: then `aw` is cancelled and ClientGone raised."""
    task = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        raise ClientGone
    return task.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client has disconnected (the request body must already be read)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.01)


def _retry_after(e: grpc.aio.AioRpcError) -> float | None:
    """The router's retry hint of a refusal (trailing metadata retry-after-ms), in seconds."""
    for key, value in e.trailing_metadata() or ():
        if key == RETRY_AFTER_METADATA:
            try:
                return int(value) / 1e3
            except ValueError:
                return None
    return None


def _event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"
