"""The SLO controller's fleet on Ray (`pdcluster up` with `controller.enabled`): it runs in the
router's actor, reads each worker's signals from its actor, flips workers in place (the router
stops sending to it, it drains, its actor serves the other role on the weights it holds, its KV
handshakes run, it rejoins), and starts or stops workers within the pools' min_replicas /
max_replicas. Membership lives in the Controller actor, so `pdcluster status` and `scale` see
every change; the last decision goes there too.

A worker of any pool may serve either role when `controller.flips` is on (its pool is where it was
started and counts against that pool's bounds); tensor-parallel workers do not flip. New workers
are Ray actors with their pool's resources: on a Ray cluster with an autoscaler, an actor waiting
for resources is what asks it for a node of that pool (`timeouts.startup_s` bounds the wait).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from pdcluster.cluster_config import ClusterConfig
from pdcluster.ray_members import add_workers, drain, next_ids, retire_worker
from pdcluster.role_flip import Flip
from pdcluster.worker_launch import check_kv_pairs, worker_bundle, worker_options
from pdcluster.worker_signals import WorkerSignals
from router.server import RouterServer
from scaling.policy import Bounds, Decision, Signals

log = logging.getLogger("pdcluster.controller")


class RayFleet:
    def __init__(self, router: RouterServer, cfg: ClusterConfig, meta: dict[str, Any]) -> None:
        import ray

        from pdcluster.actors import CONTROLLER_NAME

        if cfg.mode != "disaggregated":
            raise ValueError("the controller moves workers between prefill and decode: a disaggregated cluster")
        self.router, self.cfg, self.meta = router, cfg, meta
        self.controller = ray.get_actor(CONTROLLER_NAME)
        self.pools = {p.name: p for p in cfg.pools}
        self._handles: dict[str, Any] = {}  # worker id -> actor handle (`_actor`)

    def _members(self) -> list[dict[str, Any]]:
        import ray

        return ray.get(self.controller.membership.remote(), timeout=30)["workers"]

    def _actor(self, worker_id: str) -> Any:
        """The worker's actor handle, looked up once (a name lookup is a GCS call each interval)."""
        import ray

        if worker_id not in self._handles:
            self._handles[worker_id] = ray.get_actor(worker_id)
        return self._handles[worker_id]

    def _publish(self, members: list[dict[str, Any]]) -> None:
        self.router.set_workers([(w["worker_id"], w["role"], w["address"]) for w in members])

    def read_workers(self, limit_s: float) -> list[WorkerSignals]:
        import ray

        refs = {w["worker_id"]: self._actor(w["worker_id"]).signals.remote(limit_s) for w in self._members()}
        out = []
        for worker_id, ref in refs.items():
            try:
                out.append(WorkerSignals.from_dict(ray.get(ref, timeout=30)))
            except Exception as e:  # restarting (or gone): not counted this interval, looked up again next
                self._handles.pop(worker_id, None)
                log.warning("no signals from %s: %s", worker_id, str(e).strip().splitlines()[-1:])
        return out

    def bounds(self) -> Bounds:
        low = {r: sum(p.replica_bounds[0] for p in self.cfg.pools_by_role(r)) for r in ("prefill", "decode")}
        high = {r: sum(p.replica_bounds[1] for p in self.cfg.pools_by_role(r)) for r in ("prefill", "decode")}
        total_low, total_high = low["prefill"] + low["decode"], high["prefill"] + high["decode"]
        if self.cfg.controller.flips:
            return Bounds(1, total_high - 1, 1, total_high - 1, total_high, min_total=total_low)
        return Bounds(max(1, low["prefill"]), high["prefill"], max(1, low["decode"]), high["decode"], total_high,
                      min_total=total_low)

    def flip(self, worker_id: str, role: str) -> Flip:
        import ray

        members = self._members()
        worker = next(w for w in members if w["worker_id"] == worker_id)
        others = [w for w in members if w is not worker]
        t0 = time.monotonic()
        self._publish(others)
        actor = self._actor(worker_id)
        if not drain(actor, self.cfg.controller.drain_timeout_s):
            self._publish(members)
            raise TimeoutError(f"{worker_id} did not drain within {self.cfg.controller.drain_timeout_s:g} s")
        drained = time.monotonic()
        pool = self.pools[worker["pool"]]
        secret = ray.get(self.controller.cluster_secret.remote(), timeout=30)
        options = worker_options(self.cfg, role, self.meta.get("worker_host", "auto"), secret, pool.device)
        info = ray.get(actor.flip.remote(role, options), timeout=self.cfg.timeouts.startup_s)
        ray.get(self.controller.register_worker.remote(info), timeout=30)
        check_kv_pairs([info] + [w for w in others if w["role"] != role], self.cfg.kv_transfer.timeout_s)
        self._publish(others + [info])
        return Flip(worker_id, role, drained - t0, time.monotonic() - drained)

    def resize(self, role: str, workers: int) -> None:
        """Start or stop workers until `role` has `workers` (within the pools' bounds)."""
        members = self._members()
        have = [w for w in members if w["role"] == role]
        count = lambda name: sum(w.get("pool") == name for w in members)  # noqa: E731
        # pools of this role first; with flips, another pool's worker may start in this role
        pools = sorted(self.cfg.pools, key=lambda p: p.role != role)
        if workers > len(have):
            for pool in pools:
                if pool.role != role and not self.cfg.controller.flips:
                    continue
                room = min(workers - len(have), pool.replica_bounds[1] - count(pool.name))
                if room > 0:
                    ids = next_ids(pool.name, members, room)
                    log.info("starting %s in pool %s as %s", ", ".join(ids), pool.name, role)
                    self.request_nodes([w["pool"] for w in members] + [pool.name] * room)
                    started = add_workers(self.cfg, dataclasses.replace(pool, role=role), ids, self.meta,
                                          self.controller, members)
                    members, have = members + started, have + started
                    self._publish(members)
            return
        for w in sorted(have, key=lambda w: w["worker_id"], reverse=True):
            if len(have) <= workers:
                break
            if count(w["pool"]) > self.pools[w["pool"]].replica_bounds[0]:
                members = [m for m in members if m is not w]
                have = [m for m in have if m is not w]
                self._publish(members)
                retire_worker(w, self.controller, self.cfg.controller.drain_timeout_s, log.info)
                self._handles.pop(w["worker_id"], None)
        self.request_nodes([w["pool"] for w in members])

    def request_nodes(self, pools: list[str]) -> None:
        """Tell Ray's autoscaler the workers the fleet needs now, one resource bundle per worker of
        these pools (`ray.autoscaler.sdk.request_resources`: a standing request, replaced by the
        next): nodes for new workers are asked for before their actors wait, and let go once
        workers are given back. Without an autoscaler nothing reads it."""
        import ray
        from ray.autoscaler.sdk import request_resources

        have = ray.cluster_resources()
        bundles = [worker_bundle(self.pools[name], have) for name in pools]
        try:
            request_resources(bundles=bundles)
        except Exception as e:  # noqa: BLE001 (a hint: the actors' own demand still asks for nodes)
            log.warning("could not ask the autoscaler for %d worker bundles: %s", len(bundles), e)

    def record(self, decision: Decision, signals: Signals) -> None:
        """The target and the last decision, for `pdcluster status`."""
        self.controller.set_meta.remote(controller={
            "target": {"prefill": decision.prefill, "decode": decision.decode},
            "last": {"at": time.time(), "action": decision.action, "reason": decision.reason,
                     "pressure": {"prefill": round(decision.prefill_pressure, 3),
                                  "decode": round(decision.decode_pressure, 3)}}})
