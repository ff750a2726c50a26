"""A worker changes role in place: the SLO controller's flip (docs/controller.md).

The worker leaves the router's list at once (new requests go to the other workers of its role),
finishes what it holds (a prefill worker its queued prompts, a decode worker its running
sequences: no request is lost or cut), then its server stops and a server of the other role starts
in the same process on the same weights (no reload) and the same KV cache memory (no allocation;
a decode worker's shared-memory cache, for shm senders, takes a new segment without a copy), and
it joins the router's list in its new role. `Flip.out_of_service_s` is the time from drained to serving again:
the service the flip itself costs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from decode_worker.server import DecodeWorkerServer
from prefill_worker.server import PrefillWorkerServer

if TYPE_CHECKING:
    from pdcluster.local_cluster import LocalCluster


@dataclass(frozen=True)
class Flip:
    worker_id: str
    role: str  # the role it serves now
    drain_s: float  # leaving the router's list until it held nothing
    out_of_service_s: float  # drained until serving its new role


def flip_role(cluster: LocalCluster, worker_id: str, role: str, timeout_s: float = 60.0) -> Flip:
    """Move `worker_id` of a disaggregated cluster to `role` ("prefill" or "decode"). ValueError when
    it cannot (colocated, unknown worker, already that role, the last worker of its role, tensor
    parallel); TimeoutError when it did not drain within `timeout_s` (it then serves its old role
    again)."""
    if cluster.decode_role == "colocated":
        raise ValueError("a colocated worker serves both phases already: nothing to flip")
    if role not in ("prefill", "decode"):
        raise ValueError(f"role must be prefill or decode, got {role!r}")
    source, target = ((cluster.decode_workers, cluster.prefill_workers) if role == "prefill"
                      else (cluster.prefill_workers, cluster.decode_workers))
    worker = next((w for w in source if w.worker_id == worker_id), None)
    if worker is None:
        known = ", ".join(w.worker_id for w in cluster.workers)
        raise ValueError(f"no worker {worker_id!r} of the other role to move to {role} (workers: {known})")
    if len(source) < 2:
        raise ValueError(f"{worker_id} is the last worker of its role: the cluster would stop serving it")
    if worker.engine.tensor_parallel_size > 1:
        raise ValueError(f"{worker_id} is tensor-parallel: its ranks hold shards, not the weights another role needs")
    assert cluster.router is not None
    t0 = time.monotonic()
    source.remove(worker)
    cluster.router.set_workers(cluster.members())
    while worker.in_flight():
        if time.monotonic() - t0 > timeout_s:
            source.append(worker)
            cluster.router.set_workers(cluster.members())
            raise TimeoutError(f"{worker_id} still held {worker.in_flight()} requests after {timeout_s:g} s")
        time.sleep(0.005)
    drained = time.monotonic()
    held = {"model": worker.engine.runner.model, "kv_caches": worker.engine.runner.kv_caches}
    cfg = worker.engine.cfg
    worker.stop(grace=0.0)
    server = PrefillWorkerServer if role == "prefill" else DecodeWorkerServer
    target.append(server(cfg, worker_id, **held, **cluster.options[role]))
    cluster.router.set_workers(cluster.members())
    return Flip(worker_id, role, drained - t0, time.monotonic() - drained)
