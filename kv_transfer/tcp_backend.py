"""tcp backend: each layer's bytes travel over a raw TCP connection next to the gRPC control plane.

Only the bytes move another way; everything else is the grpc backend's control plane, unchanged
(see kv_transfer.grpc_backend): the `KVReceiver` service, handshake, one SendLayers stream per
transfer carrying `KVLayer` metadata with the XXH3-64 checksum of the bytes and its final ack,
Commit, Abort, deadlines and status codes. The model followed is the torch_distributed backend. What
it avoids is grpc-python's own cost per byte (HTTP/2 framing, copies into and out of messages),
which keeps even a bare gRPC stream well below what a socket moves.

Wire protocol of the data connection (big-endian `struct`s; nothing is pickled):

    handshake  a tcp sender sets HandshakeRequest.tcp; the receiver mints a connection for it and
               answers tcp_port (its data listener, on the host of its gRPC endpoint), tcp_conn (the
               connection id, 32 hex digits) and tcp_token (32 random bytes). The token travels only
               over the control channel (which carries the cluster secret when there is one).
    hello      sender -> receiver, first on the connection: b"PDKVTCP1" | id (16 bytes) | token (32 bytes).
               The receiver compares the token with hmac.compare_digest; anything else closes the
               connection before one byte of KV is read. Accepted: it answers the single byte 0x01.
               An id takes one connection.
    frame      sender -> receiver, any number: tag (u64) | nbytes (u64) | nbytes raw C-contiguous
               bytes. Tags count up per connection; a KVLayer names its frame (tcp_conn, tcp_tag).

Per layer: `send_layer` keeps views of the layer's bytes (the caller hands its tensor over, as
`KVSender.send_layer` says; a CUDA or scattered tensor is copied into a pooled buffer instead) and
queues them, never waiting on the network. On the stream's thread the sender checksums them, takes
the connection's next tag, queues the frame for the connection's sending thread (which `sendall`s
the views: the kernel's copy is the only one) and yields the KVLayer (no payload).
Large layers go as runs of blocks (`max_message_bytes`), so the receiver checks and copies one run
while the next is on the wire.

Receiver: a thread per authenticated connection reads frames with `recv_into` into pooled buffers,
reused transfer after transfer (no fresh page faults). SendLayers, for a KVLayer naming a frame,
checks the transfer id and auth token, waits for the frame, checks its checksum (DATA_LOSS when it
differs), dtype and size against the message, and only then hands a view of the buffer to the
shared checks (`KVReceiver._on_layer`), which copy it into the reserved blocks. So a layer costs
one checksum pass on each side and one copy into the cache, besides the socket's own, and a SendLayers ack means every byte of its layers arrived
and was checked: commit is the grpc backend's (flush, then Commit).

Bounded memory and time (`timeout_s`, `max_buffered_bytes`): a KVLayer whose frame does not come
within timeout_s is refused (DEADLINE_EXCEEDED); the frame of a refused KVLayer is dropped when it
comes, a frame nobody claims after timeout_s; at most max_buffered_bytes of frames are held (the
reading thread waits, so TCP pushes back on the sender, and gives up after timeout_s). A data
connection that dies fails the layers waiting on it (UNAVAILABLE); aborts free the blocks as for
every backend. Sender: a connection found closed (the receiver restarted) or failing is dropped
with its handshake, and the next layer to that endpoint handshakes again and connects anew.

Refusals (KVTransferError, cached per endpoint like a refused layout): a receiver without the tcp
backend (no data port in its handshake), a data port that cannot be reached or does not accept the
token within timeout_s. `TcpSender.connect(endpoint)` checks at once (`auto` falls back to grpc on
these). int8 compression travels over the grpc backend only. The receiver also takes inline
payloads (a grpc sender).
"""

from __future__ import annotations

import hmac
import itertools
import queue
import secrets
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from kv_transfer.base import KVSink, KVTransferError, TransferTicket
from kv_transfer.buffers import BufferPool
from kv_transfer.checksum import checksum
from kv_transfer.grpc_backend import GrpcReceiver, GrpcSender
from kv_transfer.torch_dist_backend import _split_host_port
from proto import kv_transfer_pb2

MAGIC = b"PDKVTCP1"
HELLO = struct.Struct("!8s16s32s")  # magic, connection id, token
FRAME = struct.Struct("!QQ")  # tag, nbytes
ACCEPTED = b"\x01"
MAX_FRAME_BYTES = 1 << 30
# refusals that say the endpoint cannot take tcp from here (auto falls back to grpc on them)
PLACEMENT = ("does not take the tcp backend", "data port")


class _Unavailable(KVTransferError):
    status = grpc.StatusCode.UNAVAILABLE


class _Late(KVTransferError):
    status = grpc.StatusCode.DEADLINE_EXCEEDED


def _recv_exactly(sock: socket.socket, view: memoryview) -> int:
    """Fill `view` from `sock`; the bytes read (fewer only when the peer closed)."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            break
        got += n
    return got


def _bytes(buf: torch.Tensor, nbytes: int) -> memoryview:
    """The first `nbytes` of a pooled buffer, as a memoryview (no copy)."""
    return memoryview(buf.numpy())[:nbytes]


# ------------------------------------------------------------------------------------------ sender
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
    """The sender's data connection to one endpoint, with the thread that writes its frames."""

    endpoint: str
    conn_id: str
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


class TcpSender(GrpcSender):
    """Pushes layers to `TcpReceiver`s, their bytes over one TCP connection per endpoint. Thread-safe.

    `TcpSender(compat_hash, timeout_s=30.0, sender_id=None, *, pool_bytes=1 GiB)`: `timeout_s`
    bounds every control RPC as for grpc, connecting and authenticating to a data port, and writing
    one frame; `pool_bytes` how much free staging buffer is kept for reuse.
    """

    BACKEND = "tcp"
    max_message_bytes: int | None = 16 << 20  # a frame per run of blocks of at most this

    def __init__(
        self,
        compat_hash: str,
        timeout_s: float = 30.0,
        sender_id: str | None = None,
        compression: str = "none",
        *,
        pool_bytes: int = 1 << 30,
    ) -> None:
        if compression != "none":
            raise ValueError(f"KV compression {compression!r} travels over the grpc backend only, not tcp")
        super().__init__(compat_hash, timeout_s=timeout_s, sender_id=sender_id)
        self._pool = BufferPool(pool_bytes)
        self._link_lock = threading.Lock()  # connects; never held by send_layer
        self._links: dict[str, _Link] = {}  # endpoint -> its live connection
        self._retired: set[str] = set()  # ids of dropped connections (a stale handshake must not revive them)

    # ------------------------------------------------------------------ handshake and connections
    def _handshake_request(self, endpoint: str) -> kv_transfer_pb2.HandshakeRequest:
        request = super()._handshake_request(endpoint)
        request.tcp = True
        return request

    def _check_handshake(self, endpoint: str, response: kv_transfer_pb2.HandshakeResponse) -> str | None:
        if not response.tcp_port or not response.tcp_conn:
            return (
                f"KV receiver at {endpoint} does not take the tcp backend (its handshake offers no data "
                "port; a grpc or shm receiver?): use the same kv_transfer backend on both sides"
            )
        try:
            self._link(endpoint, response)
        except KVTransferError as e:
            return str(e)
        return None

    def _link(self, endpoint: str, response: kv_transfer_pb2.HandshakeResponse) -> _Link:
        """The endpoint's connection for this handshake, made on first use (blocks up to timeout_s)."""
        with self._link_lock:
            if self._closed:
                raise KVTransferError("KV sender is closed")
            link = self._links.get(endpoint)
            if link is not None and link.conn_id == response.tcp_conn:
                return link
            if response.tcp_conn in self._retired:
                raise KVTransferError(f"tcp: the data connection {response.tcp_conn[:8]} to {endpoint} was reset")
            if link is not None:  # an older connection: replaced by this handshake's
                self._drop_locked(link, "replaced by a new handshake")
            host = _split_host_port(endpoint)[0]
            where = f"data port {host}:{response.tcp_port} of the KV receiver at {endpoint}"
            try:
                sock = socket.create_connection((host, response.tcp_port), timeout=self.timeout_s)
            except OSError as e:
                raise KVTransferError(f"tcp: cannot reach the {where} within {self.timeout_s:g}s: {e}") from None
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
            link = self._links[endpoint] = _Link(endpoint, response.tcp_conn, sock)
            link.thread = threading.Thread(
                target=self._send_frames, args=(link,), name=f"kv-tcp-send-{response.tcp_conn[:8]}", daemon=True
            )
            link.thread.start()
            return link

    def _drop_locked(self, link: _Link, why: str) -> None:
        """Under self._link_lock: retire a connection; its thread skips what is queued and exits."""
        if link.broken is None:
            link.broken = why
        self._retired.add(link.conn_id)
        if self._links.get(link.endpoint) is link:
            del self._links[link.endpoint]
        link.frames.put(None)
        try:
            link.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _reset(self, link: _Link, why: str) -> None:
        """Drop a connection and the handshake that made it: the next layer handshakes anew."""
        with self._link_lock:
            self._drop_locked(link, why)
        self._forget_handshake(link.endpoint, lambda response: response.tcp_conn == link.conn_id)

    def _live_link(self, endpoint: str) -> _Link | None:
        """On a stream's thread: the endpoint's connection, made anew (handshake included) when the
        receiver closed it, e.g. because it restarted; None when that fails."""
        link = self._links.get(endpoint)
        if link is not None and link.alive():
            return link
        if link is not None:
            self._reset(link, link.broken or "the KV receiver closed the data connection")
        try:
            with self._lock:
                hs = self._handshake(endpoint)
            self._await_handshake(endpoint, hs, self.timeout_s)
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
        with self._link_lock:
            return {e: link.conn_id for e, link in self._links.items()}

    # ------------------------------------------------------------------ transfers
    def _payload(self, ticket: TransferTicket, layer: int, kv: torch.Tensor) -> Any:
        """On the caller's thread: the layer's bytes as views of `kv` (the caller hands it over and
        does not change it afterwards, see KVSender.send_layer), or a copy in a pooled buffer when
        they are not plain CPU memory in order. No network."""
        self._raise_if_refused(ticket.kv_endpoint)  # do not stage for an endpoint already refused
        nbytes = kv.numel() * kv.element_size()
        if nbytes == 0:
            return b""  # nothing to send: an empty inline payload
        views = _views_of(kv.detach())
        if views is not None:
            return _Staged(views, nbytes)
        buf = self._pool.take(nbytes)
        buf[:nbytes].view(kv.dtype).view(kv.shape).copy_(kv.detach())
        return _Staged((_bytes(buf, nbytes),), nbytes, buf)

    def _layer_message(
        self, ticket: TransferTicket, layer: int, dtype: str, shape: list[int], payload: Any, first_block: int = 0
    ) -> kv_transfer_pb2.KVLayer:
        """On the stream's thread (after the handshake and its connection): queue the frame, describe it."""
        if not isinstance(payload, _Staged):
            return super()._layer_message(ticket, layer, dtype, shape, payload, first_block)
        digest = checksum(*payload.views)
        link = self._live_link(ticket.kv_endpoint)
        if link is None:  # no connection to be had: the receiver refuses the layer (unknown connection)
            self._give(payload)
            conn, tag = "gone", 0
        else:
            conn, tag = link.conn_id, next(link.tags)
            self._queue_frame(link, tag, payload)
        return kv_transfer_pb2.KVLayer(
            transfer_id=ticket.transfer_id,
            auth_token=ticket.auth_token,
            layer=layer,
            dtype=dtype,
            shape=shape,
            checksum=digest,
            first_block=first_block,
            tcp_conn=conn,
            tcp_tag=tag,
        )

    def _queue_frame(self, link: _Link, tag: int, staged: _Staged) -> None:
        """Hand a frame to the connection's thread (a test hook: bytes may be altered here)."""
        link.frames.put((tag, staged))

    def close(self) -> None:
        """Cancel streams in flight, close every channel and every data connection."""
        super().close()
        with self._link_lock:
            links = list(self._links.values())
            for link in links:
                self._drop_locked(link, "sender closed")
        for link in links:
            if link.thread is not None:
                link.thread.join(timeout=self.timeout_s)
        self._pool.clear()


# ---------------------------------------------------------------------------------------- receiver
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


class TcpReceiver(GrpcReceiver):
    """Serves `KVReceiver` for a sink and reads layers' bytes from its senders' data connections.

    `TcpReceiver(sink, server=None, endpoint=None, *, host="127.0.0.1", port=0, max_workers=16,
    timeout_s=30.0, max_buffered_bytes=1 GiB)`: as `GrpcReceiver`, plus a data listener on an
    ephemeral port of the endpoint's host (`data_port`); `timeout_s` bounds the wait for a frame,
    for buffer room and for a sender's hello, and how long an unclaimed frame is kept;
    `max_buffered_bytes` the frames held at once.
    """

    def __init__(
        self,
        sink: KVSink,
        server: grpc.Server | None = None,
        endpoint: str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_workers: int = 16,
        timeout_s: float = 30.0,
        max_buffered_bytes: int = 1 << 30,
        **kwargs: Any,
    ) -> None:
        """`kwargs`: for the next receiver in a cooperative subclass (auto: the shm one)."""
        self.timeout_s = timeout_s
        self.max_buffered_bytes = max_buffered_bytes
        self._cv = threading.Condition()  # guards the connections, their frames and the buffered bytes
        self._conns: dict[str, _Conn] = {}
        self._buffered = 0
        self._pool = BufferPool(max_buffered_bytes)
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._socks: set[socket.socket] = set()  # accepted, authenticated or not
        super().__init__(sink, server, endpoint, host=host, port=port, max_workers=max_workers, **kwargs)
        data_host = _split_host_port(self.endpoint)[0]
        family = socket.AF_INET6 if ":" in data_host else socket.AF_INET
        try:
            listener = socket.create_server((data_host, 0), family=family)
        except OSError as e:
            super().close()
            raise KVTransferError(f"could not listen for KV data on {data_host}: {e}") from None
        listener.settimeout(0.5)  # the accepting thread sweeps stale frames between accepts
        self.data_port: int = listener.getsockname()[1]
        self._listener = listener
        self._accepter = threading.Thread(target=self._accept, name=f"kv-tcp-accept-{self.data_port}", daemon=True)
        self._accepter.start()

    # ------------------------------------------------------------------ connections
    def handshake_fields(self, request: kv_transfer_pb2.HandshakeRequest) -> dict[str, Any]:
        fields = super().handshake_fields(request)
        if not request.tcp:
            return fields  # a grpc / shm sender: inline payloads or shared memory
        sender = request.sender_id or "anonymous"
        conn = _Conn(secrets.token_hex(16), secrets.token_bytes(32), sender, time.monotonic())
        with self._cv:
            if self._listener is None or self.closed:
                return fields  # no data port: the sender refuses
            for old in self._conns.values():  # a sender handshakes anew once it dropped its connection
                if old.sender_id == sender:
                    self._end_locked(old, "replaced by a new handshake of its sender")
            self._conns[conn.conn_id] = conn
        return {**fields, "tcp_port": self.data_port, "tcp_conn": conn.conn_id, "tcp_token": conn.token}

    def _accept(self) -> None:
        while True:
            listener = self._listener
            if listener is None:
                return
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
            if _recv_exactly(sock, memoryview(hello)) != HELLO.size:
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
        while not self.closed:
            try:
                got = sock.recv_into(header)
            except TimeoutError:
                continue  # idle between transfers
            if got == 0:
                return
            if _recv_exactly(sock, memoryview(header)[got:]) != FRAME.size - got:
                raise _Unavailable("closed inside a frame header")
            tag, nbytes = FRAME.unpack(header)
            if nbytes > MAX_FRAME_BYTES:
                raise KVTransferError(f"frame {tag} of {nbytes} bytes is over {MAX_FRAME_BYTES}")
            buf = self._reserve(conn, nbytes)
            try:
                if _recv_exactly(sock, _bytes(buf, nbytes)) != nbytes:
                    raise _Unavailable(f"closed inside frame {tag}")
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
                if conn.error is not None or self.closed or left <= 0:
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
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)  # wakes its reading thread
            except OSError:
                pass
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
    def receive_layer(self, msg: kv_transfer_pb2.KVLayer) -> None:
        if not msg.tcp_conn:
            return super().receive_layer(msg)  # inline payload (a grpc sender, or an empty layer)
        with self._cv:
            conn = self._conns.get(msg.tcp_conn)
        if conn is None:
            raise KVTransferError(f"layer {msg.layer}: unknown tcp data connection {msg.tcp_conn!r}")
        try:
            with self._lock:  # who is asking, before any frame is taken
                self._get(msg.transfer_id, msg.auth_token)
            if msg.payload:
                raise KVTransferError(f"layer {msg.layer}: both an inline payload and a tcp frame")
            frame = self._claim(conn, msg)
        except BaseException:
            self._refuse(conn, msg.tcp_tag)
            raise
        try:
            dtype, shape = self.check_layer(msg, _bytes(frame.buf, frame.nbytes))  # checksum, dtype, size
            kv = frame.buf[: frame.nbytes].view(dtype).view(shape)
            self._on_layer(msg.transfer_id, msg.auth_token, msg.layer, kv, msg.first_block)  # copies into the blocks
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
                    raise _Unavailable(f"layer {msg.layer} of {msg.transfer_id!r}: {conn.error}")
                if self.closed:
                    raise _Unavailable(f"layer {msg.layer} of {msg.transfer_id!r}: KV receiver closed")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _Late(
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
        """Refuse further messages, close the data listener and every data connection."""
        super().close()
        with self._cv:
            listener, self._listener = self._listener, None
            for conn in self._conns.values():
                self._end_locked(conn, "KV receiver closed")
            self._conns.clear()
            for sock in self._socks:  # connections still to say hello too
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            threads = list(self._threads)
        if listener is not None:
            self._accepter.join(timeout=2.0)
            listener.close()
        for t in threads:
            t.join(timeout=2.0)
        self._pool.clear()
