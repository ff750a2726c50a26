"""Router metrics (recording, rendering, the per-worker collector) and structured logs; no servers."""

from __future__ import annotations

import io
import json
import logging

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.logs import request_context, setup_logging
from proto import generate_pb2 as gen
from proto import worker_pb2 as wk
from router import metrics as router_metrics
from router.metrics import PHASES, RouterMetrics
from router.worker_pool import WorkerHandle


def _families(registry=None) -> dict:
    body, content_type = router_metrics.render(registry)
    assert content_type.startswith("text/plain; version=0.0.4")
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def _value(families: dict, family: str, sample: str, **labels: str) -> float:
    for s in families[family].samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError(f"{sample} {labels}")


def _final(finish: str = "length", prompt: int = 7, completion: int = 4) -> gen.GenerateResponse:
    final = gen.GenerateResponse(request_id="r", finish_reason=finish)
    final.usage.prompt_tokens, final.usage.completion_tokens = prompt, completion
    t = final.timing
    t.router_queue_ms, t.prefill_queue_ms, t.prefill_compute_ms, t.kv_transfer_ms = 1.0, 2.0, 30.0, 4.0
    t.decode_queue_ms, t.ttft_ms, t.mean_tpot_ms = 5.0, 40.0, 20.0
    return final


def test_a_finished_request_records_latencies_phases_tokens_and_reason():
    m = RouterMetrics()
    req = m.request(arrival=100.0)
    assert _value(_families(m.registry), "pdcluster_requests_queued", "pdcluster_requests_queued") == 1
    req.running()
    f = _families(m.registry)
    assert _value(f, "pdcluster_requests_queued", "pdcluster_requests_queued") == 0
    assert _value(f, "pdcluster_requests_running", "pdcluster_requests_running") == 1
    for now in (100.04, 100.06, 100.09):  # three arrivals: two gaps
        req.tokens(now)
    req.finished(_final(), now=100.1)
    req.close()  # after the final message: nothing more
    f = _families(m.registry)
    assert _value(f, "pdcluster_requests_running", "pdcluster_requests_running") == 0
    assert _value(f, "pdcluster_time_to_first_token_seconds", "pdcluster_time_to_first_token_seconds_count") == 1
    assert _value(f, "pdcluster_time_to_first_token_seconds", "pdcluster_time_to_first_token_seconds_sum") == \
        pytest.approx(0.04)
    assert _value(f, "pdcluster_e2e_request_latency_seconds", "pdcluster_e2e_request_latency_seconds_sum") == \
        pytest.approx(0.1)
    assert _value(f, "pdcluster_inter_token_latency_seconds", "pdcluster_inter_token_latency_seconds_count") == 2
    assert _value(f, "pdcluster_inter_token_latency_seconds", "pdcluster_inter_token_latency_seconds_sum") == \
        pytest.approx(0.05)
    assert _value(f, "pdcluster_time_per_output_token_seconds",
                  "pdcluster_time_per_output_token_seconds_sum") == pytest.approx(0.02)
    for phase, ms in zip(PHASES, (1.0, 2.0, 30.0, 4.0, 5.0)):
        assert _value(f, "pdcluster_request_phase_seconds", "pdcluster_request_phase_seconds_sum",
                      phase=phase) == pytest.approx(ms / 1e3)
    assert _value(f, "pdcluster_requests_finished", "pdcluster_requests_finished_total", finish_reason="length") == 1
    assert _value(f, "pdcluster_requests_finished", "pdcluster_requests_finished_total", finish_reason="stop") == 0
    assert _value(f, "pdcluster_prompt_tokens", "pdcluster_prompt_tokens_total") == 7
    assert _value(f, "pdcluster_generation_tokens", "pdcluster_generation_tokens_total") == 4


def test_names_units_types_and_buckets_follow_prometheus_conventions():
    f = _families(RouterMetrics().registry)
    types = {name: fam.type for name, fam in f.items() if name.startswith("pdcluster_")}
    assert types == {
        "pdcluster_time_to_first_token_seconds": "histogram",
        "pdcluster_inter_token_latency_seconds": "histogram",
        "pdcluster_time_per_output_token_seconds": "histogram",
        "pdcluster_e2e_request_latency_seconds": "histogram",
        "pdcluster_request_phase_seconds": "histogram",
        "pdcluster_requests_running": "gauge",
        "pdcluster_requests_queued": "gauge",
        "pdcluster_requests_finished": "counter",
        "pdcluster_request_errors": "counter",
        "pdcluster_request_retries": "counter",
        "pdcluster_local_prefills": "counter",
        "pdcluster_prompt_tokens": "counter",
        "pdcluster_generation_tokens": "counter",
        "pdcluster_routed_prompt_tokens": "counter",
        "pdcluster_routed_requests": "counter",
        "pdcluster_routed_max_tokens": "counter",
        "pdcluster_controller_decisions": "counter",
        "pdcluster_controller_target_workers": "gauge",
        "pdcluster_routed_cached_tokens": "counter",
    }
    buckets = [float(s.labels["le"]) for s in f["pdcluster_e2e_request_latency_seconds"].samples
               if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]
    assert buckets[0] <= 0.005 and buckets[-1] >= 300  # ms to minutes
    reasons = {s.labels["finish_reason"] for s in f["pdcluster_requests_finished"].samples}
    assert reasons == {"stop", "length", "abort"}


def test_colocated_mode_has_no_prefill_queue_or_kv_transfer_phase_and_unreached_decode_is_skipped():
    m = RouterMetrics(mode="colocated")
    final = _final()
    final.timing.decode_queue_ms = 0.0  # never reached a decode step
    m.request(arrival=0.0).finished(final, now=1.0)
    f = _families(m.registry)
    counts = {s.labels["phase"]: s.value for s in f["pdcluster_request_phase_seconds"].samples
              if s.name.endswith("_count")}
    assert counts == {"router_queue": 1, "prefill_compute": 1, "decode_queue": 0}


def test_errors_are_counted_by_code_once_and_a_vanished_client_counts_as_cancelled():
    m = RouterMetrics()
    bad = m.request()
    bad.error(grpc.StatusCode.INVALID_ARGUMENT)
    bad.error(grpc.StatusCode.UNAVAILABLE)  # already ended: ignored
    bad.close()
    gone = m.request()
    gone.running()
    gone.close()  # neither finished nor failed: the client went away
    f = _families(m.registry)
    assert _value(f, "pdcluster_request_errors", "pdcluster_request_errors_total", code="INVALID_ARGUMENT") == 1
    assert _value(f, "pdcluster_request_errors", "pdcluster_request_errors_total", code="CANCELLED") == 1
    assert not any(s.labels.get("code") == "UNAVAILABLE" for s in f["pdcluster_request_errors"].samples)
    assert _value(f, "pdcluster_requests_running", "pdcluster_requests_running") == 0
    assert _value(f, "pdcluster_requests_queued", "pdcluster_requests_queued") == 0


def _worker(wid: str, role: str, stats: wk.WorkerStats | None, healthy: bool = True) -> WorkerHandle:
    return WorkerHandle(wid, role, "127.0.0.1:1", channel=None, stub=None, healthy=healthy, stats=stats)


def test_worker_collector_exposes_gauges_and_counters_from_the_last_stats():
    prefill = wk.WorkerStats(worker_id="p0", role=wk.WORKER_ROLE_PREFILL, running=1, queued=2, kv_blocks_used=3,
                             kv_blocks_free=61, queued_prefill_tokens=40, prompt_tokens=900,
                             prefix_cache_hit_tokens=320, kv_bytes_sent={"shm": 4096, "grpc": 1024})
    decode = wk.WorkerStats(worker_id="d0", role=wk.WORKER_ROLE_DECODE, running=5, kv_blocks_used=10,
                            kv_blocks_free=54, steps=[wk.StepPhaseStats(phase="decode", steps=7, seconds=0.35, seqs=21,
                                                                        tokens=21, context_tokens=2100)],
                            steps_by_batch=[wk.StepPhaseStats(phase="decode", steps=2, seconds=0.05, seqs=2, tokens=2,
                                                              context_tokens=200, batch_min=1),
                                            wk.StepPhaseStats(phase="decode", steps=5, seconds=0.3, seqs=19, tokens=19,
                                                              context_tokens=1900, batch_min=2)])
    workers = [_worker("p0", "prefill", prefill), _worker("d0", "decode", decode), _worker("d1", "decode", None, False)]
    m = RouterMetrics(lambda: workers)
    f = _families(m.registry)
    assert f["pdcluster_worker_requests_running"].type == "gauge"
    assert _value(f, "pdcluster_worker_requests_running", "pdcluster_worker_requests_running", worker="d0",
                  role="decode") == 5
    assert _value(f, "pdcluster_worker_requests_queued", "pdcluster_worker_requests_queued", worker="p0") == 2
    assert _value(f, "pdcluster_worker_kv_blocks_used", "pdcluster_worker_kv_blocks_used", worker="p0",
                  role="prefill") == 3
    assert _value(f, "pdcluster_worker_kv_blocks_free", "pdcluster_worker_kv_blocks_free", worker="d0") == 54
    assert _value(f, "pdcluster_worker_queued_prefill_tokens", "pdcluster_worker_queued_prefill_tokens",
                  worker="p0") == 40
    assert f["pdcluster_worker_kv_transfer_bytes"].type == "counter"
    assert _value(f, "pdcluster_worker_kv_transfer_bytes", "pdcluster_worker_kv_transfer_bytes_total", worker="p0",
                  backend="shm") == 4096
    assert _value(f, "pdcluster_worker_kv_transfer_bytes", "pdcluster_worker_kv_transfer_bytes_total",
                  backend="grpc") == 1024
    assert _value(f, "pdcluster_worker_prefix_cache_hit_tokens", "pdcluster_worker_prefix_cache_hit_tokens_total",
                  worker="p0", role="prefill") == 320
    assert _value(f, "pdcluster_worker_prompt_tokens", "pdcluster_worker_prompt_tokens_total", worker="p0") == 900
    assert f["pdcluster_worker_steps"].type == "counter"
    assert _value(f, "pdcluster_worker_steps", "pdcluster_worker_steps_total", worker="d0", phase="decode") == 7
    assert _value(f, "pdcluster_worker_step_seconds", "pdcluster_worker_step_seconds_total", worker="d0") == 0.35
    assert _value(f, "pdcluster_worker_step_seqs", "pdcluster_worker_step_seqs_total", phase="decode") == 21
    assert _value(f, "pdcluster_worker_step_context_tokens", "pdcluster_worker_step_context_tokens_total",
                  worker="d0", role="decode", phase="decode") == 2100
    # per batch-size bucket, in families of their own (summing them gives the phase's totals)
    assert _value(f, "pdcluster_worker_steps_by_batch", "pdcluster_worker_steps_by_batch_total", worker="d0",
                  phase="decode", batch="1") == 2
    assert _value(f, "pdcluster_worker_step_seqs_by_batch", "pdcluster_worker_step_seqs_by_batch_total",
                  batch="2-3") == 19
    assert not any("batch" in s.labels for s in f["pdcluster_worker_steps"].samples)
    assert _value(f, "pdcluster_worker_up", "pdcluster_worker_up", worker="d1", role="decode") == 0
    assert _value(f, "pdcluster_worker_up", "pdcluster_worker_up", worker="p0") == 1
    assert not any(s.labels["worker"] == "d1" for s in f["pdcluster_worker_kv_blocks_free"].samples)  # no stats yet


def test_render_defaults_to_the_current_router_registry():
    a, b = RouterMetrics(), RouterMetrics()
    b.request().error(grpc.StatusCode.NOT_FOUND)
    router_metrics.set_current(b.registry)
    try:
        f = _families()
        assert _value(f, "pdcluster_request_errors", "pdcluster_request_errors_total", code="NOT_FOUND") == 1
        router_metrics.clear_current(a.registry)  # not current: no effect
        assert router_metrics.render()[0] == router_metrics.render(b.registry)[0]
    finally:
        router_metrics.clear_current(b.registry)
    with pytest.raises(LookupError):
        router_metrics.render()


# ------------------------------------------------------------------------------------- logs
@pytest.fixture
def log_stream():
    stream = io.StringIO()
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield stream
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)


def test_json_logs_carry_the_request_id_from_the_context(log_stream):
    setup_logging("DEBUG", "json", stream=log_stream)
    log = logging.getLogger("pdcluster.test")
    with request_context("req-42"):
        log.info("admitted: %d prompt tokens", 7)
    log.debug("no request here")
    log.warning("explicit", extra={"request_id": "req-7"})
    lines = [json.loads(line) for line in log_stream.getvalue().splitlines()]
    assert [line["message"] for line in lines] == ["admitted: 7 prompt tokens", "no request here", "explicit"]
    assert lines[0]["request_id"] == "req-42" and lines[0]["level"] == "INFO"
    assert lines[0]["logger"] == "pdcluster.test" and lines[0]["time"].endswith("Z")
    assert "request_id" not in lines[1]
    assert lines[2]["request_id"] == "req-7"


def test_text_logs_carry_the_request_id_and_setup_replaces_its_own_handler(log_stream):
    setup_logging("INFO", "text", stream=io.StringIO())
    setup_logging("INFO", "text", stream=log_stream)  # replaces the first one
    log = logging.getLogger("pdcluster.test")
    with request_context("abc123"):
        log.info("finished: stop")
    log.debug("dropped at INFO")
    log.info("plain")
    first, second = log_stream.getvalue().splitlines()
    parts = first.split(" ", 4)
    assert parts[1:] == ["INFO", "pdcluster.test", "[request_id=abc123]", "finished: stop"]
    assert second.endswith(" INFO pdcluster.test plain")
    assert sum(getattr(h, "_pdcluster", False) for h in logging.getLogger().handlers) == 1
    with pytest.raises(ValueError):
        setup_logging("INFO", "xml")
