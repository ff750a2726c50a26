"""Several choices over the gRPC API (SamplingParams.n / best_of), end to end through a disaggregated
cluster of gRPC servers: each choice equals the offline engine's fork of the same request (choice k
== the request with seed + k); messages carry their choice's index and the last one the total;
best_of sends the n of highest cumulative logprob; the later choices reuse the first's prompt KV;
a worker refuses several choices; Abort frees every choice's blocks; a decode worker stopped
mid-stream: every choice resumes identical."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from pdcluster import SamplingParams
from pdcluster.local_cluster import LocalCluster
from proto import worker_pb2 as wk
from proto import worker_pb2_grpc as wk_grpc
from proto.convert import sampling_to_proto
from tests.integration.openai_helpers import builtin_engine

pytestmark = pytest.mark.slow

PROMPT = [1] + [(11 * j + 5) % 3000 + 30 for j in range(44)]  # 45 tokens: 2 full blocks and a partial one


@pytest.fixture(scope="module")
def cluster(builtin_path):
    with LocalCluster(builtin_engine(builtin_path), 1, 2, router={"request_timeout_s": 60, "max_retries": 2}) as c:
        yield c


def _idle(cluster: LocalCluster) -> None:
    assert cluster.wait_blocks_free(10.0), cluster.blocks_in_use()
    deadline = time.monotonic() + 5
    while cluster.router._active and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not cluster.router._active


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=8, temperature=0.0, n=3),
                                    SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=42, n=4)],
                         ids=["greedy", "seeded"])
def test_each_choice_equals_the_offline_fork(cluster, builtin_llm, params):
    (want,) = builtin_llm.generate([PROMPT], params)
    with cluster.client() as client:
        msgs = list(client.stream(PROMPT, params, request_id="several"))
        got = client.complete_choices(PROMPT, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want.outputs]
    assert [c.index for c in got] == list(range(params.n))
    assert {m.request_id for m in msgs} == {"several"}
    finals = [m for m in msgs if m.finish_reason]
    assert sorted(m.index for m in finals) == list(range(params.n))
    assert msgs[-1].usage.total_completion_tokens == sum(m.usage.completion_tokens for m in finals) == 8 * params.n
    _idle(cluster)


def test_best_of_sends_the_n_of_highest_cumulative_logprob(cluster, builtin_llm):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=2, best_of=5)
    (want,) = builtin_llm.generate([PROMPT], params)
    with cluster.client() as client:
        msgs = list(client.stream(PROMPT, params))
    got = {k: [t for m in msgs if m.index == k for t in m.token_ids] for k in range(2)}
    assert [got[0], got[1]] == [c.token_ids for c in want.outputs]
    assert all(not m.logprobs for m in msgs)  # computed to rank them, not asked for
    assert msgs[-1].usage.total_completion_tokens == 6 * 5
    _idle(cluster)


def _kv_sent(cluster: LocalCluster) -> int:
    return sum(sum(w.stats().kv_bytes_sent.values()) for w in cluster.prefill_workers)


def test_later_choices_reuse_the_first_choice_prompt_kv(cluster):
    prompt = [1] + [(7 * j + 2) % 3000 + 40 for j in range(60)]  # new to the cluster: 3 full blocks + 13 tokens
    index = cluster.router.orchestrator.pool.index
    deadline = time.monotonic() + 15  # the router indexes a worker's cache from its first snapshot on
    while not all(index.knows(w.worker_id) for w in cluster.decode_workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    sent = _kv_sent(cluster)
    params = SamplingParams(max_tokens=4, temperature=0.0, n=4)
    with cluster.client() as client:
        client.complete_choices(prompt, params)
        per_block = cluster.decode_workers[0].engine.kv_bytes_per_block
        moved = _kv_sent(cluster) - sent
    # the first choice moves the 4 blocks of its prompt; each later one only the partial last block
    assert moved == (4 + 3) * per_block
    _idle(cluster)


def test_a_worker_refuses_several_choices(cluster):
    w = cluster.decode_workers[0]
    with grpc.insecure_channel(w.address) as ch:
        stub = wk_grpc.DecodeWorkerStub(ch)
        req = wk.ReserveRequest(request_id="direct", token_ids=PROMPT, num_prompt_tokens=len(PROMPT), max_tokens=4,
                                sampling=sampling_to_proto(SamplingParams(max_tokens=4, n=2)), run_prefill=True)
        with pytest.raises(grpc.RpcError) as e:
            stub.Reserve(req, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "one choice" in e.value.details()


def test_abort_frees_every_choice(cluster):
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True, n=3)
    with cluster.client() as client:
        stream = client.stream(PROMPT, params, request_id="to-abort")
        seen = set()
        for msg in stream:
            seen.add(msg.index)
            if len(seen) == 3:
                break
        assert client.abort("to-abort")
        stream.close()
    _idle(cluster)


def test_a_decode_worker_stopped_mid_stream_every_choice_resumes_identical(builtin_path, builtin_llm):
    params = SamplingParams(max_tokens=60, temperature=0.8, seed=9, ignore_eos=True, n=3)
    (want,) = builtin_llm.generate([PROMPT], params)
    with LocalCluster(builtin_engine(builtin_path), 1, 2, router={"request_timeout_s": 60, "max_retries": 2}) as c, \
            c.client() as client:
        got: dict[int, list[int]] = {0: [], 1: [], 2: []}
        stopped = threading.Event()
        for msg in client.stream(PROMPT, params):
            got[msg.index] += msg.token_ids
            if sum(map(len, got.values())) >= 30 and not stopped.is_set():
                next(w for w in c.decode_workers if w.stats().running).stop()
                stopped.set()
        assert stopped.is_set() and c.router.metrics.retries._value.get() >= 1
        assert [got[k] for k in range(3)] == [o.token_ids for o in want.outputs]
