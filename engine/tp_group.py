"""The ranks of one tensor-parallel worker: a torch.distributed process group for the all-reduces of
the forward pass, and a control channel on which rank 0 sends each step's inputs to the others.

Rank 0 hosts a TCPStore (the group's rendezvous) and a control socket; rank r > 0 connects to
both. The group is gloo between CPU processes, NCCL between GPUs; no global default group is
made (several engines may live in one process). Every collective waits at most `timeout_s`: a rank
that died or stalls fails the step on the others instead of leaving them waiting forever. The
control channel carries int64 arrays in frames (8-byte length, then the array's bytes; no pickle);
a follower blocks on it while rank 0 is idle, and its end (rank 0 gone) stops the follower.
"""

from __future__ import annotations

import datetime
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

TP_BACKENDS = ("gloo", "nccl")
_LEN = struct.Struct("<Q")
MAX_FRAME = 1 << 30


def bytes_tensor(data: bytes) -> torch.Tensor:
    """`data` as a uint8 tensor (a payload frame)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


class TPError(RuntimeError):
    """A tensor-parallel group failed (a rank died, a collective timed out, the channel broke)."""


def make_process_group(backend: str, store: Any, rank: int, size: int, timeout_s: float,
                       hostname: str = "127.0.0.1") -> Any:
    """A process group over `store` whose every operation waits at most `timeout_s` (blocks until
    all `size` ranks joined); gloo binds to `hostname`'s interface. No global default group."""
    timeout = datetime.timedelta(seconds=timeout_s)
    dist = torch.distributed
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
        return dist.ProcessGroupGloo(store, rank, size, opts)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    raise ValueError(f"tensor parallel backend must be one of {TP_BACKENDS}, got {backend!r}")


@dataclass
class TPGroup:
    """This rank's view of the group: its rank, the size, the process group."""

    rank: int
    size: int
    pg: Any
    timeout_s: float

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; raises TPError after `timeout_s` or when a rank is gone."""
        try:
            self.pg.allreduce([t]).wait(datetime.timedelta(seconds=self.timeout_s))
        except Exception as e:  # noqa: BLE001 (gloo and NCCL raise RuntimeError or DistBackendError)
            raise TPError(f"all-reduce across {self.size} tensor-parallel ranks failed: {e}") from e
        return t

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `t` (same shape) on rank 0, in rank order; None on the others."""
        dist = torch.distributed
        outs = [torch.empty_like(t) for _ in range(self.size)] if self.rank == 0 else []
        try:
            self.pg.gather([outs] if self.rank == 0 else [], [t], dist.GatherOptions()).wait(
                datetime.timedelta(seconds=self.timeout_s))
        except Exception as e:  # noqa: BLE001
            raise TPError(f"gather across {self.size} tensor-parallel ranks failed: {e}") from e
        return outs if self.rank == 0 else None

    def close(self) -> None:
        for method in ("abort", "shutdown"):
            fn = getattr(self.pg, method, None)
            if fn is not None:
                try:
                    fn()
                    return
                except Exception:  # noqa: BLE001
                    continue


class Channel:
    """One end of the control channel: int64 arrays in frames."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._lock = threading.Lock()  # the engine's thread and KV receivers' threads send
        self._call_lock = threading.Lock()  # a call's request and answer

    def send(self, values: torch.Tensor, payload: torch.Tensor | None = None) -> None:
        """`values` (int64), then, when given, `payload`'s bytes as the next frame (the receiver knows
        its dtype and shape from `values`)."""
        data = values.to(torch.int64).numpy().tobytes()
        frames = [_LEN.pack(len(data)), data]
        if payload is not None:
            raw = payload.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
            frames += [_LEN.pack(len(raw)), raw]
        try:
            with self._lock:
                self.sock.sendall(b"".join(frames))
        except OSError as e:
            raise TPError(f"the tensor-parallel control channel broke: {e}") from e

    def call(self, values: torch.Tensor, payload: bytes) -> tuple[torch.Tensor, bytes]:
        """Send a request and its payload, and wait (the socket's timeout) for the answer and its
        payload: one call at a time on the channel, the only messages the other end answers."""
        with self._call_lock:
            self.send(values, bytes_tensor(payload))
            reply = self.recv()
            data = self.recv_bytes() if reply is not None else None
        if reply is None or data is None:
            raise TPError("a tensor-parallel rank did not answer on the control channel (it exited or stalled)")
        return reply, data

    def recv_bytes(self) -> bytes | None:
        """The raw frame after a message that announced one; None when the channel ended."""
        head = self._read(_LEN.size)
        return self._read(_LEN.unpack(head)[0]) if head is not None else None

    def recv_payload(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The frame after a message that announced a payload."""
        head = self._read(_LEN.size)
        data = self._read(_LEN.unpack(head)[0]) if head is not None else None
        if data is None:
            raise TPError("the tensor-parallel control channel ended inside a KV payload")
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).view(shape)

    def recv(self) -> torch.Tensor | None:
        """The next array; None when the other end closed the channel."""
        head = self._read(_LEN.size)
        if head is None:
            return None
        (n,) = _LEN.unpack(head)
        if n > MAX_FRAME or n % 8:
            raise TPError(f"the tensor-parallel control channel sent a frame of {n} bytes")
        data = self._read(n)
        if data is None:
            return None
        return torch.frombuffer(bytearray(data), dtype=torch.int64)

    def _read(self, n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = self.sock.recv(n - len(buf))
            except OSError:
                return None
            if not chunk:
                return None
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


@dataclass(frozen=True)
class Rendezvous:
    """Where rank 0 waits for the others: its TCPStore port and its control port."""

    host: str
    store_port: int
    control_port: int


class Leader:
    """Rank 0: hosts the rendezvous, then holds the group and a channel to every other rank."""

    def __init__(self, size: int, host: str = "127.0.0.1", timeout_s: float = 60.0) -> None:
        self.size, self.timeout_s = size, timeout_s
        self.store = torch.distributed.TCPStore(host, 0, size, True, datetime.timedelta(seconds=timeout_s),
                                                wait_for_workers=False)
        self._listener = socket.create_server((host, 0))
        self.rendezvous = Rendezvous(host, self.store.port, self._listener.getsockname()[1])
        self.channels: list[Channel] = []
        self.group: TPGroup | None = None

    def join(self, backend: str, join_timeout_s: float, check: Callable[[], None] | None = None) -> TPGroup:
        """Wait (at most `join_timeout_s`) until every rank has connected, then form the group.
        `check` raises when a rank is known to have failed (its process exited), ending the wait."""
        deadline = time.monotonic() + join_timeout_s
        by_rank: dict[int, Channel] = {}
        while len(by_rank) < self.size - 1:
            if check is not None:
                check()
            if time.monotonic() >= deadline:
                raise TPError(f"{self.size - 1 - len(by_rank)} of {self.size - 1} tensor-parallel ranks did not "
                              f"join within {join_timeout_s:.0f}s")
            self._listener.settimeout(min(0.5, max(0.01, deadline - time.monotonic())))
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            sock.settimeout(None)
            ch = Channel(sock)
            hello = ch.recv()
            if hello is None or len(hello) != 1 or not 0 < int(hello[0]) < self.size or int(hello[0]) in by_rank:
                ch.close()
                continue
            by_rank[int(hello[0])] = ch
        self._listener.close()
        self.channels = [by_rank[r] for r in range(1, self.size)]
        pg = make_process_group(backend, self.store, 0, self.size, self.timeout_s)
        self.group = TPGroup(0, self.size, pg, self.timeout_s)
        return self.group

    def send(self, values: torch.Tensor, payload: torch.Tensor | None = None) -> None:
        for ch in self.channels:
            ch.send(values, payload)

    def close(self) -> None:
        for ch in self.channels:
            ch.close()
        if self.group is not None:
            self.group.close()


def follow(rendezvous: Rendezvous, rank: int, size: int, backend: str, timeout_s: float) -> tuple[Channel, TPGroup]:
    """Rank `rank` > 0 joins rank 0's group: its control channel, then the process group."""
    sock = socket.create_connection((rendezvous.host, rendezvous.control_port), timeout=timeout_s)
    sock.settimeout(None)
    ch = Channel(sock)
    ch.send(torch.tensor([rank]))
    store = torch.distributed.TCPStore(rendezvous.host, rendezvous.store_port, size, False,
                                       datetime.timedelta(seconds=timeout_s))
    pg = make_process_group(backend, store, rank, size, timeout_s)
    return ch, TPGroup(rank, size, pg, timeout_s)
