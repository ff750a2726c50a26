"""Every pure decode step of an engine timed: what the offline benchmarks divide a step's bytes by."""

from __future__ import annotations

import time
from typing import Any


class DecodeSteps:
    """Wraps `engine.step`; `totals` (steps, seconds, sequences and attended context summed over the
    decode steps) since the last `reset`."""

    def __init__(self, engine: Any) -> None:
        self.totals = {"steps": 0, "seconds": 0.0, "seqs": 0, "context": 0}
        step = engine.step

        def timed(*args, **kwargs):
            t = time.perf_counter()
            out = step(*args, **kwargs)
            shape = engine.last_step
            if shape is not None and shape.phase == "decode":
                self.totals["steps"] += 1
                self.totals["seconds"] += time.perf_counter() - t
                self.totals["seqs"] += shape.seqs
                self.totals["context"] += shape.context
            return out

        engine.step = timed

    def reset(self) -> None:
        for k in self.totals:
            self.totals[k] = 0

    @property
    def mean_seconds(self) -> float:
        return self.totals["seconds"] / max(1, self.totals["steps"])
