"""A decode worker's KV cache in shared memory, which same-node prefill workers write in place:

    [ fence: one int64 tag per block, padded to a page | layer 0 | layer 1 | ... ]

each layer the engine's usual (2, num_blocks, block_size, kv_heads, head_dim) tensor.

The write fence keeps a sender from writing into blocks that are no longer its transfer's: every
block reserved for a transfer carries its tag (a hash of its id and auth token), cleared when the
transfer ends, before its blocks are freed or start decoding. A sender writes a layer only under a
shared record lock on the ticket's first block's fence entry while it sees its tag on every block;
the receiver clears tags under an exclusive lock on that entry, so a clear waits for a write in
progress and every later write is skipped (the receiver then refuses the message).

Trust: a sender that maps the segment could write anywhere in the cache, as any process of the
same user on the node could already; the fence stops stale and misdirected writes, not a hostile
process with the user's rights.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import math
import mmap
import os
import re
import secrets
import struct
import threading
import time

import numpy as np
import torch

from engine.block_runs import block_runs, copy_runs
from kv_transfer.base import KVTransferError, TransferTicket
from kv_transfer.checksum import checksum

PAGE = mmap.PAGESIZE
SHM_DIR = "/dev/shm"
FENCE_ITEM = 8  # bytes per block's tag (int64)
LOCK_TIMEOUT_S = 10.0
_CACHE_NAME = re.compile(r"pdkv-[0-9]+-cache-[0-9a-f]+")  # a write holds its lock for one layer's memcpy; this only bounds a hung writer


def fence_tag(ticket: TransferTicket) -> int:
    """The transfer's nonzero int64 tag (only a holder of its auth token can compute it)."""
    digest = hashlib.blake2b(f"{ticket.transfer_id}/{ticket.auth_token}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True) or 1


def _setlk(fd: int, kind: int, block: int) -> None:
    """One non-blocking record lock request on block's fence entry. Open-file-description locks
    (Linux): they conflict between two descriptors even within one process, and a process's other
    descriptors of the file do not drop them when closed."""
    start = block * FENCE_ITEM
    if _OFD_SETLK is None:
        fcntl.lockf(fd, {fcntl.LOCK_SH: fcntl.LOCK_SH | fcntl.LOCK_NB, fcntl.LOCK_EX: fcntl.LOCK_EX | fcntl.LOCK_NB,
                         fcntl.LOCK_UN: fcntl.LOCK_UN}[kind], FENCE_ITEM, start)
        return
    l_type = {fcntl.LOCK_SH: fcntl.F_RDLCK, fcntl.LOCK_EX: fcntl.F_WRLCK, fcntl.LOCK_UN: fcntl.F_UNLCK}[kind]
    # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks)
    fcntl.fcntl(fd, _OFD_SETLK, struct.pack("hhqqi4x", l_type, os.SEEK_SET, start, FENCE_ITEM, 0))


_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", None)


def _lock(fd: int, kind: int, block: int, timeout_s: float) -> None:
    """Take a record lock on block's fence entry, retrying until `timeout_s` (never forever)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _setlk(fd, kind, block)
            return
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
        if time.monotonic() > deadline:
            raise KVTransferError(f"KV cache fence of block {block} still locked after {timeout_s:.0f} s")
        time.sleep(0.0005)


def _unlock(fd: int, block: int) -> None:
    _setlk(fd, fcntl.LOCK_UN, block)


def create_segment(shm_dir: str, name: str, size: int, what: str = "KV segment") -> tuple[int, mmap.mmap, bool]:
    """Create the shared memory file `name` in `shm_dir` (this user only) with all `size` bytes of
    pages reserved now (a full tmpfs is a KVTransferError here, never a SIGBUS on a later write),
    mapped read-write. Returns (fd, mapping, tracked): in /dev/shm the segment is registered with
    multiprocessing's resource tracker, which unlinks it if this process dies without
    `remove_segment`. The caller closes fd when it no longer needs it."""
    path = os.path.join(shm_dir, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise KVTransferError(f"cannot create a {what} in {shm_dir}: {e.strerror}") from None
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            raise KVTransferError(
                f"no room for a {size}-byte {what} in {shm_dir}: {e.strerror} "
                "(a container's /dev/shm is often small: raise its size, e.g. docker --shm-size)"
            ) from None
        mm = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    tracked = os.path.realpath(shm_dir) == os.path.realpath(SHM_DIR)
    if tracked:
        from multiprocessing import resource_tracker

        resource_tracker.register("/" + name, "shared_memory")
    return fd, mm, tracked


def remove_segment(shm_dir: str, name: str, tracked: bool) -> None:
    """Unlink a segment made by `create_segment` (gone already: fine) and untrack it."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(shm_dir, name))
    if tracked:
        from multiprocessing import resource_tracker

        resource_tracker.unregister("/" + name, "shared_memory")


def _geometry(num_blocks: int) -> int:
    """Byte offset of the cache in the segment (after the fence table)."""
    return -(-num_blocks * FENCE_ITEM // PAGE) * PAGE


def blocks_digest(layer: torch.Tensor, ids: list[int]) -> int:
    """XXH3-64 of blocks `ids` of a (2, num_blocks, ...) layer, K's then V's, as a contiguous tensor
    of those blocks would hash (the sender hashes the tensor it copied from)."""
    parts = [layer[kv, first : first + n].reshape(-1).view(torch.uint8).numpy()
             for kv in range(layer.shape[0]) for _, first, n in block_runs(ids)]
    return checksum(*parts)


class SharedKVCache:
    """Receiver side: creates the segment, lays the cache out in it, keeps the fence."""

    def __init__(self, shm_dir: str, num_layers: int, layer_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.num_layers = num_layers
        self.num_blocks = layer_shape[1]
        self.offset = _geometry(self.num_blocks)
        nbytes = num_layers * math.prod(layer_shape) * dtype.itemsize
        self.size = self.offset + nbytes
        self.shm_dir = shm_dir
        self.name = f"pdkv-{os.getpid()}-cache-{secrets.token_hex(6)}"
        # fd kept open for the record locks (closing any fd of the file would drop them)
        self._fd, mm, self._tracked = create_segment(shm_dir, self.name, self.size, "KV cache")
        self.fence = torch.frombuffer(mm, dtype=torch.int64, count=self.num_blocks)
        count = nbytes // dtype.itemsize
        self.cache = torch.frombuffer(mm, dtype=dtype, count=count, offset=self.offset).view(num_layers, *layer_shape)
        self._closed = False

    def grant(self, ticket: TransferTicket) -> None:
        """Open the ticket's blocks to its sender (before the ticket is handed out)."""
        self.fence[ticket.block_ids] = fence_tag(ticket)

    def revoke(self, ticket: TransferTicket) -> None:
        """Close the ticket's blocks: returns once no write of its sender is in progress or can start."""
        if not ticket.block_ids or self._closed:
            return
        first = ticket.block_ids[0]
        _lock(self._fd, fcntl.LOCK_EX, first, LOCK_TIMEOUT_S)
        try:
            self.fence[ticket.block_ids] = 0
        finally:
            _unlock(self._fd, first)

    def digest(self, layer: int, ids: list[int]) -> int:
        return blocks_digest(self.cache[layer], ids)

    def close(self) -> None:
        """Unlink the segment (the cache tensors keep their memory while anyone uses them)."""
        if self._closed:
            return
        self._closed = True
        remove_segment(self.shm_dir, self.name, self._tracked)
        os.close(self._fd)


class MappedKVCache:
    """Sender side: a receiver's shared cache, mapped read-write; writes layers through the fence."""

    def __init__(self, shm_dir: str, name: str, offset: int, num_blocks: int, num_layers: int) -> None:
        if not _CACHE_NAME.fullmatch(name):
            raise KVTransferError(f"bad shared KV cache name {name!r}")
        if offset != _geometry(num_blocks):
            raise KVTransferError(f"shared KV cache {name!r}: cache offset {offset} does not fit {num_blocks} blocks")
        self.name, self.offset, self.num_blocks, self.num_layers = name, offset, num_blocks, num_layers
        self.path = os.path.join(shm_dir, name)
        fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            self.size, self._identity = st.st_size, (st.st_dev, st.st_ino)
            # map every page now (once per receiver): a fault per 4 KiB would cost more than the copy
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mm = mmap.mmap(fd, self.size, flags=flags)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._fence_np = np.frombuffer(self._mm, dtype=np.int64, count=num_blocks)
        self._last_plan: tuple[tuple, tuple[int, list[tuple[int, int, int]]]] | None = None
        self._layers: torch.Tensor | None = None  # (layers, 2, blocks, ...) view, made at the first write
        self._mutex = threading.Lock()  # a lock held twice by one descriptor is one lock: one writer thread at a time
        self._closed = False

    def is_current(self) -> bool:
        """The receiver still has this segment (gone: it closed or restarted, and has another)."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._identity

    def _view(self, kv: torch.Tensor) -> torch.Tensor | None:
        """The cache as (layers, planes, num_blocks, *block) of kv's dtype, or None if kv's blocks do not
        fit the segment (another layout: the receiver refuses the message by its own checks)."""
        if self._layers is not None:
            ok = self._layers.dtype == kv.dtype and self._layers.shape[3:] == kv.shape[2:]
            return self._layers if ok else None
        block_elems = math.prod(kv.shape[2:])
        planes = kv.shape[0] if kv.dim() >= 3 else 0  # K and V (2), or one latent row (1): engine/kv_spec.py
        count = self.num_layers * planes * self.num_blocks * block_elems
        if planes not in (1, 2) or self.offset + count * kv.element_size() != self.size:
            return None
        self._layers = torch.frombuffer(self._mm, dtype=kv.dtype, count=count, offset=self.offset).view(
            self.num_layers, planes, self.num_blocks, *kv.shape[2:]
        )
        return self._layers

    def _plan(self, ticket: TransferTicket, first_block: int, n: int) -> tuple[int, list[tuple[int, int, int]]] | None:
        """(tag, runs) for blocks block_ids[first_block : first_block + n], None if they are not
        blocks of this cache; remembered for the ticket's next layer (every layer has the same)."""
        key = (ticket.transfer_id, ticket.auth_token, first_block, n)
        if self._last_plan is not None and self._last_plan[0] == key:
            return self._last_plan[1]
        ids = ticket.block_ids[first_block : first_block + n]
        if len(ids) != n or n == 0 or min(ids) < 0 or max(ids) >= self.num_blocks:
            return None
        plan = (fence_tag(ticket), block_runs(ids))
        self._last_plan = (key, plan)
        return plan

    def write(self, ticket: TransferTicket, layer: int, kv: torch.Tensor, first_block: int = 0) -> bool:
        """Copy `kv` (2, n, ...) into blocks block_ids[first_block : first_block + n] of `layer` if the
        fence still shows this ticket's tag on all of them; False (nothing written) otherwise."""
        if kv.dim() < 2 or not 0 <= layer < self.num_layers:
            return False
        with self._mutex:
            plan = self._plan(ticket, first_block, kv.shape[1])
            view = None if self._closed or plan is None else self._view(kv)
            if view is None:
                return False
            tag, runs = plan
            lock_block = ticket.block_ids[0]
            _lock(self._fd, fcntl.LOCK_SH, lock_block, LOCK_TIMEOUT_S)
            try:
                fence = self._fence_np
                if not all((fence[first : first + n] == tag).all() for _, first, n in runs):
                    return False
                copy_runs(view[layer], runs, kv)
            finally:
                _unlock(self._fd, lock_block)
        return True

    def close(self) -> None:
        with self._mutex:
            if self._closed:
                return
            self._closed = True
            self._layers = self._fence_np = None  # type: ignore[assignment]
            with contextlib.suppress(BufferError):  # a view outlived a write (never normally): unmapped later
                self._mm.close()
            os.close(self._fd)
