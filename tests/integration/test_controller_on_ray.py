"""The SLO controller of `pdcluster up` (controller.enabled; pdcluster/ray_fleet.py) on a real local
Ray: prefill-heavy traffic presses prefill while decode idles, so the controller in the router's
actor moves a decode worker to prefill in place (its actor serves the other role on the weights it
holds); with flips off it starts a new worker of the prefill pool within max_replicas instead and
gives it back once the traffic stops. Every request completes with transformers' tokens, every
block comes back, and `pdcluster status` and /metrics show the decisions."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import time
import urllib.request

import pytest

from cli.main import controller_line
from pdcluster.client import Client
from pdcluster.cluster_config import load_cluster_config
from pdcluster.launcher import up
from tests.reference import hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = [[(17 * i + 3 * j) % 400 + 3 for j in range(160 + 8 * (i % 4))] for i in range(160)]
MAX_TOKENS = 2


def _config(flips: bool, prefill: dict, decode: dict):
    cfg = load_cluster_config("cluster.yaml")
    return dataclasses.replace(
        cfg, router=dataclasses.replace(cfg.router, grpc_port=0, http_port=0),
        kv_cache=dataclasses.replace(cfg.kv_cache, memory_mb=32),
        model=dataclasses.replace(cfg.model, path="builtin:tiny-llama", max_model_len=512),
        pools=(dataclasses.replace(cfg.pools[0], **prefill), dataclasses.replace(cfg.pools[1], **decode)),
        # first tokens late: prefill pressed for sure; decode steps of 3 processes on 2 cores are not the question
        slo=dataclasses.replace(cfg.slo, ttft_ms=50.0, tpot_ms=1000.0),
        controller=dataclasses.replace(cfg.controller, enabled=True, interval_s=0.3, cooldown_s=1.0, warmup_s=0.0,
                                       flips=flips, drain_timeout_s=60.0)).validate()


@pytest.fixture(scope="module")
def reference(builtin_path):
    ref = hf_greedy(str(builtin_path))  # (pad token 0: the prompts hold token 3, the model's pad token)
    return lambda ids: ref(ids, MAX_TOKENS)


def _membership() -> dict:
    import ray

    return ray.get(ray.get_actor("controller").membership.remote(), timeout=30)


def _load(client: Client, until) -> list[list[int]]:
    """The prompts from 8 threads; then wait (up to 20 s) for `until(membership)`."""
    with cf.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: client.complete(p, max_tokens=MAX_TOKENS, temperature=0.0,
                                                      ignore_eos=True).token_ids, PROMPTS))
    deadline = time.monotonic() + 20
    while not until(_membership()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return got


def _roles(info: dict) -> dict[str, int]:
    roles = [w["role"] for w in info["workers"]]
    return {r: roles.count(r) for r in ("prefill", "decode")}


def _blocks_used() -> int:
    import ray

    return sum(w.get("kv_blocks_used", 0) for w in ray.get(ray.get_actor("controller").status.remote(), timeout=60))


def _wait_blocks_free(timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (used := _blocks_used()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return used


def test_prefill_pressed_moves_a_decode_worker_to_prefill_in_place(reference):
    handle = up(_config(True, {}, {"replicas": 2}), say=lambda _: None)
    try:
        with Client(handle.router_address) as client:
            got = _load(client, lambda info: _roles(info)["prefill"] == 2)
            info = _membership()
            assert _roles(info) == {"prefill": 2, "decode": 1}, info["workers"]
            moved = next(w for w in info["workers"] if w["pool"] == "decode" and w["role"] == "prefill")
            assert moved["pid"] in {w["pid"] for w in handle.workers}  # the same process: no new worker
            assert got == [reference(p) for p in PROMPTS]
            assert client.complete(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0,
                                   ignore_eos=True).token_ids == got[0]  # the new shape serves
        assert _wait_blocks_free() == 0
        line = controller_line(info["meta"]["controller"])
        assert "target 2 prefill + 1 decode" in line and "flip 1 to prefill" in line, line
        metrics = urllib.request.urlopen(f"http://{handle.http_address}/metrics", timeout=10).read().decode()
        assert 'pdcluster_controller_decisions_total{cause="prefill pressed",change="prefill+1 decode-1"} 1.0' \
            in metrics, [m for m in metrics.splitlines() if "controller" in m]
    finally:
        handle.stop()


def test_without_flips_a_new_worker_starts_within_max_replicas_and_goes_when_idle(reference):
    handle = up(_config(False, {"min_replicas": 1, "max_replicas": 2}, {}), say=lambda _: None)
    try:
        with Client(handle.router_address) as client:
            got = _load(client, lambda info: _roles(info)["prefill"] == 2)
            grown = _membership()
            assert _roles(grown) == {"prefill": 2, "decode": 1}, grown["workers"]
            assert sorted(w["worker_id"] for w in grown["workers"]) == ["decode-0", "prefill-0", "prefill-1"]
            assert got == [reference(p) for p in PROMPTS]
            deadline = time.monotonic() + 30  # idle now: prefill shrinks back to min_replicas
            while _roles(_membership())["prefill"] > 1 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert _roles(_membership()) == {"prefill": 1, "decode": 1}
            assert client.complete(PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0.0,
                                   ignore_eos=True).token_ids == got[1]
        assert _wait_blocks_free() == 0
    finally:
        handle.stop()
