"""KV cache transfer between prefill and decode workers (docs/kv_transfer.md). Backends are imported
lazily by name so that, say, torch.distributed is only touched when chosen."""

from __future__ import annotations

import importlib
from typing import Any

from kv_transfer.base import KVReceiver, KVSender, KVSink, KVTransferError, TransferTicket
from kv_transfer.faults import FaultInjector, KVFaults

# name -> (sender class, receiver class), as "module:Class"
BACKENDS: dict[str, tuple[str, str]] = {
    "inproc": ("kv_transfer.inproc:InprocSender", "kv_transfer.inproc:InprocReceiver"),
    "grpc": ("kv_transfer.control_sender:GrpcSender", "kv_transfer.control_receiver:GrpcReceiver"),
    "shm": ("kv_transfer.shm_sender:ShmSender", "kv_transfer.shm_receiver:ShmReceiver"),
    "torch_distributed": ("kv_transfer.torch_dist_sender:TorchDistSender",
                          "kv_transfer.torch_dist_receiver:TorchDistReceiver"),
    "tcp": ("kv_transfer.tcp_sender:TcpSender", "kv_transfer.tcp_receiver:TcpReceiver"),
    "auto": ("kv_transfer.auto:AutoSender", "kv_transfer.auto:AutoReceiver"),
}


def _backend(name: str, side: int) -> Any:
    if name not in BACKENDS:
        raise ValueError(f"unknown KV transfer backend {name!r}; available: {', '.join(sorted(BACKENDS))}")
    module, cls = BACKENDS[name][side].split(":")
    return getattr(importlib.import_module(module), cls)


def create_sender(backend: str, compat_hash: str, faults: KVFaults | None = None, **kwargs: Any) -> KVSender:
    """A sender of `backend`; with `faults` (or $PDCLUSTER_KV_FAULTS, which wins) its messages are
    dropped, delayed or corrupted as the spec says (kv_transfer/faults.py; off by default)."""
    sender = _backend(backend, 0)(compat_hash, **kwargs)
    faults = KVFaults.from_env() or faults
    if faults is not None:
        sender.fault_injector = FaultInjector(faults)
        sender.add_channel_interceptor(sender.fault_injector.interceptor())
    return sender


def create_receiver(backend: str, sink: KVSink, **kwargs: Any) -> KVReceiver:
    return _backend(backend, 1)(sink, **kwargs)


__all__ = [
    "BACKENDS",
    "FaultInjector",
    "KVFaults",
    "KVReceiver",
    "KVSender",
    "KVSink",
    "KVTransferError",
    "TransferTicket",
    "create_receiver",
    "create_sender",
]
