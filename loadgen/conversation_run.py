"""One bounded run of a multi-turn workload: each conversation starts at its open-loop arrival
offset and then runs as a closed loop, turn k sent `think` seconds after turn k-1's answer ended,
its prompt the history (loadgen/conversations.py) built from that answer.

Bounds as for runner.py: at `time_limit_s` the turns in flight are cancelled (`unfinished`) and the
turns not yet sent stay `not_sent`; a conversation whose turn failed sends no more turns (the rest
are `not_sent`, "an earlier turn failed"). Records are in conversation order, turn by turn, and
carry their conversation and turn.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import datetime, timezone

from loadgen.client import CompletionsClient, EndpointConfig, RequestRecord
from loadgen.conversations import Conversation, History, MessageMaker
from loadgen.runner import RunResult
from loadgen.workload import Request


def turn_records(conversations: list[Conversation], offsets: list[float]) -> list[list[RequestRecord]]:
    """Per conversation, a record per turn; turn 0 is due at the conversation's offset, a later turn's
    due time is set when the answer before it ends."""
    out, index = [], 0
    for conv, off in zip(conversations, offsets):
        recs = []
        for t in conv.turns:
            recs.append(RequestRecord(index, off, t.prompt_len, t.output_len, conversation=conv.index, turn=t.turn))
            index += 1
        out.append(recs)
    return out


def next_due(prev: RequestRecord, think_s: float) -> float:
    """When the turn after `prev` is due: its answer's end plus the think time."""
    assert prev.end_s is not None, "a turn is due only after the answer before it"
    return prev.end_s + think_s


async def run_conversations_async(conversations: list[Conversation], offsets: list[float],
                                  endpoint: EndpointConfig, model: str, time_limit_s: float, maker: MessageMaker,
                                  on_done: Callable[[RequestRecord], None] | None = None,
                                  rate: float | None = None, arrivals: str = "") -> RunResult:
    """`maker` makes the first prompts and new messages (with a tokenizer: token ids, and the run asks
    for return_token_ids)."""
    per_conv = turn_records(conversations, offsets)
    records = [r for recs in per_conv for r in recs]
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    token_ids = maker.tokenizer is not None
    async with CompletionsClient(endpoint, return_token_ids=token_ids) as client:
        t0 = time.perf_counter()
        deadline = t0 + time_limit_s
        late: list[int] = []  # conversations with a turn due after the time limit

        async def until(due_s: float) -> bool:
            """Sleep until `due_s` (run time); False when that is past the time limit."""
            if t0 + due_s >= deadline:
                return False
            await asyncio.sleep(max(0.0, t0 + due_s - time.perf_counter()))
            return True

        async def converse(conv: Conversation, recs: list[RequestRecord]) -> None:
            history = History(maker)
            for k, (turn, rec) in enumerate(zip(conv.turns, recs)):
                if k:
                    rec.scheduled_s = next_due(recs[k - 1], turn.think_s)
                if not await until(rec.scheduled_s):
                    late.append(conv.index)
                    return
                prompt = history.prompt(turn)
                req = Request(rec.index, prompt, turn.prompt_len, turn.output_len, None)
                try:
                    state = await client.send(req, rec, t0, model)
                finally:
                    if on_done is not None:
                        on_done(rec)
                if not rec.ok or state is None:
                    for later in recs[k + 1:]:
                        later.error_kind, later.error = "not sent", f"turn {k} of its conversation failed"
                    return
                history.answered(state.prompt_token_ids, state.token_ids, state.text)

        tasks = [asyncio.create_task(converse(c, recs)) for c, recs in zip(conversations, per_conv)]
        if tasks:
            await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        stop = time.perf_counter()
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for t in tasks:  # a bug in building a prompt must not pass silently
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
    for rec in records:
        if rec.outcome == "unfinished":
            rec.error_kind, rec.error = "unfinished", f"still running at the time limit ({time_limit_s:g} s)"
        elif rec.outcome == "not_sent" and rec.error_kind is None:
            rec.error_kind, rec.error = "not sent", f"due after the time limit ({time_limit_s:g} s)"
    cut = bool(pending) or bool(late)
    ends = [r.end_s for r in records if r.end_s is not None]
    duration = (stop - t0) if cut else max(ends, default=stop - t0)
    return RunResult(endpoint.label, endpoint.url, model, rate, arrivals, records, duration,
                     "time limit" if cut else "workload done", started_at)


def run_conversations(conversations: list[Conversation], offsets: list[float], endpoint: EndpointConfig,
                      model: str, time_limit_s: float, maker: MessageMaker,
                      on_done: Callable[[RequestRecord], None] | None = None, rate: float | None = None,
                      arrivals: str = "") -> RunResult:
    """`run_conversations_async` on a fresh event loop."""
    return asyncio.run(run_conversations_async(conversations, offsets, endpoint, model, time_limit_s, maker,
                                               on_done, rate, arrivals))
