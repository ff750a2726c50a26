"""The KV transfer interface: a prefill-side sender pushes layers into a decode-side receiver.

    decode:  receiver.expect(ticket)            blocks reserved, transfer registered
    prefill: sender.send_layer(ticket, l, kv)   for each layer l as soon as it is computed
    prefill: sender.commit(ticket, token, lp)   after the last layer: the first sampled token
    decode:  sink.commit(...)                   all layers arrived -> the sequence may run
    either:  abort(ticket, reason)              the receiver forgets it; the sink frees the blocks

Between tensor-parallel workers a transfer may travel in parts (kv_transfer/parts.py): part
"<id>@<decode rank>:<first head>+<heads>" carries those KV heads of every layer to the receiver of the decode rank
holding them and commits alone; the transfer itself then commits with no layers, and is accepted
only once its parts cover every KV head on every rank (`KVSink.check_parts` asks the other ranks).

The receiver checks everything a sender claims before a single byte touches the cache, so a bad
or stale message can never write into another request's blocks; the checks live here, shared.
"""

from __future__ import annotations

import dataclasses
import hmac
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.kv_spec import mismatch
from engine.sequence import TokenLogprobs
from proto import worker_pb2 as wk


class KVTransferError(RuntimeError):
    """A transfer was refused or failed; the message says why."""


@dataclass
class TransferTicket:
    """What the decode side hands out for one request: where and how to push its KV."""

    transfer_id: str
    kv_endpoint: str
    block_ids: list[int]
    compat_hash: str
    auth_token: str
    num_tokens: int
    backend: str = "inproc"
    cached_tokens: int = 0  # leading tokens the receiver holds already; block_ids cover the rest
    rank_endpoints: list[str] = field(default_factory=list)  # per decode rank (tensor parallel): parts go there
    # a part of a transfer (never on the wire: derived from the part's id): the model's KV heads it carries
    first_head: int = 0
    num_heads: int = 0  # 0: every KV head (a whole transfer)

    def to_proto(self) -> wk.TransferTicket:
        return wk.TransferTicket(
            transfer_id=self.transfer_id, kv_endpoint=self.kv_endpoint, block_ids=self.block_ids,
            compat_hash=self.compat_hash, auth_token=self.auth_token, num_tokens=self.num_tokens,
            backend=self.backend, cached_tokens=self.cached_tokens, rank_endpoints=self.rank_endpoints,
        )

    @classmethod
    def from_proto(cls, msg: wk.TransferTicket) -> TransferTicket:
        return cls(
            transfer_id=msg.transfer_id, kv_endpoint=msg.kv_endpoint, block_ids=list(msg.block_ids),
            compat_hash=msg.compat_hash, auth_token=msg.auth_token, num_tokens=msg.num_tokens, backend=msg.backend,
            cached_tokens=msg.cached_tokens, rank_endpoints=list(msg.rank_endpoints),
        )

    def part(self, rank: int, first_head: int, num_heads: int, endpoint: str) -> TransferTicket:
        """The ticket of this transfer's part carrying KV heads [first_head, first_head + num_heads) to
        decode rank `rank` at `endpoint`."""
        return dataclasses.replace(self, transfer_id=part_id(self.transfer_id, rank, first_head, num_heads),
                                   kv_endpoint=endpoint, rank_endpoints=[], first_head=first_head,
                                   num_heads=num_heads)


PART_ID = re.compile(r"(.+)@\d+:(\d+)\+(\d+)")


def part_id(transfer_id: str, rank: int, first_head: int, num_heads: int) -> str:
    """The id of a part: the rank it goes to keeps a replicated head's parts apart (one sender)."""
    return f"{transfer_id}@{rank}:{first_head}+{num_heads}"


def parse_part_id(transfer_id: str) -> tuple[str, int, int] | None:
    """(the transfer's id, first KV head, heads) of a part's id; None for a whole transfer's."""
    m = PART_ID.fullmatch(transfer_id)
    return (m.group(1), int(m.group(2)), int(m.group(3))) if m else None


def uncovered(held: tuple[int, int], parts: list[tuple[int, int]]) -> list[int]:
    """The heads of `held` (first, count) that no part (first, count) carries."""
    first, n = held
    have = {h for f, k in parts for h in range(f, f + k)}
    return [h for h in range(first, first + n) if h not in have]


class KVSink(Protocol):
    """What a receiver writes into (implemented by the decode worker)."""

    compat_hash: str
    num_layers: int

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]: ...
    def write_layer(self, ticket: TransferTicket, layer: int, kv: torch.Tensor, first_block: int = 0) -> None:
        """Copy `kv` (2, n, ...) into the ticket's blocks block_ids[first_block : first_block + n]."""
        ...
    def commit(self, ticket: TransferTicket, first_token: int, logprob: TokenLogprobs | None) -> None: ...
    def abort(self, ticket: TransferTicket, reason: str) -> None: ...

    # optional, for transfers in parts (a sink without them holds every KV head, and has no other ranks):
    #   kv_heads: tuple[int, int]                       the model's first KV head held here, and how many
    #   check_parts(ticket) -> None                     raise KVTransferError unless the other ranks'
    #                                                   parts of the transfer all arrived


def sink_heads(sink: KVSink) -> tuple[int, int]:
    """(first KV head, count) that `sink` holds."""
    held = getattr(sink, "kv_heads", None)
    return held if held is not None else (0, sink.layer_shape(1)[3])


@dataclass
class _Pending:
    ticket: TransferTicket
    layers: set[int] = field(default_factory=set)  # complete layers
    blocks: dict[int, bytearray] = field(default_factory=dict)  # layer -> which of its blocks arrived


class KVReceiver(ABC):
    """Decode side. Subclasses deliver messages to `_on_layer` / `_on_commit` / `_on_abort`."""

    def __init__(self, sink: KVSink) -> None:
        self.sink = sink
        self._pending: dict[str, _Pending] = {}
        self._parts: dict[str, list[tuple[int, int]]] = {}  # transfer id -> (first head, heads) of parts committed
        self._lock = threading.Lock()

    @property
    @abstractmethod
    def endpoint(self) -> str: ...

    def expect(self, ticket: TransferTicket) -> None:
        with self._lock:
            self._pending[ticket.transfer_id] = _Pending(ticket)
        self._granted(ticket)

    def forget(self, transfer_id: str) -> None:
        with self._lock:
            pending = self._pending.pop(transfer_id, None)
            self._drop_parts(transfer_id)
        if pending is not None:
            self._revoked(pending.ticket)

    def _drop_parts(self, transfer_id: str) -> None:
        """Under the lock: forget the transfer's parts, arrived or arriving."""
        self._parts.pop(transfer_id, None)
        for key in [k for k, p in self._pending.items() if p.ticket.num_heads and parse_part_id(k)[0] == transfer_id]:
            del self._pending[key]

    def parts_missing(self, transfer_id: str) -> str | None:
        """Why this receiver's KV heads of the transfer are not all in (None: every one came in a
        committed part)."""
        with self._lock:
            missing = uncovered(sink_heads(self.sink), self._parts.get(transfer_id, []))
        return f"KV heads {missing} of {transfer_id!r} did not arrive at {self.endpoint}" if missing else None

    def _granted(self, ticket: TransferTicket) -> None:
        """The ticket's blocks are now this transfer's (an extension point: shm opens them to its sender)."""

    def _revoked(self, ticket: TransferTicket) -> None:
        """The transfer is over (committed, aborted, forgotten): called before the sink is told, so
        an extension that lets senders write blocks in place closes them here (shm)."""

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def _get(self, transfer_id: str, auth_token: str) -> _Pending:
        pending = self._pending.get(transfer_id)
        if pending is None:
            pending = self._new_part(transfer_id, auth_token)
        if not hmac.compare_digest(auth_token, pending.ticket.auth_token):
            raise KVTransferError(f"bad auth token for transfer {transfer_id!r}")
        return pending

    def _new_part(self, transfer_id: str, auth_token: str) -> _Pending:
        """Under the lock: the first message of a part of an expected transfer registers the part
        (its ticket: the transfer's blocks, the part's heads, which must be held here)."""
        parsed = parse_part_id(transfer_id)
        whole = self._pending.get(parsed[0]) if parsed is not None else None
        if whole is None or whole.ticket.num_heads:
            raise KVTransferError(f"unknown transfer id {transfer_id!r}")
        if not hmac.compare_digest(auth_token, whole.ticket.auth_token):
            raise KVTransferError(f"bad auth token for transfer {transfer_id!r}")
        _, first, n = parsed
        held_first, held = sink_heads(self.sink)
        if n < 1 or first < held_first or first + n > held_first + held:
            raise KVTransferError(f"part {transfer_id!r}: KV heads [{first}, {first + n}) are not among the heads "
                                  f"[{held_first}, {held_first + held}) held at {self.endpoint}")
        part = dataclasses.replace(whole.ticket, transfer_id=transfer_id, kv_endpoint=self.endpoint, rank_endpoints=[],
                                   first_head=first, num_heads=n)
        pending = self._pending[transfer_id] = _Pending(part)
        return pending

    def expected_shape(self, ticket: TransferTicket, num_blocks: int) -> tuple[int, ...]:
        """One layer of `num_blocks` blocks of the ticket's transfer (a part: its heads only)."""
        shape = tuple(self.sink.layer_shape(num_blocks))
        return shape[:3] + (ticket.num_heads,) + shape[4:] if ticket.num_heads else shape

    def authorize(self, transfer_id: str, auth_token: str) -> TransferTicket:
        """The transfer's ticket, if `auth_token` is its own (asked before any bytes are touched)."""
        with self._lock:
            return self._get(transfer_id, auth_token).ticket

    def check_layer_index(self, layer: int) -> None:
        if not 0 <= layer < self.sink.num_layers:
            raise KVTransferError(f"layer {layer} out of range [0, {self.sink.num_layers})")

    def check_compat(self, compat_hash: str) -> None:
        if compat_hash != self.sink.compat_hash:
            raise KVTransferError(
                f"incompatible KV layout: sender {compat_hash}, receiver {self.sink.compat_hash} "
                f"(differs: {mismatch(compat_hash, self.sink.compat_hash)}; what each layer keeps, model, dtype, "
                "block size and layout version must match)"
            )

    def _on_layer(
        self, transfer_id: str, auth_token: str, layer: int, kv: torch.Tensor, first_block: int = 0
    ) -> None:
        """One layer's K and V, or a run of its blocks starting at the ticket's `first_block`
        (a large layer may travel in several messages); the layer is complete once every block came."""
        self._accept_layer(
            transfer_id, auth_token, layer, tuple(kv.shape), first_block,
            lambda ticket: self.sink.write_layer(ticket, layer, kv, first_block),
        )

    def _accept_layer(
        self, transfer_id: str, auth_token: str, layer: int, shape: tuple[int, ...], first_block: int,
        land: Callable[[TransferTicket], None],
    ) -> None:
        """The shared checks of a layer (or run of its blocks) of `shape`; `land(ticket)` runs only
        after they passed (it copies the bytes into the blocks, or verifies bytes written in place)."""
        with self._lock:
            pending = self._get(transfer_id, auth_token)
            self.check_layer_index(layer)
            total = len(pending.ticket.block_ids)
            expected = self.expected_shape(pending.ticket, total)
            blockwise = len(shape) == len(expected) and shape[:1] + shape[2:] == expected[:1] + expected[2:]
            n = shape[1] if blockwise else 0
            if n < 1 or (first_block == 0 and n > total):
                raise KVTransferError(f"layer {layer}: shape {shape}, expected {expected}")
            if first_block + n > total:
                raise KVTransferError(
                    f"layer {layer}: blocks [{first_block}, {first_block + n}) outside the transfer's {total}"
                )
            land(pending.ticket)
            if first_block == 0 and n == total:
                pending.layers.add(layer)
                return
            seen = pending.blocks.setdefault(layer, bytearray(total))
            seen[first_block : first_block + n] = b"\x01" * n
            if seen.count(0) == 0:
                pending.layers.add(layer)

    def _on_commit(self, transfer_id: str, auth_token: str, first_token: int, logprob: TokenLogprobs | None) -> None:
        in_parts = False
        with self._lock:
            pending = self._get(transfer_id, auth_token)
            # a transfer sent in parts commits with no layers of its own: its parts must cover the heads
            in_parts = not pending.layers and not pending.ticket.num_heads and transfer_id in self._parts
            if len(pending.layers) != self.sink.num_layers and not in_parts:
                missing = sorted(set(range(self.sink.num_layers)) - pending.layers)
                raise KVTransferError(f"commit of {transfer_id!r} before layers {missing} arrived")
            if pending.ticket.num_heads:  # a part: recorded, the transfer goes on
                del self._pending[transfer_id]
                self._parts.setdefault(parse_part_id(transfer_id)[0], []).append(
                    (pending.ticket.first_head, pending.ticket.num_heads))
                return
        if in_parts:
            why = self.parts_missing(transfer_id)
            if why is not None:
                raise KVTransferError(f"commit of {transfer_id!r}: {why}")
            check = getattr(self.sink, "check_parts", None)
            if check is not None:
                check(pending.ticket)  # the other ranks' heads (outside the lock: it asks them)
        with self._lock:
            if self._pending.get(transfer_id) is not pending:
                raise KVTransferError(f"transfer {transfer_id!r} was aborted while it committed")
            del self._pending[transfer_id]
            self._drop_parts(transfer_id)
        self._revoked(pending.ticket)
        self.sink.commit(pending.ticket, first_token, logprob)

    def _on_abort(self, transfer_id: str, auth_token: str, reason: str) -> None:
        with self._lock:
            pending = self._get(transfer_id, auth_token)
            del self._pending[transfer_id]
            if pending.ticket.num_heads:
                return  # a part: the transfer cannot commit without it
            self._drop_parts(transfer_id)
        self._revoked(pending.ticket)
        self.sink.abort(pending.ticket, reason)

    def close(self) -> None:
        """Stop accepting transfers."""


class KVSender(ABC):
    """Prefill side. `kv` is one layer of the request's blocks: (2, num_blocks, block_size, kvh, hd).

    `bytes_sent`: KV bytes handed to the transport so far, by backend name (cumulative; written by
    the thread calling `send_layer`, read for metrics)."""

    sends_parts = True  # can reach each rank of a tensor-parallel decode worker (kv_transfer/parts.py)

    def __init__(self, compat_hash: str) -> None:
        self.compat_hash = compat_hash
        self.bytes_sent: dict[str, int] = {}
        self.fault_injector: object | None = None  # kv_transfer.faults.FaultInjector when faults are on

    def _count_sent(self, backend: str, nbytes: int) -> None:
        self.bytes_sent[backend] = self.bytes_sent.get(backend, 0) + nbytes

    def check_ticket(self, ticket: TransferTicket) -> None:
        if ticket.compat_hash != self.compat_hash:
            raise KVTransferError(
                f"incompatible KV layout for transfer {ticket.transfer_id!r}: this worker {self.compat_hash}, "
                f"receiver {ticket.compat_hash} (differs: {mismatch(self.compat_hash, ticket.compat_hash)}; what each "
                "layer keeps, model, dtype, block size and layout version must match)"
            )

    def add_channel_interceptor(self, interceptor: object) -> None:
        """Put a gRPC client interceptor on every channel this sender opens from now on (fault
        injection, authentication). Backends without gRPC channels refuse."""
        raise KVTransferError(f"{type(self).__name__} opens no gRPC channels to intercept")

    @abstractmethod
    def send_layer(self, ticket: TransferTicket, layer: int, kv: torch.Tensor) -> None:
        """Queue one layer. `kv` is handed over: the caller does not change it afterwards (a
        backend may send straight from its memory later; PrefillEngine passes a fresh gather)."""

    @abstractmethod
    def commit(self, ticket: TransferTicket, first_token: int, logprob: TokenLogprobs | None) -> None: ...

    @abstractmethod
    def abort(self, ticket: TransferTicket, reason: str) -> None: ...

    def close(self) -> None:
        """Release connections."""
