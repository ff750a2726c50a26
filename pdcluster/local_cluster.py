"""An in-process cluster without Ray: real worker and router gRPC servers on loopback ports, for
tests, experiments and calibration.

    with LocalCluster(EngineConfig(model=path, num_threads=1), router={"request_timeout_s": 60}) as c:
        with c.client() as client:
            client.complete([5, 6, 7], max_tokens=8)

`mode="colocated"` starts `num_decode` colocated workers (`colocated-0`, ...) and no prefill
worker. Options of each kind of server go in `prefill` / `decode` / `router` dicts (the servers' own
keyword arguments; `decode` is the colocated workers' in that mode); the router gets the engine's
model and max_model_len unless given. `cluster_secret` goes to every server, `tls` to the router
and the HTTP API.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from decode_worker.colocated import ColocatedWorkerServer
from decode_worker.server import DecodeWorkerServer
from engine.config import EngineConfig
from pdcluster.client import Client
from pdcluster.role_flip import Flip, flip_role
from pdcluster.worker_signals import WorkerSignals, read_worker
from prefill_worker.server import PrefillWorkerServer
from router.http_api import HttpApi, router_metrics, router_readiness
from router.server import RouterServer
from scaling.policy import Bounds, Decision, Signals

MODES = ("disaggregated", "colocated")
log = logging.getLogger("pdcluster.local_cluster")


class LocalCluster:
    def __init__(self, engine: EngineConfig, num_prefill: int = 1, num_decode: int = 1,
                 mode: str = "disaggregated", prefill: dict[str, Any] | None = None,
                 decode: dict[str, Any] | None = None, router: dict[str, Any] | None = None,
                 http: dict[str, Any] | None = None, cluster_secret: str | None = None,
                 tls: tuple[str, str] | None = None, prefill_engine: EngineConfig | list[EngineConfig] | None = None,
                 decode_engine: EngineConfig | list[EngineConfig] | None = None) -> None:
        """`prefill_engine` / `decode_engine`: that role's engine instead of `engine` (another
        tensor_parallel_size, say), or a list of one per worker of the role (another offload tier each:
        workers of different nodes). `http`: also serve the OpenAI API (HttpApi's keyword arguments; {} for the defaults).
        `cluster_secret`: required of every worker RPC (the router sends it). `tls`: (certificate,
        private key) PEM files; the router's public port and the HTTP API serve TLS only."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.engine_cfg = engine  # every worker's
        self.decode_role = "colocated" if mode == "colocated" else "decode"
        secret = {} if cluster_secret is None else {"cluster_secret": cluster_secret}
        # each role's server options, for a worker that changes role (pdcluster/role_flip.py)
        self.options = {"prefill": {**secret, **(prefill or {})}, "decode": {**secret, **(decode or {})}}
        certs = {} if tls is None else {"tls_cert": tls[0], "tls_key": tls[1]}
        self.prefill_workers: list[PrefillWorkerServer] = []
        self.decode_workers: list[DecodeWorkerServer | ColocatedWorkerServer] = []
        self.router: RouterServer | None = None
        self.http: HttpApi | None = None
        try:
            decode_server = ColocatedWorkerServer if mode == "colocated" else DecodeWorkerServer
            for i in range(num_decode):
                self.decode_workers.append(decode_server(_nth(decode_engine, i) or engine, f"{self.decode_role}-{i}",
                                                         **{**secret, **(decode or {})}))
            for i in range(0 if mode == "colocated" else num_prefill):
                self.prefill_workers.append(PrefillWorkerServer(_nth(prefill_engine, i) or engine, f"prefill-{i}",
                                                                **{**secret, **(prefill or {})}))
            options = {"max_model_len": engine.max_model_len, **secret, **certs, **(router or {})}
            self.router = RouterServer(options.pop("model", engine.model), mode=mode, **options)
            self.router.set_workers(self.members())
            if http is not None:
                self.http = HttpApi(self.router.local_address, self.router.model_name, self.router.tokenizer,
                                    **{"readiness": router_readiness(self.router),
                                       "max_model_len": self.router.max_model_len,
                                       "metrics": router_metrics(self.router), "router": self.router, **certs,
                                       **http})
                self.http.start()
        except BaseException:
            self.stop()
            raise

    @property
    def address(self) -> str:
        """The router's gRPC address."""
        assert self.router is not None
        return self.router.address

    @property
    def url(self) -> str:
        """The OpenAI API's base URL (with `http=`)."""
        if self.http is None:
            raise RuntimeError("this LocalCluster serves no HTTP API (start it with http={})")
        return f"{'https' if self.http.tls_cert else 'http'}://{self.http.address}"

    @property
    def workers(self) -> list[PrefillWorkerServer | DecodeWorkerServer | ColocatedWorkerServer]:
        return [*self.prefill_workers, *self.decode_workers]

    def members(self) -> list[tuple[str, str, str]]:
        """(worker id, role, address) of every worker, as the router's `set_workers` takes them."""
        return [(w.worker_id, "prefill", w.address) for w in self.prefill_workers] + [
            (w.worker_id, self.decode_role, w.address) for w in self.decode_workers]

    def flip(self, worker_id: str, role: str, timeout_s: float = 60.0) -> Flip:
        """Move a worker to `role` in place, on the weights it holds (pdcluster/role_flip.py)."""
        return flip_role(self, worker_id, role, timeout_s)

    # the SLO controller's view (pdcluster/live_controller.py `Fleet`): it only flips here
    def read_workers(self, limit_s: float) -> list[WorkerSignals]:
        return [read_worker(w, role, limit_s) for role, ws in (("prefill", self.prefill_workers),
                                                               ("decode", self.decode_workers)) for w in ws]

    def bounds(self) -> Bounds:
        if self.decode_role == "colocated":
            raise ValueError("the controller moves workers between prefill and decode: a disaggregated cluster")
        total = len(self.workers)
        return Bounds(1, total - 1, 1, total - 1, total, min_total=total)

    def resize(self, role: str, workers: int) -> None:
        raise ValueError("an in-process cluster starts and stops no workers (its bounds allow flips only)")

    def record(self, decision: Decision, signals: Signals) -> None:
        pass  # the controller keeps its decisions; nothing else shows them here

    def client(self, **options: Any) -> Client:
        return Client(self.address, **options)

    def blocks_in_use(self) -> int:
        return sum(w.engine.load().blocks_used for w in self.workers)

    def wait_blocks_free(self, timeout_s: float = 10.0) -> bool:
        """Whether every worker's KV blocks came back within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.blocks_in_use():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self) -> None:
        """Stop everything started, front to back; one server failing to stop does not keep the
        others running."""
        for server in (self.http, self.router, *self.workers):
            if server is None:
                continue
            try:
                server.stop()
            except Exception:
                log.exception("stopping %s failed", type(server).__name__)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _nth(cfg: EngineConfig | list[EngineConfig] | None, i: int) -> EngineConfig | None:
    """A role's engine config for its worker i (one for all, or one each)."""
    return cfg[i] if isinstance(cfg, list) else cfg
