"""The mixture-of-experts model (builtin:tiny-moe) and the latent-attention one (builtin:tiny-mla,
DeepSeek-V3's attention and routing) through every way the cluster serves them: each KV backend
disaggregated, colocated, prefix-cache hits, a decode worker stopped mid-stream, and a real Ray
cluster through `pdcluster up` with a decode worker SIGKILLed under load. Greedy tokens equal transformers' generate() every time; a latent
model's transfers carry one latent row per token and layer, nothing per head."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading

import pytest
import torch

from engine.builtin_model import resolve_model_path
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from pdcluster.client import Client
from pdcluster.cluster_config import load_cluster_config
from pdcluster.launcher import up
from pdcluster.local_cluster import LocalCluster
from tests.integration.kill_streams import streams_through_a_kill
from proto import worker_pb2 as wk
from tests.integration.test_faults import _retries, _stub, wait_blocks_free
from tests.reference import hf_greedy

pytestmark = pytest.mark.slow

MODELS = ["builtin:tiny-moe", "builtin:tiny-mla"]
N = 16
PROMPTS = [[1] + [(37 * i + 11 * j) % 8000 + 4 for j in range(n)] for i, n in enumerate([5, 23, 40, 61])]


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    return request.param


@pytest.fixture(scope="module")
def reference(model):
    return hf_greedy(str(resolve_model_path(model)), pad_token_id=3)


def _engine(model: str) -> EngineConfig:
    return EngineConfig(model=model, num_blocks=128, block_size=16, max_model_len=256, num_threads=1,
                        max_num_batched_tokens=32, max_num_seqs=8, dtype="float32")


@pytest.mark.parametrize("backend", ["grpc", "shm", "tcp", "torch_distributed"])
def test_every_kv_backend_serves_the_model_token_for_token(model, reference, backend):
    kv = {"kv_backend": backend}
    with LocalCluster(_engine(model), 1, 1, prefill={"kv_timeout_s": 10.0, **kv}, decode=kv,
                      router={"request_timeout_s": 60}) as c, c.client() as client:
        params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
        got = [client.complete(p, params).token_ids for p in PROMPTS]
        again = client.complete(PROMPTS[3], params).token_ids  # its prompt's blocks now cached
        sent = sum(c.prefill_workers[0].prefill.bytes_sent().values())
        spec = c.prefill_workers[0].engine.runner.spec
    assert got == [reference(p, N) for p in PROMPTS]
    assert again == got[3]
    if model.endswith("mla"):  # (latent 128 + RoPE 32) x 6 layers x 4 bytes a token, whole blocks
        assert spec.bytes_per_token(torch.float32) == 160 * 6 * 4
        # each prompt's blocks of 16 tokens, then the repeat's last, partial block (its full ones were
        # cached): exactly one latent row per token slot and layer, no head-sized K and V
        blocks = sum(-(-len(p) // 16) for p in PROMPTS) + 1
        assert sent == blocks * 16 * 160 * 6 * 4


def test_colocated_and_a_decode_worker_stopped_mid_stream(model, reference):
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    with LocalCluster(_engine(model), mode="colocated", router={"request_timeout_s": 60}) as c, c.client() as client:
        assert client.complete(PROMPTS[2], SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
                               ).token_ids == reference(PROMPTS[2], N)
    with LocalCluster(_engine(model), 1, 2, router={"request_timeout_s": 60, "max_retries": 2}) as c, \
            c.client() as client:
        got, stopped = [], threading.Event()
        for chunk in client.stream(PROMPTS[1], params):
            got += chunk.token_ids
            if len(got) >= 10 and not stopped.is_set():
                next(w for w in c.decode_workers if w.stats().running).stop()
                stopped.set()
        assert stopped.is_set() and c.router.metrics.retries._value.get() >= 1
    assert got == reference(PROMPTS[1], 60)  # resumed on the other worker: nothing lost, nothing repeated


def _streaming_decode_worker(handle) -> dict:
    """A decode worker with requests in its running batch (the router may have put every stream on
    one of the two)."""
    for w in handle.workers:
        if w["role"] == "decode":
            ch, stub = _stub(w, handle.secret)
            with ch:
                if stub.Stats(wk.StatsRequest(), timeout=5).running:
                    return w
    raise AssertionError("no decode worker is running a stream")


def test_pdcluster_up_serves_the_model_and_survives_a_killed_decode_worker(model, reference):
    """A real Ray cluster (1 prefill + 2 decode workers): the prompts token for token, then a decode
    worker SIGKILLed while it streams: every stream goes on elsewhere from the tokens it had, equal to
    transformers', and the live workers' KV blocks return to zero."""
    cfg = load_cluster_config("cluster.yaml")
    usable = sorted(os.sched_getaffinity(0))
    pools = (dataclasses.replace(cfg.pools[0], cpus=(usable[0],)),
             dataclasses.replace(cfg.pools[1], cpus=(usable[-1],), replicas=2))
    cfg = dataclasses.replace(
        cfg, pools=pools, router=dataclasses.replace(cfg.router, grpc_port=0, http_port=0, local_prefill_max_tokens=0,
                                                     max_retries=2),
        kv_cache=dataclasses.replace(cfg.kv_cache, memory_mb=64),
        model=dataclasses.replace(cfg.model, path=model, max_model_len=512)).validate()
    handle = up(cfg, say=lambda _: None)
    long = 80
    try:
        with Client(handle.router_address, timeout_s=120) as client:
            got = [client.complete(p, max_tokens=N, temperature=0.0, ignore_eos=True).token_ids for p in PROMPTS]
        before = _retries(handle)
        streamed = streams_through_a_kill(handle.router_address, PROMPTS, long,
                                          lambda: os.kill(_streaming_decode_worker(handle)["pid"], signal.SIGKILL),
                                          begun=5)
        retried = _retries(handle) - before
        used = wait_blocks_free(handle)
    finally:
        handle.stop()
    assert got == [reference(p, N) for p in PROMPTS]
    assert retried >= 1, "no stream was on the killed worker"
    assert streamed == [reference(p, long) for p in PROMPTS]  # nothing lost, nothing repeated
    assert not any(used.values()), used
