"""Lockstep: what rank 0 of a tensor-parallel worker sends the other ranks, and their loop.

Rank 0 owns the scheduler and the block manager. Before each forward pass it sends the step's
batch (per sequence: tokens computed before, the new tokens, the block table), and before a fork's
KV copy the block pairs; every rank then runs the same operation on its shard and its KV cache, so
block ids mean the same on every rank. The others never sample (rank 0 runs the LM head).

KV that leaves or enters a tensor-parallel worker goes through rank 0 (the fallback path through
one rank, the only one built so far): a prefill worker's step names the blocks it sends, and after
each layer every rank's slice of them is gathered on rank 0, which sends the whole layer (all KV
heads: the wire format of one rank); a decode worker's rank 0 writes its heads of a received layer
and sends each other rank its heads' slice (KV messages, ahead of any step that reads them).

Messages (int64 arrays on the control channel, engine/tp_group.py):
    [INIT, num_blocks]            rank 0 -> others, once: size the KV cache alike
    [READY]                       others -> rank 0, once: shard loaded, cache allocated
    [STEP, n, (computed, new, table_len, *table, *new token ids) x n, g, *blocks to gather per layer]
    [COPY, n, *sources, *destinations]
    [KV, layer, n, *blocks] + a payload frame: the rank's heads of those blocks' K/V
    [STOP]                        or the channel's end: the follower exits
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from engine.tp_group import Channel, TPError

log = logging.getLogger("pdcluster.engine")
INIT, READY, STEP, COPY, STOP, KV = 1, 2, 3, 4, 5, 6


@dataclass
class TPContext:
    """What a ModelRunner needs to be one rank of a tensor-parallel worker."""

    layout: Any  # engine.tp_layout.TPLayout
    group: Any  # engine.tp_group.TPGroup
    leader: Any = None  # rank 0: engine.tp_group.Leader (its channels to the others); None on the others
    join_timeout_s: float = 300.0

    @property
    def is_leader(self) -> bool:
        return self.layout.rank == 0

    def gather_heads(self, local: torch.Tensor) -> torch.Tensor | None:
        """Every rank calls it with its slice (2, blocks, block_size, its KV heads, head_dim) of the
        same blocks: rank 0 gets them with all the model's KV heads, the others None."""
        parts = self.group.gather(local)
        if parts is None:
            return None
        return torch.cat([parts[r] for r, _ in self.layout.assembly()], dim=3)

    def heads_of(self, rank: int, full: torch.Tensor) -> torch.Tensor:
        """Rank `rank`'s KV heads of K/V with all of them (dim 3)."""
        other = self.layout.of_rank(rank)
        return full[:, :, :, other.first_kv_head:other.first_kv_head + other.kv_heads]

    def scatter_heads(self, layer: int, blocks: list[int], full: torch.Tensor) -> torch.Tensor:
        """Rank 0: send each other rank its heads of `full` for `blocks` of `layer`; returns its own."""
        for r, ch in enumerate(self.leader.channels, 1):
            ch.send(torch.tensor([KV, layer, len(blocks), *blocks]), self.heads_of(r, full))
        return self.heads_of(0, full)


def encode_step(batch: list[Any], gather: list[int]) -> torch.Tensor:
    """A batch of ScheduledSeq and the blocks whose K/V are gathered after each layer -> the STEP message."""
    out = [STEP, len(batch)]
    for item in batch:
        seq, start = item.seq, item.seq.num_computed_tokens
        out += [start, item.num_tokens, len(seq.block_table), *seq.block_table,
                *seq.token_ids[start:start + item.num_tokens]]
    return torch.tensor(out + [len(gather), *gather], dtype=torch.int64)


def encode_copy(pairs: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor([COPY, len(pairs), *(s for s, _ in pairs), *(d for _, d in pairs)], dtype=torch.int64)


class _Tokens:
    """A shadow sequence's token ids: only the step's new ones are known (and asked for)."""

    def __init__(self, start: int, new: list[int]) -> None:
        self.start, self.new = start, new

    def __len__(self) -> int:
        return self.start + len(self.new)

    def __getitem__(self, s: slice) -> list[int]:
        assert s.start == self.start, "a follower is asked only for the step's new tokens"
        return self.new[: (s.stop - self.start) if s.stop is not None else None]


@dataclass
class _Shadow:
    """Enough of a Sequence for ModelRunner._prepare on a rank that does not schedule."""

    token_ids: Any
    block_table: list[int]
    num_computed_tokens: int


def decode_step(msg: torch.Tensor) -> tuple[list[Any], list[int]]:
    """The STEP message -> ScheduledSeq items over shadow sequences, and the blocks to gather."""
    from engine.model_runner import ScheduledSeq

    values = msg.tolist()
    n, i, batch = values[1], 2, []
    for _ in range(n):
        start, new, tl = values[i:i + 3]
        i += 3
        table = values[i:i + tl]
        i += tl
        tokens = values[i:i + new]
        i += new
        batch.append(ScheduledSeq(_Shadow(_Tokens(start, tokens), table, start), new))
    return batch, values[i + 1:i + 1 + values[i]]


def decode_copy(msg: torch.Tensor) -> list[tuple[int, int]]:
    n = int(msg[1])
    values = msg[2:].tolist()
    return list(zip(values[:n], values[n:]))


def follow_steps(runner: Any, channel: Channel) -> None:
    """Another rank's loop: run what rank 0 sends until STOP or the channel's end."""
    while True:
        msg = channel.recv()
        if msg is None or int(msg[0]) == STOP:
            return
        op = int(msg[0])
        if op == STEP:
            batch, gather = decode_step(msg)
            runner.forward(batch, (lambda layer: runner.layer_kv(layer, gather)) if gather else None)
        elif op == COPY:
            runner.copy_local(decode_copy(msg))
        elif op == KV:
            layer, n = int(msg[1]), int(msg[2])
            blocks = msg[3:3 + n].tolist()
            cache = runner.kv_caches[layer]
            runner.write_local(layer, blocks, channel.recv_payload(cache.dtype, (2, n, *cache.shape[2:])))
        else:
            raise TPError(f"unexpected tensor-parallel message {op}")
