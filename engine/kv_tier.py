"""The KV offload tier: a node's pool of KV blocks evicted from its engines' prefix caches, shared by
the engines of one cluster on that node, so that a block one of them evicted comes back (to it or to
a neighbour) instead of being computed again.

A tier is a directory (on /dev/shm by default: host memory; any path: a disk pool) holding one file
per block, named by the engine layout's key and the block's chain hash (engine/prefix_hash.py):

    <layout key: 16 hex>-<block hash: 32 hex>.kv
        header  magic | layout digest | block hash | parent's hash | token count | the block's token ids
        body    the block's bytes of every layer and plane, in the cache's own dtype (quantized pages
                stay quantized)

Writes go to a temporary file renamed into place, so a reader sees a whole block or none; a reader
checks the header against the hash, parent and tokens it wants before it trusts the body, so a
stale or foreign file is a miss, never wrong KV. Removing a file another engine is reading is safe
(its open descriptor keeps the bytes).

Size and order: `capacity_bytes` over the whole directory, least recently used out first (a load
touches the file's time). Each engine keeps its own view of the directory, merged with a rescan
at most every `rescan_s`, so the directory can exceed the size by what its neighbours wrote since
their last rescan.

Lifetime: every engine using the directory holds a file in `users/` (named by its process id); the
last to close removes the directory. Directories of tiers whose users all died (killed workers)
are removed by the next tier opened beside them, so a crashed cluster leaks nothing past the next
start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import secrets
import shutil
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.cache_events import CacheChanges, CacheEvents

if TYPE_CHECKING:  # torch and numpy are imported where blocks are read and written: the launcher names tiers without them
    import numpy as np
    import torch

    from engine.config import EngineConfig

MAGIC = b"PDKVT01\0"
_HEADER = struct.Struct("<8s16s16s16sI4x")  # magic, layout digest, hash, parent hash, token count
DIR_PREFIX = "pdkv-tier-"
STALE_AFTER_S = 60.0  # a sibling tier younger than this may still be starting: never swept
IOV_MAX = 512


@dataclass
class TierStats:
    capacity_bytes: int
    used_bytes: int  # this engine's view of the directory
    blocks: int
    saves: int = 0  # blocks this engine wrote
    hits: int = 0  # blocks this engine loaded
    misses: int = 0  # lookups of blocks the tier did not hold (or held for another context)
    evictions: int = 0  # blocks this engine removed to make room
    failures: int = 0  # writes that failed (a full disk): the block is only dropped


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _live_users(path: Path) -> list[int]:
    users = path / "users"
    pids = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(users):
            pid = entry.name.split("-", 1)[0]
            if pid.isdigit() and _alive(int(pid)):
                pids.append(int(pid))
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
    return pids


def sweep_dead_tiers(parent: Path, keep: Path | None = None) -> list[Path]:
    """Remove tier directories under `parent` whose users have all exited (older than a minute).
    Returns those removed."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(parent):
            path = Path(entry.path)
            if not entry.name.startswith(DIR_PREFIX) or not entry.is_dir(follow_symlinks=False) or path == keep:
                continue
            with contextlib.suppress(FileNotFoundError):
                if time.time() - entry.stat(follow_symlinks=False).st_mtime < STALE_AFTER_S:
                    continue
            if not _live_users(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


class KVTier:
    """One engine's handle on a node's tier directory, for blocks of one layout."""

    def __init__(self, path: str | os.PathLike, layout: str, capacity_bytes: int, rescan_s: float = 1.0) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"the KV offload tier needs a size > 0, got {capacity_bytes} bytes")
        self.path = Path(path)
        if not self.path.name.startswith(DIR_PREFIX):
            raise ValueError(f"a KV offload tier directory's name starts with {DIR_PREFIX!r}, got {str(self.path)!r}")
        self.capacity_bytes = capacity_bytes
        self.layout_digest = hashlib.blake2b(layout.encode(), digest_size=16).digest()
        self._prefix = self.layout_digest[:8].hex() + "-"
        self.tier_id = f"{socket.gethostname()}:{self.path}:{self._prefix[:-1]}"
        self.rescan_s = rescan_s
        self._user = self.path / "users" / f"{os.getpid()}-{secrets.token_hex(4)}"  # one per engine, even in one process
        try:
            (self.path / "users").mkdir(parents=True, exist_ok=True)
            self._user.touch()
        except OSError as e:
            raise ValueError(f"cannot use {self.path} for the KV offload tier: {e.strerror}") from None
        sweep_dead_tiers(self.path.parent, keep=self.path)
        self._lock = threading.Lock()  # the engine thread saves and loads; gRPC threads read stats
        self._files: OrderedDict[str, int] = OrderedDict()  # name -> bytes, least recently used first
        self._used = 0
        self._last_scan = 0.0
        self._block_bytes = 0  # a block file's size for this layout, once known
        self.events = CacheEvents()  # blocks this engine saved and evicted, for the router's index
        self.stats = TierStats(capacity_bytes, 0, 0)
        self._closed = False
        self._rescan(force=True)

    # ------------------------------------------------------------------ names and the directory
    def _name(self, h: bytes) -> str:
        return f"{self._prefix}{h.hex()}.kv"

    def _rescan(self, force: bool = False) -> None:
        """Merge what the neighbours wrote and removed into this view (caller holds the lock): names
        only (no stat per file: the directory holds thousands); a block new to this view counts as
        just used and, for this layout, as big as this engine's blocks."""
        now = time.monotonic()
        if not force and now - self._last_scan < self.rescan_s:
            return
        self._last_scan = now
        names = set()
        with contextlib.suppress(FileNotFoundError):
            names = {e.name for e in os.scandir(self.path) if e.name.endswith(".kv")}
        for name in [n for n in self._files if n not in names]:
            self._used -= self._files.pop(name)
        for name in names.difference(self._files):
            size = self._block_bytes if name.startswith(self._prefix) and self._block_bytes else self._size_of(name)
            if size:
                self._files[name] = size
                self._used += size
        self._make_room(0)

    def _size_of(self, name: str) -> int:
        try:
            return os.stat(self.path / name, follow_symlinks=False).st_size
        except FileNotFoundError:
            return 0

    def _make_room(self, need: int) -> None:
        while self._files and self._used + need > self.capacity_bytes:
            name, size = self._files.popitem(last=False)
            self._used -= size
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path / name)
            self.stats.evictions += 1
            if name.startswith(self._prefix):
                self.events.removed(bytes.fromhex(name[len(self._prefix):-3]))

    def holds(self, h: bytes) -> bool:
        """Whether the tier has a block of this hash for this layout (a file check: cheap)."""
        return os.path.exists(self.path / self._name(h))

    def lookup(self, h: bytes) -> bool:
        """`holds`, for the engine's lookups: a block it lacks counts as a miss (a held one counts
        when it is loaded, as a hit or, if it turns out stale, a miss)."""
        if self.holds(h):
            return True
        with self._lock:
            self.stats.misses += 1
        return False

    # ------------------------------------------------------------------ blocks
    def save(self, h: bytes, parent: bytes | None, token_ids: tuple[int, ...], parts: list[np.ndarray]) -> bool:
        """Write a block (its bytes: `parts`, contiguous uint8 arrays, every layer's K and V in
        order) unless the tier holds it already (then only mark it used). False: not written (no
        room, an error)."""
        name = self._name(h)
        path = self.path / name
        with self._lock:
            if self._closed:
                return False
            if os.path.exists(path):
                with contextlib.suppress(FileNotFoundError):
                    os.utime(path)
                if name in self._files:
                    self._files.move_to_end(name)
                return True
            header = _HEADER.pack(MAGIC, self.layout_digest, h, parent or bytes(16), len(token_ids))
            tokens = struct.pack(f"<{len(token_ids)}q", *token_ids)
            size = len(header) + len(tokens) + sum(b.nbytes for b in parts)
            self._block_bytes = size
        return self._write(h, [memoryview(header), memoryview(tokens), *(memoryview(b) for b in parts)], size)

    def _write(self, h: bytes, views: list[memoryview], size: int) -> bool:
        """Write a block's file beside its name and rename it into place, room made first."""
        name = self._name(h)
        with self._lock:
            if self._closed or size > self.capacity_bytes:
                return False
            if name in self._files and os.path.exists(self.path / name):
                return True
            self._rescan()
            self._make_room(size)
            tmp = self.path / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                try:
                    _write_all(fd, views)
                finally:
                    os.close(fd)
                os.replace(tmp, self.path / name)
            except OSError:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                self.stats.failures += 1
                return False
            self._files[name] = size
            self._used += size
            self.stats.saves += 1
            self.events.stored(h)
            return True

    def load(self, h: bytes, parent: bytes | None, token_ids: tuple[int, ...], parts: list[np.ndarray]) -> bool:
        """Read a block into `parts` (writable uint8 arrays: a fresh block's bytes) if the tier holds
        it for exactly this context: same layout, parent hash and tokens. False: a miss, and `parts`
        hold nothing meaningful (the caller computes the block)."""
        name = self._name(h)
        with self._lock:
            if self._closed:
                return False
            ok = self._read(self.path / name, h, parent, token_ids, parts)
            if ok:
                self.stats.hits += 1
                if name in self._files:
                    self._files.move_to_end(name)
            else:
                self.stats.misses += 1
            return ok

    def _read(self, path: Path, h: bytes, parent: bytes | None, token_ids: tuple[int, ...],
              parts: list[np.ndarray]) -> bool:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            head = os.read(fd, _HEADER.size)
            if len(head) != _HEADER.size:
                return False
            magic, layout, fh, fparent, n = _HEADER.unpack(head)
            want = struct.pack(f"<{len(token_ids)}q", *token_ids)
            if (magic, layout, fh, fparent, n) != (MAGIC, self.layout_digest, h, parent or bytes(16), len(token_ids)):
                return False
            body = sum(b.nbytes for b in parts)
            if os.fstat(fd).st_size != _HEADER.size + len(want) + body or os.read(fd, len(want)) != want:
                return False
            if not _read_all(fd, [memoryview(b) for b in parts]):
                return False
            with contextlib.suppress(FileNotFoundError):
                os.utime(fd)
            return True
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ between nodes
    def read_file(self, h: bytes) -> bytes | None:
        """A block's file as this tier holds it (header and body), for a worker of another node;
        None if it is not here."""
        if len(h) != 16:
            return None
        try:
            with open(self.path / self._name(h), "rb") as f:
                data = f.read()
        except OSError:
            return None
        return data if data[: len(MAGIC)] == MAGIC and data[8:24] == self.layout_digest else None

    def put_file(self, h: bytes, data: bytes) -> bool:
        """Store a block another node's tier sent (`read_file`'s bytes) as if this engine had saved
        it; a load checks it like any other. False: not stored (not a block of this layout, no room)."""
        if len(h) != 16 or len(data) < _HEADER.size:
            return False
        magic, layout, fh, _, _ = _HEADER.unpack(data[: _HEADER.size])
        if (magic, layout, fh) != (MAGIC, self.layout_digest, h):
            return False
        return self._write(h, [memoryview(data)], len(data))

    # ------------------------------------------------------------------ what the router and status read
    def changes(self, cursor: int) -> CacheChanges:
        """Hashes this engine saved and evicted since `cursor`; a reader that is new (0) or fell
        behind gets every block the directory holds for this layout (written by any engine)."""
        got = self.events.since(cursor)
        if not got.snapshot:
            return got
        with self._lock:
            self._rescan(force=True)
            held = [bytes.fromhex(n[len(self._prefix):-3]) for n in self._files if n.startswith(self._prefix)]
        return CacheChanges(got.cursor, True, held)

    def snapshot_stats(self) -> TierStats:
        """This engine's counters, and the directory's size as last rescanned (at most `rescan_s` ago)."""
        with self._lock:
            if not self._closed:
                self._rescan()
            return dataclasses.replace(self.stats, used_bytes=self._used, blocks=len(self._files))

    def close(self) -> None:
        """Leave the tier; the last engine to leave removes its directory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._user)
        if not _live_users(self.path):
            shutil.rmtree(self.path, ignore_errors=True)


def _write_all(fd: int, views: list[memoryview]) -> None:
    for i in range(0, len(views), IOV_MAX):
        chunk = views[i : i + IOV_MAX]
        while chunk:
            chunk = _advance(chunk, os.writev(fd, chunk))


def _read_all(fd: int, views: list[memoryview]) -> bool:
    for i in range(0, len(views), IOV_MAX):
        chunk = [v.cast("B") for v in views[i : i + IOV_MAX]]
        while chunk:
            done = os.readv(fd, chunk)
            if done == 0:
                return False
            chunk = _advance(chunk, done)
    return True


def _advance(chunk: list[memoryview], done: int) -> list[memoryview]:
    """What is left of a writev/readv's buffers after `done` bytes."""
    while chunk and done >= chunk[0].nbytes:
        done -= chunk[0].nbytes
        chunk = chunk[1:]
    if chunk and done:
        chunk = [chunk[0][done:], *chunk[1:]]
    return chunk


DEFAULT_PARENT = "/dev/shm"


def new_tier_path(parent: str = DEFAULT_PARENT) -> str:
    """A fresh tier directory's path (for the engines of one process to share)."""
    return os.path.join(parent, f"{DIR_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")


def open_tier(cfg: EngineConfig, layout: str) -> KVTier:
    """The tier an engine config names: its shared directory, or one of this engine's own."""
    return KVTier(cfg.kv_offload_path or new_tier_path(), layout, cfg.kv_offload_bytes)


class TierLink:
    """The block manager's side of a tier: block ids into bytes of the engine's cache.

    `caches` gives the engine's current per-layer caches (a decode worker may swap them for shared
    memory after start), each (planes, num_blocks, ...) and contiguous. On the CPU a block's bytes are
    numpy views of the caches, made once per set of caches (a torch op per plane costs more than the
    copy: 13 us against 5), written and read in place; elsewhere (CUDA) they pass through a host
    buffer, one copy per layer."""

    def __init__(self, tier: KVTier, caches: Callable[[], list[torch.Tensor]]) -> None:
        self.tier = tier
        self._caches = caches
        self._seen: list[torch.Tensor] | None = None
        self._bytes: list[np.ndarray] = []  # per layer: (planes, num_blocks, block bytes) on the CPU
        self._host: list[torch.Tensor] = []  # per layer: one block's planes on the host (CUDA)

    def _views(self) -> list[np.ndarray]:
        import torch

        caches = self._caches()
        if caches is not self._seen:
            self._seen = caches
            if all(c.device.type == "cpu" for c in caches):
                self._bytes = [c.view(torch.uint8).reshape(c.shape[0], c.shape[1], -1).numpy() for c in caches]
                self._host = []
            else:
                self._host = [torch.empty((c.shape[0], *c.shape[2:]), dtype=c.dtype) for c in caches]
                self._bytes = [h.view(torch.uint8).reshape(h.shape[0], 1, -1).numpy() for h in self._host]
        return self._bytes

    def _parts(self, block_id: int) -> list[np.ndarray]:
        views = self._views()  # first: it decides whether blocks pass through the host buffer
        b = 0 if self._host else block_id
        return [layer[p, b] for layer in views for p in range(layer.shape[0])]

    def holds(self, h: bytes) -> bool:
        return self.tier.lookup(h)

    def save(self, block_id: int, h: bytes, parent: bytes | None, token_ids: tuple[int, ...]) -> bool:
        parts = self._parts(block_id)
        for host, cache in zip(self._host, self._seen or []):
            host.copy_(cache[:, block_id])
        return self.tier.save(h, parent, token_ids, parts)

    def load(self, block_id: int, h: bytes, parent: bytes | None, token_ids: tuple[int, ...]) -> bool:
        if not self.tier.load(h, parent, token_ids, self._parts(block_id)):
            return False
        for host, cache in zip(self._host, self._seen or []):
            cache[:, block_id].copy_(host)
        return True
