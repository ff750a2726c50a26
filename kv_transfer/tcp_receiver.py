"""The tcp data plane, receiver side: a layer's bytes come over a raw TCP connection beside the gRPC
control plane, without grpc-python's cost per byte.

Wire protocol of the data connection (big-endian `struct`s; nothing is pickled):

    handshake  a tcp sender sets HandshakeRequest.tcp; the receiver answers tcp_port (its data
               listener, on the host of its gRPC endpoint), tcp_conn (connection id, 32 hex digits)
               and tcp_token (32 random bytes), over the control channel only.
    hello      sender -> receiver, first: b"PDKVTCP1" | id (16 bytes) | token (32 bytes), compared
               with hmac.compare_digest; anything else closes the connection before one byte of KV
               is read. Accepted: the single byte 0x01. An id takes one connection.
    frame      sender -> receiver, any number: tag (u64) | nbytes (u64) | nbytes raw C-contiguous
               bytes. Tags count up per connection; a KVLayer names its frame (tcp_conn, tcp_tag).

Bounded: a frame that does not come within `timeout_s` fails its layer (DEADLINE_EXCEEDED), a
refused layer's frame is dropped when it comes, an unclaimed one after timeout_s; at most
`max_buffered_bytes` are held (then TCP pushes back on the sender). A dead connection fails the
layers waiting on it (UNAVAILABLE).
"""

from __future__ import annotations

import contextlib
import hmac
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kv_transfer.base import KVTransferError
from kv_transfer.buffers import BufferPool
from kv_transfer.control_receiver import ControlReceiver
from kv_transfer.planes import ReceivePlane
from kv_transfer.wire import Late, Unavailable, split_host_port
from proto import kv_transfer_pb2

MAGIC = b"PDKVTCP1"
HELLO = struct.Struct("!8s16s32s")  # magic, connection id, token
FRAME = struct.Struct("!QQ")  # tag, nbytes
ACCEPTED = b"\x01"
MAX_FRAME_BYTES = 1 << 30


def recv_exactly(sock: socket.socket, view: memoryview) -> int:
    """Fill `view` from `sock`; the bytes read (fewer only when the peer closed)."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            break
        got += n
    return got


def buffer_bytes(buf: torch.Tensor, nbytes: int) -> memoryview:
    """The first `nbytes` of a pooled buffer, as a memoryview (no copy)."""
    return memoryview(buf.numpy())[:nbytes]


@dataclass(eq=False)
class _Frame:
    buf: torch.Tensor
    nbytes: int
    arrived: float


@dataclass(eq=False)
class _Conn:
    """A data connection the receiver minted at a handshake: waiting for its sender, then reading."""

    conn_id: str
    token: bytes
    sender_id: str
    made: float
    sock: socket.socket | None = None
    frames: dict[int, _Frame] = field(default_factory=dict)  # arrived, not yet claimed
    refused: dict[int, float] = field(default_factory=dict)  # tag -> when its KVLayer was refused
    error: str | None = None
    ended: float | None = None


def shut(sock: socket.socket) -> None:
    """Shut both directions (which wakes a thread blocked reading it); already closed: fine."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class TcpReceivePlane(ReceivePlane):
    """A data listener on an ephemeral port of the endpoint's host (`data_port`); `timeout_s` bounds
    the wait for a frame, for buffer room and for a sender's hello, and how long an unclaimed frame
    is kept; `max_buffered_bytes` the frames held at once."""

    name = "tcp"

    def __init__(self, control: ControlReceiver, timeout_s: float = 30.0, max_buffered_bytes: int = 1 << 30) -> None:
        super().__init__(control)
        self.timeout_s = timeout_s
        self.max_buffered_bytes = max_buffered_bytes
        self._cv = threading.Condition()  # guards the connections, their frames and the buffered bytes
        self._conns: dict[str, _Conn] = {}
        self._buffered = 0
        self._pool = BufferPool(max_buffered_bytes)
        self._threads: list[threading.Thread] = []
        self._socks: set[socket.socket] = set()  # accepted, authenticated or not
        data_host = split_host_port(control.endpoint)[0]
        family = socket.AF_INET6 if ":" in data_host else socket.AF_INET
        try:
            self._listener: socket.socket | None = socket.create_server((data_host, 0), family=family)
        except OSError as e:
            raise KVTransferError(f"could not listen for KV data on {data_host}: {e}") from None
        self._listener.settimeout(0.5)  # the accepting thread sweeps stale frames between accepts
        self.data_port: int = self._listener.getsockname()[1]
        self._accepter = threading.Thread(target=self._accept, name=f"kv-tcp-accept-{self.data_port}", daemon=True)
        self._accepter.start()

    # ------------------------------------------------------------------ connections
    def handshake_fields(self, request: kv_transfer_pb2.HandshakeRequest) -> dict[str, Any]:
        if not request.tcp:
            return {}  # another plane's sender
        sender = request.sender_id or "anonymous"
        conn = _Conn(secrets.token_hex(16), secrets.token_bytes(32), sender, time.monotonic())
        with self._cv:
            if self._listener is None or self.control.closed:
                return {}  # no data port: the sender refuses
            for old in self._conns.values():  # a sender handshakes anew once it dropped its connection
                if old.sender_id == sender:
                    self._end_locked(old, "replaced by a new handshake of its sender")
            self._conns[conn.conn_id] = conn
        return {"tcp_port": self.data_port, "tcp_conn": conn.conn_id, "tcp_token": conn.token}

    def _accept(self) -> None:
        while (listener := self._listener) is not None:
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                self._sweep_frames()
                continue
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(sock,), name="kv-tcp-conn", daemon=True)
            with self._cv:
                self._threads = [th for th in self._threads if th.is_alive()]
                self._threads.append(t)
                self._socks.add(sock)
            t.start()

    def _serve(self, sock: socket.socket) -> None:
        """A connection's thread: authenticate it, then read its frames until it ends."""
        conn = None
        why = "data connection ended"
        try:
            sock.settimeout(self.timeout_s)
            hello = bytearray(HELLO.size)
            if recv_exactly(sock, memoryview(hello)) != HELLO.size:
                return
            magic, conn_id, token = HELLO.unpack(hello)
            with self._cv:
                known = self._conns.get(conn_id.hex())
                if (magic != MAGIC or known is None or known.sock is not None or known.error is not None
                        or not hmac.compare_digest(token, known.token)):
                    return  # closed without reading further
                conn = known
                conn.sock = sock
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(ACCEPTED)
            self._read_frames(conn, sock)
            why = f"data connection from {conn.sender_id} closed by the sender"
        except (OSError, KVTransferError) as e:
            why = f"data connection from {conn.sender_id if conn else '?'} failed: {e}"
        finally:
            with self._cv:
                if conn is not None:
                    self._end_locked(conn, why)
                self._socks.discard(sock)
            sock.close()

    def _read_frames(self, conn: _Conn, sock: socket.socket) -> None:
        header = bytearray(FRAME.size)
        while not self.control.closed:
            try:
                got = sock.recv_into(header)
            except TimeoutError:
                continue  # idle between transfers
            if got == 0:
                return
            if recv_exactly(sock, memoryview(header)[got:]) != FRAME.size - got:
                raise Unavailable("closed inside a frame header")
            tag, nbytes = FRAME.unpack(header)
            if nbytes > MAX_FRAME_BYTES:
                raise KVTransferError(f"frame {tag} of {nbytes} bytes is over {MAX_FRAME_BYTES}")
            buf = self._reserve(conn, nbytes)
            try:
                if recv_exactly(sock, buffer_bytes(buf, nbytes)) != nbytes:
                    raise Unavailable(f"closed inside frame {tag}")
            except BaseException:
                with self._cv:
                    self._release_locked(buf)
                raise
            with self._cv:
                if conn.refused.pop(tag, None) is not None or tag in conn.frames or conn.error is not None:
                    self._release_locked(buf)  # its layer was refused already: dropped
                    continue
                conn.frames[tag] = _Frame(buf, nbytes, time.monotonic())
                self._cv.notify_all()

    def _reserve(self, conn: _Conn, nbytes: int) -> torch.Tensor:
        """Room for a frame among the buffered bytes (waits up to timeout_s), and its buffer."""
        deadline = time.monotonic() + self.timeout_s
        buf = self._pool.take(nbytes)
        with self._cv:
            while self._buffered and self._buffered + buf.numel() > self.max_buffered_bytes:
                left = deadline - time.monotonic()
                if conn.error is not None or self.control.closed or left <= 0:
                    self._pool.give(buf)
                    raise KVTransferError(
                        f"no room for a {nbytes}-byte frame: {self._buffered} bytes held, at most "
                        f"{self.max_buffered_bytes}, for {self.timeout_s:g}s"
                    )
                self._cv.wait(left)
            self._buffered += buf.numel()
        return buf

    def _release_locked(self, buf: torch.Tensor) -> None:
        self._buffered -= buf.numel()
        self._pool.give(buf)
        self._cv.notify_all()

    def _end_locked(self, conn: _Conn, why: str) -> None:
        """Under self._cv: the connection is over; its waiting layers fail, its frames are dropped."""
        if conn.error is None:
            conn.error = why
            conn.ended = time.monotonic()
        if conn.sock is not None:
            shut(conn.sock)
        for frame in conn.frames.values():
            self._release_locked(frame.buf)
        conn.frames.clear()
        self._cv.notify_all()

    def _sweep_frames(self) -> None:
        """Drop what nobody claimed within timeout_s: frames, refusals, connections ended or never made."""
        old = time.monotonic() - self.timeout_s
        with self._cv:
            for conn_id, conn in list(self._conns.items()):
                for tag, frame in list(conn.frames.items()):
                    if frame.arrived < old:
                        del conn.frames[tag]
                        self._release_locked(frame.buf)
                conn.refused = {t: when for t, when in conn.refused.items() if when >= old}
                if conn.ended is not None and conn.ended < old:
                    del self._conns[conn_id]
                elif conn.sock is None and conn.error is None and conn.made < old:
                    self._end_locked(conn, "its sender never connected")

    @property
    def connections(self) -> list[str]:
        """Ids of the data connections that are live or awaited."""
        with self._cv:
            return sorted(c.conn_id for c in self._conns.values() if c.error is None)

    @property
    def buffered_bytes(self) -> int:
        return self._buffered

    # ------------------------------------------------------------------ layers
    def claims(self, msg: kv_transfer_pb2.KVLayer) -> bool:
        return bool(msg.tcp_conn)

    def receive(self, msg: kv_transfer_pb2.KVLayer) -> None:
        with self._cv:
            conn = self._conns.get(msg.tcp_conn)
        if conn is None:
            raise KVTransferError(f"layer {msg.layer}: unknown tcp data connection {msg.tcp_conn!r}")
        try:
            self.control.authorize(msg.transfer_id, msg.auth_token)  # who is asking, before any frame is taken
            if msg.payload:
                raise KVTransferError(f"layer {msg.layer}: both an inline payload and a tcp frame")
            frame = self._claim(conn, msg)
        except BaseException:
            self._refuse(conn, msg.tcp_tag)
            raise
        try:
            dtype, shape = self.control.check_layer(msg, buffer_bytes(frame.buf, frame.nbytes))
            kv = frame.buf[: frame.nbytes].view(dtype).view(shape)
            self.control._on_layer(msg.transfer_id, msg.auth_token, msg.layer, kv, msg.first_block)
        finally:
            with self._cv:
                self._release_locked(frame.buf)

    def _claim(self, conn: _Conn, msg: kv_transfer_pb2.KVLayer) -> _Frame:
        """Wait (up to timeout_s) for the frame `msg` names and take it."""
        deadline = time.monotonic() + self.timeout_s
        with self._cv:
            while True:
                frame = conn.frames.pop(msg.tcp_tag, None)
                if frame is not None:
                    return frame
                if conn.error is not None:
                    raise Unavailable(f"layer {msg.layer} of {msg.transfer_id!r}: {conn.error}")
                if self.control.closed:
                    raise Unavailable(f"layer {msg.layer} of {msg.transfer_id!r}: KV receiver closed")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Late(
                        f"layer {msg.layer} of {msg.transfer_id!r}: its bytes (frame {msg.tcp_tag}) did not "
                        f"arrive within {self.timeout_s:g}s"
                    )
                self._cv.wait(left)

    def _refuse(self, conn: _Conn, tag: int) -> None:
        """A refused layer's frame is dropped: now if it is here, else when it comes."""
        with self._cv:
            frame = conn.frames.pop(tag, None)
            if frame is not None:
                self._release_locked(frame.buf)
            elif conn.error is None:
                conn.refused[tag] = time.monotonic()

    def close(self) -> None:
        """Close the data listener and every data connection."""
        with self._cv:
            listener, self._listener = self._listener, None
            for conn in self._conns.values():
                self._end_locked(conn, "KV receiver closed")
            self._conns.clear()
            for sock in self._socks:  # connections still to say hello too
                shut(sock)
            threads = list(self._threads)
        if listener is not None:
            self._accepter.join(timeout=2.0)
            listener.close()
        for t in threads:
            t.join(timeout=2.0)
        self._pool.clear()


class TcpReceiver(ControlReceiver):
    """The tcp backend's receiver, also taking inline layers (options: `TcpReceivePlane`)."""

    PLANES = (TcpReceivePlane,)
