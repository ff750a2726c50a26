"""KV cache transfer between prefill and decode workers: one interface, pluggable backends.

Backends are imported lazily by name so that, say, torch.distributed is only touched when chosen.
"""

from __future__ import annotations

import importlib
from typing import Any

from kv_transfer.base import KVReceiver, KVSender, KVSink, KVTransferError, TransferTicket
from kv_transfer.faults import FaultInjector, KVFaults

# name -> (module, sender class, receiver class)
BACKENDS: dict[str, tuple[str, str, str]] = {
    "inproc": ("kv_transfer.inproc", "InprocSender", "InprocReceiver"),
    "grpc": ("kv_transfer.grpc_backend", "GrpcSender", "GrpcReceiver"),
    "shm": ("kv_transfer.shm_backend", "ShmSender", "ShmReceiver"),
    "torch_distributed": ("kv_transfer.torch_dist_backend", "TorchDistSender", "TorchDistReceiver"),
    "tcp": ("kv_transfer.tcp_backend", "TcpSender", "TcpReceiver"),
    "auto": ("kv_transfer.auto", "AutoSender", "AutoReceiver"),
}


def _backend(name: str) -> Any:
    if name not in BACKENDS:
        raise ValueError(f"unknown KV transfer backend {name!r}; available: {', '.join(sorted(BACKENDS))}")
    module, sender, receiver = BACKENDS[name]
    mod = importlib.import_module(module)
    return getattr(mod, sender), getattr(mod, receiver)


def create_sender(backend: str, compat_hash: str, faults: KVFaults | None = None, **kwargs: Any) -> KVSender:
    """A sender of `backend`; with `faults` (or $PDCLUSTER_KV_FAULTS, which wins) its messages are
    dropped, delayed or corrupted as the spec says (kv_transfer/faults.py; off by default)."""
    sender = _backend(backend)[0](compat_hash, **kwargs)
    faults = KVFaults.from_env() or faults
    if faults is not None:
        sender.fault_injector = FaultInjector(faults)
        sender.add_channel_interceptor(sender.fault_injector.interceptor())
    return sender


def create_receiver(backend: str, sink: KVSink, **kwargs: Any) -> KVReceiver:
    return _backend(backend)[1](sink, **kwargs)


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
