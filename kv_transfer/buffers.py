"""Reusable byte buffers for the tcp plane: a fresh large allocation page-faults every 4 KiB on first
touch, a pooled one lands in pages already there. Sizes are powers of two from `MIN_BYTES`; at most
`keep_bytes` of free buffers are kept."""

from __future__ import annotations

import threading

import torch

MIN_BYTES = 64 << 10


def size_class(nbytes: int) -> int:
    """The buffer size that serves `nbytes`: the next power of two, at least MIN_BYTES."""
    return max(MIN_BYTES, 1 << max(0, nbytes - 1).bit_length())


class BufferPool:
    """Thread-safe pool of 1-D uint8 CPU tensors. `take(n)` returns a buffer of at least n bytes
    (reused when one of its size is free); `give(buf)` returns it once nothing reads it any more."""

    def __init__(self, keep_bytes: int = 1 << 30) -> None:
        self.keep_bytes = keep_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._free_bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        size = size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                self._free_bytes -= size
                return free.pop()
        return torch.empty(size, dtype=torch.uint8)

    def give(self, buf: torch.Tensor) -> None:
        size = buf.numel()
        with self._lock:
            if self._free_bytes + size <= self.keep_bytes:
                self._free.setdefault(size, []).append(buf)
                self._free_bytes += size

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._free_bytes = 0
