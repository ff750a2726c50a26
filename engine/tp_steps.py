"""Lockstep: what rank 0 of a tensor-parallel worker sends the other ranks, and their loop.

Rank 0 owns the scheduler and the block manager. Before each forward pass it sends the step's
batch (per sequence: tokens computed before, the new tokens, the block table), and before a fork's
KV copy the block pairs; every rank then runs the same operation on its shard and its KV cache, so
block ids mean the same on every rank. The others never sample (rank 0 runs the LM head).

KV that leaves or enters a tensor-parallel worker takes one of two paths (docs/tensor_parallel.md):
- direct: each rank sends or receives its own heads. The worker gives its ranks a `RankKV` (a KV
  sender or receiver of their own, started in each rank's process); a prefill step then carries its
  transfers (a payload frame), every rank sends its heads of them after each layer and commits its
  parts, and the ranks sum their failure flags (one all-reduce) before rank 0 commits. A decode
  worker's rank 0 asks its ranks (CALL) to expect a transfer, to settle it (its parts came?), to forget it.
- the fallback through rank 0: a prefill step names blocks whose slices are gathered on rank 0
  after each layer (rank 0 sends every KV head); a decode worker's rank 0 writes its heads of a
  received layer and sends each other rank its heads' slice (KV messages, ahead of any step).

Messages (int64 arrays on the control channel, engine/tp_group.py):
    [INIT, num_blocks]            rank 0 -> others, once: size the KV cache alike
    [READY, *info]                others -> rank 0, once: shard loaded, cache allocated (info: RankKV.start's)
    [STEP, n, (computed, new, table_len, *table, *new token ids) x n, g, *blocks to gather per layer, p]
                                  p = 1: a payload frame follows, the step's direct transfers (RankKV.parts)
    [COPY, n, *sources, *destinations]
    [KV, layer, n, head, heads, *blocks] + a payload frame: K/V of the rank's heads [head, head + heads)
                                  (its own indices) of those blocks
    [CALL] + a JSON payload       rank 0 -> a rank's RankKV.call, answered [REPLY] + a JSON payload
    [STOP]                        or the channel's end: the follower exits
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from engine.tp_group import Channel, TPError, bytes_tensor

log = logging.getLogger("pdcluster.engine")
INIT, READY, STEP, COPY, STOP, KV, CALL, REPLY = 1, 2, 3, 4, 5, 6, 7, 8


class RankSend(Protocol):
    """One rank's share of a step's direct KV sends (kv_transfer/parts.py `PartSend`)."""

    payload: bytes  # what the other ranks build their share from

    def send(self, layer: int, cache: torch.Tensor) -> None:
        """After `layer` ran: send this rank's heads (`cache`: its cache layer)."""
        ...

    def finish(self) -> list[int]:
        """After the pass: commit; per transfer 1 if this rank's part of it failed."""
        ...

    def fail(self, flags: list[int]) -> None:
        """Every rank's flags, summed."""
        ...


class RankKV(Protocol):
    """What a worker gives each of its other ranks for the direct KV path (picklable: it travels to
    the rank's process). prefill_worker/rank_kv.py and decode_worker/rank_kv.py implement it."""

    def start(self, runner: Any) -> list[int]:
        """In the rank's process once its KV cache exists; what rank 0 learns (READY's info)."""
        ...

    def parts(self, payload: bytes, runner: Any) -> RankSend: ...

    def call(self, request: dict) -> dict: ...

    def close(self) -> None: ...


@dataclass
class TPContext:
    """What a ModelRunner needs to be one rank of a tensor-parallel worker."""

    layout: Any  # engine.tp_layout.TPLayout
    group: Any  # engine.tp_group.TPGroup
    leader: Any = None  # rank 0: engine.tp_group.Leader (its channels to the others); None on the others
    join_timeout_s: float = 300.0
    rank_info: list[list[int]] = field(default_factory=list)  # rank 0: each other rank's READY info

    def call(self, request: dict) -> list[dict]:
        """Rank 0: each other rank's RankKV.call(request), in rank order."""
        payload = json.dumps(request).encode()
        return [json.loads(ch.call(torch.tensor([CALL]), payload)[1]) for ch in self.leader.channels]

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

    def scatter_heads(self, layer: int, blocks: list[int], kv: torch.Tensor, first_head: int = 0,
                      ) -> tuple[int, torch.Tensor] | None:
        """Rank 0: send each other rank its heads of `kv` (the model's KV heads [first_head,
        first_head + kv.shape[3])) for `blocks` of `layer`; returns rank 0's own (offset in its
        heads, K/V), or None when it holds none of them."""
        own = None
        for r in range(self.layout.size):
            other = self.layout.of_rank(r)
            lo = max(other.first_kv_head, first_head)
            hi = min(other.first_kv_head + other.kv_heads, first_head + kv.shape[3])
            if lo >= hi:
                continue
            piece = kv[:, :, :, lo - first_head:hi - first_head]
            if r == 0:
                own = (lo - other.first_kv_head, piece)
            else:
                self.leader.channels[r - 1].send(
                    torch.tensor([KV, layer, len(blocks), lo - other.first_kv_head, hi - lo, *blocks]), piece)
        return own


def encode_step(batch: list[Any], gather: list[int], parts: bool = False) -> torch.Tensor:
    """A batch of ScheduledSeq, the blocks whose K/V are gathered after each layer, and whether a
    payload of direct transfers follows -> the STEP message."""
    out = [STEP, len(batch)]
    for item in batch:
        seq, start = item.seq, item.seq.num_computed_tokens
        out += [start, item.num_tokens, len(seq.block_table), *seq.block_table,
                *seq.token_ids[start:start + item.num_tokens]]
    return torch.tensor(out + [len(gather), *gather, int(parts)], dtype=torch.int64)


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
    """The STEP message -> ScheduledSeq items over shadow sequences, and the blocks to gather
    (whether a payload follows is its last value)."""
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


def step_hook(runner: Any, gather: list[int], parts: RankSend | None,
              send: Callable[[int, torch.Tensor], None] | None = None) -> Callable[[int], None] | None:
    """What every rank does after each layer of a step: its slices of `gather` to rank 0 (`send`
    gets them there), and its own heads of the direct transfers."""
    if not gather and parts is None:
        return None

    def hook(layer: int) -> None:
        if gather:
            kv = runner.layer_kv(layer, gather)
            if send is not None:
                send(layer, kv)
        if parts is not None:
            parts.send(layer, runner.kv_caches[layer])

    return hook


def settle_parts(group: Any, parts: RankSend, device: torch.device) -> None:
    """After a step's pass, on every rank: commit this rank's parts, then sum the failure flags (on
    the ranks' device: NCCL takes no host tensors)."""
    flags = torch.tensor(parts.finish(), dtype=torch.int64, device=device)
    if group is not None and flags.numel():
        group.all_reduce(flags)
    parts.fail(flags.tolist())


def _answer(channel: Channel, rank_kv: RankKV | None) -> None:
    request = json.loads(channel.recv_bytes() or b"{}")
    try:
        reply = rank_kv.call(request) if rank_kv is not None else {"error": "this rank has no KV endpoint"}
    except Exception as e:  # noqa: BLE001 (the answer says why; rank 0 decides)
        reply = {"error": repr(e)}
    channel.send(torch.tensor([REPLY]), bytes_tensor(json.dumps(reply).encode()))


def _read(runner: Any, channel: Channel, rank_kv: RankKV | None, inbox: queue.Queue) -> None:
    """A follower's channel reader: answers CALLs at once (a step in progress does not delay rank 0's
    reservations and commits) and queues everything else, with its payload, in order; None: the end."""
    try:
        while True:
            msg = channel.recv()
            if msg is None or int(msg[0]) == STOP:
                break
            op = int(msg[0])
            if op == CALL:
                _answer(channel, rank_kv)
                continue
            payload: Any = None
            if op == STEP and int(msg[-1]):
                payload = channel.recv_bytes() or b"[]"
            elif op == KV:
                cache = runner.kv_caches[int(msg[1])]
                payload = channel.recv_payload(cache.dtype, (2, int(msg[2]), cache.shape[2], int(msg[4]),
                                                             *cache.shape[4:]))
            inbox.put((op, msg, payload))
    except BaseException as e:  # noqa: BLE001 (the loop raises it)
        inbox.put(e)
        return
    inbox.put(None)


def follow_steps(runner: Any, channel: Channel, rank_kv: RankKV | None = None) -> None:
    """Another rank's loop: run what rank 0 sends until STOP or the channel's end."""
    inbox: queue.Queue = queue.Queue(maxsize=256)  # bounded: rank 0's KV sends wait when this rank lags
    threading.Thread(target=_read, args=(runner, channel, rank_kv, inbox), name="tp-channel", daemon=True).start()
    while True:
        item = inbox.get()
        if item is None:
            return
        if isinstance(item, BaseException):
            raise item
        op, msg, payload = item
        if op == STEP:
            batch, gather = decode_step(msg)
            # (rank 0 sends transfers in parts only when its ranks were given a RankKV)
            parts = rank_kv.parts(payload, runner) if payload is not None else None
            runner.forward(batch, step_hook(runner, gather, parts))
            if parts is not None:
                settle_parts(runner.tp.group, parts, runner.device)
        elif op == COPY:
            runner.copy_local(decode_copy(msg))
        elif op == KV:
            runner.write_local(int(msg[1]), msg[5:5 + int(msg[2])].tolist(), payload, int(msg[3]))
        else:
            raise TPError(f"unexpected tensor-parallel message {op}")
