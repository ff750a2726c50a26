"""The torch_distributed data plane's channel: per (sender, receiver) a 2-rank process group over a
`PrefixStore(pair key, the receiver's TCPStore)`; the receiver is rank 0. No global default group.

NCCL ignores tags: it matches a pair's sends and recvs in the order each side posts them. So each
side posts its layers' point-to-point operations in one sequence per pair (`PairOrder`): the sender
numbers each send as it posts it (the number is the tag, and travels in the layer's `KVLayer`), and
the receiver posts the recv of send n only once it has posted those of 0 .. n-1, whatever order the
messages arrive in, on however many threads. Any number of transfers may be in flight on a pair,
under NCCL as under gloo (where the tags match too); gloo between CPU caches is what is tested,
including with every tag made equal so that gloo matches by order alone.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from engine.tp_group import make_process_group
from kv_transfer.base import KVTransferError
from kv_transfer.shm_receiver import node_id
from kv_transfer.wire import Late, Unavailable

DIST_BACKENDS = ("gloo", "nccl")
OFF = "off"  # a receiver's dist_backend when it hosts no process groups (auto without a GPU cache)
FIRST_TAG = 1 << 30  # the pair's first exchange (layers count their tags up from 0)
SEQ_LIMIT = FIRST_TAG  # a pair's sends are numbered 0, 1, ... modulo this (gloo tags are non-negative int32)
T = TypeVar("T")


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


def gpu_identity(device: torch.device) -> str:
    """The physical GPU `device` is, as "hostname/boot id/GPU uuid" (the node as shm's handshake
    names it, then the uuid CUDA reports, the same whatever CUDA_VISIBLE_DEVICES numbers it as);
    "" for a device that is not a CUDA GPU."""
    if device.type != "cuda":
        return ""
    return f"{node_id()}/{torch.cuda.get_device_properties(device).uuid}"


def same_gpu(mine: str, theirs: str) -> bool:
    """Whether two `gpu_identity`s are one GPU (NCCL cannot pair two ranks on it); "" is no GPU."""
    return bool(mine) and mine == theirs


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


class PairOrder:
    """One pair's sequence of point-to-point operations, the same on both sides: the sender numbers
    its sends in the order it posts them (`post_next`), the receiver posts each recv in that order
    (`post_at`). Closed (`close`) when the pair is dropped: every waiter fails at once."""

    def __init__(self, first: int = 0) -> None:
        self._turn = threading.Condition()
        self._next = first  # the number of the next operation to post
        self._closed: str | None = None

    def post_next(self, post: Callable[[int], T]) -> tuple[int, T]:
        """Sender: run `post(n)` for the next number n (under the pair's lock: numbers and posting
        order agree); returns (n, what it returned). Raises once the order is closed."""
        with self._turn:
            if self._closed is not None:
                raise Unavailable(self._closed)
            seq = self._next
            done = post(seq)
            self._next = (seq + 1) % SEQ_LIMIT
            return seq, done

    def post_at(self, seq: int, post: Callable[[], T], timeout_s: float) -> T:
        """Receiver: run `post()` as operation `seq`, once every earlier one has been posted; waits at
        most `timeout_s` for them (then a gap that never filled: `Late`), fails at once for a number
        already posted or out of range, or once the order is closed (`Unavailable`). A failed
        `post()` leaves `seq` unposted: the caller drops the pair."""
        deadline = time.monotonic() + timeout_s
        with self._turn:
            while self._closed is None and self._next != seq:
                if not 0 <= seq < SEQ_LIMIT or (seq - self._next) % SEQ_LIMIT >= SEQ_LIMIT // 2:
                    raise KVTransferError(f"send {seq} of the pair came twice or out of order "
                                          f"(next: {self._next})")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Late(f"send {self._next} of the pair never came (waited {timeout_s:g}s for it, "
                               f"holding send {seq})")
                self._turn.wait(left)
            if self._closed is not None:
                raise Unavailable(self._closed)
            done = post()
            self._next = (seq + 1) % SEQ_LIMIT
            self._turn.notify_all()
            return done

    def close(self, why: str) -> None:
        with self._turn:
            if self._closed is None:
                self._closed = why
            self._turn.notify_all()


def shutdown(pg: Any) -> None:
    for method in ("abort", "shutdown"):
        fn = getattr(pg, method, None)
        if fn is not None:
            try:
                fn()
                return
            except Exception:
                continue
