"""Processes killed under load (SIGKILL, on a real local Ray): every request a dead worker was serving
goes on from the tokens already streamed on another worker, token-identical to transformers' greedy
generation; Ray restarts the dead workers and they rejoin; a killed router answers UNAVAILABLE at once,
the workers free its orphaned requests, and Ray brings it back on the same port. After each test every
live worker's KV blocks return to zero.

One cluster of 2 prefill + 2 decode workers; the first test kills a decode worker mid-generation, the
second a prefill worker while prompts are being prefilled (each needs two live workers of its role),
the third waits for both to be back, the fourth kills the router."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
import signal
import threading
import time

import grpc
import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from common.net import fixed_port
from pdcluster.client import Client
from pdcluster.cluster_config import ClusterConfig, load_cluster_config
from pdcluster.launcher import up
from proto import worker_pb2 as wk
from proto import worker_pb2_grpc as wk_grpc
from proto.cluster_auth import with_secret

pytestmark = pytest.mark.slow

MAX_TOKENS = 120


def small_cluster(prefill: dict, decode: dict, max_model_len: int) -> ClusterConfig:
    """The repository's cluster.yaml with the pools changed as given, fixed ports, 2 retries, a 64 MiB
    KV cache and one thread per worker."""
    cfg = load_cluster_config("cluster.yaml")
    pools = (dataclasses.replace(cfg.pools[0], **prefill), dataclasses.replace(cfg.pools[1], **decode))
    return dataclasses.replace(
        cfg, pools=pools, router=dataclasses.replace(cfg.router, grpc_port=fixed_port(), http_port=fixed_port(),
                                                     max_retries=2),
        kv_cache=dataclasses.replace(cfg.kv_cache, memory_mb=64),
        model=dataclasses.replace(cfg.model, path="builtin:tiny-llama", max_model_len=max_model_len),
        engine=dataclasses.replace(cfg.engine, num_threads=1),
    ).validate()


@pytest.fixture(scope="module")
def cluster(builtin_path):
    cfg = small_cluster({"replicas": 2}, {"replicas": 2}, 1024)
    # every prompt goes through a prefill worker (none is prefilled on its decode worker), so killing
    # one always catches prompts on it, whatever the queues look like
    cfg = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, local_prefill_max_tokens=0))
    handle = up(cfg, say=lambda _: None)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def reference(builtin_path):
    hf = AutoModelForCausalLM.from_pretrained(builtin_path).eval()

    def ref(ids: list[int], n: int) -> list[int]:
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=3)
        return out[0, len(ids):].tolist()

    return ref


def _stub(w: dict, secret: str | None):
    ch = with_secret(grpc.insecure_channel(w["address"]), secret)
    return ch, (wk_grpc.PrefillWorkerStub(ch) if w["role"] == "prefill" else wk_grpc.DecodeWorkerStub(ch))


def _alive(w: dict, secret: str | None) -> bool:
    ch, stub = _stub(w, secret)
    try:
        stub.Stats(wk.StatsRequest(), timeout=2)
        return True
    except grpc.RpcError:
        return False
    finally:
        ch.close()


def _kill(handle, role: str) -> dict:
    victims = [w for w in handle.workers if w["role"] == role and _alive(w, handle.secret)]
    assert len(victims) >= 2, f"need two live {role} workers, have {len(victims)}"
    os.kill(victims[0]["pid"], signal.SIGKILL)
    return victims[0]


def wait_blocks_free(handle, timeout_s: float = 15.0) -> dict[str, int]:
    """Used KV blocks of every live worker, once all are zero (or the timeout passed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        used = {}
        for w in handle.workers:
            if not _alive(w, handle.secret):
                continue
            ch, stub = _stub(w, handle.secret)
            with ch:
                used[w["worker_id"]] = stub.Stats(wk.StatsRequest(), timeout=5).kv_blocks_used
        if not any(used.values()) or time.monotonic() > deadline:
            return used


def _retries(handle) -> float:
    text = httpx.get(f"http://{handle.http_address}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("pdcluster_request_retries_total"))


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 2000, (length + i,), generator=g).tolist() for i in range(n)]


def test_a_decode_worker_killed_mid_generation_loses_no_request_and_no_token(cluster, reference):
    prompts = _prompts(8, 40, seed=1)
    started = [threading.Event() for _ in prompts]
    before = _retries(cluster)

    def run(i: int) -> list[list[int]]:
        chunks = []
        with Client(cluster.router_address, timeout_s=120) as client:
            for chunk in client.stream(prompts[i], max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True):
                chunks.append(list(chunk.token_ids))
                if sum(map(len, chunks)) >= 5:
                    started[i].set()
                last = chunk
        assert last.finish_reason == "length" and last.usage.completion_tokens == MAX_TOKENS
        return chunks

    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(run, i) for i in range(len(prompts))]
        for e in started:
            assert e.wait(60), "streams did not start"
        victim = _kill(cluster, "decode")
        results = [f.result(timeout=180) for f in futures]
    for prompt, chunks in zip(prompts, results):
        tokens = [t for c in chunks for t in c]
        assert tokens == reference(prompt, MAX_TOKENS)  # nothing repeated, nothing missing, same tokens
    assert _retries(cluster) - before >= 1, f"no request was on {victim['worker_id']} when it died"
    assert not any(wait_blocks_free(cluster).values())


def test_a_prefill_worker_killed_while_prefilling_loses_no_request(cluster, reference):
    prompts = _prompts(16, 400, seed=2)
    before = _retries(cluster)
    n = 16

    def run(i: int) -> list[int]:
        with Client(cluster.router_address, timeout_s=120) as client:
            out = client.complete(prompts[i], max_tokens=n, temperature=0.0, ignore_eos=True)
        assert out.finish_reason == "length"
        return out.token_ids

    with cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(run, i) for i in range(len(prompts))]
        time.sleep(0.5)  # prompts queue on both prefill workers
        victim = _kill(cluster, "prefill")
        results = [f.result(timeout=180) for f in futures]
    for prompt, tokens in zip(prompts, results):
        assert tokens == reference(prompt, n)
    assert _retries(cluster) - before >= 1, f"no prompt was on {victim['worker_id']} when it died"
    assert not any(wait_blocks_free(cluster).values())


def _membership(handle) -> dict:
    import ray

    from pdcluster.actors import CONTROLLER_NAME

    return ray.get(ray.get_actor(CONTROLLER_NAME).membership.remote(), timeout=30)


def test_killed_workers_are_restarted_by_ray_and_rejoin_the_rotation(cluster, reference):
    old = {w["worker_id"]: w["pid"] for w in cluster.workers}
    deadline = time.monotonic() + 120
    while True:
        now = {w["worker_id"]: w for w in _membership(cluster)["workers"]}
        restarted = [w for wid, w in now.items() if w["pid"] != old[wid]]
        if len(restarted) == 2 and all(_alive(w, cluster.secret) for w in restarted):
            break
        assert time.monotonic() < deadline, f"not back after 120 s: {now}"
        time.sleep(1)
    assert sorted(w["role"] for w in restarted) == ["decode", "prefill"]
    cluster.workers = list(now.values())
    prompts = _prompts(8, 30, seed=3)
    with Client(cluster.router_address, timeout_s=120) as client, cf.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: client.complete(p, max_tokens=8, temperature=0.0, ignore_eos=True), prompts))
    assert [o.token_ids for o in outs] == [reference(p, 8) for p in prompts]
    for w in restarted:  # back in rotation: each took part
        ch, stub = _stub(w, cluster.secret)
        with ch:
            stats = stub.Stats(wk.StatsRequest(), timeout=5)
        assert stats.prompt_tokens > 0 if w["role"] == "prefill" else stats.kv_blocks_used == 0
    assert not any(wait_blocks_free(cluster).values())


def test_a_killed_router_fails_fast_frees_its_requests_and_comes_back(cluster):
    import ray

    router = ray.get_actor("router")
    pid = ray.get(router.pid.remote(), timeout=30)
    errors, started = [], threading.Event()

    def stream() -> None:
        with Client(cluster.router_address, timeout_s=120) as client:
            try:
                for i, _ in enumerate(client.stream([7] * 40, max_tokens=400, temperature=0.0, ignore_eos=True)):
                    if i >= 2:
                        started.set()
            except grpc.RpcError as e:
                errors.append((e.code(), time.monotonic()))

    threads = [threading.Thread(target=stream) for _ in range(4)]
    for t in threads:
        t.start()
    assert started.wait(60)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(60)
    assert len(errors) == 4 and all(code == grpc.StatusCode.UNAVAILABLE for code, _ in errors)
    assert max(t for _, t in errors) - killed_at < 5.0  # promptly, not at a deadline
    assert not any(wait_blocks_free(cluster).values())  # the workers freed the orphaned requests
    deadline = time.monotonic() + 120
    while True:  # Ray restarts it on the same port, with the workers from the controller
        try:
            with Client(cluster.router_address, timeout_s=30) as client:
                out = client.complete([7] * 10, max_tokens=4, temperature=0.0, ignore_eos=True)
            break
        except grpc.RpcError:
            assert time.monotonic() < deadline, "the router did not come back"
            time.sleep(1)
    assert len(out.token_ids) == 4
    while True:  # Ray may still report the actor as restarting for a moment after it serves again
        try:
            assert ray.get(router.pid.remote(), timeout=30) != pid
            break
        except ray.exceptions.ActorUnavailableError:
            assert time.monotonic() < deadline, "the router actor stayed unavailable"
            time.sleep(1)
    r = httpx.get(f"http://{cluster.http_address}/health", timeout=10)
    assert r.status_code == 200
