"""What a worker shows the SLO controller (pdcluster/worker_signals.py): the decode batch whose step
reaches the limit, from a line through the steps seen per batch bucket."""

from __future__ import annotations

from engine.step_stats import PhaseTotals
from pdcluster.worker_signals import WorkerSignals, batch_at


def _steps(*points: tuple[int, float]) -> dict:
    """Ten decode steps per (batch, step seconds) point."""
    return {("decode", b): PhaseTotals(steps=10, seqs=10 * b, seconds=10 * s) for b, s in points}


def test_the_batch_at_the_limit_comes_from_a_line_through_the_buckets():
    # 10 ms + 1 ms a sequence: a 40 ms step holds 30 sequences
    b, s = batch_at(_steps((1, 0.011), (8, 0.018), (16, 0.026)), 0.040, 256)
    assert abs(b - 30) < 1e-6 and abs(s - 0.040) < 1e-9
    assert batch_at(_steps((1, 0.011), (8, 0.018)), 0.040, 16)[0] == 16  # capped at max_num_seqs


def test_no_estimate_from_one_bucket_or_a_step_time_that_does_not_grow():
    assert batch_at(_steps((4, 0.02)), 0.04, 256) is None
    assert batch_at(_steps((1, 0.02), (8, 0.019)), 0.04, 256) is None
    assert batch_at({("prefill", 1): PhaseTotals(steps=3, seqs=3, seconds=0.3)}, 0.04, 256) is None


def test_signals_survive_the_plain_values_a_ray_actor_returns():
    w = WorkerSignals("decode-1", "decode", 3, batch=(30.0, 0.04), kv_used=0.5, running=3)
    d = w.to_dict()
    d["batch"] = list(d["batch"])  # as msgpack / JSON would give it back
    assert WorkerSignals.from_dict(d) == w
