"""A pool's workers on Ray: where each goes and with what resources, the options of its server,
waiting until all serve, and the KV checks between prefill and decode workers before the router
sends them a request; stopping actors.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

from engine.kv_tier import DIR_PREFIX
from pdcluster.cluster_config import ClusterConfig
from pdcluster.ray_runtime import LaunchError

KV_FAULTS_ENV = "PDCLUSTER_KV_FAULTS"  # kv_transfer.faults.ENV (not imported here: it pulls in grpc)


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


def worker_bundle(pool: Any, cluster_resources: dict[str, float]) -> dict[str, float]:
    """One worker of `pool` as a Ray resource bundle (what the autoscaler is asked to fit)."""
    opts = _actor_options(pool, None, cluster_resources)
    bundle = {"CPU": float(opts["num_cpus"]), "GPU": float(opts["num_gpus"]), **opts.get("resources", {})}
    if "memory" in opts:
        bundle["memory"] = float(opts["memory"])
    return {k: v for k, v in bundle.items() if v}


def cluster_kv_backend(cfg: ClusterConfig) -> str:
    """The KV transfer backend of the workers of `cfg`; a LaunchError for one that cannot serve a cluster."""
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


def check_tensor_parallel(cfg: ClusterConfig) -> None:
    """A pool whose tensor_parallel_size cannot split the model is an error at `up`, naming the pool,
    before any worker starts (a worker would fail loading its shard). Any two degrees that each split
    the model can exchange KV (kv_transfer/parts.py plans every such pair), so no pair is checked.
    `expert_parallel` is checked alike (routed experts that the ranks divide); it does
    not enter the KV compatibility key (attention, and so the cache, is laid out as without it)."""
    if all(p.tensor_parallel_size == 1 and not p.expert_parallel for p in cfg.pools):
        return
    from engine.builtin_model import resolve_model_path
    from engine.config import ModelConfig
    from engine.tp_ranks import layout_for

    model = ModelConfig.from_pretrained(resolve_model_path(cfg.model.path))
    for i, pool in enumerate(cfg.pools):
        try:
            layout_for(model, 0, pool.tensor_parallel_size, pool.expert_parallel)
        except ValueError as e:
            key = "expert_parallel" if str(e).startswith("expert") else "tensor_parallel_size"
            raise LaunchError(f"pools[{i}].{key} (pool {pool.name!r}): {e}") from None


def check_backend_placement(kv_backend: str, workers: list[dict[str, Any]]) -> None:
    """A pinned backend that cannot work for some pair is an error now, not at the first request."""
    if kv_backend == "shm":
        nodes = {w["node_id"] for w in workers if w["role"] in ("prefill", "decode")}
        if len(nodes) > 1:
            raise LaunchError("kv_transfer.backend: 'shm' needs every prefill and decode worker on one node, "
                              f"but they landed on {len(nodes)} nodes; use grpc or auto")


def check_kv_pairs(workers: list[dict[str, Any]], timeout_s: float) -> None:
    """Every prefill worker (each of its tensor-parallel ranks) handshakes with every decode worker's
    KV receivers (each rank's on the direct path) now, so a backend that
    cannot work for some pair (another node for shm, no process group for torch_distributed, an
    unreachable data port for tcp, a different KV layout) is an error at `up` / `scale`, not at the first request."""
    import ray

    by_address = {}  # KV endpoint -> the decode worker (and rank) it belongs to
    for w in workers:
        if w["role"] == "decode":
            ends = w.get("kv_endpoints") or [w["address"]]
            by_address.update({e: w["worker_id"] + (f" rank {r}" if len(ends) > 1 else "") for r, e in enumerate(ends)})
    decode = list(by_address)
    prefill = [w for w in workers if w["role"] == "prefill"]
    if not decode or not prefill:
        return
    refs = {ray.get_actor(w["worker_id"]).connect_kv.remote(decode, timeout_s): w["worker_id"] for w in prefill}
    problems = []
    for ref, worker_id in refs.items():
        try:
            errors = ray.get(ref, timeout=timeout_s * len(decode) + 30)
        except Exception as e:
            problems.append(f"  {worker_id}: KV handshakes failed: {cause(e)}")
            continue
        problems += [f"  {worker_id} -> {by_address[a]} ({a}): {reason}" for a, reason in errors.items()]
    if problems:
        raise LaunchError("KV transfer between these prefill and decode workers cannot work:\n" + "\n".join(problems))


def worker_options(cfg: ClusterConfig, role: str, host: str, secret: str | None = None,
                   device: str = "cpu") -> dict[str, Any]:
    """The keyword arguments of a `role` worker's server (PrefillWorkerServer / DecodeWorkerServer)
    whose engine runs on `device` (its pool's: "cpu" or "cuda")."""
    kv = cfg.kv_transfer
    options: dict[str, Any] = {"host": host, "kv_backend": cluster_kv_backend(cfg),
                               "request_timeout_s": cfg.timeouts.request_s, "cluster_secret": secret}
    shm = options["kv_backend"] in ("shm", "auto")  # the backends with a shm part: its writer's options
    if role == "prefill":
        if shm:
            options["kv_options"] = {"in_place": kv.shm_in_place, "verify_in_place": kv.shm_verify}
        elif options["kv_backend"] == "torch_distributed" and device == "cuda":
            # the sender's group is gloo unless told; a decode worker's receiver picks NCCL for a CUDA cache
            options["kv_options"] = {"dist_backend": "nccl"}
        options["kv_timeout_s"] = kv.timeout_s
        options["kv_compression"] = kv.compression
        # the driver's environment wins: Ray workers do not all inherit it
        options["kv_faults"] = os.environ.get(KV_FAULTS_ENV) or kv.faults
        return options
    if shm and role == "decode":
        options["kv_options"] = {"in_place": kv.shm_in_place}
    options["reservation_ttl_s"] = kv.lease_s
    return options


def tier_path(parent: str, secret: str | None) -> str:
    """The offload tier's directory of the cluster whose secret this is (the same on every node,
    and for workers added later by `pdcluster scale`)."""
    tag = hashlib.blake2b((secret or "").encode(), digest_size=6).hexdigest()
    return os.path.join(parent, f"{DIR_PREFIX}{tag}")


def start_workers(cfg: ClusterConfig, pool: Any, worker_ids: list[str], lifetime: str | None,
                   log_level: str, host: str, log_format: str = "text",
                   secret: str | None = None) -> tuple[list[Any], dict[Any, str]]:
    """Create the WorkerActors of `pool` named `worker_ids`; returns (actors, info ref -> label).
    `host`: where workers serve gRPC; "auto" = their node's IP (a Ray we started here: loopback)."""
    import ray

    from pdcluster.actors import WorkerActor

    cluster_resources = ray.cluster_resources()
    engine_kwargs = cfg.engine_kwargs(pool)
    if engine_kwargs.get("num_threads") is None:  # one torch thread per pinned CPU, else per Ray CPU, shared by the ranks
        cpus = len(pool.cpus) if pool.cpus else int(pool.resources.get("num_cpus", 1))
        engine_kwargs["num_threads"] = max(1, cpus // pool.tensor_parallel_size)
    if cfg.kv_cache.offload_mb:  # one directory per cluster and node, shared by its workers there
        engine_kwargs["kv_offload_path"] = tier_path(cfg.kv_cache.offload_dir, secret)
    options = worker_options(cfg, pool.role, host, secret, pool.device)
    actors, pending = [], {}
    for wid in worker_ids:
        actor = WorkerActor.options(name=wid, **_actor_options(pool, lifetime, cluster_resources,
                                                               cfg.ray.max_restarts)).remote(
            pool.role, wid, engine_kwargs, options, log_level, pool.name, log_format,
            list(pool.cpus) if pool.cpus else None)
        actors.append(actor)
        pending[actor.info.remote()] = f"{wid} (pool {pool.name}, role {pool.role})"
    return actors, pending


def wait_workers(pending: dict[Any, str], timeout_s: float) -> list[dict[str, Any]]:
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
                failed.append(f"{pending[ref]}: {cause(e)}")
    if failed or refs:
        lines = [f"  {m}" for m in failed] + [
            f"  {pending[r]}: not up after {timeout_s:.0f}s (are the pool's resources available in the Ray "
            "cluster? see `ray status`)" for r in refs]
        raise LaunchError("workers did not start:\n" + "\n".join(lines))
    return infos


def cause(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__


def stop_actors(actors: list[Any]) -> None:
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
