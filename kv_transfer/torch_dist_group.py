"""The torch_distributed data plane's channel: per (sender, receiver) a 2-rank process group over a
`PrefixStore(pair key, the receiver's TCPStore)`; the receiver is rank 0. No global default group.

NCCL ignores tags and matches point-to-point operations in order, so "nccl" is only safe with one
transfer in flight per pair; gloo between CPU caches is what is tested.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

import torch

from engine.tp_group import make_process_group
from kv_transfer.base import KVTransferError

DIST_BACKENDS = ("gloo", "nccl")
OFF = "off"  # a receiver's dist_backend when it hosts no process groups (auto without a GPU cache)
FIRST_TAG = 1 << 30  # the pair's first exchange (layers count their tags up from 0)
TAG_LIMIT = 1 << 31  # gloo tags are non-negative int32


def check_dist_backend(backend: str) -> str:
    if backend not in DIST_BACKENDS:
        raise ValueError(f"dist_backend must be one of {DIST_BACKENDS}, not {backend!r}")
    if not torch.distributed.is_available():
        raise KVTransferError("the torch_distributed KV backend needs torch.distributed (not in this build of torch)")
    if backend == "gloo" and not torch.distributed.is_gloo_available():
        raise KVTransferError("the torch_distributed KV backend with gloo needs a torch built with gloo")
    if backend == "nccl" and not (torch.cuda.is_available() and torch.distributed.is_nccl_available()):
        raise KVTransferError("the torch_distributed KV backend with nccl needs CUDA and NCCL")
    return backend


def device_for(backend: str) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def local_address_towards(host: str, port: int) -> str:
    """The address of this machine that packets to host:port leave from (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1" if host in ("127.0.0.1", "localhost") else socket.gethostname()


def _make_group(backend: str, store: Any, rank: int, hostname: str, timeout_s: float) -> Any:
    """A 2-rank process group over `store` (blocks until both ranks joined, or raises)."""
    if backend not in DIST_BACKENDS:
        raise KVTransferError(f"unknown torch.distributed backend {backend!r} (expected one of {DIST_BACKENDS})")
    return make_process_group(backend, store, rank, 2, timeout_s, hostname)


def _first_exchange(pg: Any, rank: int, device: torch.device, timeout_s: float) -> None:
    """One element from the sender (rank 1) to the receiver (rank 0), before any layer: NCCL and gloo
    set a group up lazily, at its first operation, so a pair that cannot work (e.g. two processes on
    one GPU: NCCL refuses a duplicate device) fails here, while the pair is being built, and not at
    a request's first layer. Raises on failure or after `timeout_s`."""
    t = torch.ones(1, device=device) if rank == 1 else torch.zeros(1, device=device)
    work = pg.send([t], 0, FIRST_TAG) if rank == 1 else pg.recv([t], 1, FIRST_TAG)
    work.wait(datetime.timedelta(seconds=timeout_s))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if rank == 0 and t.item() != 1.0:
        raise RuntimeError(f"the first exchange carried {t.item()}, not 1.0")


def build_pair(backend: str, store: Any, key: str, rank: int, hostname: str, device: torch.device,
               timeout_s: float) -> Any:
    """This side (`rank`) of pair `key`'s group over `store`, proven by the first exchange; raises
    (with nothing left running) when it cannot be built within `timeout_s`."""
    pg = None
    try:
        pg = _make_group(backend, torch.distributed.PrefixStore(key, store), rank, hostname, timeout_s)
        _first_exchange(pg, rank, device, timeout_s)
    except Exception:
        if pg is not None:
            shutdown(pg)
        raise
    return pg


def shutdown(pg: Any) -> None:
    for method in ("abort", "shutdown"):
        fn = getattr(pg, method, None)
        if fn is not None:
            try:
                fn()
                return
            except Exception:
                continue
