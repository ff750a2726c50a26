"""The shm data plane, receiver side: a prefill and a decode worker on one node (Linux).

A layer written in place gets the shared checks (and its checksum against the blocks, when it
carries one); otherwise its message names a range of a sender's segment, which is mapped read-only
(kept while it exists) and checked, and a view of it (no copy) goes to the shared checks. Only
`pdkv-*` names under `shm_dir` are opened, never unlinked.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import re
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from kv_transfer.base import KVTransferError, TransferTicket
from kv_transfer.control_receiver import ControlReceiver
from kv_transfer.planes import ReceivePlane
from kv_transfer.shm_cache import SHM_DIR, SharedKVCache
from kv_transfer.wire import WIRE_DTYPES, check_digest, wire_dtype
from proto import kv_transfer_pb2

log = logging.getLogger(__name__)

SEGMENT_PREFIX = "pdkv-"
SEGMENT_NAME = re.compile(r"pdkv-[A-Za-z0-9_-]{1,200}")
PROBE_BYTES = 16
MAX_MAPPINGS = 64  # segments a receiver keeps mapped (a sender normally uses a few)


def node_id() -> str:
    """This machine as "hostname/boot id": equal for two processes on one node (one kernel boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def _unopenable(layer: int, name: str, shm_dir: str, e: OSError, what: str = "open") -> KVTransferError:
    if isinstance(e, FileNotFoundError):
        return KVTransferError(
            f"layer {layer}: shared memory segment {name!r} not found in {shm_dir} (sender gone, or not on this node?)"
        )
    return KVTransferError(f"layer {layer}: cannot {what} shared memory segment {name!r}: {e.strerror}")


@dataclass
class _Mapping:
    """A receiver's read-only, shared mapping of a whole sender segment."""

    mm: mmap.mmap
    identity: tuple[int, int, int]  # (st_dev, st_ino, st_size) when mapped
    size: int
    users: int = 0  # layers being read from it now
    retired: bool = False

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # a view outlived its layer (never normally): unmapped later
            self.mm.close()


class ShmReceivePlane(ReceivePlane):
    """`shm_dir`: where senders' segments are ("/dev/shm"); `in_place` (default True): move a sink's
    CPU cache into a shared segment that senders on this node write in place (the sink must offer
    `move_kv_cache`, as DecodeEngine does). If the segment cannot be made (a small /dev/shm) the
    cache stays private and senders copy through their segments, with a warning."""

    name = "shm"

    def __init__(self, control: ControlReceiver, shm_dir: str = SHM_DIR, in_place: bool = True) -> None:
        super().__init__(control)
        self.in_place = in_place
        self.shm_dir = shm_dir
        self.node_id = node_id()
        self._maps: dict[str, _Mapping] = {}  # segment name -> mapping, least recently mapped first
        self._maps_lock = threading.Lock()
        self._last_sweep = 0.0
        self.shared: SharedKVCache | None = None  # the sink's cache, when senders write it in place
        move = getattr(control.sink, "move_kv_cache", None)
        if self.in_place and move is not None:
            try:
                move(self._shared_cache)
            except KVTransferError as e:
                log.warning("the KV cache stays private; shm senders copy through segments: %s", e)

    def _shared_cache(self, num_layers: int, layer_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Make the shared segment the sink's cache moves into; its (num_layers, *layer_shape) tensor."""
        self.shared = SharedKVCache(self.shm_dir, num_layers, layer_shape, dtype)
        return self.shared.cache

    def granted(self, ticket: TransferTicket) -> None:
        if self.shared is not None:
            self.shared.grant(ticket)

    def revoked(self, ticket: TransferTicket) -> None:
        if self.shared is not None:
            self.shared.revoke(ticket)

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
        if not SEGMENT_NAME.fullmatch(name):
            return b""
        try:
            fd = os.open(os.path.join(self.shm_dir, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                return os.read(fd, PROBE_BYTES)
            finally:
                os.close(fd)
        except OSError:
            return b""

    # ------------------------------------------------------------------ layers
    def claims(self, msg: kv_transfer_pb2.KVLayer) -> bool:
        return bool(msg.shm_in_place or msg.shm_name or msg.shm_nbytes or msg.shm_offset)

    def receive(self, msg: kv_transfer_pb2.KVLayer) -> None:
        if msg.shm_in_place:
            return self._receive_in_place(msg)
        self.control.authorize(msg.transfer_id, msg.auth_token)  # who is asking, before any shared memory is touched
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
            if msg.shm_checksummed:
                blocks = ticket.block_ids[msg.first_block : msg.first_block + shape[1]]
                check_digest(msg, "blocks", shared.digest(msg.layer, blocks))

        self.control._accept_layer(msg.transfer_id, msg.auth_token, msg.layer, shape, msg.first_block, verify)

    def _deliver(self, msg: kv_transfer_pb2.KVLayer, mm: mmap.mmap, start: int) -> None:
        """Check the mapped bytes and hand a tensor over them (no copy) to the shared checks."""
        with memoryview(mm) as whole:
            data = whole[start : start + msg.shm_nbytes]
            try:
                dtype, shape = self.control.check_layer(msg, data)
            finally:
                data.release()
        kv = torch.frombuffer(mm, dtype=dtype, count=math.prod(shape), offset=start).view(shape)
        try:  # the shared checks copy it into the blocks
            self.control._on_layer(msg.transfer_id, msg.auth_token, msg.layer, kv, msg.first_block)
        except BaseException as e:
            traceback.clear_frames(e.__traceback__)  # the frames below hold `kv`, i.e. the mapping
            raise
        finally:
            del kv

    # ------------------------------------------------------------------ mappings
    # A sender reuses its segments transfer after transfer, so each one is mapped once (read-only,
    # shared) and kept: a fresh mapping per layer page-faults every 4 KiB and its unmapping stalls
    # every thread of the process. A mapping whose file is gone (unlinked by its sender) or was
    # replaced is closed at the next sweep, which runs whenever a segment is mapped and at most once
    # a second otherwise, so a departed sender's pages are not held for long.
    def _map(self, msg: kv_transfer_pb2.KVLayer) -> _Mapping:
        """The mapping of the segment holding [shm_offset, shm_offset + shm_nbytes), in use."""
        name, offset, nbytes = msg.shm_name, msg.shm_offset, msg.shm_nbytes
        if not SEGMENT_NAME.fullmatch(name):
            raise KVTransferError(f"bad shared memory segment name {name!r} (expected {SEGMENT_PREFIX}*)")
        if nbytes == 0:
            raise KVTransferError(f"layer {msg.layer}: an empty range of shared memory segment {name!r}")
        itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}.get(msg.dtype, 1)
        if offset % itemsize:
            raise KVTransferError(f"layer {msg.layer}: offset {offset} in {name!r} is not aligned to {msg.dtype}")
        path = os.path.join(self.shm_dir, name)
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError as e:
            raise _unopenable(msg.layer, name, self.shm_dir, e) from None
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
        except OSError as e:
            raise _unopenable(layer, name, self.shm_dir, e) from None
        try:
            st = os.fstat(fd)
            if st.st_size == 0:
                raise KVTransferError(f"layer {layer}: shared memory segment {name!r} is empty")
            mm = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ)
        except OSError as e:
            raise _unopenable(layer, name, self.shm_dir, e, "map") from None
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
        with self._maps_lock:
            for mapping in self._maps.values():
                self._retire(mapping)
            self._maps.clear()
        if self.shared is not None:
            self.shared.close()  # unlinked; the sink keeps using its memory


class ShmReceiver(ControlReceiver):
    """The shm backend's receiver, also taking inline layers (options: `ShmReceivePlane`)."""

    PLANES = (ShmReceivePlane,)
