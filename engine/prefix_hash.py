"""The prefix cache's block hash, shared by the engine and everyone who predicts its hits (the
router's prefix index, the planner's simulator). Pure Python, no torch.

Block i of a token sequence hashes as `h_i = blake2b(h_{i-1} || int64 token ids of block i)`, with
`h_{-1}` sixteen zero bytes: equal hashes mean equal leading blocks, whatever process computed them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def chain_hash(prev: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Stable (cross-process) hash of a full block given the hash of the block before it."""
    h = hashlib.blake2b(digest_size=16)
    h.update(prev or b"\0" * 16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int, num_blocks: int) -> list[bytes]:
    """Grow `hashes` (the chain hashes of `token_ids`' first blocks, kept by the caller) in place to
    its first `num_blocks` full blocks; returns it."""
    while len(hashes) < num_blocks:
        i = len(hashes)
        hashes.append(chain_hash(hashes[-1] if hashes else None, token_ids[i * block_size : (i + 1) * block_size]))
    return hashes


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The chain hashes of every full block of `token_ids`."""
    return extend_hashes([], token_ids, block_size, len(token_ids) // block_size)
