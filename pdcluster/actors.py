"""Ray actors: thin shells that host each component's gRPC server in its own process.

The servers do the work; an actor only starts one, reports its address, and stops it. Worker
actors are placed by the launcher with their pool's resources; the Controller is a named actor
that holds membership so `pdcluster status` / `down` can find everything later.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import ray

from common.heap import freeze_startup_heap

NAMESPACE = "pdcluster"
CONTROLLER_NAME = "controller"
ROUTER_NAME = "router"


def _setup_logging(level: str, fmt: str) -> None:
    from common.logs import setup_logging

    setup_logging(level, fmt)


def pin_process(cpus: list[int]) -> None:
    """Pin every thread of this process (and those it starts later) to `cpus` (Linux)."""
    if not hasattr(os, "sched_setaffinity"):
        raise RuntimeError("pools[].cpus needs Linux (os.sched_setaffinity)")
    usable = os.sched_getaffinity(0)
    if not set(cpus) <= usable:
        raise RuntimeError(f"pools[].cpus {sorted(cpus)} are not all usable on this node (usable: {sorted(usable)})")
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that ended meanwhile
            pass


@ray.remote(num_cpus=0)
class WorkerActor:
    """Hosts a prefill, decode or colocated worker server."""

    def __init__(self, role: str, worker_id: str, engine_kwargs: dict, options: dict, log_level: str = "info",
                 pool: str = "", log_format: str = "text", cpus: list[int] | None = None) -> None:
        _setup_logging(log_level, log_format)
        if cpus:
            pin_process(cpus)
        from engine.config import EngineConfig

        self.role, self.worker_id, self.pool = role, worker_id, pool
        self.server = _server(role, EngineConfig(**engine_kwargs), worker_id, options)
        self.server.on_fatal = self._exit
        self.gc_frozen = freeze_startup_heap()
        self._rejoin()

    def _exit(self, reason: str) -> None:
        """The engine broke for good (a tensor-parallel rank died): kill the other ranks at once (they
        hold devices the restarted worker needs) and exit, so Ray restarts this worker whole."""
        try:
            self.server.engine.close(timeout_s=0.0)
        finally:
            os._exit(1)

    def _rejoin(self) -> None:
        """After Ray restarted this actor (its process died): tell the controller and the router the
        new address, so it is back in rotation. At first start the launcher registers it instead."""
        try:
            controller = ray.get_actor(CONTROLLER_NAME)
        except ValueError:
            return  # no cluster around (started by hand)
        if ray.get(controller.worker.remote(self.worker_id), timeout=60) is None:
            return  # first start
        info = self.info()
        ray.get(controller.register_worker.remote(info), timeout=60)
        try:
            ray.get(ray.get_actor(ROUTER_NAME).update_worker.remote(self.worker_id, self.role, info["address"]),
                    timeout=60)
        except ValueError:
            pass  # the router is restarting too: it reads the membership when it is back
        logging.getLogger("pdcluster.worker").warning("restarted by Ray; rejoined at %s", info["address"])

    def info(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "role": self.role,
            "pool": self.pool,
            "address": self.server.address,
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "gc_frozen": self.gc_frozen,  # objects kept out of the garbage collector's scans
            "ranks": self.server.engine_ranks(),
            "kv": self.server.engine.kv_description(),  # what its KV cache keeps per token  # tensor-parallel ranks: [this process's pid, children's ...]
            # a decode worker's KV receivers (one per tensor-parallel rank on the direct path)
            "kv_endpoints": self.server.kv_endpoints() if hasattr(self.server, "kv_endpoints") else [],
        }

    def connect_kv(self, endpoints: list[str], timeout_s: float) -> dict[str, str]:
        """A prefill worker's KV handshakes with these decode workers: endpoint -> why refused."""
        return self.server.connect_kv(endpoints, timeout_s) if self.role == "prefill" else {}

    def load(self) -> dict[str, int]:
        """What the worker still holds (for draining): running, queued, KV blocks used."""
        s = self.server.stats()
        return {"running": s.running, "queued": s.queued, "kv_blocks_used": s.kv_blocks_used}

    def in_flight(self) -> int:
        return self.server.in_flight()

    def signals(self, limit_s: float) -> dict[str, Any]:
        """What the SLO controller reads of this worker (pdcluster/worker_signals.py)."""
        from pdcluster.worker_signals import read_worker

        return read_worker(self.server, self.role, limit_s).to_dict()

    def flip(self, role: str, options: dict) -> dict[str, Any]:
        """Serve `role` from now on, on the weights this process holds (pdcluster/role_flip.py; the
        caller drained it first). Ray restarting this actor later starts its first role again."""
        if self.server.engine.tensor_parallel_size > 1:
            raise ValueError(f"{self.worker_id} is tensor-parallel: its ranks hold shards, not whole weights")
        runner, cfg = self.server.engine.runner, self.server.engine.cfg
        self.server.stop(grace=0.0)
        self.server = _server(role, cfg, self.worker_id, options, model=runner.model, kv_caches=runner.kv_caches)
        self.server.on_fatal = self._exit
        self.role = role
        return self.info()

    def stop(self) -> None:
        self.server.stop()


def _server(role: str, cfg: Any, worker_id: str, options: dict, model: Any = None, kv_caches: Any = None) -> Any:
    """A `role` worker's server on `cfg` (`model`, `kv_caches`: weights and KV cache memory already in
    this process)."""
    if options.get("host") == "auto":  # serve on this node's address (loopback when Ray is local)
        ip = ray.util.get_node_ip_address()
        options = {**options, "host": "127.0.0.1" if ip in ("127.0.0.1", "localhost") else ip}
    shared = {} if model is None else {"model": model, "kv_caches": kv_caches}
    if role == "prefill":
        from prefill_worker.server import PrefillWorkerServer

        return PrefillWorkerServer(cfg, worker_id, **options, **shared)
    if role == "decode":
        from decode_worker.server import DecodeWorkerServer

        return DecodeWorkerServer(cfg, worker_id, **options, **shared)
    from decode_worker.colocated import ColocatedWorkerServer

    # no KV arrives at a colocated worker: the KV backend and the reservation lease do not apply
    options = {k: v for k, v in options.items() if k not in ("kv_backend", "reservation_ttl_s")}
    return ColocatedWorkerServer(cfg, worker_id, **options)


@ray.remote(num_cpus=0)
class RouterActor:
    """Hosts the RouterServer (gRPC) and, when `http` ({host, port}) is given, the OpenAI HTTP API
    in front of it."""

    def __init__(self, router_kwargs: dict, log_level: str = "info", http: dict | None = None,
                 log_format: str = "text") -> None:
        _setup_logging(log_level, log_format)
        from router.server import RouterServer

        self.server = RouterServer(**router_kwargs)
        self.slo_controller = None  # pdcluster/live_controller.py, with `controller.enabled`
        self._rejoin()
        self.http = None
        if http is not None:
            from router.http_api import HttpApi, router_metrics, router_readiness

            try:
                self.http = HttpApi(self.server.local_address, self.server.model_name, router_kwargs["model"],
                                    api_keys=router_kwargs.get("api_keys"), readiness=router_readiness(self.server),
                                    metrics=router_metrics(self.server),
                                    request_timeout_s=self.server.request_timeout_s + 10,
                                    max_model_len=self.server.max_model_len,
                                    tls_cert=router_kwargs.get("tls_cert"), tls_key=router_kwargs.get("tls_key"),
                                    router=self.server, **http)
                self.http.start()
            except BaseException:
                self.server.stop()
                raise
        self.gc_frozen = freeze_startup_heap()

    def gc_frozen_objects(self) -> int:
        return self.gc_frozen

    def _rejoin(self) -> None:
        """After Ray restarted the router (its process died): take the workers from the controller."""
        try:
            controller = ray.get_actor(CONTROLLER_NAME)
        except ValueError:
            return
        info = ray.get(controller.membership.remote(), timeout=60)
        if info["router"] is None:
            return  # first start: the launcher sets the workers
        self.server.set_workers([(w["worker_id"], w["role"], w["address"]) for w in info["workers"]])
        ray.get(controller.register_router.remote({"address": self.server.address}), timeout=60)
        logging.getLogger("pdcluster.router").warning("restarted by Ray with %d workers", len(info["workers"]))
        self.start_controller()

    def start_controller(self) -> bool:
        """Start the SLO controller in this process when the cluster's config enables it
        (pdcluster/ray_fleet.py); whether it runs."""
        from pdcluster.cluster_config import ClusterConfig

        meta = ray.get(ray.get_actor(CONTROLLER_NAME).membership.remote(), timeout=60)["meta"]
        cfg = ClusterConfig.from_dict(meta["config"])
        if not cfg.controller.enabled or self.slo_controller is not None:
            return self.slo_controller is not None
        from pdcluster.live_controller import LiveController
        from pdcluster.ray_fleet import RayFleet

        self.slo_controller = LiveController(RayFleet(self.server, cfg, meta), cfg.controller_config()).start()
        ray.get_actor(CONTROLLER_NAME).set_meta.remote(controller={"target": None, "last": None})
        return True

    def address(self) -> str:
        return self.server.address

    def pid(self) -> int:
        return os.getpid()

    def http_address(self) -> str | None:
        return self.http.address if self.http else None

    def set_workers(self, workers: list[tuple[str, str, str]]) -> None:
        self.server.set_workers(workers)

    def update_worker(self, worker_id: str, role: str, address: str) -> None:
        """A worker restarted at a new address (or joined): replace its entry, keep the others."""
        self.server.pool.update_worker(worker_id, role, address)

    def stop(self) -> None:
        if self.slo_controller is not None:
            self.slo_controller.stop()
        if self.http:
            self.http.stop()
        self.server.stop()


@ray.remote(num_cpus=0)
class Controller:
    """Membership: which actors exist, their pools, roles and addresses; live stats on request."""

    def __init__(self, cluster_secret: str | None = None) -> None:
        self._secret = cluster_secret  # what every worker RPC must carry (proto/cluster_auth.py)
        self.workers: dict[str, dict[str, Any]] = {}  # worker_id -> info (+ pool, actor name)
        self.router: dict[str, Any] | None = None
        self.meta: dict[str, Any] = {"started": time.time()}

    def register_worker(self, info: dict[str, Any]) -> None:
        self.workers[info["worker_id"]] = info

    def worker(self, worker_id: str) -> dict[str, Any] | None:
        return self.workers.get(worker_id)

    def deregister_worker(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)

    def cluster_secret(self) -> str | None:
        """For `scale` (new workers get it) and for tests; never part of `membership()`."""
        return self._secret

    def register_router(self, info: dict[str, Any]) -> None:
        self.router = info

    def set_meta(self, **meta: Any) -> None:
        self.meta.update(meta)

    def membership(self) -> dict[str, Any]:
        return {"workers": list(self.workers.values()), "router": self.router, "meta": self.meta}

    def status(self) -> list[dict[str, Any]]:
        """Each worker's live stats over gRPC (state 'unreachable' if it does not answer)."""
        import grpc

        from proto import worker_pb2 as wk
        from proto import worker_pb2_grpc as wk_grpc
        from proto.cluster_auth import with_secret

        rows = []
        for info in self.workers.values():
            row = dict(info)
            channel = with_secret(grpc.insecure_channel(info["address"]), self._secret)
            stub = wk_grpc.PrefillWorkerStub(channel) if info["role"] == "prefill" else wk_grpc.DecodeWorkerStub(channel)
            try:
                s = stub.Stats(wk.StatsRequest(), timeout=3.0)
                row.update(state="healthy", running=s.running, queued=s.queued, kv_blocks_used=s.kv_blocks_used,
                           kv_blocks_free=s.kv_blocks_free, queued_prefill_tokens=s.queued_prefill_tokens,
                           prompt_tokens=s.prompt_tokens, prefix_cache_hit_tokens=s.prefix_cache_hit_tokens,
                           local_prefills=s.local_prefills, kv_bytes_not_sent=s.kv_bytes_not_sent)
                if s.tier_id:
                    row.update(tier_id=s.tier_id, tier_capacity_bytes=s.tier_capacity_bytes,
                               tier_used_bytes=s.tier_used_bytes, tier_blocks=s.tier_blocks, tier_saves=s.tier_saves,
                               tier_hits=s.tier_hits, tier_misses=s.tier_misses, tier_evictions=s.tier_evictions)
            except grpc.RpcError as e:
                row.update(state=f"unreachable ({e.code().name})")
            finally:
                channel.close()
            rows.append(row)
        return rows
