"""Bring a cluster up on Ray from a `ClusterConfig`, and find it again to inspect or stop it.

`up()` connects to Ray (or starts it: in-process for a foreground cluster, as a `ray start --head`
process for `--detach`, so the cluster outlives this command), creates the Controller, one
WorkerActor per pool replica with the pool's resources, and the Router; waits until every worker
has loaded its model and serves gRPC (bounded by `timeouts.startup_s`, naming what did not start);
and records where it is in a state file so `status()` and `down()` work from another shell.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from engine.builtin_model import cache_root
from pdcluster.cluster_config import ClusterConfig

STATE_FILE = "cluster-state.json"


class LaunchError(RuntimeError):
    """The cluster could not be brought up; the message says what and why."""


def _state_path() -> Path:
    return cache_root() / STATE_FILE


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ClusterHandle:
    router_address: str
    workers: list[dict[str, Any]]
    ray_address: str | None
    started_ray: str | None  # "inprocess" | "head" | None (joined an existing cluster)
    actors: list[Any] = field(default_factory=list, repr=False)

    def stop(self) -> None:
        _stop_actors(self.actors)
        _stop_ray(self.started_ray)
        _state_path().unlink(missing_ok=True)


def _stop_actors(actors: list[Any]) -> None:
    import ray

    for actor in actors:
        try:
            ray.get(actor.stop.remote(), timeout=10)
        except Exception:
            pass
        try:
            ray.kill(actor)
        except Exception:
            pass


def _stop_ray(started: str | None) -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
    if started == "head":
        subprocess.run([shutil.which("ray") or "ray", "stop", "--force"], capture_output=True, timeout=120)


def ray_auth_env() -> None:
    """Ray 2.60 turns on token authentication for clusters started with `ray start --head`; drivers
    and joining nodes must then say RAY_AUTH_MODE=token (the token is in ~/.ray/auth_token or
    RAY_AUTH_TOKEN[_PATH]). Set it whenever a token is present, unless the user chose a mode."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    if (Path.home() / ".ray" / "auth_token").is_file() or "RAY_AUTH_TOKEN" in os.environ \
            or "RAY_AUTH_TOKEN_PATH" in os.environ:
        os.environ["RAY_AUTH_MODE"] = "token"


def _connect(cfg: ClusterConfig, detach: bool, num_cpus: float) -> tuple[str | None, str | None]:
    """Connect this process to Ray. Returns (address to reconnect with, what we started).

    Ray reads RAY_AUTH_MODE when it is imported, so `ray start` runs (and may create the token)
    before this process imports ray."""
    address = cfg.ray.address
    cpus = max(os.cpu_count() or 1, int(num_cpus + 0.999))
    started = None
    if address is None and detach:
        port = _free_port()
        cmd = [shutil.which("ray") or "ray", "start", "--head", f"--port={port}", f"--num-cpus={cpus}",
               "--include-dashboard=false", "--disable-usage-stats"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        if proc.returncode != 0:
            raise LaunchError(f"`{' '.join(cmd)}` failed:\n{proc.stderr[-2000:]}")
        address, started = f"127.0.0.1:{port}", "head"
    ray_auth_env()
    import ray

    from pdcluster.actors import NAMESPACE

    if address is None:
        ray.init(address="local", namespace=NAMESPACE, num_cpus=cpus, include_dashboard=False,
                 _node_ip_address="127.0.0.1", log_to_driver=False, configure_logging=False)
        return None, "inprocess"
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="warning")
    return address, started


def _actor_options(pool: Any, lifetime: str | None) -> dict[str, Any]:
    res = dict(pool.resources)
    opts: dict[str, Any] = {"num_cpus": res.pop("num_cpus", 1), "num_gpus": res.pop("num_gpus", 0)}
    if "memory" in res:
        opts["memory"] = res.pop("memory")
    if res:
        opts["resources"] = res
    if lifetime:
        opts["lifetime"] = lifetime
    return opts


def up(cfg: ClusterConfig, detach: bool = False, log_level: str = "info",
       say: Callable[[str], None] = print) -> ClusterHandle:
    if cfg.kv_transfer.backend == "inproc":
        raise LaunchError("kv_transfer.backend: 'inproc' only works inside one process (the offline LLM); "
                          "use grpc or auto for a cluster")
    kv_backend = "grpc" if cfg.kv_transfer.backend == "auto" else cfg.kv_transfer.backend
    if kv_backend != "grpc":
        raise LaunchError(f"kv_transfer.backend: {kv_backend!r} is not available yet; use grpc or auto")
    num_cpus = sum(p.resources.get("num_cpus", 1) * p.replicas for p in cfg.pools)
    ray_address, started = _connect(cfg, detach, num_cpus)
    import ray

    from pdcluster.actors import CONTROLLER_NAME, Controller, RouterActor, WorkerActor

    lifetime = "detached" if detach else None
    actors: list[Any] = []
    try:
        try:
            ray.get_actor(CONTROLLER_NAME)
            raise LaunchError("a pdcluster is already running on this Ray cluster; run `pdcluster down` first")
        except ValueError:
            pass
        controller = Controller.options(name=CONTROLLER_NAME, lifetime=lifetime).remote()
        actors.append(controller)
        pending: dict[Any, str] = {}
        pool_of: dict[str, str] = {}
        for pool in cfg.pools:
            for i in range(pool.replicas):
                wid = f"{pool.name}-{i}"
                pool_of[wid] = pool.name
                engine_kwargs = cfg.engine_kwargs(pool)
                if engine_kwargs.get("num_threads") is None:
                    engine_kwargs["num_threads"] = max(1, int(pool.resources.get("num_cpus", 1)))
                options: dict[str, Any] = {"host": "127.0.0.1" if started else _node_host(),
                                           "kv_backend": kv_backend, "request_timeout_s": cfg.timeouts.request_s}
                if pool.role == "prefill":
                    options["kv_timeout_s"] = cfg.kv_transfer.timeout_s
                actor = WorkerActor.options(name=wid, **_actor_options(pool, lifetime)).remote(
                    pool.role, wid, engine_kwargs, options, log_level)
                actors.append(actor)
                pending[actor.info.remote()] = f"{wid} (pool {pool.name}, role {pool.role})"
        say(f"starting {len(pending)} workers (loading {cfg.model.path}) ...")
        workers = _wait_workers(pending, cfg.timeouts.startup_s)
        for w in workers:
            w["pool"] = pool_of[w["worker_id"]]
        ray.get([controller.register_worker.remote(w) for w in workers])
        router = RouterActor.options(name="router", lifetime=lifetime).remote(dict(
            model=cfg.model.path, max_model_len=cfg.model.max_model_len, mode=cfg.mode, host=cfg.router.host,
            port=cfg.router.grpc_port, request_timeout_s=cfg.timeouts.request_s, api_keys=list(cfg.router.api_keys),
        ), log_level)
        actors.append(router)
        try:
            router_address = ray.get(router.address.remote(), timeout=cfg.timeouts.startup_s)
        except Exception as e:
            raise LaunchError(f"router did not start on {cfg.router.host}:{cfg.router.grpc_port}: {_cause(e)}") from None
        ray.get(router.set_workers.remote([(w["worker_id"], w["role"], w["address"]) for w in workers]))
        ray.get(controller.register_router.remote({"address": router_address}))
        ray.get(controller.set_meta.remote(mode=cfg.mode, model=cfg.model.path, ray_address=ray_address))
    except BaseException:
        _stop_actors(actors)
        _stop_ray(started)
        raise
    handle = ClusterHandle(router_address, workers, ray_address, started, actors)
    if detach:
        _state_path().parent.mkdir(parents=True, exist_ok=True)
        _state_path().write_text(json.dumps(
            {"ray_address": ray_address, "started_ray": started, "router": router_address}))
    return handle


def _node_host() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _cause(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__


def _wait_workers(pending: dict[Any, str], timeout_s: float) -> list[dict[str, Any]]:
    import ray

    deadline = time.monotonic() + timeout_s
    infos, failed = [], []
    refs = list(pending)
    while refs and time.monotonic() < deadline:
        ready, refs = ray.wait(refs, num_returns=1, timeout=max(0.1, deadline - time.monotonic()))
        for ref in ready:
            try:
                infos.append(ray.get(ref))
            except Exception as e:
                failed.append(f"{pending[ref]}: {_cause(e)}")
    if failed or refs:
        lines = [f"  {m}" for m in failed] + [
            f"  {pending[r]}: not up after {timeout_s:.0f}s (are the pool's resources available in the Ray "
            "cluster? see `ray status`)" for r in refs]
        raise LaunchError("workers did not start:\n" + "\n".join(lines))
    return infos


# ---------------------------------------------------------------------- later commands
def _read_state() -> dict[str, Any] | None:
    path = _state_path()
    return json.loads(path.read_text()) if path.is_file() else None


def _reconnect(address: str | None) -> Any:
    ray_auth_env()
    import ray

    from pdcluster.actors import CONTROLLER_NAME, NAMESPACE

    state = _read_state()
    address = address or (state or {}).get("ray_address")
    if address is None:
        raise LaunchError("no detached pdcluster found (start one with `pdcluster up --detach`)")
    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="warning")
    try:
        return ray.get_actor(CONTROLLER_NAME)
    except ValueError:
        raise LaunchError(f"no pdcluster is running on the Ray cluster at {address}") from None


def status(address: str | None = None) -> dict[str, Any]:
    ray_auth_env()
    import ray

    controller = _reconnect(address)
    info = ray.get(controller.membership.remote(), timeout=30)
    info["workers"] = ray.get(controller.status.remote(), timeout=60)
    return info


def down(address: str | None = None) -> None:
    ray_auth_env()
    import ray

    from pdcluster.actors import CONTROLLER_NAME

    state = _read_state() or {}
    controller = _reconnect(address)
    info = ray.get(controller.membership.remote(), timeout=30)
    names = [w["worker_id"] for w in info["workers"]] + ["router"]
    actors = []
    for name in names:
        try:
            actors.append(ray.get_actor(name))
        except ValueError:
            pass
    _stop_actors(actors + [ray.get_actor(CONTROLLER_NAME)])
    _stop_ray(state.get("started_ray") if address is None else None)
    _state_path().unlink(missing_ok=True)
