"""router/local_call.py: a gRPC handler called in process answers as a grpc.aio call would: its
messages in order, an abort as AioRpcError (code, details, trailing metadata), the caller's
metadata and deadline seen by the handler, callbacks run once when the call ends or is cancelled."""

from __future__ import annotations

import asyncio
import threading

import grpc
import grpc.aio
import pytest

from router.local_call import LocalStub


class Handlers:
    """Handlers shaped like the router's Generate: (request, context) -> messages."""

    def __init__(self) -> None:
        self.ended = threading.Event()
        self.seen: dict = {}
        self.release = threading.Event()

    def Generate(self, request, context):  # noqa: N802
        context.add_callback(self.ended.set)
        self.seen = {"metadata": dict(context.invocation_metadata()), "remaining": context.time_remaining()}
        if request == "refuse":
            context.set_trailing_metadata((("retry-after-ms", "250"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")
        if request == "crash":
            raise KeyError("bug")
        for i in range(3):
            yield i
        if request == "hold":
            self.release.wait(5)
            yield 99


def _run(coro):
    return asyncio.run(coro)


def test_messages_arrive_in_order_with_the_callers_metadata_and_deadline():
    h = Handlers()

    async def go():
        return [m async for m in LocalStub(h).Generate("ok", timeout=5.0, metadata=(("authorization", "Bearer k"),))]

    assert _run(go()) == [0, 1, 2]
    assert h.seen["metadata"] == {"authorization": "Bearer k"} and 0 < h.seen["remaining"] <= 5.0
    assert h.ended.wait(1)


@pytest.mark.parametrize("request_, code, details", [("refuse", grpc.StatusCode.RESOURCE_EXHAUSTED, "busy"),
                                                     ("crash", grpc.StatusCode.UNKNOWN, "KeyError: 'bug'")])
def test_an_abort_is_an_aio_rpc_error(request_, code, details):
    h = Handlers()

    async def go():
        async for _ in LocalStub(h).Generate(request_, timeout=None):
            pass

    with pytest.raises(grpc.aio.AioRpcError) as e:
        _run(go())
    assert e.value.code() == code and e.value.details() == details
    if request_ == "refuse":
        assert tuple(e.value.trailing_metadata()) == (("retry-after-ms", "250"),)
    assert h.ended.wait(1)


def test_cancel_runs_the_callbacks_and_ends_the_handler():
    h = Handlers()

    async def go():
        call = LocalStub(h).Generate("hold", timeout=None)
        got = [await call.__anext__() for _ in range(3)]
        call.cancel()
        return got

    assert _run(go()) == [0, 1, 2]
    assert h.ended.wait(1)  # the router's abort of the request runs at the cancel, not at the handler's end
    h.release.set()
