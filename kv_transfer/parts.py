"""KV between tensor-parallel workers, the direct path: each rank of the decode worker receives its
KV heads of every layer straight from the rank of the prefill worker that holds them.

A prefill worker of degree a sends to a decode worker of degree b (either may be 1; the ticket's
`rank_endpoints` names b > 1 receivers). `plan(K, a, b)` lists the parts: for each receiving rank, its
heads grouped by the sending rank they come from (of the ranks holding a replicated head, the
receiving ranks take turns). A part is
a transfer of its own, "<id>@<decode rank>:<first head>+<heads>" with the transfer's blocks and auth token, from
the sending rank's KV sender to the receiving rank's receiver, and it commits alone; the transfer
then commits from rank 0 with no layers, and the decode worker takes it only once parts cover every
KV head on every rank (kv_transfer/base.py). `PartSend` is one sending rank's share of one step.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import time
from dataclasses import dataclass

import torch

from engine.tp_layout import kv_head_range
from kv_transfer.base import KVSender, TransferTicket

log = logging.getLogger("pdcluster.kv")
# a step's parts commit together within this (under the tensor-parallel group's 60 s timeout, which
# bounds the flags' all-reduce the other ranks wait in)
PART_DEADLINE_S = 40.0
_POOL = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="kv-parts")


@dataclass(frozen=True)
class Part:
    src: int  # the sending rank
    dst: int  # the receiving rank
    first_head: int  # the model's index of its first KV head
    num_heads: int


def plan(num_kv_heads: int, src_size: int, dst_size: int) -> list[Part]:
    """The parts that move every KV head from `src_size` ranks to `dst_size` ranks (ValueError when a
    degree cannot split the KV heads). A head several sending ranks hold (replicated) comes to
    receiving rank r from the (r mod holders)-th of them, so the replicas share the sending."""
    holders: dict[int, list[int]] = {}
    for s in range(src_size):
        first, n = kv_head_range(num_kv_heads, src_size, s)
        for h in range(first, first + n):
            holders.setdefault(h, []).append(s)
    parts: list[Part] = []
    for r in range(dst_size):
        first, n = kv_head_range(num_kv_heads, dst_size, r)
        for h in range(first, first + n):
            src = holders[h][r % len(holders[h])]
            last = parts[-1] if parts else None
            if last is not None and last.dst == r and last.src == src and last.first_head + last.num_heads == h:
                parts[-1] = dataclasses.replace(last, num_heads=last.num_heads + 1)
            else:
                parts.append(Part(src, r, h, 1))
    return parts


def receivers(ticket: TransferTicket) -> list[str]:
    """The KV endpoint of each decode rank."""
    return list(ticket.rank_endpoints) or [ticket.kv_endpoint]


@dataclass
class PartItem:
    """One transfer of a step: its ticket, and the blocks of the sending engine holding its KV."""

    ticket: TransferTicket
    blocks: list[int]


def encode_items(items: list[PartItem]) -> bytes:
    """The step's transfers for the other sending ranks (JSON on the tensor-parallel control channel)."""
    return json.dumps([{"ticket": dataclasses.asdict(i.ticket), "blocks": i.blocks} for i in items]).encode()


def decode_items(payload: bytes) -> list[PartItem]:
    return [PartItem(TransferTicket(**d["ticket"]), list(d["blocks"])) for d in json.loads(payload)]


class PartSend:
    """One sending rank's parts of a step's transfers: `send(layer, cache)` after each layer sends
    this rank's heads of each transfer's blocks to the ranks that take them; `finish()` commits the
    parts and returns per transfer 1 if any of its parts failed (else 0); `fail(flags)` takes every
    rank's flags summed (rank 0: which transfers to abort)."""

    def __init__(self, sender: KVSender, rank: int, size: int, num_kv_heads: int, items: list[PartItem],
                 deadline_s: float = PART_DEADLINE_S) -> None:
        self.sender = sender
        self.deadline_s = deadline_s
        self.items = items
        self.payload = encode_items(items)
        own_first, _ = kv_head_range(num_kv_heads, size, rank)
        self.parts: list[list[tuple[TransferTicket, int]]] = []  # per item: (part ticket, head offset here)
        for item in items:
            ends = receivers(item.ticket)
            self.parts.append([(item.ticket.part(p.dst, p.first_head, p.num_heads, ends[p.dst]), p.first_head - own_first)
                               for p in plan(num_kv_heads, size, len(ends)) if p.src == rank])
        self.index = [torch.tensor(item.blocks, dtype=torch.long) for item in items]  # made once, not per layer
        self.errors: list[str | None] = [None] * len(items)
        self.finish_ms = 0.0  # committing the parts (the transfer not hidden behind the pass)

    def send(self, layer: int, cache: torch.Tensor) -> None:
        """`cache`: this rank's cache layer (2, num_blocks, block_size, its KV heads, head_dim)."""
        for i in range(len(self.items)):
            if self.errors[i] is not None or not self.parts[i]:
                continue
            if self.index[i].device != cache.device:
                self.index[i] = self.index[i].to(cache.device)
            index = self.index[i]
            try:
                for ticket, offset in self.parts[i]:  # one copy each: those blocks' heads of the part
                    kv = cache[:, index, :, offset:offset + ticket.num_heads]
                    self.sender.send_layer(ticket, layer, kv.contiguous())
            except Exception as e:  # noqa: BLE001 (one failed transfer must not fail the batch)
                self.errors[i] = f"KV part failed at layer {layer}: {e}"

    def finish(self) -> list[int]:
        """Commit every part at once (a failed one is aborted, in the background), waiting at most
        `deadline_s`: the other ranks wait in the flags' all-reduce, whose timeout is the group's."""
        t0 = time.monotonic()
        jobs = {}
        for i in range(len(self.items)):
            for ticket, _ in self.parts[i]:
                if self.errors[i] is None:
                    jobs[_POOL.submit(self.sender.commit, ticket, 0, None)] = (i, ticket)
                else:  # its streams and staged bytes released; the transfer's abort tells the receivers
                    _POOL.submit(self._abort_quietly, ticket, self.errors[i])
        done, late = concurrent.futures.wait(jobs, timeout=self.deadline_s)
        for future in done:
            i, ticket = jobs[future]
            if future.exception() is not None and self.errors[i] is None:
                self.errors[i] = f"KV part {ticket.transfer_id!r} failed: {future.exception()}"
        for future in late:
            i, ticket = jobs[future]
            self.errors[i] = self.errors[i] or f"KV part {ticket.transfer_id!r} did not commit within {self.deadline_s:.0f}s"
        for error in self.errors:
            if error is not None:
                log.warning("%s", error)
        self.finish_ms = (time.monotonic() - t0) * 1e3
        return [int(e is not None) for e in self.errors]

    def _abort_quietly(self, ticket: TransferTicket, reason: str) -> None:
        try:
            self.sender.abort(ticket, reason)
        except Exception:  # noqa: BLE001 (the receiver may be gone; the transfer fails anyway)
            pass

    def fail(self, flags: list[int]) -> None:
        for i, flag in enumerate(flags):
            if flag and self.errors[i] is None:
                self.errors[i] = "another tensor-parallel rank failed to send its KV heads (its log says why)"
