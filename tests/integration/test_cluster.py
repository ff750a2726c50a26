"""The cluster end to end on a real local Ray: router -> prefill -> KV over gRPC -> decode -> stream."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdcluster.client import Client
from pdcluster.cluster_config import ClusterConfig, load_cluster_config
from pdcluster.launcher import up
from proto import generate_pb2 as gen
from proto import worker_pb2 as wk
from proto import worker_pb2_grpc as wk_grpc
from proto.cluster_auth import with_secret

pytestmark = pytest.mark.slow

PROMPTS = ["Once upon a time", "The quick brown fox jumps over the lazy dog", "Hello", "A b c d e f g h i j k"]
MAX_TOKENS = 12


def _config(mode: str) -> ClusterConfig:
    mode, *transfer = mode.split("+")  # e.g. "disaggregated+grpc+int8", "disaggregated+shm+segments"
    overlap = "overlap" in transfer  # the router reserves while the prompt is prefilled, the ticket following
    transfer = [t for t in transfer if t != "overlap"]
    cfg = load_cluster_config("cluster.yaml")
    if transfer:
        option = transfer[1] if len(transfer) > 1 else "none"
        kv = dataclasses.replace(cfg.kv_transfer, backend=transfer[0],
                                 compression=option if option in ("none", "int8") else "none",
                                 shm_in_place=option != "segments")
        cfg = dataclasses.replace(cfg, kv_transfer=kv)
    router = dataclasses.replace(cfg.router, grpc_port=0, http_port=0, reserve_overlap_max_tokens=256 * overlap)
    kv = dataclasses.replace(cfg.kv_cache, memory_mb=64)
    model = dataclasses.replace(cfg.model, path="builtin:tiny-llama", max_model_len=1024)
    usable = sorted(os.sched_getaffinity(0))
    if mode == "colocated":
        pools = (dataclasses.replace(cfg.pools[0], name="workers", role="colocated", cpus=tuple(usable)),)
        return dataclasses.replace(cfg, mode=mode, router=router, pools=pools, kv_cache=kv, model=model).validate()
    pools = (dataclasses.replace(cfg.pools[0], cpus=(usable[0],)), dataclasses.replace(cfg.pools[1], cpus=(usable[-1],)))
    return dataclasses.replace(cfg, router=router, kv_cache=kv, model=model, pools=pools).validate()


@pytest.fixture(scope="module")
def reference(builtin_path):
    tok = AutoTokenizer.from_pretrained(builtin_path)
    hf = AutoModelForCausalLM.from_pretrained(builtin_path).eval()

    def ref(prompt: str, n: int = MAX_TOKENS) -> list[int]:
        ids = tok(prompt, return_tensors="pt").input_ids
        out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=3)
        return out[0, ids.shape[1]:].tolist()

    return ref


@pytest.fixture(scope="module", params=["disaggregated", "disaggregated+grpc", "disaggregated+torch_distributed",
                                        "disaggregated+tcp", "disaggregated+grpc+int8", "disaggregated+shm+segments",
                                        "disaggregated+tcp+overlap", "colocated"])
def cluster(request, builtin_path):
    handle = up(_config(request.param), say=lambda _: None)
    yield request.param.partition("+")[0], handle
    handle.stop()


def test_every_server_process_froze_its_startup_heap(cluster):
    """Workers and the router take their startup objects (torch, transformers, the model) out of the
    garbage collector's scans: a full collection of them stalls the process for ~200 ms."""
    import ray

    _, handle = cluster
    assert all(w["gc_frozen"] > 50_000 for w in handle.workers), [w["gc_frozen"] for w in handle.workers]
    assert ray.get(ray.get_actor("router", namespace="pdcluster").gc_frozen_objects.remote(), timeout=30) > 10_000


def test_the_decode_cache_is_shared_only_where_shm_writes_in_place(cluster, request):
    """Default (auto on one node): the decode worker's KV cache lives in /dev/shm, where the prefill
    worker writes it; kv_transfer.shm_in_place: false keeps it private (layers go through segments)."""
    _, handle = cluster
    decode_pids = {w["pid"] for w in handle.workers if w["role"] == "decode"}
    shared = {int(n.split("-")[1]) for n in os.listdir("/dev/shm") if n.startswith("pdkv-") and "-cache-" in n}
    variant = request.node.callspec.params["cluster"]
    in_place = variant == "disaggregated"  # auto, shm_in_place: true (cluster.yaml)
    assert (shared & decode_pids == decode_pids) if in_place else not shared & decode_pids, (variant, shared)


def test_the_openai_api_comes_up_with_the_cluster(cluster):
    import httpx

    mode, handle = cluster
    assert handle.http_address and handle.http_address != handle.router_address
    models = httpx.get(f"http://{handle.http_address}/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["builtin:tiny-llama"]
    assert httpx.get(f"http://{handle.http_address}/health", timeout=30).json() == {"status": "ok"}
    r = httpx.post(f"http://{handle.http_address}/v1/completions", timeout=60,
                   json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


def test_each_worker_runs_on_its_pool_cpus(cluster):
    _, handle = cluster
    cfg = {p.name: p for p in _config("colocated" if handle.workers[0]["role"] == "colocated" else "x").pools}
    for w in handle.workers:
        assert w["cpus"] == sorted(cfg[w["pool"]].cpus), w


def _stats(handle) -> list[wk.WorkerStats]:
    out = []
    for w in handle.workers:
        with with_secret(grpc.insecure_channel(w["address"]), handle.secret) as ch:
            stub = wk_grpc.PrefillWorkerStub(ch) if w["role"] == "prefill" else wk_grpc.DecodeWorkerStub(ch)
            out.append(stub.Stats(wk.StatsRequest(), timeout=5))
    return out


def _wait_blocks_free(handle, timeout: float = 10.0) -> list[wk.WorkerStats]:
    import time

    deadline = time.monotonic() + timeout
    while True:
        stats = _stats(handle)
        if all(s.kv_blocks_used == 0 for s in stats) or time.monotonic() > deadline:
            return stats


def test_greedy_output_through_the_cluster_equals_transformers(cluster, reference):
    mode, handle = cluster
    with Client(handle.router_address) as client, cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        outs = list(pool.map(lambda p: client.complete(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                             PROMPTS))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == reference(prompt), f"{mode}: {prompt!r}"
        assert out.finish_reason == "length" and out.completion_tokens == MAX_TOKENS
        t = out.timing
        assert t["ttft_ms"] > 0 and t["mean_tpot_ms"] > 0 and t["prefill_compute_ms"] > 0
        # the parts the first token waited on fit inside the TTFT the router measured
        parts = t.get("router_queue_ms", 0) + t.get("prefill_queue_ms", 0) + t["prefill_compute_ms"]
        if mode == "colocated":
            parts += t.get("decode_queue_ms", 0)  # queueing on the worker before the prompt ran
        else:
            parts += t.get("kv_transfer_ms", 0)
        assert parts <= t["ttft_ms"] + 1.0, t


def test_64_concurrent_streams_finish_and_free_every_block(cluster):
    mode, handle = cluster
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 300, (64,), generator=g).tolist()
    prompts = [torch.randint(4, 8192, (n,), generator=g).tolist() for n in lengths]
    outputs = [int(x) for x in torch.randint(1, 24, (64,), generator=g)]

    def run(i):
        with Client(handle.router_address) as client:
            chunks = list(client.stream(prompts[i], max_tokens=outputs[i], temperature=0.0, ignore_eos=True))
        return chunks

    with cf.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(run, range(64)))
    for i, chunks in enumerate(results):
        tokens = [t for c in chunks for t in c.token_ids]
        assert len(tokens) == outputs[i] and chunks[-1].finish_reason == "length"
        assert chunks[-1].usage.prompt_tokens == lengths[i]
    assert all(s.kv_blocks_used == 0 for s in _wait_blocks_free(handle))


def test_abort_frees_blocks_on_both_workers(cluster):
    mode, handle = cluster
    with Client(handle.router_address) as client:
        stream = client.stream([5] * 200, max_tokens=500, temperature=0.0, ignore_eos=True, request_id="to-abort")
        first = next(stream)
        assert first.token_ids
        assert client.abort("to-abort")
        with pytest.raises(grpc.RpcError):
            for _ in stream:
                pass
    assert all(s.kv_blocks_used == 0 for s in _wait_blocks_free(handle))
    # a client that just disconnects mid-stream frees the blocks too
    with Client(handle.router_address) as client:
        stream = client.stream([6] * 200, max_tokens=500, temperature=0.0, ignore_eos=True)
        next(stream)
        stream.close()
    assert all(s.kv_blocks_used == 0 for s in _wait_blocks_free(handle))


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda r: r.ClearField("prompt"), "prompt"),
        (lambda r: setattr(r, "text", ""), "prompt"),
        (lambda r: r.token_ids.ids.extend([7] * 1024), "max_model_len"),
        (lambda r: r.token_ids.ids.extend([5, 1 << 20]), "vocabulary"),
        (lambda r: setattr(r.sampling, "max_tokens", 0), "max_tokens"),
        (lambda r: setattr(r.sampling, "temperature", -1.0), "temperature"),
        (lambda r: setattr(r.sampling, "top_p", 1.5), "top_p"),
        (lambda r: setattr(r, "model", "gpt-17"), "model"),
    ],
)
def test_bad_requests_get_invalid_argument_and_the_cluster_keeps_serving(cluster, build, field):
    mode, handle = cluster
    request = gen.GenerateRequest(text="hello")
    build(request)
    with grpc.insecure_channel(handle.router_address) as ch:
        from proto import generate_pb2_grpc as gen_grpc

        stub = gen_grpc.PDClusterStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request, timeout=30))
        assert err.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
        assert field in err.value.details()
        # unknown fields on the wire are refused too
        raw = gen.GenerateRequest(text="hi").SerializeToString() + bytes([0xF8, 0x07, 0x01])
        call = ch.unary_stream("/pdcluster.v1.PDCluster/Generate", request_serializer=lambda b: b,
                               response_deserializer=gen.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as err:
            list(call(raw, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown fields" in err.value.details()
    with Client(handle.router_address) as client:
        assert client.complete("still serving", max_tokens=3, temperature=0.0).completion_tokens >= 1


def test_stop_string_ends_the_stream_with_text_and_tokens_cut_at_it(cluster):
    mode, handle = cluster
    with Client(handle.router_address) as client:
        full = client.complete("Once upon a time", max_tokens=24, temperature=0.0, ignore_eos=True)
        stop = full.text[8:11]
        out = client.complete("Once upon a time", max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]
    assert out.token_ids == full.token_ids[: len(out.token_ids)] and len(out.token_ids) < len(full.token_ids)
    assert out.completion_tokens == len(out.token_ids)
    assert all(s.kv_blocks_used == 0 for s in _wait_blocks_free(handle))
