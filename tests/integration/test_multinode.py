"""Node pools on a real multi-node Ray cluster (a head and two more raylets on this machine), and
runtime scaling with draining."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses

import pytest
import ray
from ray.cluster_utils import Cluster
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdcluster import launcher
from pdcluster.client import Client
from pdcluster.cluster_config import load_cluster_config

pytestmark = pytest.mark.slow
PROMPTS = ["Once upon a time", "The quick brown fox", "Hello there", "One two three four five"]


@pytest.fixture(scope="module")
def multinode(builtin_path):
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=2, resources={"pool:prefill": 2})
    cluster.add_node(num_cpus=3, resources={"pool:decode": 3})
    cfg = load_cluster_config("cluster.yaml")
    pools = tuple(dataclasses.replace(p, replicas=2, resources={"num_cpus": 0.5}) for p in cfg.pools)
    cfg = dataclasses.replace(
        cfg, ray=dataclasses.replace(cfg.ray, address=cluster.address), pools=pools,
        router=dataclasses.replace(cfg.router, grpc_port=0, http_port=0),
        kv_cache=dataclasses.replace(cfg.kv_cache, memory_mb=32),
        model=dataclasses.replace(cfg.model, path="builtin:tiny-llama", max_model_len=512),
    ).validate()
    handle = launcher.up(cfg, say=lambda _: None)
    # node id -> the pool whose marker resource it carries
    pools_of = {n["NodeID"]: next((r.split(":", 1)[1] for r in n["Resources"] if r.startswith("pool:")), None)
                for n in ray.nodes() if n["Alive"]}
    nodes = {pool: node for node, pool in pools_of.items() if pool}
    assert len(nodes) == 2 and len(pools_of) == 3
    yield cluster, handle, nodes
    try:
        launcher.down(cluster.address)
    finally:
        ray.shutdown()
        cluster.shutdown()


def _reference(builtin_path, prompt, n):
    tok = AutoTokenizer.from_pretrained(builtin_path)
    hf = AutoModelForCausalLM.from_pretrained(builtin_path).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    return hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                       pad_token_id=3)[0, ids.shape[1]:].tolist()


def test_every_worker_lands_on_a_node_of_its_pool(multinode):
    cluster, handle, nodes = multinode
    assert len(handle.workers) == 4
    for w in handle.workers:
        assert w["node_id"] == nodes[w["pool"]], w
    assert len({w["pid"] for w in handle.workers}) == 4


def test_generation_across_nodes_equals_transformers(multinode, builtin_path):
    cluster, handle, _ = multinode
    with Client(handle.router_address) as client, cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        outs = list(pool.map(lambda p: client.complete(p, max_tokens=10, temperature=0.0, ignore_eos=True), PROMPTS))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == _reference(builtin_path, prompt, 10)


def test_scale_up_then_down_while_serving_loses_no_request(multinode):
    cluster, handle, nodes = multinode
    workers = launcher.scale("decode", 3, cluster.address, say=lambda _: None)
    assert len(workers) == 3 and all(w["node_id"] == nodes["decode"] for w in workers)
    status = launcher.status(cluster.address)
    assert sum(1 for w in status["workers"] if w["pool"] == "decode" and w["state"] == "healthy") == 3, [(w["worker_id"], w["state"]) for w in status["workers"]]

    with Client(handle.router_address) as client, cf.ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(client.complete, [5 + i] * 30, max_tokens=40, temperature=0.0, ignore_eos=True)
                   for i in range(12)]
        remaining = launcher.scale("decode", 1, cluster.address, say=lambda _: None)
        outs = [f.result(timeout=300) for f in futures]
    assert [len(o.token_ids) for o in outs] == [40] * 12
    assert all(o.finish_reason == "length" for o in outs)
    assert [w["worker_id"] for w in remaining] == ["decode-0"]
    status = launcher.status(cluster.address)
    assert sorted(w["worker_id"] for w in status["workers"]) == ["decode-0", "prefill-0", "prefill-1"]
    with Client(handle.router_address) as client:
        assert len(client.complete("after scaling", max_tokens=5, temperature=0.0, ignore_eos=True).token_ids) == 5
