"""The SLO controller of `pdcluster up` (controller.enabled; pdcluster/ray_fleet.py) on a real local
Ray: prefill-heavy traffic presses prefill while decode idles, so the controller in the router's
actor moves a decode worker to prefill in place (its actor serves the other role on the weights it
holds); with flips off it starts a new worker of the prefill pool within max_replicas instead and
gives it back once the traffic stops. Every request completes with transformers' tokens, every
block comes back, and `pdcluster status` and /metrics show the decisions."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import time
import urllib.request
from pathlib import Path

import pytest

from cli.main import controller_line
from pdcluster.client import Client
from pdcluster.cluster_config import load_cluster_config
from pdcluster.launcher import up
from tests.reference import hf_greedy

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

PROMPTS = [[(17 * i + 3 * j) % 400 + 3 for j in range(160 + 8 * (i % 4))] for i in range(160)]
MAX_TOKENS = 2


def _config(flips: bool, prefill: dict, decode: dict, slo: tuple[float, float] = (50.0, 1000.0),
            num_blocks: int | str = "auto", **controller):
    """Pools "prefill" and "decode" with these changes; by default first tokens late for sure (TTFT SLO
    50 ms: prefill pressed) and decode steps of 3 processes on 2 cores not the question (TPOT 1 s)."""
    cfg = load_cluster_config("cluster.yaml")
    return dataclasses.replace(
        cfg, router=dataclasses.replace(cfg.router, grpc_port=0, http_port=0),
        kv_cache=dataclasses.replace(cfg.kv_cache, memory_mb=32, num_blocks=num_blocks),
        model=dataclasses.replace(cfg.model, path="builtin:tiny-llama", max_model_len=512),
        pools=(dataclasses.replace(cfg.pools[0], **prefill), dataclasses.replace(cfg.pools[1], **decode)),
        slo=dataclasses.replace(cfg.slo, ttft_ms=slo[0], tpot_ms=slo[1]),
        controller=dataclasses.replace(cfg.controller, **{
            "enabled": True, "interval_s": 0.3, "cooldown_s": 1.0, "warmup_s": 0.0, "shrink_after_s": 1.0, "flips": flips,
            "drain_timeout_s": 60.0, **controller})).validate()


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


def _autoscaler_request() -> list[dict]:
    """The worker bundles the controller last asked Ray's autoscaler (v1's standing request) to fit."""
    from ray.autoscaler.v2.utils import is_autoscaler_v2
    from ray.experimental.internal_kv import _internal_kv_get

    assert not is_autoscaler_v2(), "autoscaler v2 keeps the request elsewhere"
    return json.loads(_internal_kv_get("autoscaler_resource_request") or b"[]")


def test_without_flips_a_new_worker_starts_within_max_replicas_and_goes_when_idle(reference):
    handle = up(_config(False, {"min_replicas": 1, "max_replicas": 2}, {}), say=lambda _: None)
    try:
        with Client(handle.router_address) as client:
            got = _load(client, lambda info: _roles(info)["prefill"] == 2)
            grown = _membership()
            assert _roles(grown) == {"prefill": 2, "decode": 1}, grown["workers"]
            assert sorted(w["worker_id"] for w in grown["workers"]) == ["decode-0", "prefill-0", "prefill-1"]
            assert _autoscaler_request() == [{"CPU": 1.0}] * 3  # asked for before the new actor waited
            assert got == [reference(p) for p in PROMPTS]
            deadline = time.monotonic() + 30  # idle now: prefill shrinks back to min_replicas
            while _roles(_membership())["prefill"] > 1 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert _roles(_membership()) == {"prefill": 1, "decode": 1}
            assert _autoscaler_request() == [{"CPU": 1.0}] * 2  # and let go
            assert client.complete(PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0.0,
                                   ignore_eos=True).token_ids == got[1]
        assert _wait_blocks_free() == 0
    finally:
        handle.stop()


def test_the_simulator_and_the_cluster_make_the_same_decision_at_a_phase_change(tmp_path, capsys):
    """Prompt-heavy traffic, then output-heavy traffic that fills one decode worker's 128 blocks: on
    2 prefill + 1 decode workers, the cluster's controller and the simulator's (the planner's cost
    model fitted on this kind of machine, planner/cpu_coefficients.json, with the same cache) both
    move a prefill worker to decode."""
    from loadgen.cli import main as bench_serve
    from planner.cli import main as plan

    phases = "512/4:6:12,32/256:4:25"
    handle = up(_config(True, {"replicas": 2}, {"replicas": 1}, slo=(1000.0, 50.0), num_blocks=128,
                        interval_s=1.0, cooldown_s=5.0, warmup_s=2.0), say=lambda _: None)
    try:
        assert bench_serve(["--endpoint", f"http://{handle.http_address}", "--phases", phases, "--ignore-eos",
                            "--slo-ttft-ms", "1000", "--slo-tpot-ms", "50", "--out", str(tmp_path / "bench"),
                            "--no-progress"]) == 0
        info = _membership()
    finally:
        handle.stop()
    assert _roles(info) == {"prefill": 1, "decode": 2}, info["workers"]
    assert info["meta"]["controller"]["last"]["action"] == "flip 1 to decode", info["meta"]["controller"]

    coefficients = json.loads((ROOT / "planner" / "cpu_coefficients.json").read_text())
    coefficients["kv_capacity_tokens"] = 128 * 16
    (tmp_path / "coefficients.json").write_text(json.dumps(coefficients))
    capsys.readouterr()
    assert plan(["simulate", "--controller", "--model", "builtin:tiny-llama", "--coefficients",
                 str(tmp_path / "coefficients.json"), "--prefill", "cpu:2", "--decode", "cpu:1", "--phases", phases,
                 "--max-workers", "3", "--min-workers", "3", "--interval-s", "1", "--flip-s", "0.3",
                 "--no-progress"]) == 0
    decisions = capsys.readouterr().out.split("controller's decisions:")[1].strip().splitlines()
    assert decisions and "flip 1 to decode" in decisions[0], decisions
