"""What each engine step did and how long it took, summed per phase (prefill / decode).

`Engine.step` notes the shape of the batch it ran (`StepShape`); the worker's engine loop times the
whole iteration -- the step plus handing its tokens to the response streams, the cadence a client
sees -- and adds both to its `StepTotals`. Workers report the totals in `WorkerStats.steps`, the
router exports them as Prometheus counters, and `pdcluster plan calibrate --serving-url` fits the
planner's cost model to them under real load.

Decode steps are also summed by batch size, in power-of-two buckets (1, 2-3, 4-7, ...): a run's
totals alone give one mean batch per run, which cannot tell the per-step cost from the
per-sequence one, nor show how a step grows with the batch; the buckets do, from the same run
(`pdcluster plan calibrate --from-bench` fits to them).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

PHASES = ("prefill", "decode")
BY_BATCH_PHASES = ("decode",)  # phases also summed per batch-size bucket


def batch_bucket(seqs: int) -> int:
    """The lower bound of the power-of-two bucket `seqs` falls in: 1, 2, 4, 8, ..."""
    return 1 << (max(1, seqs).bit_length() - 1)


def bucket_label(lo: int) -> str:
    """"1", "2-3", "4-7", ... for the bucket starting at `lo`."""
    return "1" if lo == 1 else f"{lo}-{2 * lo - 1}"


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

    def add(self, shape: StepShape, seconds: float) -> None:
        self.steps += 1
        self.seconds += seconds
        self.seqs += shape.seqs
        self.tokens += shape.tokens
        self.context += shape.context


@dataclass
class StepTotals:
    """Cumulative per phase since the worker started; written by the engine thread, read by Stats."""

    phases: dict[str, PhaseTotals] = field(default_factory=lambda: {p: PhaseTotals() for p in PHASES})
    # (phase, bucket lower bound) -> totals of that phase's steps with a batch in the bucket
    by_batch: dict[tuple[str, int], PhaseTotals] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, shape: StepShape | None, seconds: float) -> None:
        if shape is None:
            return
        with self._lock:
            self.phases[shape.phase].add(shape, seconds)
            if shape.phase in BY_BATCH_PHASES:
                self.by_batch.setdefault((shape.phase, batch_bucket(shape.seqs)), PhaseTotals()).add(shape, seconds)

    def snapshots(self) -> tuple[dict[str, PhaseTotals], dict[tuple[str, int], PhaseTotals]]:
        """Copies of ({phase: totals}, {(phase, bucket lower bound): totals} of the buckets that had
        a step, in order), taken at one moment: the buckets add up to their phase."""
        with self._lock:
            return ({p: PhaseTotals(**vars(t)) for p, t in self.phases.items()},
                    {k: PhaseTotals(**vars(t)) for k, t in sorted(self.by_batch.items())})
