"""KV transfers that fail (fault injection in kv_transfer: drop, corrupt, stall) are retried by the router
on another pair and the client gets the right tokens; a reservation whose commit never comes is freed
by its lease. Each with a dense model and with DeepSeek-V3's latent attention and routed experts.
Real gRPC servers of the workers and the router in this process (no Ray)."""

from __future__ import annotations

import concurrent.futures as cf
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

PROMPTS = [[5 + i, 9, 17, 33 + i, 60, 61, 62 + i] * (1 + i) for i in range(8)]
N = 8


def _cfg(checkpoint, shape: str) -> EngineConfig:
    return EngineConfig(model=str(checkpoint(shape)), num_blocks=64, max_model_len=256, num_threads=1)


@pytest.fixture(scope="module", params=["llama-gqa", "deepseek-v3"])
def shape(request) -> str:
    """A dense model, and latent attention with routed experts (its KV a latent row per token)."""
    return request.param


@pytest.fixture(scope="module")
def cluster(checkpoint, shape):
    with LocalCluster(_cfg(checkpoint, shape), num_decode=2, decode={"reservation_ttl_s": 2.0}, prefill={"kv_timeout_s": 2.0},
                      router={"request_timeout_s": 60, "max_retries": 2}) as c:
        with Client(c.address) as client:
            expected = [client.complete(p, max_tokens=N, temperature=0.0, ignore_eos=True).token_ids for p in PROMPTS]
        yield c.router, c.prefill_workers[0], c.decode_workers, expected


def _used(*servers) -> list[int]:
    return [s.stats().kv_blocks_used for s in servers]


def _wait_free(*servers, timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while any(_used(*servers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _used(*servers)


@pytest.mark.parametrize("spec", [
    "drop=1,on=layer",  # a layer never arrives: the commit is refused
    "corrupt=1,on=layer",  # a payload byte flips after its checksum: DATA_LOSS
    "corrupt=1,on=commit",  # an impossible first token: the decode worker refuses the commit
    "delay_ms=4000,on=layer",  # a stalled transfer, past the 2 s transfer timeout
])
def test_a_failing_transfer_is_retried_on_another_pair(cluster, checkpoint, shape, spec):
    router, good, decodes, expected = cluster
    bad = PrefillWorkerServer(_cfg(checkpoint, shape), "prefill-bad", kv_timeout_s=2.0, kv_faults=spec)
    # the faulty worker is picked first (fewest queued tokens, then the first listed)
    router.set_workers([("prefill-bad", "prefill", bad.address), (good.worker_id, "prefill", good.address)]
                       + [(d.worker_id, "decode", d.address) for d in decodes])
    before = router.metrics.retries._value.get()
    try:
        with Client(router.address, timeout_s=60) as client, cf.ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda p: client.complete(p, max_tokens=N, temperature=0.0, ignore_eos=True), PROMPTS))
        assert [o.token_ids for o in outs] == expected
        assert sum(bad.prefill.sender.fault_injector.injected.values()) >= 1
        assert router.metrics.retries._value.get() - before >= 1
        assert _wait_free(bad, good, *decodes) == [0, 0, 0, 0]
    finally:
        router.set_workers([(good.worker_id, "prefill", good.address)] + [(d.worker_id, "decode", d.address) for d in decodes])
        bad.stop()


def test_random_faults_on_every_transfer_lose_nothing(cluster, checkpoint, shape):
    """Drops, corruptions and delays at random on both prefill workers: every request still ends right."""
    router, good, decodes, expected = cluster
    spec = "drop=0.05,corrupt=0.05,delay=0.2,delay_ms=100,seed=3"
    faulty = [PrefillWorkerServer(_cfg(checkpoint, shape), f"prefill-f{i}", kv_timeout_s=2.0, kv_faults=spec) for i in range(2)]
    router.set_workers([(p.worker_id, "prefill", p.address) for p in faulty]
                       + [(d.worker_id, "decode", d.address) for d in decodes])
    router.max_retries = 8
    try:
        with Client(router.address, timeout_s=120) as client, cf.ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda p: client.complete(p, max_tokens=N, temperature=0.0, ignore_eos=True),
                                 PROMPTS * 3))
        assert [o.token_ids for o in outs] == expected * 3
        assert sum(sum(p.prefill.sender.fault_injector.injected.values()) for p in faulty) >= 1
        assert _wait_free(*faulty, *decodes) == [0, 0, 0, 0]
    finally:
        router.max_retries = 2
        router.set_workers([(good.worker_id, "prefill", good.address)] + [(d.worker_id, "decode", d.address) for d in decodes])
        for p in faulty:
            p.stop()


def test_a_commit_that_never_comes_is_freed_by_the_lease(cluster, checkpoint, shape):
    """Commit and abort both lost, nobody tells the decode worker: its reservation's lease frees it."""
    _, _, decodes, _ = cluster
    decode = decodes[0]
    lossy = PrefillWorkerServer(_cfg(checkpoint, shape), "prefill-lossy", kv_timeout_s=1.0, kv_faults="drop=1,on=commit+abort")
    ids = list(range(3, 60))
    try:
        with grpc.insecure_channel(decode.address) as ch:
            ticket = wk_grpc.DecodeWorkerStub(ch).Reserve(
                wk.ReserveRequest(request_id="leased", token_ids=ids, sampling=gen.SamplingParams(max_tokens=4)),
                timeout=10).ticket
        assert _used(decode) == [4]
        with grpc.insecure_channel(lossy.address) as ch, pytest.raises(grpc.RpcError) as err:
            wk_grpc.PrefillWorkerStub(ch).Prefill(
                wk.PrefillRequest(request_id="leased", token_ids=ids, sampling=gen.SamplingParams(max_tokens=4),
                                  ticket=ticket), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "lost in transit" in err.value.details()
        assert _wait_free(decode, lossy, timeout_s=5.0) == [0, 0]  # the 2 s lease
    finally:
        lossy.stop()
