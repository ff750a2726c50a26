"""A tensor-parallel worker on a real local Ray loses a rank (SIGKILL of the child process) under
load: every request completes token-identical to transformers (the router resumes them on the other
decode worker), all blocks come back, the broken worker goes down as a whole and Ray restarts it
with new ranks, which serve again. `pdcluster status`'s rows carry each worker's rank pids."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pdcluster.client import Client
from pdcluster.launcher import up
from tests.integration.kill_streams import streams_through_a_kill
from tests.integration.test_faults import _alive, _membership, _prompts, _retries, small_cluster, wait_blocks_free
from tests.reference import hf_greedy

pytestmark = pytest.mark.slow
MAX_TOKENS = 60


@pytest.fixture(scope="module")
def cluster(builtin_path):
    handle = up(small_cluster({}, {"replicas": 2, "tensor_parallel_size": 2}, 512), say=lambda _: None)
    yield handle
    handle.stop()


def test_a_rank_killed_under_load_loses_no_token_and_its_worker_comes_back(cluster, builtin_path):
    reference = hf_greedy(str(builtin_path), pad_token_id=3)
    decode = [w for w in cluster.workers if w["role"] == "decode"]
    assert all(len(w["ranks"]) == 2 for w in decode)  # rank 0 (the actor) and one child
    # a KV receiver per rank (the direct path), each handshaken by the prefill workers at `up`
    assert all(len(set(w["kv_endpoints"])) == 2 for w in decode)
    prompts = _prompts(6, 30, seed=7)
    before = _retries(cluster)
    victim = decode[0]
    results = streams_through_a_kill(cluster.router_address, prompts, MAX_TOKENS,
                                     lambda: os.kill(victim["ranks"][1], signal.SIGKILL))
    assert results == [reference(p, MAX_TOKENS) for p in prompts]
    assert _retries(cluster) - before >= 1
    assert not any(wait_blocks_free(cluster).values())

    deadline = time.monotonic() + 120  # Ray restarts the actor, which starts new ranks
    while True:
        now = {w["worker_id"]: w for w in _membership(cluster)["workers"]}
        back = now[victim["worker_id"]]
        if back["pid"] != victim["pid"] and _alive(back, cluster.secret):
            break
        assert time.monotonic() < deadline, f"not back after 120 s: {back}"
        time.sleep(1)
    assert len(back["ranks"]) == 2 and not set(back["ranks"]) & set(victim["ranks"])
    cluster.workers = list(now.values())
    with Client(cluster.router_address, timeout_s=120) as client:
        outs = [client.complete(p, max_tokens=8, temperature=0.0, ignore_eos=True).token_ids for p in prompts]
    assert outs == [reference(p, 8) for p in prompts]
