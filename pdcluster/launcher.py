"""Bring a cluster up on Ray from a `ClusterConfig`, and find it again to inspect or stop it.

`up()` connects to Ray (or starts it: in-process for a foreground cluster, as a `ray start --head`
process for `--detach`, so the cluster outlives this command), creates the Controller, one
WorkerActor per pool replica with the pool's resources, and the Router; waits until every worker
has loaded its model and serves gRPC (bounded by `timeouts.startup_s`, naming what did not start);
and records where it is in a state file so `status()` and `down()` work from another shell.
`scale()` changes a running cluster's pool.

Joining or starting Ray is pdcluster/ray_runtime.py; placing workers, their options and the KV
checks before serving are pdcluster/worker_launch.py.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from engine.builtin_model import cache_root
from pdcluster.cluster_config import ClusterConfig
from pdcluster.ray_members import add_workers, next_ids, retire_worker
from pdcluster.ray_runtime import LaunchError, connect, ray_auth_env, ray_cli, stop_ray
from pdcluster.worker_launch import (
    KV_FAULTS_ENV,
    cause,
    check_backend_placement,
    check_kv_pairs,
    check_tensor_parallel,
    cluster_kv_backend,
    pool_resource,
    start_workers,
    stop_actors,
    wait_workers,
    worker_options,
)

__all__ = ["KV_FAULTS_ENV", "STATE_FILE", "ClusterHandle", "LaunchError", "down", "pool_resource",
           "ray_auth_env", "ray_cli", "scale", "status", "up", "worker_options"]

STATE_FILE = "cluster-state.json"


def _state_path() -> Path:
    return cache_root() / STATE_FILE


@dataclass
class ClusterHandle:
    router_address: str
    workers: list[dict[str, Any]]
    ray_address: str | None
    started_ray: str | None  # "inprocess" | "head:PID" | None (joined an existing cluster)
    actors: list[Any] = field(default_factory=list, repr=False)
    http_address: str = ""  # the OpenAI-compatible HTTP API (host:port)
    secret: str | None = field(default=None, repr=False)  # the cluster secret (proto/cluster_auth.py)

    def stop(self) -> None:
        stop_actors(self.actors[::-1])  # the router first (its SLO controller reads the others), the Controller last
        stop_ray(self.started_ray)
        _state_path().unlink(missing_ok=True)


def _here() -> Any:
    """Scheduling strategy that keeps an actor on this driver's node (router, controller)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)


def up(cfg: ClusterConfig, detach: bool = False, log_level: str = "info",
       say: Callable[[str], None] = print, log_format: str = "text") -> ClusterHandle:
    """Bring the cluster of `cfg` up; workers and router log at `log_level` in `log_format`
    ("text", or "json": one object per line), with the request id on every line about a request."""
    cluster_kv_backend(cfg)
    check_tensor_parallel(cfg)
    # room for every worker the controller may start (a Ray started here has these CPUs)
    most = (lambda p: p.replica_bounds[1]) if cfg.controller.enabled else (lambda p: p.replicas)
    num_cpus = sum(p.resources.get("num_cpus", 1) * most(p) for p in cfg.pools)
    ray_address, started = connect(cfg, detach, num_cpus)
    import ray

    from pdcluster.actors import CONTROLLER_NAME, Controller, RouterActor
    from proto.cluster_auth import generate_secret

    lifetime = "detached" if detach else None
    worker_host = "127.0.0.1" if started else "auto"
    actors: list[Any] = []
    try:
        try:
            ray.get_actor(CONTROLLER_NAME)
            raise LaunchError("a pdcluster is already running on this Ray cluster; run `pdcluster down` first")
        except ValueError:
            pass
        secret = generate_secret()  # every worker RPC and KV transfer carries it; handed out by Ray only
        controller = Controller.options(name=CONTROLLER_NAME, lifetime=lifetime,
                                        scheduling_strategy=_here()).remote(secret)
        actors.append(controller)
        pending: dict[Any, str] = {}
        for pool in cfg.pools:
            new, refs = start_workers(cfg, pool, [f"{pool.name}-{i}" for i in range(pool.replicas)], lifetime,
                                       log_level, worker_host, log_format, secret)
            actors += new
            pending.update(refs)
        say(f"starting {len(pending)} workers (loading {cfg.model.path}) ...")
        workers = wait_workers(pending, cfg.timeouts.startup_s)
        check_backend_placement(cluster_kv_backend(cfg), workers)
        check_kv_pairs(workers, cfg.kv_transfer.timeout_s)
        ray.get([controller.register_worker.remote(w) for w in workers])
        router = RouterActor.options(name="router", lifetime=lifetime, scheduling_strategy=_here(),
                                     max_restarts=cfg.ray.max_restarts).remote(dict(
            model=cfg.model.path, max_model_len=cfg.model.max_model_len, mode=cfg.mode, host=cfg.router.host,
            port=cfg.router.grpc_port, request_timeout_s=cfg.timeouts.request_s, api_keys=list(cfg.router.api_keys),
            max_retries=cfg.router.max_retries, max_requests=cfg.router.max_requests,
            max_queued_prompt_tokens=cfg.router.max_queued_prompt_tokens, cluster_secret=secret,
            tls_cert=cfg.router.tls_cert, tls_key=cfg.router.tls_key,
            local_prefill_max_tokens=cfg.router.local_prefill_max_tokens,
            prefix_aware=cfg.router.prefix_aware,
            local_prefill_uncached_tokens=cfg.router.local_prefill_uncached_tokens,
            reserve_overlap_max_tokens=cfg.router.reserve_overlap_max_tokens,
        ), log_level, dict(host=cfg.router.host, port=cfg.router.http_port), log_format)
        actors.append(router)
        try:
            router_address = ray.get(router.address.remote(), timeout=cfg.timeouts.startup_s)
            http_address = ray.get(router.http_address.remote(), timeout=cfg.timeouts.startup_s)
        except Exception as e:
            raise LaunchError(f"router did not start on {cfg.router.host} (gRPC port {cfg.router.grpc_port}, "
                              f"HTTP port {cfg.router.http_port}): {cause(e)}") from None
        ray.get(router.set_workers.remote([(w["worker_id"], w["role"], w["address"]) for w in workers]))
        ray.get(controller.register_router.remote({"address": router_address}))
        ray.get(controller.set_meta.remote(mode=cfg.mode, model=cfg.model.path, ray_address=ray_address,
                                           config=cfg.to_dict(), log_level=log_level, log_format=log_format,
                                           worker_host=worker_host,
                                           detached=detach, http_address=http_address))
        if ray.get(router.start_controller.remote(), timeout=60):
            say(f"SLO controller on: deciding every {cfg.controller.interval_s:g} s (docs/controller.md)")
    except BaseException:
        stop_actors(actors)
        stop_ray(started)
        raise
    handle = ClusterHandle(router_address, workers, ray_address, started, actors, http_address=http_address,
                           secret=secret)
    if detach:
        _state_path().parent.mkdir(parents=True, exist_ok=True)
        _state_path().write_text(json.dumps(
            {"ray_address": ray_address, "started_ray": started, "router": router_address,
             "ray_auth_mode": os.environ.get("RAY_AUTH_MODE", "disabled")}))
    return handle


# ---------------------------------------------------------------------- later commands
def _read_state() -> dict[str, Any] | None:
    path = _state_path()
    return json.loads(path.read_text()) if path.is_file() else None


def _reconnect(address: str | None) -> Any:
    state = _read_state() or {}
    known = state.get("ray_auth_mode") if address is None else None
    address = address or state.get("ray_address")
    if address is None:
        raise LaunchError("no detached pdcluster found (start one with `pdcluster up --detach`)")
    ray_auth_env(address, known)
    import ray

    from pdcluster.actors import CONTROLLER_NAME, NAMESPACE

    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="warning")
    try:
        return ray.get_actor(CONTROLLER_NAME)
    except ValueError:
        raise LaunchError(f"no pdcluster is running on the Ray cluster at {address}") from None


def status(address: str | None = None) -> dict[str, Any]:
    controller = _reconnect(address)
    import ray

    info = ray.get(controller.membership.remote(), timeout=30)
    info["workers"] = ray.get(controller.status.remote(), timeout=60)
    return info


def down(address: str | None = None) -> None:
    state = _read_state() or {}
    controller = _reconnect(address)
    import ray

    from pdcluster.actors import CONTROLLER_NAME

    info = ray.get(controller.membership.remote(), timeout=30)
    names = ["router"] + [w["worker_id"] for w in info["workers"]]
    actors = []
    for name in names:
        try:
            actors.append(ray.get_actor(name))
        except ValueError:
            pass
    stop_actors(actors + [ray.get_actor(CONTROLLER_NAME)])
    stop_ray(state.get("started_ray") if address is None else None)
    _state_path().unlink(missing_ok=True)


def scale(pool_name: str, replicas: int, address: str | None = None, drain_timeout_s: float = 600.0,
          say: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Set a running (detached) cluster's pool to `replicas` workers.

    New workers start like at `up` and join the router once healthy. Removed workers (highest
    index first) leave the router's rotation at once, drain (finish running and queued requests,
    bounded by `drain_timeout_s`), and only then stop: no request is lost."""
    if replicas < 0:
        raise LaunchError(f"replicas must be >= 0, got {replicas}")
    controller = _reconnect(address)
    import ray

    info = ray.get(controller.membership.remote(), timeout=30)
    meta = info["meta"]
    cfg = ClusterConfig.from_dict(meta["config"])
    pool = next((p for p in cfg.pools if p.name == pool_name), None)
    if pool is None:
        raise LaunchError(f"no pool {pool_name!r}; pools: {', '.join(p.name for p in cfg.pools)}")
    current = sorted((w for w in info["workers"] if w.get("pool") == pool_name),
                     key=lambda w: int(w["worker_id"].rsplit("-", 1)[1]))
    others = [w for w in info["workers"] if w.get("pool") != pool_name]
    router = ray.get_actor("router")
    if replicas > len(current):
        ids = next_ids(pool_name, current, replicas - len(current))
        say(f"starting {len(ids)} worker(s) in pool {pool_name}: {', '.join(ids)}")
        current += add_workers(cfg, pool, ids, meta, controller, info["workers"])
    elif replicas < len(current):
        leaving, current = current[replicas:], current[:replicas]
        ray.get(router.set_workers.remote([(w["worker_id"], w["role"], w["address"]) for w in others + current]))
        for w in leaving:
            retire_worker(w, controller, drain_timeout_s, say)
    ray.get(router.set_workers.remote([(w["worker_id"], w["role"], w["address"]) for w in others + current]))
    return current
