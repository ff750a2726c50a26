"""benchmarks/ttft_phases.py (scripts/exp_ttft_phases.py): phase means from two scrapes of the
router's own metrics text."""

from __future__ import annotations

import pytest

from benchmarks import ttft_phases
from proto import generate_pb2 as gen
from router import metrics as router_metrics
from router.metrics import RouterMetrics


@pytest.fixture(scope="module")
def exp():
    return ttft_phases


def _finish(m: RouterMetrics, ms: tuple[float, ...], ttft_ms: float) -> None:
    final = gen.GenerateResponse(request_id="r", finish_reason="length")
    final.usage.prompt_tokens, final.usage.completion_tokens = 5, 3
    t = final.timing
    t.router_queue_ms, t.prefill_queue_ms, t.prefill_compute_ms, t.kv_transfer_ms, t.decode_queue_ms = ms
    t.ttft_ms, t.mean_tpot_ms = ttft_ms, 10.0
    req = m.request(arrival=0.0)
    req.running()
    req.finished(final, now=1.0)


def test_the_means_are_over_the_requests_finished_between_the_scrapes(exp):
    m = RouterMetrics()
    _finish(m, (100.0, 100.0, 100.0, 100.0, 100.0), 500.0)  # before the case: left out
    before = exp.histogram_sums(router_metrics.render(m.registry)[0].decode())
    _finish(m, (2.0, 0.0, 16.0, 6.0, 12.0), 30.0)
    _finish(m, (4.0, 0.0, 18.0, 8.0, 14.0), 34.0)
    after = exp.histogram_sums(router_metrics.render(m.registry)[0].decode())
    means = exp.phase_means_ms(before, after)
    assert means["ttft_ms"] == pytest.approx(32.0)
    assert means["router_queue_ms"] == pytest.approx(3.0)
    assert means["prefill_compute_ms"] == pytest.approx(17.0)
    assert means["kv_transfer_ms"] == pytest.approx(7.0)
    assert means["decode_queue_ms"] == pytest.approx(13.0)
    assert exp.phase_means_ms(after, after) == {}  # no request in between: no mean
