"""The cluster secret: every worker RPC (Reserve, Stream, Prefill, Abort, Stats, Health, KV transfer)
without it, or with a wrong one, is refused with UNAUTHENTICATED before the request is even parsed;
with it, the cluster serves. Standard health checks stay open. Real servers in this process (no Ray)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.config import EngineConfig
from pdcluster.client import Client
from pdcluster.local_cluster import LocalCluster
from prefill_worker.server import PrefillWorkerServer
from proto import generate_pb2 as gen
from proto import kv_transfer_pb2 as kv
from proto import kv_transfer_pb2_grpc as kv_grpc
from proto import worker_pb2 as wk
from proto import worker_pb2_grpc as wk_grpc
from proto.cluster_auth import HEADER, generate_secret, with_secret
from router.server import RouterServer

pytestmark = pytest.mark.slow

SECRET = generate_secret()


@pytest.fixture(scope="module")
def cluster(checkpoint):
    cfg = EngineConfig(model=str(checkpoint("llama-gqa")), num_blocks=64, max_model_len=256, num_threads=1)
    with LocalCluster(cfg, cluster_secret=SECRET, prefill={"kv_timeout_s": 5.0}, router={"request_timeout_s": 30}) as c:
        yield c


@pytest.fixture(scope="module")
def workers(cluster):
    return cluster.decode_workers[0], cluster.prefill_workers[0]


def _calls(decode, prefill):
    """Every RPC of the workers, as (name, call(channel))."""
    ticket = wk.TransferTicket(transfer_id="t", kv_endpoint=decode.address, block_ids=[0], compat_hash="h",
                               auth_token="a", num_tokens=3)
    d = lambda ch: wk_grpc.DecodeWorkerStub(ch)  # noqa: E731
    p = lambda ch: wk_grpc.PrefillWorkerStub(ch)  # noqa: E731
    k = lambda ch: kv_grpc.KVReceiverStub(ch)  # noqa: E731
    return [
        ("Reserve", decode, lambda ch: d(ch).Reserve(wk.ReserveRequest(request_id="x", token_ids=[5, 6, 7]), timeout=5)),
        ("Stream", decode, lambda ch: list(d(ch).Stream(wk.StreamRequest(request_id="x"), timeout=5))),
        ("Abort", decode, lambda ch: d(ch).Abort(gen.AbortRequest(request_id="x"), timeout=5)),
        ("Stats", decode, lambda ch: d(ch).Stats(wk.StatsRequest(), timeout=5)),
        ("Health", decode, lambda ch: d(ch).Health(wk.HealthRequest(), timeout=5)),
        ("Prefill", prefill, lambda ch: p(ch).Prefill(wk.PrefillRequest(request_id="x", token_ids=[5, 6, 7],
                                                                         ticket=ticket), timeout=5)),
        ("Abort", prefill, lambda ch: p(ch).Abort(gen.AbortRequest(request_id="x"), timeout=5)),
        ("Stats", prefill, lambda ch: p(ch).Stats(wk.StatsRequest(), timeout=5)),
        ("KV Handshake", decode, lambda ch: k(ch).Handshake(kv.HandshakeRequest(compat_hash="h"), timeout=5)),
        ("KV SendLayers", decode, lambda ch: k(ch).SendLayers(iter([kv.KVLayer(transfer_id="t")]), timeout=5)),
        ("KV Commit", decode, lambda ch: k(ch).Commit(kv.KVCommit(transfer_id="t"), timeout=5)),
        ("KV Abort", decode, lambda ch: k(ch).Abort(kv.KVAbort(transfer_id="t"), timeout=5)),
    ]


@pytest.mark.parametrize("secret", [None, "wrong", SECRET[:-1]])
def test_every_worker_rpc_without_the_secret_is_unauthenticated(workers, secret):
    decode, prefill = workers
    for name, server, call in _calls(decode, prefill):
        with with_secret(grpc.insecure_channel(server.address), secret) as ch, pytest.raises(grpc.RpcError) as err:
            call(ch)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, err.value.code())
        assert HEADER in err.value.details(), name
    assert decode.stats().kv_blocks_used == 0  # nothing reached the engine


def test_with_the_secret_the_rpcs_are_answered_and_health_checks_stay_open(workers):
    decode, prefill = workers
    with with_secret(grpc.insecure_channel(decode.address), SECRET) as ch:
        assert wk_grpc.DecodeWorkerStub(ch).Stats(wk.StatsRequest(), timeout=5).worker_id == "decode-0"
    for server in (decode, prefill):
        with grpc.insecure_channel(server.address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING


def test_a_router_with_the_secret_serves_and_one_without_fails_clearly(cluster):
    good = cluster.router  # the cluster's router has the secret
    bad = RouterServer(cluster.engine_cfg.model, max_model_len=256, request_timeout_s=30, max_retries=1)
    try:
        bad.set_workers(cluster.members())
        with Client(good.address) as client:
            assert len(client.complete([5, 6, 7], max_tokens=4, temperature=0.0, ignore_eos=True).token_ids) == 4
        with Client(bad.address) as client, pytest.raises(grpc.RpcError) as err:
            client.complete([5, 6, 7], max_tokens=4, temperature=0.0)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "UNAUTHENTICATED" in err.value.details()
    finally:
        bad.stop()


def test_a_prefill_worker_without_the_secret_cannot_send_kv(cluster, workers):
    decode, _ = workers
    outsider = PrefillWorkerServer(cluster.engine_cfg, "prefill-outsider", kv_timeout_s=5.0)
    try:
        errors = outsider.connect_kv([decode.address], 5.0)
        assert "UNAUTHENTICATED" in errors[decode.address]
    finally:
        outsider.stop()
