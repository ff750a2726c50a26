"""The shm data plane, sender side: in place into the receiver's shared cache (kv_transfer/shm_cache.py;
the message rides in the commit), else through segments this sender owns.

Segments ("slabs") come from a per-sender pool: a transfer's first slab is sized for all its layers
(as many as the last committed transfer had); after the commit or abort they go back to the pool,
free slabs beyond `pool_bytes` are unlinked, and `close()` unlinks all. Pages are reserved up front
(a full /dev/shm is an error here, never a SIGBUS later).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import secrets
import threading
from dataclasses import dataclass
from typing import Any

import torch

from kv_transfer.base import KVTransferError, TransferTicket
from kv_transfer.checksum import checksum, tensor_checksum
from kv_transfer.control_sender import ControlSender
from kv_transfer.planes import SendPlane
from kv_transfer.shm_cache import SHM_DIR, MappedKVCache, create_segment, remove_segment
from kv_transfer.shm_receiver import PROBE_BYTES, SEGMENT_PREFIX, node_id
from proto import kv_transfer_pb2

log = logging.getLogger(__name__)

ALIGN = 256  # layers start on this byte boundary within a slab
PAGE = mmap.PAGESIZE
# phrases of the placement refusals (see ShmSendPlane.accept; auto falls back on them)
PLACEMENT = ("needs both workers on one node", "does not take the shm backend")


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class _Slab:
    """One shared memory segment the sender created (and alone unlinks), mapped read-write."""

    _ids = itertools.count()

    def __init__(self, shm_dir: str, size: int) -> None:
        self.name = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{next(self._ids)}"
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
        with contextlib.suppress(BufferError):  # a copy or checksum still running (close() racing a send)
            self.mm.close()


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


class ShmSendPlane(SendPlane):
    """`slab_bytes`: the smallest segment made; `pool_bytes`: free segment space kept for reuse
    between transfers (0: unlink each transfer's segments at its commit / abort); segments' pages are
    reserved when made, so in-flight transfers plus the pool is the /dev/shm (RAM) used.
    `in_place=False` keeps the copying path; `verify_in_place=True` adds an XXH3-64 of each layer
    written in place, which the receiver checks against its blocks."""

    name = "shm"
    max_message_bytes = None  # the bytes are in shared memory: one message per layer

    def __init__(self, control: ControlSender, *, slab_bytes: int = 2 << 20, pool_bytes: int = 1 << 30,
                 shm_dir: str = SHM_DIR, in_place: bool = True, verify_in_place: bool = False) -> None:
        if not os.path.isdir(shm_dir):
            raise KVTransferError(f"the shm KV backend needs {shm_dir} (POSIX shared memory, Linux)")
        super().__init__(control)
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
    def handshake_request(self, request: kv_transfer_pb2.HandshakeRequest) -> None:
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

    def accept(self, endpoint: str, response: kv_transfer_pb2.HandshakeResponse) -> str | None:
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
        if self.control.accepted(endpoint) is not response:
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
            try:
                self.control.connect(endpoint, 0.0)
            except KVTransferError:
                return None  # not completed yet, or refused (the layer's stream reports it)
            with self._arena_lock:
                known = self._caches.get(endpoint)
        mapping = known[1] if known is not None else None
        if mapping is not None and not mapping.is_current():  # the receiver closed or restarted
            with self._arena_lock:
                if self._caches.get(endpoint) is known:
                    del self._caches[endpoint]
            mapping.close()
            self.control._forget_handshake(endpoint)  # the next layer handshakes anew and maps its new cache
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

    def finished(self, ticket: TransferTicket, layers: int) -> None:
        """The receiver has copied every layer it acknowledged and reads nothing after this: the
        transfer's slabs go back to the pool (and a commit teaches the layer count)."""
        drop: list[_Slab] = []
        with self._arena_lock:
            if layers:
                self._num_layers = layers
            slabs = self._leases.pop(ticket.transfer_id, [])
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
            return sorted(s.name for s in self._slabs_locked())

    def _slabs_locked(self) -> list[_Slab]:
        probe = [self._probe] if self._probe is not None else []
        return [*self._free, *(s for ss in self._leases.values() for s in ss), *probe]

    # ------------------------------------------------------------------ transfers
    def stage(self, ticket: TransferTicket, layer: int, kv: torch.Tensor) -> Any:
        # a part of a transfer (some KV heads, kv_transfer/parts.py) copies through a segment
        cache = self._cache_for(ticket.kv_endpoint) if self.in_place and not ticket.num_heads else None
        if cache is not None:
            # skipped (False) for a ticket whose blocks are no longer its own, or a layer whose layout
            # the mapped cache does not have: nothing was written, so the layer goes the copying way
            # below (never a claim of bytes written in place that were not)
            if cache.write(ticket, layer, kv):
                return _InPlace(cache.name, tensor_checksum(kv) if self.verify_in_place else None)
        region = self._alloc(ticket.transfer_id, layer, kv.numel() * kv.element_size())
        region.slab.write(region.offset, kv)
        return region

    def deferred(self, staged: Any) -> bool:
        return isinstance(staged, _InPlace)  # metadata only: it rides in the commit (or the next flush)

    def fields(self, ticket: TransferTicket, staged: _InPlace | _Region) -> dict[str, Any]:
        if isinstance(staged, _InPlace):
            return {"shm_in_place": True, "shm_name": staged.cache, "shm_checksummed": staged.digest is not None,
                        "checksum": staged.digest or 0}
        try:
            digest = staged.slab.checksum(staged.offset, staged.nbytes)
        except ValueError:  # unmapped by close(), which cancelled this stream: the receiver refuses it
            digest = 0
        return {"checksum": digest, "shm_name": staged.slab.name, "shm_offset": staged.offset, "shm_nbytes": staged.nbytes}

    def close(self) -> None:
        """Unlink every segment, unmap every shared cache."""
        with self._arena_lock:
            self._arena_closed = True
            slabs = self._slabs_locked()
            self._free, self._leases, self._probe = [], {}, None
            caches, self._caches = self._caches, {}
        for slab in slabs:
            slab.destroy()
        for _, mapping in caches.values():
            if mapping is not None:
                mapping.close()


class ShmSender(ControlSender):
    """The shm backend's sender (options: `ShmSendPlane`)."""

    PLANE = ShmSendPlane
