"""One bounded, open-loop run: requests go out at their arrival offsets, each as its own task.

The run stops by itself: at the end of the workload, or when `time_limit_s` has passed since its
start. Then requests still in flight are cancelled (outcome `unfinished`) and those whose arrival
time was not reached are never sent (`not_sent`). Each request also has its own timeout (client.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

from loadgen.client import CompletionsClient, EndpointConfig, RequestRecord
from loadgen.workload import Request


@dataclass
class RunResult:
    label: str
    url: str
    model: str
    rate: float | None
    arrivals: str
    records: list[RequestRecord]
    duration_s: float  # start to the last answer (or to the stop)
    stopped_by: str  # "workload done" | "time limit"
    started_at: str = ""
    # what the server counted during the run ("role/phase" -> counter deltas; loadgen.server_counters),
    # when the endpoint exports pdcluster's worker counters
    server_counters: dict[str, dict] | None = None


async def run_async(requests: list[Request], offsets: list[float], endpoint: EndpointConfig, model: str,
                    time_limit_s: float, on_done: Callable[[RequestRecord], None] | None = None,
                    rate: float | None = None, arrivals: str = "") -> RunResult:
    records = [RequestRecord(r.index, off, r.prompt_len, r.output_len) for r, off in zip(requests, offsets)]
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    tasks: list[asyncio.Task] = []
    async with CompletionsClient(endpoint) as client:
        t0 = time.perf_counter()
        deadline = t0 + time_limit_s

        def started(req: Request, rec: RequestRecord) -> asyncio.Task:
            task = asyncio.create_task(client.send(req, rec, t0, model))
            if on_done is not None:
                task.add_done_callback(lambda _t, rec=rec: on_done(rec))
            return task

        async def dispatch() -> None:
            for req, rec in zip(requests, records):
                due = t0 + rec.scheduled_s
                if due >= deadline:
                    return
                if due > time.perf_counter():
                    await asyncio.sleep(due - time.perf_counter())
                tasks.append(started(req, rec))

        dispatcher = asyncio.create_task(dispatch())
        await asyncio.wait([dispatcher], timeout=max(0.0, deadline - time.perf_counter()))
        if tasks:
            await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        stop = time.perf_counter()
        pending = [t for t in [dispatcher, *tasks] if not t.done()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for rec in records:
        if rec.outcome == "unfinished":
            rec.error_kind, rec.error = "unfinished", f"still running at the time limit ({time_limit_s:g} s)"
        elif rec.outcome == "not_sent":
            rec.error_kind, rec.error = "not sent", f"arrival after the time limit ({time_limit_s:g} s)"
    cut = bool(pending) or any(r.outcome == "not_sent" for r in records)
    ends = [r.end_s for r in records if r.end_s is not None]
    duration = (stop - t0) if cut else max(ends, default=stop - t0)
    return RunResult(endpoint.label, endpoint.url, model, rate, arrivals, records, duration,
                     "time limit" if cut else "workload done", started_at)


def run(requests: list[Request], offsets: list[float], endpoint: EndpointConfig, model: str,
        time_limit_s: float, on_done: Callable[[RequestRecord], None] | None = None,
        rate: float | None = None, arrivals: str = "") -> RunResult:
    """`run_async` on a fresh event loop."""
    return asyncio.run(run_async(requests, offsets, endpoint, model, time_limit_s, on_done, rate, arrivals))
