"""Metrics, gRPC health and reflection, end to end over real servers in this process (no Ray)."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig
from pdcluster.client import Client
from pdcluster.local_cluster import LocalCluster
from proto.serving import add_health_and_reflection, bind_server
from router import metrics as router_metrics

pytestmark = pytest.mark.slow

PROMPT = list(range(3, 40))  # 37 tokens: two full 16-token blocks, cached after the first request
NUM_REQUESTS = 3
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def cluster(checkpoint):
    path = str(checkpoint("llama-gqa"))
    cfg = EngineConfig(model=path, num_blocks=64, max_model_len=256, num_threads=1)
    with LocalCluster(cfg, decode={"kv_backend": "auto"}, prefill={"kv_backend": "auto", "kv_timeout_s": 10.0},
                      router={"request_timeout_s": 60}) as c:
        yield (c.router, *c.workers)


@pytest.fixture(scope="module")
def served(cluster):
    """The cluster after NUM_REQUESTS requests and one bad one."""
    router, _, _ = cluster
    with Client(router.address, timeout_s=60) as client:
        outs = [client.complete(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True) for _ in range(NUM_REQUESTS)]
        with pytest.raises(grpc.RpcError) as err:
            client.complete([10**6], max_tokens=2)  # outside the vocabulary
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return outs


def _families(registry=None) -> dict:
    body, _ = router_metrics.render(registry)
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def _samples(families: dict, family: str, sample: str, **labels: str) -> list[float]:
    return [s.value for s in families.get(family, ()).samples
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]


def _scrape_when(registry, ready, timeout: float = 10.0) -> dict:
    """Scrape until `ready(families)` (the worker stats are polled every 0.5 s)."""
    deadline = time.monotonic() + timeout
    while True:
        families = _families(registry)
        if ready(families) or time.monotonic() > deadline:
            return families
        time.sleep(0.1)


def test_request_metrics_count_every_request(cluster, served):
    router, _, _ = cluster
    assert router_metrics.render() == router_metrics.render(router.metrics.registry)  # the current router's
    f = _families(router.metrics.registry)
    for hist in ("pdcluster_time_to_first_token_seconds", "pdcluster_e2e_request_latency_seconds"):
        assert _samples(f, hist, f"{hist}_count") == [NUM_REQUESTS]
        assert _samples(f, hist, f"{hist}_sum")[0] > 0
    phases = {s.labels["phase"]: s.value for s in f["pdcluster_request_phase_seconds"].samples
              if s.name.endswith("_count")}
    assert phases == dict.fromkeys(router_metrics.PHASES, NUM_REQUESTS)
    assert _samples(f, "pdcluster_inter_token_latency_seconds", "pdcluster_inter_token_latency_seconds_count")[0] >= \
        NUM_REQUESTS
    assert _samples(f, "pdcluster_requests_finished", "pdcluster_requests_finished_total",
                    finish_reason="length") == [NUM_REQUESTS]
    assert _samples(f, "pdcluster_prompt_tokens", "pdcluster_prompt_tokens_total") == [NUM_REQUESTS * len(PROMPT)]
    assert _samples(f, "pdcluster_generation_tokens", "pdcluster_generation_tokens_total") == \
        [sum(len(o.token_ids) for o in served)]
    assert _samples(f, "pdcluster_request_errors", "pdcluster_request_errors_total", code="INVALID_ARGUMENT") == [1]
    assert _samples(f, "pdcluster_requests_running", "pdcluster_requests_running") == [0]
    assert _samples(f, "pdcluster_requests_queued", "pdcluster_requests_queued") == [0]


def test_worker_metrics_come_from_the_polled_stats(cluster, served):
    router, prefill, decode = cluster
    backend = prefill.prefill.sender.backend_for(decode.address)  # auto: shm here, grpc across nodes

    def kv_bytes(families: dict) -> list[float]:
        return _samples(families, "pdcluster_worker_kv_transfer_bytes", "pdcluster_worker_kv_transfer_bytes_total",
                        worker="prefill-0", role="prefill", backend=backend)

    def decode_free(families: dict) -> list[float]:
        return _samples(families, "pdcluster_worker_kv_blocks_free", "pdcluster_worker_kv_blocks_free",
                        worker="decode-0")

    f = _scrape_when(router.metrics.registry, lambda fam: bool(kv_bytes(fam)) and decode_free(fam) == [decode.stats().kv_blocks_free] and
                     _samples(fam, "pdcluster_worker_prompt_tokens", "pdcluster_worker_prompt_tokens_total",
                              worker="prefill-0") == [NUM_REQUESTS * len(PROMPT)])
    assert kv_bytes(f)[0] > 0
    hits = _samples(f, "pdcluster_worker_prefix_cache_hit_tokens", "pdcluster_worker_prefix_cache_hit_tokens_total",
                    worker="prefill-0")
    assert hits and hits[0] >= (NUM_REQUESTS - 1) * 32  # the repeats hit the prompt's two full blocks
    for worker, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        assert _samples(f, "pdcluster_worker_up", "pdcluster_worker_up", worker=worker, role=role) == [1]
        for gauge in ("requests_running", "requests_queued", "kv_blocks_used", "kv_blocks_free"):
            name = f"pdcluster_worker_{gauge}"
            assert len(_samples(f, name, name, worker=worker, role=role)) == 1, name
    assert decode_free(f) == [decode.stats().kv_blocks_free]


def _check(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _list_services(address: str) -> set[str]:
    with grpc.insecure_channel(address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                              timeout=5)
        return {s.name for r in responses for s in r.list_services_response.service}


def test_health_and_reflection_on_the_router_and_each_worker(cluster):
    router, prefill, decode = cluster
    common = {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    expected = {
        router.address: {"pdcluster.v1.PDCluster"},
        prefill.address: {"pdcluster.v1.PrefillWorker"},
        decode.address: {"pdcluster.v1.DecodeWorker", "pdcluster.v1.KVReceiver"},
    }
    for address, services in expected.items():
        for service in ("", *services):
            assert _check(address, service) == health_pb2.HealthCheckResponse.SERVING, (address, service)
        assert _list_services(address) == services | common
    with pytest.raises(grpc.RpcError) as err:
        _check(router.address, "no.such.Service")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_health_turns_not_serving_when_stopping():
    server, address = bind_server("127.0.0.1", 0, 4, "health test")
    health = add_health_and_reflection(server, ["pdcluster.v1.PDCluster"])
    server.start()
    try:
        assert _check(address, "") == health_pb2.HealthCheckResponse.NOT_SERVING  # until serving()
        health.serving()
        assert _check(address, "pdcluster.v1.PDCluster") == health_pb2.HealthCheckResponse.SERVING
        health.stopping()
        for service in ("", "pdcluster.v1.PDCluster"):
            assert _check(address, service) == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        server.stop(None)


def test_colocated_mode_metrics(checkpoint):
    path = str(checkpoint("llama-gqa"))
    with LocalCluster(EngineConfig(model=path, num_blocks=64, max_model_len=256, num_threads=1), mode="colocated",
                      router={"request_timeout_s": 60}) as c:
        router, worker = c.router, c.decode_workers[0]
        with Client(router.address, timeout_s=60) as client:
            for _ in range(2):
                client.complete(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
        registry = router.metrics.registry
        f = _scrape_when(registry, lambda fam: _samples(
            fam, "pdcluster_worker_prompt_tokens", "pdcluster_worker_prompt_tokens_total", worker="colocated-0",
            role="colocated") == [2 * len(PROMPT)])
        phases = {s.labels["phase"]: s.value for s in f["pdcluster_request_phase_seconds"].samples
                  if s.name.endswith("_count")}
        assert phases == {"router_queue": 2, "prefill_compute": 2, "decode_queue": 2}
        assert _samples(f, "pdcluster_time_to_first_token_seconds", "pdcluster_time_to_first_token_seconds_count") == [2]
        assert _samples(f, "pdcluster_worker_prefix_cache_hit_tokens", "pdcluster_worker_prefix_cache_hit_tokens_total",
                        worker="colocated-0")[0] >= 32
        assert not _samples(f, "pdcluster_worker_kv_transfer_bytes", "pdcluster_worker_kv_transfer_bytes_total")
        assert _check(worker.address, "pdcluster.v1.DecodeWorker") == health_pb2.HealthCheckResponse.SERVING
        assert "pdcluster.v1.KVReceiver" not in _list_services(worker.address)
