"""The router calls of one OpenAI request (router/openai_choices.py: one per prompt, each with the
request's n and best_of), run over the router's gRPC API and merged into one sequence of (answer
index, message).

One call is relayed as it comes. Several (a list of prompts) run as tasks that feed one queue. The
first error of any call (an ApiError, or ClientGone) is raised to the reader, which then cancels
every call (`cancel`), so no call outlives the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from proto import generate_pb2 as gen
from router.http_stream import ClientGone, relay
from router.openai_choices import PromptCall, prompt_calls, slot
from router.openai_protocol import OpenAIRequest
from router.openai_responses import Output


class ChoiceRun:
    def __init__(self, stub: Any, req: OpenAIRequest, metadata: Any, timeout_s: float,
                 gone: asyncio.Event) -> None:
        self.stub, self.req, self.metadata, self.timeout_s, self.gone = stub, req, metadata, timeout_s, gone
        self.calls = prompt_calls(req)
        self._started: list[Any] = []  # the gRPC calls made
        self._tasks: list[asyncio.Task] = []
        self._queue: asyncio.Queue = asyncio.Queue()

    def _relay(self, c: PromptCall) -> AsyncIterator[gen.GenerateResponse]:
        call = self.stub.Generate(c.grpc, timeout=self.timeout_s, metadata=self.metadata)
        self._started.append(call)
        return relay(call, self.req, self.gone, choices=self.req.n)

    def cancel(self) -> None:
        for call in self._started:
            call.cancel()
        for task in self._tasks:
            task.cancel()

    async def messages(self) -> AsyncIterator[tuple[int, gen.GenerateResponse]]:
        """(answer index, message) as the calls answer; ends when every call has finished."""
        if len(self.calls) == 1:
            async for msg in self._relay(self.calls[0]):
                yield slot(self.req, 0, msg), msg
            return
        self._tasks = [asyncio.ensure_future(self._pump(c)) for c in self.calls]
        running = len(self.calls)
        while running:
            index, msg, error = await self._queue.get()
            if error is not None:
                raise error
            if msg is None:
                running -= 1
                continue
            yield index, msg

    async def _pump(self, c: PromptCall) -> None:
        ended = False  # a terminal item is in the queue (each pump puts exactly one)
        try:
            async for msg in self._relay(c):
                await self._queue.put((slot(self.req, c.prompt, msg), msg, None))
            self._queue.put_nowait((c.prompt, None, None))
            ended = True
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 (ApiError, ClientGone, any other): the reader raises it
            self._queue.put_nowait((c.prompt, None, e))
            ended = True
        finally:
            if not ended:  # cancelled: a reader still waiting must not wait for this call forever
                self._queue.put_nowait((c.prompt, None, ClientGone()))


async def collect_all(run: ChoiceRun) -> list[Output]:
    """A non-streaming answer: every choice's messages, accumulated, in answer order."""
    outs = [Output() for _ in range(len(run.calls) * run.req.n)]
    async for index, msg in run.messages():
        outs[index].add(msg)
    return outs
