"""The router calls of one OpenAI request (router/openai_choices.py: one per prompt and choice),
run over the router's gRPC API and merged into one sequence of (slot, message).

One call is relayed as it comes. Several run as tasks that feed one queue: each prompt's leading
call starts at once, the prompt's other calls once the leader has its first token (or has ended),
so they find its KV in the prefix caches. The first error of any call (an ApiError, or ClientGone)
is raised to the reader, which then cancels every call (`cancel`), so no call outlives the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from proto import generate_pb2 as gen
from router.http_stream import ClientGone, relay
from router.openai_choices import ChoiceCall, choice_calls
from router.openai_protocol import OpenAIRequest
from router.openai_responses import Output


class ChoiceRun:
    def __init__(self, stub: Any, req: OpenAIRequest, metadata: Any, timeout_s: float,
                 gone: asyncio.Event) -> None:
        self.stub, self.req, self.metadata, self.timeout_s, self.gone = stub, req, metadata, timeout_s, gone
        self.calls = choice_calls(req)
        self._started: list[Any] = []  # the gRPC calls made
        self._tasks: list[asyncio.Task] = []
        self._queue: asyncio.Queue = asyncio.Queue()

    def _start(self, c: ChoiceCall) -> Any:
        call = self.stub.Generate(c.grpc, timeout=self.timeout_s, metadata=self.metadata)
        self._started.append(call)
        return call

    def cancel(self) -> None:
        for call in self._started:
            call.cancel()
        for task in self._tasks:
            task.cancel()

    async def messages(self) -> AsyncIterator[tuple[int, gen.GenerateResponse]]:
        """(slot, message) as the calls answer; ends when every call has finished."""
        if len(self.calls) == 1:
            async for msg in relay(self._start(self.calls[0]), self.req, self.gone):
                yield 0, msg
            return
        gates: dict[int, asyncio.Event] = {}
        for c in self.calls:
            if c.leader:
                gates[c.prompt] = asyncio.Event()
            gate = None if c.leader else gates[c.prompt]
            self._tasks.append(asyncio.ensure_future(self._pump(c, gate, gates[c.prompt] if c.leader else None)))
        running = len(self.calls)
        while running:
            slot, msg, error = await self._queue.get()
            if error is not None:
                raise error
            if msg is None:
                running -= 1
                continue
            yield slot, msg

    async def _pump(self, c: ChoiceCall, gate: asyncio.Event | None, first: asyncio.Event | None) -> None:
        ended = False  # a terminal item is in the queue (each pump puts exactly one)
        try:
            if gate is not None:
                await gate.wait()
            async for msg in relay(self._start(c), self.req, self.gone):
                if first is not None:
                    first.set()
                await self._queue.put((c.slot, msg, None))
            self._queue.put_nowait((c.slot, None, None))
            ended = True
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 (ApiError, ClientGone, any other): the reader raises it
            self._queue.put_nowait((c.slot, None, e))
            ended = True
        finally:
            if first is not None:
                first.set()  # the prompt's other calls go on whatever became of the leader
            if not ended:  # cancelled: a reader still waiting must not wait for this call forever
                self._queue.put_nowait((c.slot, None, ClientGone()))


async def collect_all(run: ChoiceRun) -> list[Output]:
    """A non-streaming answer: every call's messages, accumulated, in slot order."""
    outs = [Output() for _ in run.calls]
    async for slot, msg in run.messages():
        outs[slot].add(msg)
    return outs
