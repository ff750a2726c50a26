"""The integrity checksum every KV transfer backend puts on a layer's bytes: XXH3-64.

XXH3 hashes at memory speed (about 60 GB/s on one core here, against 4 GB/s for zlib's crc32), so
checking every byte on both sides no longer costs more than moving them. It detects corruption, it
is not a MAC: the transfer's auth token is what keeps strangers out.
"""

from __future__ import annotations

from typing import Any

import torch
import xxhash

NAME = "xxh3-64"


def checksum(*buffers: Any) -> int:
    """XXH3-64 of the concatenation of `buffers` (bytes-like objects, e.g. memoryviews)."""
    if len(buffers) == 1:
        return xxhash.xxh3_64_intdigest(buffers[0])
    h = xxhash.xxh3_64()
    for b in buffers:
        h.update(b)
    return h.intdigest()


def tensor_checksum(tensor: torch.Tensor) -> int:
    """Checksum of a tensor's C-contiguous bytes (copied to the CPU first when on a GPU)."""
    t = tensor.detach()
    if t.numel() == 0:
        return checksum(b"")
    t = t.cpu().contiguous().reshape(-1).view(torch.uint8)
    return checksum(t.numpy())
