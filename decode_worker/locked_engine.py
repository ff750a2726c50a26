"""An `Engine` behind one lock, shared by a worker's gRPC handlers and its engine thread.

A colocated worker serves one as it is: every prompt joins the queue (`add_local`) and runs in the
engine's mixed steps. `DecodeEngine` extends it with reservations whose KV arrives from a prefill
worker; its own prompts (the router's local prefill) take the same way.
"""

from __future__ import annotations

import threading

from engine.engine import Engine
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


class LockedEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.RLock()

    def add_local(self, request_id: str, token_ids: list[int], params: SamplingParams,
                  output_offset: int = 0) -> bool:
        """Prefill a prompt here: it joins the engine's queue and runs in its mixed steps; no KV
        arrives. False when the cache is too full right now."""
        with self._lock:
            return self.engine.try_add_request(request_id, token_ids, params, output_offset)

    def queued_prompt_tokens(self) -> int:
        """Prompt tokens waiting to be prefilled here (local prefills, recomputed sequences)."""
        with self._lock:
            return self.engine.queued_prompt_tokens()

    @property
    def num_reserved(self) -> int:
        """Requests holding blocks while their KV is on its way (none here)."""
        return 0

    def has_work(self) -> bool:
        return self.engine.has_work()

    def step(self) -> list[Sequence]:
        """One engine step; returns the sequences that got a token."""
        with self._lock:
            return self.engine.step()

    def abort_request(self, request_id: str, index: int | None = None) -> bool:
        """Drop the request (or its choice `index`) and free its blocks; whether it was here."""
        with self._lock:
            return self.engine.abort(request_id, index) is not None

    def close(self) -> None:
        """Release what the engine holds beyond memory (its tensor-parallel ranks)."""
        self.engine.close()
