"""What each engine step did and how long it took, summed per phase (prefill / decode).

`Engine.step` notes the shape of the batch it ran (`StepShape`); the worker's engine loop times the
whole iteration -- the step plus handing its tokens to the response streams, the cadence a client
sees -- and adds both to its `StepTotals`. Workers report the totals in `WorkerStats.steps`, the
router exports them as Prometheus counters, and `pdcluster plan calibrate --serving-url` fits the
planner's cost model to them under real load.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

PHASES = ("prefill", "decode")


@dataclass(frozen=True)
class StepShape:
    phase: str  # "prefill" (any prompt chunk in the batch) or "decode" (one token per sequence)
    seqs: int  # sequences in the batch
    tokens: int  # tokens computed
    context: int  # sum over the batch of the tokens attended to (cached + new)


@dataclass
class PhaseTotals:
    steps: int = 0
    seconds: float = 0.0
    seqs: int = 0
    tokens: int = 0
    context: int = 0


@dataclass
class StepTotals:
    """Cumulative per phase since the worker started; written by the engine thread, read by Stats."""

    phases: dict[str, PhaseTotals] = field(default_factory=lambda: {p: PhaseTotals() for p in PHASES})
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, shape: StepShape | None, seconds: float) -> None:
        if shape is None:
            return
        with self._lock:
            t = self.phases[shape.phase]
            t.steps += 1
            t.seconds += seconds
            t.seqs += shape.seqs
            t.tokens += shape.tokens
            t.context += shape.context

    def snapshot(self) -> dict[str, PhaseTotals]:
        with self._lock:
            return {p: PhaseTotals(**vars(t)) for p, t in self.phases.items()}
