"""A worker's engine thread survives a bug in its loop: the requests it held fail, the next ones are served.

(The loop once died on `deque mutated during iteration` when a colocated Reserve raced it; the
worker then queued requests forever.) Real router and colocated worker servers in this process."""

from __future__ import annotations

import concurrent.futures as cf

import grpc
import pytest

from engine.config import EngineConfig
from pdcluster.client import Client
from pdcluster.local_cluster import LocalCluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def colocated(checkpoint):
    path = str(checkpoint("llama-gqa"))
    with LocalCluster(EngineConfig(model=path, num_blocks=256, max_model_len=256, num_threads=1), mode="colocated",
                      router={"request_timeout_s": 30}) as c:
        yield c.decode_workers[0], c.router


def test_a_failing_loop_iteration_does_not_kill_the_engine_thread(colocated, monkeypatch):
    worker, router = colocated
    calls = {"n": 0}
    original = worker._expire_reservations

    def flaky() -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("deque mutated during iteration")  # what the race raised
        original()

    monkeypatch.setattr(worker, "_expire_reservations", flaky)
    with Client(router.address) as client:
        for _ in range(3):  # some may be failed by the bad iteration; the thread must live on
            try:
                client.complete([5, 6, 7, 8], max_tokens=4, temperature=0.0, ignore_eos=True)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE
        assert calls["n"] > 3 and worker._thread.is_alive()
        out = client.complete([5, 6, 7, 8], max_tokens=4, temperature=0.0, ignore_eos=True)
        assert len(out.token_ids) == 4


def test_concurrent_reserves_while_the_loop_runs_all_finish(colocated):
    _, router = colocated
    with Client(router.address) as client, cf.ThreadPoolExecutor(32) as pool:
        prompts = [[5 + i % 50, 6, 7] * (1 + i % 20) for i in range(96)]
        outs = list(pool.map(lambda p: client.complete(p, max_tokens=6, temperature=0.0, ignore_eos=True), prompts))
    assert all(len(o.token_ids) == 6 for o in outs)
