"""Prefill side of disaggregation: batch prompts, push each layer's KV as soon as it is computed.

A request arrives with a `TransferTicket` from the decode worker that reserved blocks for it. The
engine prefills it (batched with other prompts under the token budget, long prompts chunked);
during the forward pass that completes a prompt, a layer hook hands layer l's K/V for that
prompt's blocks to the KV sender right after layer l ran, so the transfer of early layers overlaps
the compute of later ones. The first token is sampled and sent with the commit; the prefill-side
blocks are freed (they stay in the prefix cache until evicted).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.engine import Engine
from engine.model_runner import LayerSend, ScheduledSeq
from engine.sampling_params import SamplingParams
from engine.sequence import TokenLogprobs
from kv_transfer import KVSender, TransferTicket
from kv_transfer.parts import PartItem, PartSend


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


class PrefillEngine:
    def __init__(self, engine: Engine, sender: KVSender) -> None:
        if engine.role != "prefill":
            raise ValueError("PrefillEngine needs an Engine with role='prefill'")
        self.engine = engine
        self.sender = sender
        # the direct path between tensor-parallel workers (kv_transfer/parts.py): every rank sends its
        # own heads; without a KV sender on each rank, slices are gathered on rank 0 (the fallback)
        self.sends_parts = sender.sends_parts and (engine.tensor_parallel_size == 1 or engine.rank_kv is not None)
        self._tickets: dict[str, TransferTicket] = {}
        self._errors: dict[str, str] = {}
        self._parts: tuple[list[str], PartSend] | None = None  # this step's direct transfers: request ids, sends

    def add(self, request_id: str, token_ids: list[int], params: SamplingParams, ticket: TransferTicket,
            output_offset: int = 0) -> None:
        """`output_offset`: a resumed request's completion tokens generated before (see Sequence)."""
        self.sender.check_ticket(ticket)
        if ticket.num_tokens != len(token_ids):
            raise ValueError(f"ticket covers {ticket.num_tokens} tokens, prompt has {len(token_ids)}")
        bs = self.engine.block_size
        if ticket.cached_tokens % bs or not 0 <= ticket.cached_tokens < len(token_ids):
            raise ValueError(f"ticket's cached_tokens {ticket.cached_tokens} must be a multiple of the block size "
                             f"{bs} below the prompt's {len(token_ids)} tokens")
        if len(ticket.block_ids) != -(-len(token_ids) // bs) - ticket.cached_tokens // bs:
            raise ValueError(f"ticket has {len(ticket.block_ids)} blocks for tokens {ticket.cached_tokens}.."
                             f"{len(token_ids)} in blocks of {bs}")
        self.engine.add_request(request_id, token_ids, params, output_offset)
        self._tickets[request_id] = ticket

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
        return seq is not None

    def _safe_abort(self, ticket: TransferTicket, reason: str) -> None:
        try:
            self.sender.abort(ticket, reason)
        except Exception:  # the receiver may be gone; its lease frees the blocks
            pass

    def in_parts(self, ticket: TransferTicket) -> bool:
        """Whether the ticket's KV goes the direct way, each rank's heads to the ranks taking them."""
        return self.sends_parts and (self.engine.tensor_parallel_size > 1 or len(ticket.rank_endpoints) > 1)

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
        spans, blocks = [], []
        for seq in done:
            own = seq.block_table[self._tickets[seq.request_id].cached_tokens // bs :]
            spans.append((seq, len(blocks), len(own)))
            blocks += own

        def send(layer: int, kv) -> None:
            for seq, start, n in spans:
                rid = seq.request_id
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
            error = self._errors.pop(rid, None)
            commit_ms = 0.0
            # a request with several choices hands its prompt on even when choice 0 ended here: the
            # others fork from it on the decode side (the offline LLM; cluster workers take one choice)
            hand_on = seq.finish_reason is None or seq.params.num_choices > 1
            if error is None and hand_on:
                t0 = time.monotonic()
                try:
                    self.sender.commit(ticket, token, lp)
                except Exception as e:
                    error = f"KV commit failed: {e}"
                commit_ms = (time.monotonic() - t0) * 1e3
            if error is not None or not hand_on:
                self._safe_abort(ticket, error or "finished at prefill")
            # the direct path commits its parts inside the step: transfer time, not compute
            in_step = parts_ms if rid in direct else 0.0
            commit_ms += in_step
            compute_ms = (sampled_at - (seq.first_scheduled_time or seq.arrival_time)) * 1e3 - in_step
            results.append(PrefillResult(rid, token, lp, seq.finish_reason, seq.num_cached_tokens, error, commit_ms,
                                         seq.queue_ms, compute_ms, seq.prompt_logprobs))
        return results
