"""Copying K/V into a paged cache layer's blocks by runs of consecutive block ids (one slice copy
per run): what arrives from another worker, and what a tensor-parallel rank receives from rank 0."""

from __future__ import annotations

import torch


def block_runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(position in ids, first block id, count) of each run of consecutive block ids: a run is one
    slice copy (a plain memcpy), far cheaper than an index_copy_; fresh blocks come in a few runs."""
    runs, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            runs.append((start, ids[start], i - start))
            start = i
    return runs


def copy_runs(layer: torch.Tensor, runs: list[tuple[int, int, int]], kv: torch.Tensor) -> None:
    """Copy `kv` (2, n, ...) into the blocks `runs` (`block_runs` of its n block ids) of a
    (2, num_blocks, ...) cache layer."""
    for pos, first, n in runs:
        layer[:, first : first + n].copy_(kv[:, pos : pos + n])
