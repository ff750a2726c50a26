"""What one worker shows the SLO controller (pdcluster/live_controller.py): read in the worker's
process from its server, as plain values (a Ray actor returns them to the router's process).

    prefill_tokens_per_s  a prefill worker's prompt tokens per second of prefill step time
    batch                 a decode worker's (sequences, step seconds) of the batch whose step takes
                          the limit, from a line through its steps per batch bucket (None before two
                          buckets were seen, or when the step time does not grow with the batch)
    kv_used               a decode worker's share of KV blocks in use by its sequences: blocks reserved
                          for prompts still at a prefill worker are left out (they are the prefill
                          side's backlog: counted here, a slow prefill side would look like a full
                          decode side, and neither could give the other a worker)
    running, in_flight    sequences in its decode batch; requests it holds (flip the idlest)
    can_flip              not tensor-parallel
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class WorkerSignals:
    worker_id: str
    role: str
    in_flight: int
    prefill_tokens_per_s: float = 0.0
    batch: tuple[float, float] | None = None
    kv_used: float = 0.0
    running: int = 0
    can_flip: bool = True  # False: tensor-parallel (its ranks hold shards, not whole weights)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkerSignals:
        batch = d.get("batch")
        return cls(**{**d, "batch": tuple(batch) if batch is not None else None})


def batch_at(by_batch: dict, limit_s: float, max_seqs: int) -> tuple[float, float] | None:
    """(sequences, step seconds) of the batch whose decode step takes `limit_s`, from the steps seen
    per batch bucket; None with fewer than two buckets or no growth with the batch."""
    points = [(t.seqs / t.steps, t.seconds / t.steps) for (phase, _), t in by_batch.items()
              if phase == "decode" and t.steps]
    if len(points) < 2:
        return None
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0
    if slope <= 0:
        return None
    base = my - slope * mx
    b = max(1.0, min(float(max_seqs), (limit_s - base) / slope))
    return b, base + slope * b


def read_worker(server: Any, role: str, limit_s: float) -> WorkerSignals:
    """A prefill or decode worker server's signals; `limit_s`: the decode step time aimed at."""
    by_phase, by_batch = server.step_totals.snapshots()
    can_flip = server.engine.tensor_parallel_size == 1
    if role == "prefill":
        t = by_phase["prefill"]
        return WorkerSignals(server.worker_id, role, server.in_flight(), can_flip=can_flip,
                             prefill_tokens_per_s=t.tokens / t.seconds if t.seconds else 0.0)
    load = server.engine.load()
    reserved = server.decode.reserved_blocks() if hasattr(server, "decode") else 0
    return WorkerSignals(server.worker_id, role, server.in_flight(), can_flip=can_flip,
                         batch=batch_at(by_batch, limit_s, server.engine.cfg.max_num_seqs),
                         kv_used=max(0, load.blocks_used - reserved) / max(1, load.blocks_used + load.blocks_free),
                         running=load.running)
