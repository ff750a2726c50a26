"""Shared-memory backend: a prefill and a decode worker on one node; the KV bytes never cross a socket.

The sender copies each layer's raw C-contiguous bytes into POSIX shared memory (a file in
/dev/shm that it owns) and only the metadata travels over the gRPC control channel, which is the
grpc backend's unchanged: the same `KVReceiver` service, handshake, one SendLayers stream per
transfer, Commit, Abort, deadlines and status codes (see kv_transfer.grpc_backend). A `KVLayer`
carries `shm_name`, `shm_offset`, `shm_nbytes` instead of a payload, and `checksum` is the XXH3-64 of
those bytes. The receiver checks the transfer id and auth token first, then maps the segment
(read-only and shared; kept mapped while the segment exists, since senders reuse theirs), checks
the range's checksum, dtype and size, views it as a tensor (`torch.frombuffer`, no intermediate
bytes) and hands it to the shared checks, which copy it into the reserved blocks. So a layer costs
one copy on each side plus a checksum pass on each side.

Segments (the sender's arena): a transfer takes whole segments ("slabs") from a per-sender pool
and packs its layers into them. A transfer's first slab is sized for all its layers (layer size x
the layer count of this sender's last committed transfer, at least `slab_bytes`; until that count
is known a transfer's next slab doubles its space), so a transfer normally fills one segment. After
its commit or abort its slabs go back to the pool for the next transfer (their pages are already
there, so the copy does not fault; the smallest free slab that fits is taken), and free slabs
beyond `pool_bytes` are unlinked, oldest first. `close()` unlinks all.
A slab's pages are reserved up front (posix_fallocate), so a full /dev/shm is a clear error here,
never a SIGBUS later; slabs are registered with multiprocessing's resource tracker, which unlinks
them if the prefill process dies without closing. The receiver never unlinks anything and opens
only `pdkv-*` names directly under its shared memory directory (no resource tracker there).

One node only: the handshake carries each side's node id (hostname and kernel boot id) and the
name of a small probe segment the sender made, which the receiver reads back. A sender refuses
(KVTransferError, cached per endpoint like a refused layout) a receiver on another node ("shm
needs both workers on one node"), one on this node that cannot see the sender's /dev/shm (another
container / IPC namespace), and a receiver without the shm backend. `ShmSender.connect(endpoint)`
runs that check at once, e.g. when a cluster starts.

The receiver also accepts inline payloads (a grpc sender), so a decode worker on shm takes both.
Linux only (/dev/shm).
"""

from __future__ import annotations

import itertools
import logging
import math
import mmap
import os
import re
import secrets
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from engine.sequence import TokenLogprobs
from kv_transfer.base import KVSink, KVTransferError, TransferTicket
from kv_transfer.checksum import NAME as CHECKSUM
from kv_transfer.checksum import checksum, tensor_checksum
from kv_transfer.grpc_backend import WIRE_DTYPES, GrpcReceiver, GrpcSender, _Corrupt, wire_dtype
from kv_transfer.shm_cache import SHM_DIR, MappedKVCache, SharedKVCache, create_segment, remove_segment
from proto import kv_transfer_pb2

log = logging.getLogger(__name__)

SEGMENT_PREFIX = "pdkv-"
_SEGMENT_NAME = re.compile(r"pdkv-[A-Za-z0-9_-]{1,200}")
ALIGN = 256  # layers start on this byte boundary within a slab
PAGE = mmap.PAGESIZE
PROBE_BYTES = 16
MAX_MAPPINGS = 64  # segments a receiver keeps mapped (a sender normally uses a few)
# phrases of ShmSender's placement refusals (see ShmSender._check_handshake; auto falls back on them)
PLACEMENT = ("needs both workers on one node", "does not take the shm backend")


def node_id() -> str:
    """This machine as "hostname/boot id": equal for two processes on one node (one kernel boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _check_name(name: str) -> None:
    if not _SEGMENT_NAME.fullmatch(name):
        raise KVTransferError(f"bad shared memory segment name {name!r} (expected {SEGMENT_PREFIX}*)")


# ------------------------------------------------------------------------------------------ sender
class _Slab:
    """One shared memory segment the sender created (and alone unlinks), mapped read-write."""

    _ids = itertools.count()

    def __init__(self, shm_dir: str, size: int) -> None:
        self.name = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{next(self._ids)}"
        self.path = os.path.join(shm_dir, self.name)
        self.size = size
        self.used = 0
        self.shm_dir = shm_dir
        self._gone = False
        fd, self.mm, self._tracked = create_segment(shm_dir, self.name, size)
        os.close(fd)

    def write(self, offset: int, kv: torch.Tensor) -> None:
        src = kv.detach().contiguous().reshape(-1).view(torch.uint8)
        dst = torch.frombuffer(self.mm, dtype=torch.uint8, count=src.numel(), offset=offset)
        try:
            dst.copy_(src)  # straight from the device for a GPU cache
        finally:
            del dst

    def checksum(self, offset: int, nbytes: int) -> int:
        with memoryview(self.mm) as whole:
            part = whole[offset : offset + nbytes]
            try:
                return checksum(part)
            finally:
                part.release()

    def destroy(self) -> None:
        """Unlink and unmap (a receiver still mapping it keeps its pages until it unmaps)."""
        if self._gone:
            return
        self._gone = True
        remove_segment(self.shm_dir, self.name, self._tracked)
        try:
            self.mm.close()
        except BufferError:  # a copy or checksum still running (close() racing a send): unmapped when done
            pass


@dataclass(frozen=True)
class _Region:
    slab: _Slab
    offset: int
    nbytes: int


@dataclass(frozen=True)
class _InPlace:
    """A layer already copied into the receiver's shared cache `cache`; its XXH3-64 when verified."""

    cache: str
    digest: int | None


class ShmSender(GrpcSender):
    """Pushes layers through shared memory to `ShmReceiver`s on this node. Thread-safe.

    `ShmSender(compat_hash, timeout_s=30.0, sender_id=None, *, slab_bytes=2 MiB,
    pool_bytes=1 GiB, shm_dir="/dev/shm", in_place=True, verify_in_place=False)`: `timeout_s`
    bounds every control RPC as for grpc; `slab_bytes` is the smallest segment made; `pool_bytes`
    how much free segment space is kept for reuse between transfers (0: unlink each transfer's
    segments at its commit / abort). Segments' pages are reserved when made, so in-flight transfers
    plus the pool is the /dev/shm (RAM) used.

    In place (kv_transfer.shm_cache): once a receiver's handshake names its shared cache, layers
    go straight into the ticket's blocks there (one copy, no segment, no checksum pass) instead
    of through a segment; `in_place=False` keeps the copying path. `verify_in_place=True` adds an
    XXH3-64 of each layer, which the receiver checks against its blocks before accepting it.
    Layers sent before the handshake completed (a new endpoint's first transfer) use segments.
    """

    BACKEND = "shm"
    max_message_bytes = None  # the bytes are in shared memory: one message per layer

    def __init__(
        self,
        compat_hash: str,
        timeout_s: float = 30.0,
        sender_id: str | None = None,
        *,
        slab_bytes: int = 2 << 20,
        pool_bytes: int = 1 << 30,
        shm_dir: str = SHM_DIR,
        in_place: bool = True,
        verify_in_place: bool = False,
    ) -> None:
        if not os.path.isdir(shm_dir):
            raise KVTransferError(f"the shm KV backend needs {shm_dir} (POSIX shared memory, Linux)")
        super().__init__(compat_hash, timeout_s=timeout_s, sender_id=sender_id)
        self.in_place = in_place
        self.verify_in_place = verify_in_place
        # endpoint -> (its shared cache's name, our mapping of it; None if it could not be mapped)
        self._caches: dict[str, tuple[str, MappedKVCache | None]] = {}
        self.shm_dir = shm_dir
        self.slab_bytes = max(PAGE, _round_up(slab_bytes, PAGE))
        self.pool_bytes = pool_bytes
        self.node_id = node_id()
        self._arena_lock = threading.Lock()
        self._free: list[_Slab] = []  # oldest first
        self._leases: dict[str, list[_Slab]] = {}  # transfer id -> its slabs, the last one filling
        # layers per transfer, as the last committed one had (the receiver checked them all): sizes a
        # transfer's first slab; learned from commits only, so a stray layer index cannot inflate it
        self._num_layers = 1
        self._probe: _Slab | None = None
        self._probe_data = b""
        self._arena_closed = False

    # ------------------------------------------------------------------ node check
    def _handshake_request(self, endpoint: str) -> kv_transfer_pb2.HandshakeRequest:
        request = super()._handshake_request(endpoint)
        with self._arena_lock:
            if self._arena_closed:
                raise KVTransferError("KV sender is closed")
            if self._probe is None:
                probe = _Slab(self.shm_dir, PAGE)
                self._probe_data = secrets.token_bytes(PROBE_BYTES)
                probe.mm[:PROBE_BYTES] = self._probe_data
                self._probe = probe
            request.shm_probe = self._probe.name
        request.node_id = self.node_id
        return request

    def _check_handshake(self, endpoint: str, response: kv_transfer_pb2.HandshakeResponse) -> str | None:
        if not response.node_id:
            return (
                f"KV receiver at {endpoint} does not take the shm backend (its handshake names no node; "
                "a grpc receiver?): use the same kv_transfer backend on both sides"
            )
        if response.node_id != self.node_id:
            return (
                f"shm needs both workers on one node: this prefill worker is on {self.node_id}, the KV "
                f"receiver at {endpoint} on {response.node_id} (hostname/boot id); use grpc across nodes"
            )
        if response.shm_probe_data != self._probe_data:
            return (
                f"shm needs both workers on one node sharing {self.shm_dir}: the KV receiver at {endpoint} "
                "runs on this host but cannot see this worker's shared memory (another container or "
                "IPC namespace?); share /dev/shm between them or use grpc"
            )
        self._map_cache(endpoint, response.shm_cache if self.in_place else "", response)
        return None

    def _map_cache(self, endpoint: str, name: str, response: kv_transfer_pb2.HandshakeResponse) -> None:
        """Keep a mapping of the endpoint's shared cache `name` ("": none), replacing an older one;
        only from the endpoint's current handshake (a stream may still check an older one's answer)."""
        with self._lock:
            hs = self._handshakes.get(endpoint)
            f = hs.future if hs is not None else None
            if f is None or not f.done() or f.cancelled() or f.exception() is not None or f.result() is not response:
                return
        with self._arena_lock:
            known = self._caches.get(endpoint)
            if self._arena_closed or (known is not None and known[0] == name):
                return
            mapping = None
            if name:
                try:
                    mapping = MappedKVCache(self.shm_dir, name, response.shm_cache_offset,
                                            response.shm_cache_blocks, response.shm_cache_layers)
                except (OSError, KVTransferError) as e:
                    log.warning("cannot map the shared KV cache of %s (%s): its layers go through segments",
                                endpoint, e)
            self._caches[endpoint] = (name, mapping)
        if known is not None and known[1] is not None:
            known[1].close()

    def _cache_for(self, endpoint: str) -> MappedKVCache | None:
        """The endpoint's shared cache once its handshake has completed and named one (never waits:
        the forward pass does not wait on the network). Per layer only a lookup and a stat."""
        with self._arena_lock:
            known = self._caches.get(endpoint)
        if known is None:  # not mapped yet: the handshake maps it once it has completed
            with self._lock:
                hs = self._handshake(endpoint)
            f = hs.future
            if hs.error is not None or not f.done() or f.cancelled() or f.exception() is not None:
                return None
            try:
                self._await_handshake(endpoint, hs, 0.0)
            except KVTransferError:
                return None  # the layer's stream reports it
            with self._arena_lock:
                known = self._caches.get(endpoint)
        mapping = known[1] if known is not None else None
        if mapping is not None and not mapping.is_current():  # the receiver closed or restarted
            with self._arena_lock:
                if self._caches.get(endpoint) is known:
                    del self._caches[endpoint]
            mapping.close()
            self._forget_handshake(endpoint)  # the next layer handshakes anew and maps its new cache
            return None
        return mapping

    # ------------------------------------------------------------------ arena
    def _alloc(self, transfer_id: str, layer: int, nbytes: int) -> _Region:
        with self._arena_lock:
            if self._arena_closed:
                raise KVTransferError("KV sender is closed")
            slabs = self._leases.setdefault(transfer_id, [])
            if slabs:
                slab = slabs[-1]
                offset = _round_up(slab.used, ALIGN)
                if offset + nbytes <= slab.size:
                    slab.used = offset + nbytes
                    return _Region(slab, offset, nbytes)
            # room for the layers still to come (as many as transfers had), or double what it has
            want = max(
                self.slab_bytes,
                _round_up(_round_up(nbytes, ALIGN) * max(1, self._num_layers - layer), PAGE),
                sum(s.size for s in slabs),
            )
            fits = [s for s in self._free if s.size >= want]
            if fits:
                slab = min(fits, key=lambda s: s.size)
                self._free.remove(slab)
            else:
                slab = _Slab(self.shm_dir, want)
            slab.used = nbytes
            slabs.append(slab)
            return _Region(slab, 0, nbytes)

    def _release(self, transfer_id: str) -> None:
        """The transfer is over (committed, aborted or failed): its slabs go back to the pool."""
        drop: list[_Slab] = []
        with self._arena_lock:
            slabs = self._leases.pop(transfer_id, [])
            if self._arena_closed:
                drop = slabs
            else:
                for slab in slabs:
                    slab.used = 0
                    self._free.append(slab)
                free = sum(s.size for s in self._free)
                while self._free and free > self.pool_bytes:
                    slab = self._free.pop(0)
                    free -= slab.size
                    drop.append(slab)
        for slab in drop:
            slab.destroy()

    @property
    def in_place_endpoints(self) -> list[str]:
        """Endpoints whose shared cache this sender has mapped (it writes their layers in place)."""
        with self._arena_lock:
            return sorted(e for e, (_, mapping) in self._caches.items() if mapping is not None)

    @property
    def segments(self) -> list[str]:
        """Names of the segments this sender holds now (in use, pooled, the probe)."""
        with self._arena_lock:
            slabs = [*self._free, *(s for ss in self._leases.values() for s in ss)]
            if self._probe is not None:
                slabs.append(self._probe)
            return sorted(s.name for s in slabs)

    # ------------------------------------------------------------------ transfers
    def _payload(self, ticket: TransferTicket, layer: int, kv: torch.Tensor) -> Any:
        self._raise_if_refused(ticket.kv_endpoint)  # do not fill a segment for an endpoint already refused
        nbytes = kv.numel() * kv.element_size()
        if nbytes == 0:
            return b""  # nothing to map: an empty inline payload
        cache = self._cache_for(ticket.kv_endpoint) if self.in_place else None
        if cache is not None:
            digest = tensor_checksum(kv) if self.verify_in_place else None
            # skipped (False) for a ticket whose blocks are no longer its own, or a layer that does not
            # fit: the receiver refuses the message by its own checks, and nothing was written
            cache.write(ticket, layer, kv)
            return _InPlace(cache.name, digest)
        region = self._alloc(ticket.transfer_id, layer, nbytes)
        region.slab.write(region.offset, kv)
        return region

    def _deferred(self, payload: Any) -> bool:
        return isinstance(payload, _InPlace)  # metadata only: it rides in the commit (or the next flush)

    def _layer_message(
        self, ticket: TransferTicket, layer: int, dtype: str, shape: list[int], payload: Any, first_block: int = 0
    ) -> kv_transfer_pb2.KVLayer:
        if isinstance(payload, _InPlace):
            return kv_transfer_pb2.KVLayer(
                transfer_id=ticket.transfer_id, auth_token=ticket.auth_token, layer=layer, dtype=dtype,
                shape=shape, first_block=first_block, shm_in_place=True, shm_name=payload.cache,
                shm_checksummed=payload.digest is not None, checksum=payload.digest or 0,
            )
        if not isinstance(payload, _Region):
            return super()._layer_message(ticket, layer, dtype, shape, payload, first_block)
        try:
            checksum = payload.slab.checksum(payload.offset, payload.nbytes)
        except ValueError:  # unmapped by close(), which cancelled this stream: the receiver refuses it
            checksum = 0
        return kv_transfer_pb2.KVLayer(
            transfer_id=ticket.transfer_id,
            auth_token=ticket.auth_token,
            layer=layer,
            dtype=dtype,
            shape=shape,
            checksum=checksum,
            shm_name=payload.slab.name,
            shm_offset=payload.offset,
            shm_nbytes=payload.nbytes,
        )

    def commit(self, ticket: TransferTicket, first_token: int, logprob: TokenLogprobs | None) -> None:
        with self._lock:
            transfer = self._transfers.get(ticket.transfer_id)
            num_layers = len(transfer.layers_sent) if transfer is not None else 0
        try:
            super().commit(ticket, first_token, logprob)
            if num_layers:
                with self._arena_lock:
                    self._num_layers = num_layers
        finally:  # the receiver has copied every layer it acknowledged; it reads nothing after this
            self._release(ticket.transfer_id)

    def abort(self, ticket: TransferTicket, reason: str) -> None:
        try:
            super().abort(ticket, reason)
        finally:
            self._release(ticket.transfer_id)

    def close(self) -> None:
        """Cancel streams in flight, close every channel and unlink every segment."""
        super().close()
        with self._arena_lock:
            self._arena_closed = True
            slabs = [*self._free, *(s for ss in self._leases.values() for s in ss)]
            if self._probe is not None:
                slabs.append(self._probe)
            self._free, self._leases, self._probe = [], {}, None
            caches, self._caches = self._caches, {}
        for slab in slabs:
            slab.destroy()
        for _, mapping in caches.values():
            if mapping is not None:
                mapping.close()


# ---------------------------------------------------------------------------------------- receiver
@dataclass
class _Mapping:
    """A receiver's read-only, shared mapping of a whole sender segment."""

    mm: mmap.mmap
    identity: tuple[int, int, int]  # (st_dev, st_ino, st_size) when mapped
    size: int
    users: int = 0  # layers being read from it now
    retired: bool = False

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:  # a view outlived its layer (cannot happen normally): unmapped when collected
            pass


class ShmReceiver(GrpcReceiver):
    """Serves `KVReceiver` for a sink and reads layers from the senders' shared memory.

    Same constructor as `GrpcReceiver` (`ShmReceiver(sink, server, endpoint)` on the caller's
    server, or its own on host:port), plus `shm_dir` (where senders' segments are, "/dev/shm") and
    `in_place` (default True): move a sink's CPU cache into a shared segment that senders on this
    node write in place (kv_transfer.shm_cache; the sink must offer `move_kv_cache`, as
    DecodeEngine does). If the segment cannot be made (a small /dev/shm) the cache stays private
    and senders copy through their segments, with a warning.
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
        shm_dir: str = SHM_DIR,
        in_place: bool = True,
    ) -> None:
        self.in_place = in_place
        self.shm_dir = shm_dir
        self.node_id = node_id()
        self._maps: dict[str, _Mapping] = {}  # segment name -> mapping, least recently mapped first
        self._maps_lock = threading.Lock()
        self._last_sweep = 0.0
        self.shared: SharedKVCache | None = None  # the sink's cache, when senders write it in place
        super().__init__(sink, server, endpoint, host=host, port=port, max_workers=max_workers)
        move = getattr(sink, "move_kv_cache", None)
        if self.in_place and move is not None:
            try:
                move(self._shared_cache)
            except KVTransferError as e:
                log.warning("the KV cache stays private; shm senders copy through segments: %s", e)

    def _shared_cache(self, num_layers: int, layer_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Make the shared segment the sink's cache moves into; its (num_layers, *layer_shape) tensor."""
        self.shared = SharedKVCache(self.shm_dir, num_layers, layer_shape, dtype)
        return self.shared.cache

    def _granted(self, ticket: TransferTicket) -> None:
        if self.shared is not None:
            self.shared.grant(ticket)

    def _revoked(self, ticket: TransferTicket) -> None:
        if self.shared is not None:
            self.shared.revoke(ticket)

    @classmethod
    def serve(
        cls, sink: KVSink, host: str = "127.0.0.1", port: int = 0, max_workers: int = 16
    ) -> ShmReceiver:
        return cls(sink, host=host, port=port, max_workers=max_workers)

    def handshake_fields(self, request: kv_transfer_pb2.HandshakeRequest) -> dict[str, Any]:
        fields: dict[str, Any] = {"node_id": self.node_id}
        if request.shm_probe:
            fields["shm_probe_data"] = self._read_probe(request.shm_probe)
        shared = self.shared
        if shared is not None:
            fields.update(shm_cache=shared.name, shm_cache_offset=shared.offset,
                          shm_cache_blocks=shared.num_blocks, shm_cache_layers=shared.num_layers)
        return fields

    def _read_probe(self, name: str) -> bytes:
        """The probe segment's first bytes, or b"" when this receiver cannot see it."""
        if not _SEGMENT_NAME.fullmatch(name):
            return b""
        try:
            fd = os.open(os.path.join(self.shm_dir, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return b""
        try:
            return os.read(fd, PROBE_BYTES)
        except OSError:
            return b""
        finally:
            os.close(fd)

    def receive_layer(self, msg: kv_transfer_pb2.KVLayer) -> None:
        if msg.shm_in_place:
            return self._receive_in_place(msg)
        if not (msg.shm_name or msg.shm_nbytes or msg.shm_offset):
            return super().receive_layer(msg)  # inline payload (a grpc sender, or an empty layer)
        with self._lock:  # who is asking, before any shared memory is touched
            self._get(msg.transfer_id, msg.auth_token)
        if msg.payload:
            raise KVTransferError(f"layer {msg.layer}: both an inline payload and a shared memory segment")
        mapping = self._map(msg)
        try:
            self._deliver(msg, mapping.mm, msg.shm_offset)
        finally:
            self._unuse(mapping)

    def _receive_in_place(self, msg: kv_transfer_pb2.KVLayer) -> None:
        """A layer its sender copied into our shared cache: the shared checks (and the checksum
        against the blocks, when it came with one) before it counts."""
        shared = self.shared
        if shared is None:
            raise KVTransferError(
                f"layer {msg.layer}: written in place, but this receiver's KV cache is not in shared memory"
            )
        if msg.payload or msg.shm_offset or msg.shm_nbytes:
            raise KVTransferError(f"layer {msg.layer}: written in place and also sent (payload / segment)")
        if msg.shm_name != shared.name:  # a sender still mapping the cache of this endpoint's last receiver
            raise KVTransferError(
                f"layer {msg.layer}: written into shared KV cache {msg.shm_name!r}, but this receiver's is "
                f"{shared.name!r} (it restarted)"
            )
        if WIRE_DTYPES.get(msg.dtype) != shared.cache.dtype:
            raise KVTransferError(f"layer {msg.layer}: dtype {msg.dtype!r}, expected {wire_dtype(shared.cache.dtype)}")
        shape = tuple(msg.shape)

        def verify(ticket: TransferTicket) -> None:
            if not msg.shm_checksummed:
                return
            digest = shared.digest(msg.layer, ticket.block_ids[msg.first_block : msg.first_block + shape[1]])
            if digest != msg.checksum:
                raise _Corrupt(
                    f"checksum mismatch for layer {msg.layer} of {msg.transfer_id!r}: blocks {CHECKSUM} "
                    f"{digest:#018x}, message says {msg.checksum:#018x}"
                )

        self._accept_layer(msg.transfer_id, msg.auth_token, msg.layer, shape, msg.first_block, verify)

    # ------------------------------------------------------------------ mappings
    # A sender reuses its segments transfer after transfer, so each one is mapped once (read-only,
    # shared) and kept: a fresh mapping per layer page-faults every 4 KiB and its unmapping stalls
    # every thread of the process. A mapping whose file is gone (unlinked by its sender) or was
    # replaced is closed at the next sweep, which runs whenever a segment is mapped and at most once
    # a second otherwise, so a departed sender's pages are not held for long.
    def _map(self, msg: kv_transfer_pb2.KVLayer) -> _Mapping:
        """The mapping of the segment holding [shm_offset, shm_offset + shm_nbytes), in use."""
        name, offset, nbytes = msg.shm_name, msg.shm_offset, msg.shm_nbytes
        _check_name(name)
        if nbytes == 0:
            raise KVTransferError(f"layer {msg.layer}: an empty range of shared memory segment {name!r}")
        itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}.get(msg.dtype, 1)
        if offset % itemsize:
            raise KVTransferError(
                f"layer {msg.layer}: offset {offset} in {name!r} is not aligned to {msg.dtype}"
            )
        path = os.path.join(self.shm_dir, name)
        try:
            st = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            raise KVTransferError(
                f"layer {msg.layer}: shared memory segment {name!r} not found in {self.shm_dir} "
                "(sender gone, or not on this node?)"
            ) from None
        except OSError as e:
            raise KVTransferError(
                f"layer {msg.layer}: cannot open shared memory segment {name!r}: {e.strerror}"
            ) from None
        with self._maps_lock:
            mapping = self._maps.get(name)
            if mapping is None or mapping.identity != (st.st_dev, st.st_ino, st.st_size):
                mapping = self._open(msg.layer, name, path)
            if offset + nbytes > mapping.size:
                raise KVTransferError(
                    f"layer {msg.layer}: range [{offset}, {offset + nbytes}) outside shared memory "
                    f"segment {name!r} of {mapping.size} bytes"
                )
            mapping.users += 1
        return mapping

    def _open(self, layer: int, name: str, path: str) -> _Mapping:
        """Under _maps_lock: map the segment at `path` and cache it (after a sweep)."""
        self._sweep(force=True)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise KVTransferError(
                f"layer {layer}: shared memory segment {name!r} not found in {self.shm_dir} "
                "(sender gone, or not on this node?)"
            ) from None
        except OSError as e:
            raise KVTransferError(f"layer {layer}: cannot open shared memory segment {name!r}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if st.st_size == 0:
                raise KVTransferError(f"layer {layer}: shared memory segment {name!r} is empty")
            mm = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ)
        except OSError as e:
            raise KVTransferError(f"layer {layer}: cannot map shared memory segment {name!r}: {e.strerror}") from None
        finally:
            os.close(fd)
        old = self._maps.pop(name, None)
        if old is not None:
            self._retire(old)
        mapping = self._maps[name] = _Mapping(mm, (st.st_dev, st.st_ino, st.st_size), st.st_size)
        while len(self._maps) > MAX_MAPPINGS:  # least recently mapped first
            self._retire(self._maps.pop(next(iter(self._maps))))
        return mapping

    def _sweep(self, force: bool = False) -> None:
        """Under _maps_lock: close the mappings of segments that are gone or were replaced."""
        now = time.monotonic()
        if not force and now - self._last_sweep < 1.0:
            return
        self._last_sweep = now
        for name, mapping in list(self._maps.items()):
            try:
                st = os.stat(os.path.join(self.shm_dir, name), follow_symlinks=False)
                alive = mapping.identity == (st.st_dev, st.st_ino, st.st_size)
            except OSError:
                alive = False
            if not alive:
                self._retire(self._maps.pop(name))

    def _retire(self, mapping: _Mapping) -> None:
        """Under _maps_lock: unmap now, or when its last reader is done."""
        mapping.retired = True
        if mapping.users == 0:
            mapping.close()

    def _unuse(self, mapping: _Mapping) -> None:
        with self._maps_lock:
            mapping.users -= 1
            if mapping.retired and mapping.users == 0:
                mapping.close()
            self._sweep()

    def sweep(self) -> None:
        """Unmap now the segments that are gone (this also happens by itself; see above)."""
        with self._maps_lock:
            self._sweep(force=True)

    @property
    def num_mappings(self) -> int:
        """Segments this receiver keeps mapped now."""
        return len(self._maps)

    def close(self) -> None:
        super().close()
        with self._maps_lock:
            for mapping in self._maps.values():
                self._retire(mapping)
            self._maps.clear()
        if self.shared is not None:
            self.shared.close()  # unlinked; the sink keeps using its memory

    def _deliver(self, msg: kv_transfer_pb2.KVLayer, mm: mmap.mmap, start: int) -> None:
        """Check the mapped bytes and hand a tensor over them (no copy) to the shared checks."""
        with memoryview(mm) as whole:
            data = whole[start : start + msg.shm_nbytes]
            try:
                dtype, shape = self.check_layer(msg, data)
            finally:
                data.release()
        kv = torch.frombuffer(mm, dtype=dtype, count=math.prod(shape), offset=start).view(shape)
        try:
            self._on_layer(msg.transfer_id, msg.auth_token, msg.layer, kv, msg.first_block)  # copies into the blocks
        except BaseException as e:
            traceback.clear_frames(e.__traceback__)  # the frames below hold `kv`, i.e. the mapping
            raise
        finally:
            del kv
