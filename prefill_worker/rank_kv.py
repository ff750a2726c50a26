"""The KV sender of a prefill worker, made alike on each of its tensor-parallel ranks: rank 0 makes
it for its own sends, and with `PrefillRankKV` each other rank makes one in its own process and sends
its KV heads of each step's transfers straight to the decode ranks that take them (the direct path,
kv_transfer/parts.py)."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Any

from kv_transfer import KVFaults, KVSender, create_sender
from kv_transfer.parts import PartSend, decode_items
from proto.cluster_auth import CarrySecret


def connect_all(sender: KVSender, endpoints: list[str], timeout_s: float) -> dict[str, str]:
    """Handshake with every KV endpoint at once (within about `timeout_s` in all); endpoint -> why it
    cannot take this sender's transfers."""
    errors: dict[str, str] = {}
    if not endpoints:
        return errors
    pool = concurrent.futures.ThreadPoolExecutor(min(8, len(endpoints)), thread_name_prefix="kv-connect")
    jobs = {pool.submit(sender.connect, e, timeout_s): e for e in endpoints}
    done, late = concurrent.futures.wait(jobs, timeout=timeout_s + 1.0)
    pool.shutdown(wait=False, cancel_futures=True)  # a late handshake ends by its own deadline
    for job in done:
        if job.exception() is not None:
            errors[jobs[job]] = str(job.exception())
    for job in late:
        errors[jobs[job]] = f"no handshake within {timeout_s:.0f}s"
    return errors


@dataclass
class SenderSettings:
    """How a prefill worker's KV senders are made (one per rank)."""

    backend: str = "grpc"
    timeout_s: float = 30.0
    compression: str = "none"
    faults: str | None = None  # kv_transfer/faults.py spec; None: off unless $PDCLUSTER_KV_FAULTS
    cluster_secret: str | None = None
    options: dict = field(default_factory=dict)  # more keyword arguments of the backend's sender

    def make(self, compat_hash: str) -> KVSender:
        extra = {**self.options, **({"compression": self.compression} if self.compression != "none" else {})}
        sender = create_sender(self.backend, compat_hash, timeout_s=self.timeout_s,
                               faults=KVFaults.parse(self.faults), **extra)
        if self.cluster_secret:
            sender.add_channel_interceptor(CarrySecret(self.cluster_secret))
        return sender


@dataclass
class PrefillRankKV:
    """Given to each other rank of a prefill worker (engine/tp_steps.py `RankKV`)."""

    settings: SenderSettings
    sender: KVSender | None = field(default=None, init=False, repr=False)

    def __getstate__(self) -> dict:  # what travels to the rank's process: the settings only
        return {**self.__dict__, "sender": None}

    def start(self, runner: Any) -> list[int]:
        self.sender = self.settings.make(runner.compat_hash)
        return []

    def parts(self, payload: bytes, runner: Any) -> PartSend:
        layout = runner.tp.layout
        return PartSend(self.sender, layout.rank, layout.size, layout.num_kv_heads, decode_items(payload))

    def call(self, request: dict) -> dict:
        if request.get("op") == "bytes_sent":
            return {"bytes_sent": dict(self.sender.bytes_sent)}
        if request.get("op") == "connect":  # answered within rank 0's wait on the channel (the group's timeout)
            return {"errors": connect_all(self.sender, request["endpoints"], min(request["timeout_s"], 45.0))}
        raise ValueError(f"unknown request {request.get('op')!r}")

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
