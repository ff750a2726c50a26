"""The tcp data plane, sender side (the wire protocol is in kv_transfer/tcp_receiver.py).

`stage` keeps views of the layer's own bytes (a pooled copy only for CUDA or scattered tensors); a
thread per connection `sendall`s them, so the kernel's copy is the only one. A connection found
closed (the receiver restarted) or failing is dropped with its handshake, and the next layer to
that endpoint handshakes and connects anew.
"""

from __future__ import annotations

import itertools
import queue
import select
import socket
import struct
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from kv_transfer.base import KVTransferError, TransferTicket
from kv_transfer.buffers import BufferPool
from kv_transfer.checksum import checksum
from kv_transfer.control_sender import ControlSender
from kv_transfer.planes import Channels, SendPlane
from kv_transfer.tcp_receiver import ACCEPTED, FRAME, HELLO, MAGIC, buffer_bytes, shut
from kv_transfer.wire import split_host_port
from proto import kv_transfer_pb2

# refusals that say the endpoint cannot take tcp from here (auto falls back to grpc on them)
PLACEMENT = ("does not take the tcp backend", "data port")


@dataclass(frozen=True)
class _Staged:
    """A layer's bytes waiting for their frame to go: views of the caller's tensor (`views`, in
    order), or a copy in a pooled buffer (`buf`, given back once written)."""

    views: tuple[memoryview, ...]
    nbytes: int
    buf: torch.Tensor | None = None


def _views_of(kv: torch.Tensor) -> tuple[memoryview, ...] | None:
    """`kv`'s C-contiguous bytes as views of its own memory, without copying, when it lives on the
    CPU and is contiguous or a run of blocks of a contiguous layer (K's run then V's); else None."""
    if kv.device.type != "cpu" or kv.dim() < 2:
        return None
    parts = [kv] if kv.is_contiguous() else [kv[i] for i in range(kv.shape[0])]
    if not all(p.is_contiguous() for p in parts):
        return None
    return tuple(memoryview(p.reshape(-1).view(torch.uint8).numpy()) for p in parts)


@dataclass(eq=False)
class _Link:
    """The sender's data connection to one endpoint (`key`: its id), with the thread writing its frames."""

    endpoint: str
    key: str
    sock: socket.socket
    frames: queue.SimpleQueue[tuple[int, _Staged] | None] = field(default_factory=queue.SimpleQueue)
    tags: itertools.count[int] = field(default_factory=itertools.count)
    thread: threading.Thread | None = None
    broken: str | None = None

    def alive(self) -> bool:
        """Not dropped, and the receiver has not closed it (it never writes after the hello's answer)."""
        if self.broken is not None:
            return False
        try:
            poller = select.poll()
            poller.register(self.sock, select.POLLIN)
            return not poller.poll(0)  # readable: closed (or a protocol violation)
        except (OSError, ValueError):
            return False

    def shut(self) -> None:
        """Retired: its thread skips what is queued and exits."""
        self.frames.put(None)
        shut(self.sock)


class TcpSendPlane(SendPlane):
    """`timeout_s` (the control's) also bounds connecting and authenticating to a data port and
    writing one frame; `pool_bytes` is how much free staging buffer is kept for reuse."""

    name = "tcp"
    max_message_bytes: int | None = 16 << 20  # a frame per run of blocks of at most this

    def __init__(self, control: ControlSender, compression: str = "none", *, pool_bytes: int = 1 << 30) -> None:
        if compression != "none":
            raise ValueError(f"KV compression {compression!r} travels over the grpc backend only, not tcp")
        super().__init__(control)
        self._pool = BufferPool(pool_bytes)
        self.channels = Channels(control, lambda e, key: f"tcp: the data connection {key[:8]} to {e} was reset")
        self._links: dict[str, _Link] = self.channels.live

    def handshake_request(self, request: kv_transfer_pb2.HandshakeRequest) -> None:
        request.tcp = True

    def accept(self, endpoint: str, response: kv_transfer_pb2.HandshakeResponse) -> str | None:
        if not response.tcp_port or not response.tcp_conn:
            return (
                f"KV receiver at {endpoint} does not take the tcp backend (its handshake offers no data "
                "port; a grpc or shm receiver?): use the same kv_transfer backend on both sides"
            )
        return self.channels.refusal(endpoint, response.tcp_conn, lambda: self._connect(endpoint, response))

    def _connect(self, endpoint: str, response: kv_transfer_pb2.HandshakeResponse) -> _Link:
        """Connect and authenticate to the data port (blocks up to timeout_s)."""
        timeout_s = self.control.timeout_s
        host = split_host_port(endpoint)[0]
        where = f"data port {host}:{response.tcp_port} of the KV receiver at {endpoint}"
        try:
            sock = socket.create_connection((host, response.tcp_port), timeout=timeout_s)
        except OSError as e:
            raise KVTransferError(f"tcp: cannot reach the {where} within {timeout_s:g}s: {e}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(HELLO.pack(MAGIC, bytes.fromhex(response.tcp_conn), response.tcp_token))
            answer = sock.recv(1)
        except (OSError, ValueError, struct.error) as e:
            sock.close()
            raise KVTransferError(f"tcp: the {where} did not take this sender's hello: {e}") from None
        if answer != ACCEPTED:
            sock.close()
            raise KVTransferError(f"tcp: the {where} refused this sender's token")
        link = _Link(endpoint, response.tcp_conn, sock)
        link.thread = threading.Thread(
            target=self._send_frames, args=(link,), name=f"kv-tcp-send-{response.tcp_conn[:8]}", daemon=True
        )
        link.thread.start()
        return link

    def _reset(self, link: _Link, why: str) -> None:
        self.channels.reset(link, why, lambda response: response.tcp_conn == link.key)

    def _live_link(self, endpoint: str) -> _Link | None:
        """On a stream's thread: the endpoint's connection, made anew (handshake included) when the
        receiver closed it, e.g. because it restarted; None when that fails."""
        link = self._links.get(endpoint)
        if link is not None and link.alive():
            return link
        if link is not None:
            self._reset(link, link.broken or "the KV receiver closed the data connection")
        try:
            self.control.connect(endpoint)
        except KVTransferError:
            return None
        link = self._links.get(endpoint)
        return link if link is not None and link.broken is None else None

    def _send_frames(self, link: _Link) -> None:
        """The connection's thread: write queued frames in order until dropped."""
        try:
            while (item := link.frames.get()) is not None:
                tag, staged = item
                try:
                    if link.broken is None:
                        link.sock.sendall(FRAME.pack(tag, staged.nbytes))
                        for view in staged.views:
                            link.sock.sendall(view)
                except OSError as e:
                    self._reset(link, f"sending to the data port failed: {e}")
                finally:
                    self._give(staged)
        finally:
            link.sock.close()

    def _give(self, staged: _Staged) -> None:
        if staged.buf is not None:
            self._pool.give(staged.buf)

    @property
    def links(self) -> dict[str, str]:
        """endpoint -> id of its live data connection."""
        return self.channels.keys()

    def stage(self, ticket: TransferTicket, layer: int, kv: torch.Tensor) -> Any:
        """The layer's bytes as views of `kv` (handed over by the caller), or a copy in a pooled
        buffer when they are not plain CPU memory in order. No network."""
        nbytes = kv.numel() * kv.element_size()
        views = _views_of(kv.detach())
        if views is not None:
            return _Staged(views, nbytes)
        buf = self._pool.take(nbytes)
        buf[:nbytes].view(kv.dtype).view(kv.shape).copy_(kv.detach())
        return _Staged((buffer_bytes(buf, nbytes),), nbytes, buf)

    def fields(self, ticket: TransferTicket, staged: _Staged) -> dict[str, Any]:
        """After the handshake and its connection: queue the frame, name it."""
        digest = checksum(*staged.views)
        link = self._live_link(ticket.kv_endpoint)
        if link is None:  # no connection to be had: the receiver refuses the layer (unknown connection)
            self._give(staged)
            conn, tag = "gone", 0
        else:
            conn, tag = link.key, next(link.tags)
            self._queue_frame(link, tag, staged)
        return {"checksum": digest, "tcp_conn": conn, "tcp_tag": tag}

    def _queue_frame(self, link: _Link, tag: int, staged: _Staged) -> None:
        """Hand a frame to the connection's thread (a test hook: bytes may be altered here)."""
        link.frames.put((tag, staged))

    def close(self) -> None:
        """Close every data connection."""
        for link in self.channels.close():
            if link.thread is not None:
                link.thread.join(timeout=self.control.timeout_s)
        self._pool.clear()


class TcpSender(ControlSender):
    """The tcp backend's sender (options: `TcpSendPlane`)."""

    PLANE = TcpSendPlane
