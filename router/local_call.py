"""`PDCluster.Generate` called in this process: the HTTP front end's way to the router's servicer
when both run in one process (router/http_api.py), without a loopback gRPC call.

`LocalStub(servicer).Generate(request, timeout=, metadata=)` answers like a grpc.aio stub's call:
an async iterator of the servicer's messages with `cancel()`, a refusal raised as
`grpc.aio.AioRpcError` (its code, details and trailing metadata, so the HTTP layer's error mapping
stays one). The servicer's own handler runs, unchanged, on a thread of its own (as the gRPC
server's thread pool runs it): the same API-key check, validation, admission and orchestration,
through a `LocalContext` that gives it what a gRPC context would: the caller's metadata, its
deadline, abort with a status, the callbacks run when the call ends or is cancelled (the router's
abort of the request on its workers). What goes is the serialisation, the HTTP/2 framing and the
loopback socket in both directions.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import grpc
import grpc.aio

_END = object()


class LocalAbort(Exception):
    """What `LocalContext.abort` raises to end the handler, as grpc's abort does."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple = ()) -> None:
        super().__init__(details)
        self.code, self.details, self.trailing = code, details, trailing

    def as_rpc_error(self) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(self.code, grpc.aio.Metadata(), grpc.aio.Metadata(*self.trailing), self.details)


class LocalContext:
    """The parts of grpc.ServicerContext the router's handlers use."""

    def __init__(self, metadata: Iterable[tuple[str, str]] | None, timeout_s: float | None) -> None:
        self._metadata = tuple(metadata or ())
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._callbacks: list[Callable[[], None]] = []
        self._trailing: tuple = ()
        self._lock = threading.Lock()
        self._ended = False
        self.cancelled = threading.Event()

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def set_trailing_metadata(self, metadata: Iterable[tuple[str, str]]) -> None:
        self._trailing = tuple(metadata)

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise LocalAbort(code, details, self._trailing)

    def add_callback(self, callback: Callable[[], None]) -> bool:
        with self._lock:
            if self._ended:
                return False
            self._callbacks.append(callback)
        return True

    def end(self) -> None:
        """The call is over (finished, failed or cancelled): each callback runs once."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def cancel(self) -> None:
        self.cancelled.set()
        self.end()


class LocalCall:
    """One Generate call: the handler's messages, handed from its thread to this event loop."""

    def __init__(self, handler: Callable[[Any, LocalContext], Iterable[Any]], request: Any, timeout: float | None,
                 metadata: Iterable[tuple[str, str]] | None) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self.context = LocalContext(metadata, timeout)
        self._thread = threading.Thread(target=self._run, args=(handler, request), name="generate-local", daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the HTTP front end's loop has closed: nobody reads any more
            pass

    def _run(self, handler: Callable[[Any, LocalContext], Iterable[Any]], request: Any) -> None:
        messages = iter(())
        try:
            messages = iter(handler(request, self.context))
            for msg in messages:
                if self.context.cancelled.is_set():
                    break
                self._put(msg)
            self._put(_END)
        except LocalAbort as e:
            self._put(e)
        except Exception as e:  # noqa: BLE001 (a handler's bug: the client gets INTERNAL, as over gRPC)
            self._put(LocalAbort(grpc.StatusCode.UNKNOWN, f"{type(e).__name__}: {e}"))
        finally:
            close = getattr(messages, "close", None)
            if close is not None:
                close()  # a generator cut short runs its finally blocks (the request's clean-up)
            self.context.end()

    def __aiter__(self) -> LocalCall:
        return self

    async def __anext__(self) -> Any:
        item = await self._queue.get()
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, LocalAbort):
            raise item.as_rpc_error()
        return item

    def cancel(self) -> bool:
        """As a gRPC client's cancel: the handler's callbacks run now (the router aborts the request)."""
        self.context.cancel()
        return True


class LocalStub:
    """A stand-in for `PDClusterStub` bound to an in-process servicer (only Generate is called)."""

    def __init__(self, servicer: Any) -> None:
        self.servicer = servicer

    def Generate(self, request: Any, timeout: float | None = None,  # noqa: N802 (the gRPC method's name)
                 metadata: Iterable[tuple[str, str]] | None = None) -> LocalCall:
        return LocalCall(self.servicer.Generate, request, timeout, metadata)
