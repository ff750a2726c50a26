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
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from common.net import free_port
from engine.builtin_model import cache_root
from pdcluster.cluster_config import ClusterConfig

KV_FAULTS_ENV = "PDCLUSTER_KV_FAULTS"  # kv_transfer.faults.ENV (not imported here: it pulls in grpc)

STATE_FILE = "cluster-state.json"
_OWNED_ACTORS: list = []  # handles of non-detached workers started by `scale` in this process


class LaunchError(RuntimeError):
    """The cluster could not be brought up; the message says what and why."""


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
    """Disconnect, and stop the Ray we started: "inprocess", or "head:PID" (our own head process)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    if started and started.startswith("head:"):
        _kill_head(int(started.split(":", 1)[1]))


_PROBE = "import sys, ray; ray.init(address=sys.argv[1], logging_level='error'); ray.shutdown()"


def ray_auth_env(address: str, known: str | None = None) -> None:
    """Ray 2.60 turns on token authentication for clusters started with `ray start --head`; a driver
    must then run with RAY_AUTH_MODE=token (the token is in ~/.ray/auth_token or RAY_AUTH_TOKEN).
    Ray reads the setting when it is imported, and workers inherit it, so it must match the
    cluster: use the mode recorded for our own cluster, else probe the cluster once in a
    subprocess. A mode the user set is left alone."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    if known is None:
        env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
        probe = subprocess.run([sys.executable, "-c", _PROBE, address], env=env, capture_output=True, text=True,
                               timeout=120)
        known = "token" if probe.returncode != 0 and "uthentication" in probe.stderr else "disabled"
    if known == "token":
        os.environ["RAY_AUTH_MODE"] = "token"


def ray_cli() -> str:
    """The `ray` command of the Ray this Python imports: next to the interpreter (a virtual
    environment's bin/, whether or not it is activated), else the first on PATH."""
    beside = Path(sys.executable).with_name("ray")
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("ray")
    if found is None:
        raise RuntimeError(f"no `ray` command next to {sys.executable} or on PATH; install ray (pip install ray)")
    return found


def _start_head(port: int, cpus: int) -> int:
    """Start a Ray head owned by this cluster (`ray start --head --block` in its own process group,
    so `down` stops exactly it, never another Ray on the machine). Returns its process id."""
    log_path = cache_root() / f"ray-head-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [ray_cli(), "start", "--head", f"--port={port}", f"--num-cpus={cpus}",
           "--include-dashboard=false", "--disable-usage-stats", "--block"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    try:
        while "Ray runtime started" not in log_path.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise LaunchError(f"`{' '.join(cmd)}` did not start:\n{log_path.read_text()[-2000:]}")
            time.sleep(0.3)
    except BaseException:  # including Ctrl-C while waiting
        _kill_head(proc.pid)
        raise
    return proc.pid


def _kill_head(pid: int, timeout_s: float = 60.0) -> None:
    import signal

    try:
        os.killpg(pid, signal.SIGTERM)  # `ray start --block` stops its GCS and raylet on SIGTERM
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.killpg(pid, signal.SIGKILL)


def _connect(cfg: ClusterConfig, detach: bool, num_cpus: float) -> tuple[str | None, str | None]:
    """Connect this process to Ray. Returns (address to reconnect with, what we started).

    Ray reads RAY_AUTH_MODE when it is imported, so `ray start` runs (and may create the token)
    before this process imports ray."""
    address = cfg.ray.address
    cpus = max(os.cpu_count() or 1, int(num_cpus + 0.999))
    started = None
    if address is None and detach:
        port = free_port()
        address, started = f"127.0.0.1:{port}", f"head:{_start_head(port, cpus)}"
    try:
        if address is not None:
            ray_auth_env(address)
        import ray

        from pdcluster.actors import NAMESPACE

        if address is None:
            ray.init(address="local", namespace=NAMESPACE, num_cpus=cpus, include_dashboard=False,
                     _node_ip_address="127.0.0.1", log_to_driver=False, configure_logging=False)
            return None, "inprocess"
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="warning")
        return address, started
    except BaseException:
        _stop_ray(started)  # never leave a head we started behind
        raise


def pool_resource(pool_name: str) -> str:
    """The Ray custom resource that marks nodes of a pool (`ray start --resources '{"pool:NAME": 4}'`)."""
    return f"pool:{pool_name}"


def _actor_options(pool: Any, lifetime: str | None, cluster_resources: dict[str, float],
                   max_restarts: int = 0) -> dict[str, Any]:
    """Ray placement of one worker of `pool`: its own resources, plus one unit of `pool:NAME`
    whenever the Ray cluster has that resource at all (then it lands only on that pool's nodes)."""
    res = dict(pool.resources)
    opts: dict[str, Any] = {"num_cpus": res.pop("num_cpus", 1), "num_gpus": res.pop("num_gpus", 0),
                            "max_restarts": max_restarts}
    if "memory" in res:
        opts["memory"] = res.pop("memory")
    marker = pool_resource(pool.name)
    if marker in cluster_resources:
        res.setdefault(marker, 1)
    if res:
        opts["resources"] = res
    if lifetime:
        opts["lifetime"] = lifetime
    return opts


def _kv_backend(cfg: ClusterConfig) -> str:
    if cfg.kv_transfer.backend == "inproc":
        raise LaunchError("kv_transfer.backend: 'inproc' only works inside one process (the offline LLM); "
                          "use grpc or auto for a cluster")
    kv_backend = cfg.kv_transfer.backend
    if kv_backend not in ("grpc", "shm", "tcp", "torch_distributed", "auto"):
        raise LaunchError(f"kv_transfer.backend: {kv_backend!r} cannot serve a cluster; "
                          "use auto, grpc, shm, tcp or torch_distributed")
    if cfg.kv_transfer.compression != "none" and kv_backend != "grpc":
        raise LaunchError(f"kv_transfer.compression: {cfg.kv_transfer.compression} travels over the grpc backend "
                          f"only; pin kv_transfer.backend: grpc (it is {kv_backend!r})")
    return kv_backend


def _check_backend_placement(kv_backend: str, workers: list[dict[str, Any]]) -> None:
    """A pinned backend that cannot work for some pair is an error now, not at the first request."""
    if kv_backend == "shm":
        nodes = {w["node_id"] for w in workers if w["role"] in ("prefill", "decode")}
        if len(nodes) > 1:
            raise LaunchError("kv_transfer.backend: 'shm' needs every prefill and decode worker on one node, "
                              f"but they landed on {len(nodes)} nodes; use grpc or auto")


def _check_kv_pairs(workers: list[dict[str, Any]], timeout_s: float) -> None:
    """Every prefill worker handshakes with every decode worker's KV receiver now, so a backend that
    cannot work for some pair (another node for shm, no process group for torch_distributed, an
    unreachable data port for tcp, a different KV layout) is an error at `up` / `scale`, not at the first request."""
    import ray

    decode = [w["address"] for w in workers if w["role"] == "decode"]
    prefill = [w for w in workers if w["role"] == "prefill"]
    if not decode or not prefill:
        return
    refs = {ray.get_actor(w["worker_id"]).connect_kv.remote(decode, timeout_s): w["worker_id"] for w in prefill}
    by_address = {w["address"]: w["worker_id"] for w in workers if w["role"] == "decode"}
    problems = []
    for ref, worker_id in refs.items():
        try:
            errors = ray.get(ref, timeout=timeout_s * len(decode) + 30)
        except Exception as e:
            problems.append(f"  {worker_id}: KV handshakes failed: {_cause(e)}")
            continue
        problems += [f"  {worker_id} -> {by_address[a]} ({a}): {reason}" for a, reason in errors.items()]
    if problems:
        raise LaunchError("KV transfer between these prefill and decode workers cannot work:\n" + "\n".join(problems))


def worker_options(cfg: ClusterConfig, role: str, host: str, secret: str | None = None) -> dict[str, Any]:
    """The keyword arguments of a `role` worker's server (PrefillWorkerServer / DecodeWorkerServer)."""
    kv = cfg.kv_transfer
    options: dict[str, Any] = {"host": host, "kv_backend": _kv_backend(cfg), "request_timeout_s": cfg.timeouts.request_s,
                               "cluster_secret": secret}
    shm = options["kv_backend"] in ("shm", "auto")  # the backends with a shm part: its writer's options
    if role == "prefill":
        if shm:
            options["kv_options"] = {"in_place": kv.shm_in_place, "verify_in_place": kv.shm_verify}
        options["kv_timeout_s"] = kv.timeout_s
        options["kv_compression"] = kv.compression
        # the driver's environment wins: Ray workers do not all inherit it
        options["kv_faults"] = os.environ.get(KV_FAULTS_ENV) or kv.faults
        return options
    if shm and role == "decode":
        options["kv_options"] = {"in_place": kv.shm_in_place}
    options["reservation_ttl_s"] = kv.lease_s
    return options


def _start_workers(cfg: ClusterConfig, pool: Any, worker_ids: list[str], lifetime: str | None,
                   log_level: str, host: str, log_format: str = "text",
                   secret: str | None = None) -> tuple[list[Any], dict[Any, str]]:
    """Create the WorkerActors of `pool` named `worker_ids`; returns (actors, info ref -> label).
    `host`: where workers serve gRPC; "auto" = their node's IP (a Ray we started here: loopback)."""
    import ray

    from pdcluster.actors import WorkerActor

    cluster_resources = ray.cluster_resources()
    engine_kwargs = cfg.engine_kwargs(pool)
    if engine_kwargs.get("num_threads") is None:  # one torch thread per pinned CPU, else per Ray CPU
        engine_kwargs["num_threads"] = len(pool.cpus) if pool.cpus else max(1, int(pool.resources.get("num_cpus", 1)))
    options = worker_options(cfg, pool.role, host, secret)
    actors, pending = [], {}
    for wid in worker_ids:
        actor = WorkerActor.options(name=wid, **_actor_options(pool, lifetime, cluster_resources,
                                                               cfg.ray.max_restarts)).remote(
            pool.role, wid, engine_kwargs, options, log_level, pool.name, log_format,
            list(pool.cpus) if pool.cpus else None)
        actors.append(actor)
        pending[actor.info.remote()] = f"{wid} (pool {pool.name}, role {pool.role})"
    return actors, pending


def _here() -> Any:
    """Scheduling strategy that keeps an actor on this driver's node (router, controller)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)


def up(cfg: ClusterConfig, detach: bool = False, log_level: str = "info",
       say: Callable[[str], None] = print, log_format: str = "text") -> ClusterHandle:
    """Bring the cluster of `cfg` up; workers and router log at `log_level` in `log_format`
    ("text", or "json": one object per line), with the request id on every line about a request."""
    _kv_backend(cfg)
    num_cpus = sum(p.resources.get("num_cpus", 1) * p.replicas for p in cfg.pools)
    ray_address, started = _connect(cfg, detach, num_cpus)
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
            new, refs = _start_workers(cfg, pool, [f"{pool.name}-{i}" for i in range(pool.replicas)], lifetime,
                                       log_level, worker_host, log_format, secret)
            actors += new
            pending.update(refs)
        say(f"starting {len(pending)} workers (loading {cfg.model.path}) ...")
        workers = _wait_workers(pending, cfg.timeouts.startup_s)
        _check_backend_placement(_kv_backend(cfg), workers)
        _check_kv_pairs(workers, cfg.kv_transfer.timeout_s)
        ray.get([controller.register_worker.remote(w) for w in workers])
        router = RouterActor.options(name="router", lifetime=lifetime, scheduling_strategy=_here(),
                                     max_restarts=cfg.ray.max_restarts).remote(dict(
            model=cfg.model.path, max_model_len=cfg.model.max_model_len, mode=cfg.mode, host=cfg.router.host,
            port=cfg.router.grpc_port, request_timeout_s=cfg.timeouts.request_s, api_keys=list(cfg.router.api_keys),
            max_retries=cfg.router.max_retries, max_requests=cfg.router.max_requests,
            max_queued_prompt_tokens=cfg.router.max_queued_prompt_tokens, cluster_secret=secret,
            tls_cert=cfg.router.tls_cert, tls_key=cfg.router.tls_key,
            local_prefill_max_tokens=cfg.router.local_prefill_max_tokens,
        ), log_level, dict(host=cfg.router.host, port=cfg.router.http_port), log_format)
        actors.append(router)
        try:
            router_address = ray.get(router.address.remote(), timeout=cfg.timeouts.startup_s)
            http_address = ray.get(router.http_address.remote(), timeout=cfg.timeouts.startup_s)
        except Exception as e:
            raise LaunchError(f"router did not start on {cfg.router.host} (gRPC port {cfg.router.grpc_port}, "
                              f"HTTP port {cfg.router.http_port}): {_cause(e)}") from None
        ray.get(router.set_workers.remote([(w["worker_id"], w["role"], w["address"]) for w in workers]))
        ray.get(controller.register_router.remote({"address": router_address}))
        ray.get(controller.set_meta.remote(mode=cfg.mode, model=cfg.model.path, ray_address=ray_address,
                                           config=cfg.to_dict(), log_level=log_level, log_format=log_format,
                                           worker_host=worker_host,
                                           detached=detach, http_address=http_address))
    except BaseException:
        _stop_actors(actors)
        _stop_ray(started)
        raise
    handle = ClusterHandle(router_address, workers, ray_address, started, actors, http_address=http_address,
                           secret=secret)
    if detach:
        _state_path().parent.mkdir(parents=True, exist_ok=True)
        _state_path().write_text(json.dumps(
            {"ray_address": ray_address, "started_ray": started, "router": router_address,
             "ray_auth_mode": os.environ.get("RAY_AUTH_MODE", "disabled")}))
    return handle


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
        used = {int(w["worker_id"].rsplit("-", 1)[1]) for w in current}
        ids = [f"{pool_name}-{i}" for i in range(replicas + len(used)) if i not in used][: replicas - len(current)]
        say(f"starting {len(ids)} worker(s) in pool {pool_name}: {', '.join(ids)}")
        # workers of a foreground cluster belong to the process that scales it
        lifetime = "detached" if meta.get("detached") else None
        actors, pending = _start_workers(cfg, pool, ids, lifetime, meta.get("log_level", "info"),
                                         meta.get("worker_host", "auto"), meta.get("log_format", "text"),
                                         ray.get(controller.cluster_secret.remote(), timeout=30))
        if lifetime is None:  # a non-detached actor dies with its last handle: keep them
            _OWNED_ACTORS.extend(actors)
        try:
            started = _wait_workers(pending, cfg.timeouts.startup_s)
            _check_backend_placement(_kv_backend(cfg), started + info["workers"])
            _check_kv_pairs(started + info["workers"], cfg.kv_transfer.timeout_s)
        except BaseException:
            _stop_actors(actors)
            raise
        ray.get([controller.register_worker.remote(w) for w in started])
        current += started
    elif replicas < len(current):
        leaving, current = current[replicas:], current[:replicas]
        ray.get(router.set_workers.remote([(w["worker_id"], w["role"], w["address"]) for w in others + current]))
        for w in leaving:
            actor = ray.get_actor(w["worker_id"])
            say(f"draining {w['worker_id']} ...")
            deadline = time.monotonic() + drain_timeout_s
            while time.monotonic() < deadline:
                load = ray.get(actor.load.remote(), timeout=30)
                if not any(load.values()):
                    break
                time.sleep(0.2)
            else:
                say(f"warning: {w['worker_id']} still busy after {drain_timeout_s:.0f}s; stopping it anyway")
            _stop_actors([actor])
            ray.get(controller.deregister_worker.remote(w["worker_id"]))
    ray.get(router.set_workers.remote([(w["worker_id"], w["role"], w["address"]) for w in others + current]))
    return current
