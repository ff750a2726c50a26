"""Decode side of disaggregation: reserve blocks, receive KV into them, run the decode loop.

A request moves through

    reserve() -> [reserved: blocks held, KV arriving] -> commit -> [running] -> finished: freed
                        |                                            ^
                        +-- abort / transfer failure: blocks freed   |  preempted: recomputed
                                                                     +  from its token ids here

`reserve` shares the prompt's leading blocks that this worker's prefix cache holds (confirmed by
token ids: an earlier turn's prompt and answer, a shared system prompt) and allocates fresh blocks for
the rest; the ticket names only those, so KV moves only for the tokens after the cached prefix. KV
from elsewhere is hashed into the prefix cache only after it has arrived and been committed. Commits may come from
transfer threads; they are queued and join the running batch at the next `step()`. Prompts
prefilled here (the router's local prefill) take `LockedEngine`'s way, under the same lock.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import uuid
from collections import deque
from collections.abc import Callable

import torch

from decode_worker.locked_engine import LockedEngine
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, TokenLogprobs
from kv_transfer import KVReceiver, KVTransferError, TransferTicket, create_receiver

log = logging.getLogger("pdcluster.decode")


class DecodeEngine(LockedEngine):
    """Implements `kv_transfer.KVSink` for its receiver."""

    def __init__(self, engine: Engine, backend: str = "inproc", **receiver_kwargs: object) -> None:
        if engine.role != "decode":
            raise ValueError("DecodeEngine needs an Engine with role='decode'")
        super().__init__(engine)
        self.backend = backend
        self.compat_hash = engine.compat_hash
        self.num_layers = engine.model_cfg.num_layers
        self._reserved: dict[str, Sequence] = {}  # transfer id -> sequence waiting for its KV
        self._by_request: dict[str, str] = {}  # request id -> transfer id, while reserved
        self._committed: deque[Sequence] = deque()
        self._on_commit: dict[str, Callable[[], None]] = {}
        self._settled: set[str] = set()  # transfers in parts every other rank is done with (check_parts)
        self.committed_cached_tokens = 0  # cumulative: prompt tokens of committed KV held here already
        self.receiver: KVReceiver = create_receiver(backend, self, **receiver_kwargs)
        # tensor parallel with a receiver on every rank (the direct path): tickets name them all
        rank_kv = engine.rank_kv
        self.rank_endpoints = ([self.receiver.endpoint, *rank_kv.endpoints(engine.rank_info)]
                               if rank_kv is not None and engine.rank_info else [])
        # KVSink: a part sent here must carry these heads (without a receiver per rank, rank 0 takes
        # every head and hands each rank its own)
        self.kv_heads = engine.kv_heads if self.rank_endpoints else (0, engine.model_cfg.num_kv_heads)

    # ------------------------------------------------------------------ reservation
    def reserve(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        on_commit: Callable[[], None] | None = None,
        transfer_id: str | None = None,
        output_offset: int = 0,
        reuse_prefix: bool = True,
    ) -> TransferTicket | None:
        """Hold blocks for the prompt's KV. None when the cache is too full right now.
        `transfer_id` is minted by the caller (the router) or here; it must be unused.
        `on_commit` is called (from the transfer's thread) once the KV has all arrived.
        `output_offset`: a resumed request's completion tokens generated before (see Sequence).
        `reuse_prefix`: share the cached leading blocks (False: all fresh, the whole prompt's KV moves)."""
        seq = self.engine.make_sequence(request_id, token_ids, params, output_offset)
        transfer_id = transfer_id or uuid.uuid4().hex
        with self._lock:
            if transfer_id in self._reserved:
                raise ValueError(f"transfer id {transfer_id!r} is already in use")
            if not self.engine.fits(len(token_ids)):
                return None
            # the prompt's leading blocks this worker holds (an earlier turn of the conversation, a
            # shared prefix) are shared; KV arrives only for the blocks after them
            if reuse_prefix:
                cached = self.engine.allocate_cached(seq)
            else:
                seq.block_table, cached = self.engine.allocate_blocks(len(token_ids)), 0
            ticket = TransferTicket(
                transfer_id=transfer_id,
                kv_endpoint=self.receiver.endpoint,
                block_ids=seq.block_table[cached // self.engine.block_size :],
                compat_hash=self.compat_hash,
                auth_token=secrets.token_hex(16),
                num_tokens=len(token_ids),
                backend=self.backend,
                cached_tokens=cached,
                rank_endpoints=self.rank_endpoints,
            )
            if self.rank_endpoints:  # the other ranks take their heads' parts from now on
                self._expect_on_ranks(ticket)
            self._reserved[ticket.transfer_id] = seq
            if on_commit is not None:
                self._on_commit[ticket.transfer_id] = on_commit
            self._by_request[request_id] = ticket.transfer_id
            self.receiver.expect(ticket)
            return ticket

    # ------------------------------------------------------------------ KVSink
    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        return self.engine.kv_layer_shape(num_blocks)

    def write_layer(self, ticket: TransferTicket, layer: int, kv: torch.Tensor, first_block: int = 0) -> None:
        self.engine.write_kv(layer, ticket.block_ids[first_block : first_block + kv.shape[1]], kv,
                             ticket.first_head, local=bool(ticket.num_heads and self.rank_endpoints))

    def check_parts(self, ticket: TransferTicket) -> None:
        """KVSink: a transfer sent in parts commits only once every other rank has all its heads (a
        rank that has them is done with the transfer: the commit need not tell it again)."""
        replies = self.engine.call_ranks({"op": "settle", "id": ticket.transfer_id})
        for rank, reply in enumerate(replies, 1):
            why = reply.get("missing") or reply.get("error")
            if why:
                raise KVTransferError(f"tensor-parallel rank {rank}: {why}")
        with self._lock:
            if ticket.transfer_id in self._reserved:  # (an abort in between has told the ranks already)
                self._settled.add(ticket.transfer_id)

    def _expect_on_ranks(self, ticket: TransferTicket) -> None:
        """Under the lock: every rank expects the transfer's parts, or the reservation is undone."""
        try:
            replies = self.engine.call_ranks({"op": "expect", "ticket": dataclasses.asdict(ticket)})
            refused = [f"rank {r}: {reply['error']}" for r, reply in enumerate(replies, 1) if "error" in reply]
        except Exception as e:  # noqa: BLE001 (a rank gone: the engine is broken now)
            refused = [str(e)]
        if refused:
            self._drop_reserved(ticket.transfer_id)
            self.receiver.forget(ticket.transfer_id)
            raise KVTransferError(f"the tensor-parallel ranks cannot take transfer {ticket.transfer_id!r}: "
                                  + "; ".join(refused))

    def _forget_on_ranks(self, transfer_id: str) -> None:
        if self.rank_endpoints:
            try:
                self.engine.call_ranks({"op": "forget", "id": transfer_id})
            except Exception as e:  # noqa: BLE001 (the engine is broken now; its worker restarts)
                log.warning("could not tell the tensor-parallel ranks to forget %s: %s", transfer_id, e)

    def move_kv_cache(self, place: Callable[[int, tuple[int, ...], torch.dtype], torch.Tensor]) -> None:
        """Re-home a CPU cache (its contents too) into the tensor `place(num_layers, layer_shape,
        dtype)` returns, of shape (num_layers, *layer_shape): shared memory for the shm backend.
        A cache on an accelerator, or split over tensor-parallel ranks, stays where it is (place is not
        called; shm senders then copy through their segments)."""
        caches = self.engine.kv_caches
        if caches[0].device.type != "cpu" or self.engine.tensor_parallel:  # split over ranks: senders copy
            return
        with self._lock:
            storage = place(len(caches), tuple(caches[0].shape), caches[0].dtype)
            if self.engine.load().blocks_used:  # a fresh cache holds nothing: the new memory (zeros) will do
                for dst, src in zip(storage, caches):
                    dst.copy_(src)
            self.engine.replace_kv_caches(list(storage.unbind(0)))

    def commit(self, ticket: TransferTicket, first_token: int, logprob: TokenLogprobs | None) -> None:
        vocab = self.engine.model_cfg.vocab_size
        if not 0 <= first_token < vocab:  # a bad token would fail the whole decode batch later
            self._drop_reserved(ticket.transfer_id)
            raise KVTransferError(f"commit of {ticket.transfer_id!r}: first token {first_token} outside [0, {vocab})")
        with self._lock:
            seq = self._reserved.pop(ticket.transfer_id, None)
            if seq is None:
                return
            del self._by_request[seq.request_id]
            self.committed_cached_tokens += seq.num_cached_tokens
            seq.num_computed_tokens = seq.num_prompt_tokens
            self.engine.cache_computed(seq)  # its prompt's full blocks: a prefix for what comes next
            seq.append_token(first_token)
            if logprob is not None:
                seq.logprobs.append(logprob)
            self._committed.append(seq)
            callback = self._on_commit.pop(ticket.transfer_id, None)
            settled = ticket.transfer_id in self._settled
            self._settled.discard(ticket.transfer_id)
        if not settled:  # a whole transfer: the ranks still expect it (outside the lock: a round trip each)
            self._forget_on_ranks(ticket.transfer_id)
        if callback is not None:
            callback()

    def abort(self, ticket: TransferTicket, reason: str) -> None:
        self._drop_reserved(ticket.transfer_id)

    def _drop_reserved(self, transfer_id: str) -> None:
        with self._lock:
            seq = self._reserved.pop(transfer_id, None)
            self._on_commit.pop(transfer_id, None)
            self._settled.discard(transfer_id)
            if seq is not None:
                self._forget_on_ranks(transfer_id)
                del self._by_request[seq.request_id]
                self.engine.free(seq)

    # ------------------------------------------------------------------ requests
    def abort_request(self, request_id: str, index: int | None = None) -> bool:
        """Drop the request (or only its running choice `index`: one still on its way runs on, as the
        other choices fork from it) and free its blocks; whether it was here."""
        if index is not None:
            return super().abort_request(request_id, index)
        with self._lock:
            transfer_id = self._by_request.get(request_id)
            if transfer_id is not None:
                self.receiver.forget(transfer_id)
                self._drop_reserved(transfer_id)
                return True
            for seq in list(self._committed):
                if seq.request_id == request_id:
                    self._committed.remove(seq)
                    self.engine.free(seq)
                    return True
            return super().abort_request(request_id)

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)

    def reserved_blocks(self) -> int:
        """Blocks held by reservations whose KV has not committed (prompts still being prefilled)."""
        with self._lock:
            return sum(len(seq.block_table) for seq in self._reserved.values())

    def has_work(self) -> bool:
        return bool(self._committed) or super().has_work()

    def step(self) -> list[Sequence]:
        """Admit committed sequences while the batch has room (engine max_num_seqs; preempted
        sequences waiting to be recomputed count against it, and go first), run one step; returns
        the sequences that got a token. A sequence beyond the cap keeps its blocks and waits."""
        with self._lock:
            while self._committed and self.engine.has_room():
                seq = self._committed.popleft()
                if seq.finish_reason is not None and not seq.forks:  # ended at prefill, nothing forks from it
                    self.engine.free(seq)
                    continue
                self.engine.add_running(seq)  # (one that ended forks its other choices, then finishes)
            return super().step()

    def close(self) -> None:
        self.receiver.close()
        super().close()
