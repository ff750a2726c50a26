"""A transfer that the decode worker refuses fails the request clearly and strands no blocks.

Real gRPC servers of both workers and the router in this process (no Ray needed for this)."""

from __future__ import annotations

import time

import grpc
import pytest

from engine.config import EngineConfig
from pdcluster.client import Client
from pdcluster.local_cluster import LocalCluster
from prefill_worker.server import PrefillWorkerServer
from proto import generate_pb2 as gen
from proto import worker_pb2 as wk
from proto import worker_pb2_grpc as wk_grpc

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def servers(checkpoint):
    path = str(checkpoint("llama-gqa"))
    cfg = EngineConfig(model=path, num_blocks=64, max_model_len=256, num_threads=1)
    with LocalCluster(cfg, decode={"reservation_ttl_s": 1.0}, prefill={"kv_timeout_s": 5.0},
                      router={"request_timeout_s": 30}) as c:
        yield c.decode_workers[0], c.prefill_workers[0], c.router


def _reserve(decode, rid):
    with grpc.insecure_channel(decode.address) as ch:
        return wk_grpc.DecodeWorkerStub(ch).Reserve(
            wk.ReserveRequest(request_id=rid, token_ids=list(range(3, 60)), sampling=gen.SamplingParams(max_tokens=4)),
            timeout=10).ticket


def _prefill(prefill, rid, ticket):
    with grpc.insecure_channel(prefill.address) as ch:
        return wk_grpc.PrefillWorkerStub(ch).Prefill(
            wk.PrefillRequest(request_id=rid, token_ids=list(range(3, 60)), sampling=gen.SamplingParams(max_tokens=4),
                              ticket=ticket), timeout=30)


def _used(server) -> int:
    return server.stats().kv_blocks_used


@pytest.mark.parametrize(
    "tamper, message",
    [
        (lambda t: setattr(t, "auth_token", "forged"), "auth token"),
        (lambda t: setattr(t, "transfer_id", "no-such-transfer"), "unknown transfer"),
    ],
)
def test_refused_transfer_fails_clearly_and_the_lease_frees_the_blocks(servers, tamper, message):
    decode, prefill, _ = servers
    ticket = _reserve(decode, f"r-{message}")
    assert _used(decode) == 4
    tamper(ticket)
    with pytest.raises(grpc.RpcError) as err:
        _prefill(prefill, f"r-{message}", ticket)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and message in err.value.details()
    assert _used(prefill) == 0
    deadline = time.monotonic() + 10
    while _used(decode) and time.monotonic() < deadline:  # the reservation's lease expires
        time.sleep(0.1)
    assert _used(decode) == 0


def test_incompatible_ticket_is_refused_before_any_compute(servers):
    decode, prefill, _ = servers
    ticket = _reserve(decode, "r-compat")
    ticket.compat_hash = "0123456789abcdef"
    with pytest.raises(grpc.RpcError) as err:
        _prefill(prefill, "r-compat", ticket)
    assert "incompatible KV layout" in err.value.details()
    with grpc.insecure_channel(decode.address) as ch:
        assert wk_grpc.DecodeWorkerStub(ch).Abort(gen.AbortRequest(request_id="r-compat"), timeout=5).found
    assert _used(decode) == 0


def test_router_reports_a_dead_prefill_worker_and_frees_the_reservation(servers, checkpoint):
    decode, prefill, router = servers
    router.set_workers([("prefill-x", "prefill", "127.0.0.1:1"), ("decode-0", "decode", decode.address)])
    try:
        with Client(router.address, timeout_s=30) as client, pytest.raises(grpc.RpcError) as err:
            client.complete([5, 6, 7, 8], max_tokens=4, temperature=0.0)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "failed on a worker" in err.value.details()
        assert _used(decode) == 0
    finally:
        router.set_workers([("prefill-0", "prefill", prefill.address), ("decode-0", "decode", decode.address)])
    with Client(router.address, timeout_s=30) as client:
        assert len(client.complete([5, 6, 7, 8], max_tokens=4, temperature=0.0, ignore_eos=True).token_ids) == 4


def test_prefill_worker_reports_decode_workers_it_cannot_reach_at_startup(servers, checkpoint):
    """What `pdcluster up` / `scale` asks every prefill worker before serving (pdcluster.worker_launch.check_kv_pairs)."""
    decode, prefill, _ = servers
    assert prefill.connect_kv([decode.address], 5.0) == {}  # grpc to a grpc receiver: fine
    other = EngineConfig(model=str(checkpoint("llama-gqa")), num_blocks=64, max_model_len=256, num_threads=1,
                         block_size=32)  # another KV layout
    odd = PrefillWorkerServer(other, "prefill-odd", kv_timeout_s=5.0)
    shm = PrefillWorkerServer(EngineConfig(model=str(checkpoint("llama-gqa")), num_blocks=64, max_model_len=256,
                                           num_threads=1), "prefill-shm", kv_backend="shm", kv_timeout_s=5.0)
    try:
        errors = odd.connect_kv([decode.address, "127.0.0.1:1"], 2.0)
        assert "incompatible KV layout" in errors[decode.address]
        assert "127.0.0.1:1" in errors  # nobody there
        errors = shm.connect_kv([decode.address], 5.0)
        assert "does not take the shm backend" in errors[decode.address]
    finally:
        odd.stop()
        shm.stop()
