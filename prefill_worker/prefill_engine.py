"""Prefill side of disaggregation: batch prompts, push each layer's KV as soon as it is computed.

A request arrives with a `TransferTicket` from the decode worker that reserved blocks for it. The
engine prefills it (batched with other prompts under the token budget, long prompts chunked);
during the forward pass that completes a prompt, a layer hook hands layer l's K/V for that
prompt's blocks to the KV sender right after layer l ran, so the transfer of early layers overlaps
the compute of later ones. The first token is sampled and sent with the commit; the prefill-side
blocks are freed (they stay in the prefix cache until evicted).

A request may arrive before its ticket (`add(ticket=None)`: the router reserves on the decode worker
while this engine computes the prompt). Its layers' K/V are held until `attach` brings the ticket,
then sent and committed at once (prefill_worker/held_kv.py); a prompt whose ticket came before its
forward pass goes as usual. A tensor-parallel engine (whose ranks send their own heads) parks the
request until its ticket comes.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from engine.engine import Engine
from engine.model_runner import LayerSend, ScheduledSeq
from engine.sampling_params import SamplingParams
from engine.sequence import TokenLogprobs
from kv_transfer import KVSender, TransferTicket
from kv_transfer.parts import PartItem, PartSend
from prefill_worker.held_kv import send_held


@dataclass
class PrefillResult:
    request_id: str
    first_token: int
    logprob: TokenLogprobs | None
    finish_reason: str | None  # set when the request ended with its first token (no decode needed)
    num_cached_tokens: int
    error: str | None = None  # the KV transfer failed; the decode side was told to abort
    # ms spent in commit (draining the layer stream + the commit itself): the part of the KV
    # transfer that was not hidden behind the forward pass
    commit_ms: float = 0.0
    queue_ms: float = 0.0  # added until first scheduled
    compute_ms: float = 0.0  # first scheduled until the first token was sampled (commit excluded)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # sampling.prompt_logprobs set


@dataclass
class _Held:
    """A prompt prefilled before its ticket came: its result, each layer's K/V of all its blocks."""

    result: PrefillResult
    layers: list[torch.Tensor]
    num_tokens: int
    hand_on: bool
    since: float = field(default_factory=time.monotonic)  # the transfer time counts from here


EARLY_TICKET_S = 60.0  # a ticket attached before its prompt was added is dropped after this


class PrefillEngine:
    def __init__(self, engine: Engine, sender: KVSender) -> None:
        if engine.role != "prefill":
            raise ValueError("PrefillEngine needs an Engine with role='prefill'")
        self.engine = engine
        self.sender = sender
        # the direct path between tensor-parallel workers (kv_transfer/parts.py): every rank sends its
        # own heads; without a KV sender on each rank, slices are gathered on rank 0 (the fallback)
        self.sends_parts = sender.sends_parts and (engine.tensor_parallel_size == 1 or engine.rank_kv is not None)
        self._tickets: dict[str, TransferTicket | None] = {}  # None: the ticket follows (`attach`)
        self._lens: dict[str, int] = {}  # prompt tokens of the requests added without a ticket
        self._held: dict[str, _Held] = {}  # prefilled, waiting for their ticket
        self._holding: dict[str, list[torch.Tensor]] = {}  # this step's layers of prompts without a ticket
        self._early: dict[str, tuple[TransferTicket, float]] = {}  # attached before their prompt was added
        self._parked: dict[str, tuple[list[int], SamplingParams, int]] = {}  # tensor-parallel: added at `attach`
        self._errors: dict[str, str] = {}
        self._parts: tuple[list[str], PartSend] | None = None  # this step's direct transfers: request ids, sends

    def add(self, request_id: str, token_ids: list[int], params: SamplingParams, ticket: TransferTicket | None,
            output_offset: int = 0) -> None:
        """`output_offset`: a resumed request's completion tokens generated before (see Sequence).
        `ticket` None: it follows in `attach`."""
        if ticket is None and (early := self._early.pop(request_id, None)) is not None:
            ticket = early[0]
        if ticket is not None:
            self._check(ticket, len(token_ids))
        elif self.engine.tensor_parallel_size > 1:
            self._parked[request_id] = (token_ids, params, output_offset)
            return
        self.engine.add_request(request_id, token_ids, params, output_offset)
        self._tickets[request_id] = ticket
        if ticket is None:
            self._lens[request_id] = len(token_ids)

    def _check(self, ticket: TransferTicket, num_tokens: int) -> None:
        self.sender.check_ticket(ticket)
        if ticket.num_tokens != num_tokens:
            raise ValueError(f"ticket covers {ticket.num_tokens} tokens, prompt has {num_tokens}")
        bs = self.engine.block_size
        if ticket.cached_tokens % bs or not 0 <= ticket.cached_tokens < num_tokens:
            raise ValueError(f"ticket's cached_tokens {ticket.cached_tokens} must be a multiple of the block size "
                             f"{bs} below the prompt's {num_tokens} tokens")
        if len(ticket.block_ids) != -(-num_tokens // bs) - ticket.cached_tokens // bs:
            raise ValueError(f"ticket has {len(ticket.block_ids)} blocks for tokens {ticket.cached_tokens}.."
                             f"{num_tokens} in blocks of {bs}")

    def attach(self, request_id: str, ticket: TransferTicket) -> PrefillResult | None:
        """The ticket of a request added without one; raises ValueError / KVTransferError if it does
        not fit the prompt. Returns the request's result when its prefill had finished (its held
        layers are sent and committed now), else None (layers go as they are computed)."""
        held = self._held.get(request_id)
        if held is not None:
            self._check(ticket, held.num_tokens)
            del self._held[request_id]
            r = held.result
            error, _ = self._hand_on(ticket, r.first_token, r.logprob, held.hand_on, held.layers)
            return dataclasses.replace(r, error=error, commit_ms=(time.monotonic() - held.since) * 1e3)
        if request_id in self._parked:
            token_ids, params, output_offset = self._parked[request_id]
            self._check(ticket, len(token_ids))
            del self._parked[request_id]
            self.engine.add_request(request_id, token_ids, params, output_offset)
            self._tickets[request_id] = ticket
            return None
        num_tokens = self._lens.get(request_id)
        if num_tokens is None:  # its prompt is not here yet (the two calls crossed), or gone
            now = time.monotonic()
            self._early = {k: v for k, v in self._early.items() if now - v[1] < EARLY_TICKET_S}
            self._early[request_id] = (ticket, now)
            return None
        self._check(ticket, num_tokens)
        del self._lens[request_id]
        self._tickets[request_id] = ticket
        return None

    def bytes_sent(self) -> dict[str, int]:
        """KV bytes sent so far by backend, by every tensor-parallel rank of the worker (cumulative)."""
        total = dict(self.sender.bytes_sent)
        if self.engine.rank_kv is not None and self.engine.check_broken() is None:
            try:
                replies = self.engine.call_ranks({"op": "bytes_sent"})
            except Exception:  # noqa: BLE001 (a rank gone: the engine is broken now; rank 0's count stays)
                replies = []
            for reply in replies:
                for backend, n in reply.get("bytes_sent", {}).items():
                    total[backend] = total.get(backend, 0) + n
        return total

    def close(self) -> None:
        """Release the KV sender's connections and the engine's tensor-parallel ranks."""
        self.sender.close()
        self.engine.close()

    def has_work(self) -> bool:
        return self.engine.has_work()

    @property
    def num_queued_tokens(self) -> int:
        return self.engine.queued_prompt_tokens(include_running=True)

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        seq = self.engine.abort(request_id)
        ticket = self._tickets.pop(request_id, None)
        if ticket is not None:
            self._safe_abort(ticket, reason)
        self._lens.pop(request_id, None)
        self._early.pop(request_id, None)
        self._holding.pop(request_id, None)
        parked = self._parked.pop(request_id, None) is not None
        return self._held.pop(request_id, None) is not None or parked or seq is not None

    def _safe_abort(self, ticket: TransferTicket, reason: str) -> None:
        try:
            self.sender.abort(ticket, reason)
        except Exception:  # the receiver may be gone; its lease frees the blocks
            pass

    def in_parts(self, ticket: TransferTicket | None) -> bool:
        """Whether the ticket's KV goes the direct way, each rank's heads to the ranks taking them
        (a ticket that follows: gathered on rank 0 and held)."""
        return ticket is not None and self.sends_parts and (
            self.engine.tensor_parallel_size > 1 or len(ticket.rank_endpoints) > 1)

    def _layer_hook(self, batch: list[ScheduledSeq]) -> LayerSend | None:
        done = [item.seq for item in batch if item.completes]
        if not done:
            return None
        bs = self.engine.block_size
        direct = [seq for seq in done if self.in_parts(self._tickets[seq.request_id])]
        done = [seq for seq in done if seq not in direct]
        parts = None
        if direct:
            items = [PartItem(self._tickets[seq.request_id],
                              seq.block_table[self._tickets[seq.request_id].cached_tokens // bs:]) for seq in direct]
            parts = PartSend(self.sender, 0, self.engine.tensor_parallel_size, self.engine.model_cfg.num_kv_heads,
                             items)
            self._parts = ([seq.request_id for seq in direct], parts)
        # per prompt the blocks the receiver does not hold already; after each layer their K/V come
        # as one copy (2, blocks, block_size, every KV head, hd), so the blocks may be reused at once
        # (a prompt whose ticket follows: all its blocks, held until the ticket says which it needs)
        spans, blocks = [], []
        for seq in done:
            ticket = self._tickets[seq.request_id]
            own = seq.block_table[ticket.cached_tokens // bs if ticket is not None else 0 :]
            spans.append((seq, len(blocks), len(own)))
            blocks += own
            if ticket is None:
                self._holding[seq.request_id] = []

        def send(layer: int, kv) -> None:
            for seq, start, n in spans:
                rid = seq.request_id
                if rid in self._holding:
                    self._holding[rid].append(kv[:, start:start + n])
                    continue
                if rid in self._errors:
                    continue
                try:
                    self.sender.send_layer(self._tickets[rid], layer, kv[:, start:start + n])
                except Exception as e:  # one failed transfer must not fail the whole batch
                    self._errors[rid] = f"KV transfer failed at layer {layer}: {e}"

        return LayerSend(blocks, send, parts)

    def step(self) -> list[PrefillResult]:
        results = []
        self._parts = None
        self._holding = {}
        try:
            finished = self.engine.step(self._layer_hook)
        finally:
            if self._parts is not None:  # what a rank's part of a transfer said when it failed
                for rid, error in zip(self._parts[0], self._parts[1].errors):
                    if error is not None:
                        self._errors.setdefault(rid, error)
        direct, parts_ms = (self._parts[0], self._parts[1].finish_ms) if self._parts else ([], 0.0)
        for seq in finished:
            sampled_at = time.monotonic()
            rid = seq.request_id
            ticket = self._tickets.pop(rid)
            token = seq.token_ids[-1]
            lp = seq.logprobs[-1] if seq.logprobs else None
            # a request with several choices hands its prompt on even when choice 0 ended here: the
            # others fork from it on the decode side (the offline LLM; cluster workers take one choice)
            hand_on = seq.finish_reason is None or seq.params.num_choices > 1
            # the direct path commits its parts inside the step: transfer time, not compute
            in_step = parts_ms if rid in direct else 0.0
            compute_ms = (sampled_at - (seq.first_scheduled_time or seq.arrival_time)) * 1e3 - in_step
            result = PrefillResult(rid, token, lp, seq.finish_reason, seq.num_cached_tokens, None, in_step,
                                   seq.queue_ms, compute_ms, seq.prompt_logprobs)
            if ticket is None:  # sent once its ticket comes (`attach`)
                self._held[rid] = _Held(result, self._holding.pop(rid, []), self._lens.pop(rid), hand_on)
                continue
            error, commit_ms = self._hand_on(ticket, token, lp, hand_on, error=self._errors.pop(rid, None))
            results.append(dataclasses.replace(result, error=error, commit_ms=commit_ms + in_step))
        return results

    def _hand_on(self, ticket: TransferTicket, token: int, lp: TokenLogprobs | None, hand_on: bool,
                 layers: list[torch.Tensor] | None = None, error: str | None = None) -> tuple[str | None, float]:
        """Send held `layers` (all the prompt's blocks; None: sent during the step), commit, or tell
        the decode side to free its blocks (on an error, or when the request ended here); (error, ms)."""
        t0 = time.monotonic()
        if error is None and hand_on:
            try:
                if layers is not None:
                    send_held(self.sender, ticket, layers, ticket.cached_tokens // self.engine.block_size,
                              self.engine.model_cfg.num_kv_heads, self.in_parts(ticket))
                self.sender.commit(ticket, token, lp)
            except Exception as e:
                error = f"KV commit failed: {e}"
        if error is not None or not hand_on:
            self._safe_abort(ticket, error or "finished at prefill")
        return error, (time.monotonic() - t0) * 1e3
