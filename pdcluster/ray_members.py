"""Changing a running Ray cluster's workers: start new ones into a pool (they join once healthy
and their KV handshakes pass), or drain one and stop it. Used by `pdcluster scale` (launcher.py)
and by the SLO controller (ray_fleet.py); the caller updates the router's list.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from pdcluster.cluster_config import ClusterConfig, PoolConfig
from pdcluster.worker_launch import (
    check_backend_placement,
    check_kv_pairs,
    cluster_kv_backend,
    start_workers,
    stop_actors,
    wait_workers,
)

_OWNED_ACTORS: list = []  # handles of non-detached workers started here (an actor dies with its last handle)


def add_workers(cfg: ClusterConfig, pool: PoolConfig, ids: list[str], meta: dict[str, Any], controller: Any,
                existing: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Start workers `ids` of `pool` like `up` does, wait until they serve and their KV handshakes
    with `existing` pass, and register them with the controller actor; returns their infos."""
    import ray

    # workers of a foreground cluster belong to the process that starts them
    lifetime = "detached" if meta.get("detached") else None
    actors, pending = start_workers(cfg, pool, ids, lifetime, meta.get("log_level", "info"),
                                     meta.get("worker_host", "auto"), meta.get("log_format", "text"),
                                     ray.get(controller.cluster_secret.remote(), timeout=30))
    if lifetime is None:
        _OWNED_ACTORS.extend(actors)
    try:
        started = wait_workers(pending, cfg.timeouts.startup_s)
        check_backend_placement(cluster_kv_backend(cfg), started + existing)
        check_kv_pairs(started + existing, cfg.kv_transfer.timeout_s)
    except BaseException:
        stop_actors(actors)
        raise
    ray.get([controller.register_worker.remote(w) for w in started])
    return started


def drain(actor: Any, timeout_s: float) -> bool:
    """Wait until the worker holds nothing (running, queued, KV blocks); False if it still did."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(ray.get(actor.load.remote(), timeout=30).values()):
            return True
        time.sleep(0.05)
    return False


def retire_worker(worker: dict[str, Any], controller: Any, drain_timeout_s: float,
                  say: Callable[[str], None]) -> None:
    """Drain a worker already out of the router's list, then stop it and deregister it."""
    import ray

    actor = ray.get_actor(worker["worker_id"])
    say(f"draining {worker['worker_id']} ...")
    if not drain(actor, drain_timeout_s):
        say(f"warning: {worker['worker_id']} still busy after {drain_timeout_s:.0f}s; stopping it anyway")
    stop_actors([actor])
    ray.get(controller.deregister_worker.remote(worker["worker_id"]))


def next_ids(pool_name: str, taken: list[dict[str, Any]], n: int) -> list[str]:
    """`n` worker ids of the pool not in use: the lowest free indexes."""
    used = {int(w["worker_id"].rsplit("-", 1)[1]) for w in taken if w.get("pool") == pool_name}
    return [f"{pool_name}-{i}" for i in range(n + len(used)) if i not in used][:n]
