"""Structured logs: one setup for every process of the cluster, and the request id on every line
logged while a request is being handled.

    setup_logging("INFO")           2025-05-01T12:00:00.123Z INFO pdcluster.router [request_id=ab12] admitted ...
    setup_logging("INFO", "json")   {"time": "2025-05-01T12:00:00.123Z", "level": "INFO",
                                     "logger": "pdcluster.router", "message": "admitted ...", "request_id": "ab12"}

The request id comes from `request_id_var`, a context variable the router and the workers set
(`with request_context(rid): ...`) while a thread handles that request; a line logged with
`extra={"request_id": rid}` (from a thread serving many requests, such as an engine loop) names
that id instead. Lines about no request carry none (text: no bracket; json: no key).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TextIO

FORMATS = ("text", "json")
LEVELS = {name: getattr(logging, name) for name in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")}
request_id_var: ContextVar[str | None] = ContextVar("pdcluster_request_id", default=None)


@contextmanager
def request_context(request_id: str) -> Iterator[None]:
    """Lines logged in this block (on this thread / context) carry `request_id`."""
    token = request_id_var.set(request_id)
    try:
        yield
    finally:
        try:
            request_id_var.reset(token)
        except ValueError:  # ended from another thread (a generator closed there): leave that one be
            pass


class RequestIdFilter(logging.Filter):
    """Sets `record.request_id`: an explicit `extra={"request_id": ...}`, else the context's, else None."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", None):
            record.request_id = request_id_var.get()
        return True


def _iso_time(record: logging.LogRecord) -> str:
    """UTC, millisecond precision: 2025-05-01T12:00:00.123Z."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


class TextFormatter(logging.Formatter):
    """`time level logger [request_id=...] message`, then the traceback if any."""

    def format(self, record: logging.LogRecord) -> str:
        rid = getattr(record, "request_id", None)
        tag = f"[request_id={rid}] " if rid else ""
        line = f"{_iso_time(record)} {record.levelname} {record.name} {tag}{record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request_id (when known), exc_info."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "time": _iso_time(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if rid:
            out["request_id"] = rid
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def setup_logging(level: str | int = "INFO", fmt: str = "text", stream: TextIO | None = None) -> logging.Handler:
    """Send the root logger's records at `level` and above to `stream` (stderr) in `fmt` ("text" or
    "json"). Calling it again replaces the handler it installed before; other handlers stay."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    numeric = level if isinstance(level, int) else LEVELS.get(level.upper())
    if numeric is None:
        raise ValueError(f"unknown log level {level!r}; one of {', '.join(LEVELS)}")
    root = logging.getLogger()
    for h in [h for h in root.handlers if getattr(h, "_pdcluster", False)]:
        root.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler._pdcluster = True  # type: ignore[attr-defined]
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root.addHandler(handler)
    root.setLevel(numeric)
    return handler
