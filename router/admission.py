"""Admission control: bounded work in the cluster, in requests and in prompt tokens.

A request is admitted when fewer than `max_requests` are in flight (admitted, not finished) and the
prompt tokens of admitted requests still waiting for their first token, its own included, stay within
`max_queued_prompt_tokens` (a prompt larger than that alone is admitted when nothing else waits, else
it could never be). Anything beyond is refused at once with RESOURCE_EXHAUSTED and a retry hint:
queueing it would only make every admitted request slower.

The hint is about when a place frees up: the recent mean request duration (an EWMA) divided by the
requests in flight (they finish at that rate).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

RETRY_AFTER_METADATA = "retry-after-ms"  # trailing metadata of a refusal: the hint in milliseconds


@dataclass(frozen=True)
class AdmissionLimits:
    max_requests: int = 512
    max_queued_prompt_tokens: int = 262144

    def __post_init__(self) -> None:
        if self.max_requests < 1 or self.max_queued_prompt_tokens < 1:
            raise ValueError(f"admission limits must be >= 1, got {self}")


class Refused(Exception):
    """Over a limit; `retry_after_s` is the hint."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class Admitted:
    """One admitted request's place: `started()` at its first token, `release()` when it ends."""

    admission: Admission
    prompt_tokens: int
    since: float = 0.0
    waiting: bool = True
    released: bool = False

    def started(self) -> None:
        self.admission._started(self)

    def release(self) -> None:
        self.admission._release(self)


class Admission:
    def __init__(self, limits: AdmissionLimits | None = None) -> None:
        self.limits = limits or AdmissionLimits()
        self._lock = threading.Lock()
        self.requests = 0  # admitted, not finished
        self.queued_prompt_tokens = 0  # of admitted requests without their first token yet
        self._duration_s = 1.0  # EWMA of admitted requests' durations

    def admit(self, prompt_tokens: int) -> Admitted:
        """A place for a request of `prompt_tokens`, or Refused naming the limit and the hint."""
        lim = self.limits
        with self._lock:
            if self.requests >= lim.max_requests:
                raise Refused(f"overloaded: {self.requests} requests in flight, the limit "
                              f"(router.max_requests) is {lim.max_requests}; retry after {self._hint():.2f} s",
                              self._hint())
            if self.queued_prompt_tokens and self.queued_prompt_tokens + prompt_tokens > lim.max_queued_prompt_tokens:
                raise Refused(f"overloaded: {self.queued_prompt_tokens} prompt tokens wait for prefill, this prompt "
                              f"has {prompt_tokens} and the limit (router.max_queued_prompt_tokens) is "
                              f"{lim.max_queued_prompt_tokens}; retry after {self._hint():.2f} s", self._hint())
            self.requests += 1
            self.queued_prompt_tokens += prompt_tokens
        return Admitted(self, prompt_tokens, time.monotonic())

    def _hint(self) -> float:
        """Under self._lock: seconds until a place is likely to free up."""
        return min(max(self._duration_s / max(1, self.requests), 0.05), 30.0)

    def _started(self, a: Admitted) -> None:
        with self._lock:
            if a.waiting and not a.released:
                a.waiting = False
                self.queued_prompt_tokens -= a.prompt_tokens

    def _release(self, a: Admitted) -> None:
        now = time.monotonic()
        with self._lock:
            if a.released:
                return
            a.released = True
            self.requests -= 1
            if a.waiting:
                self.queued_prompt_tokens -= a.prompt_tokens
            if not a.waiting:  # it ran (a request refused by a worker says nothing of durations)
                self._duration_s = 0.9 * self._duration_s + 0.1 * (now - a.since)
