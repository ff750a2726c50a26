"""Conversions between wire messages and engine types (shared by the router and the workers)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from engine.cache_events import CacheChanges
from engine.kv_tier import TierStats
from engine.sampling_params import GuidedDecoding, SamplingParams
from engine.sequence import TokenLogprobs
from engine.step_stats import PhaseTotals, StepTotals
from proto import generate_pb2 as gen
from proto import worker_pb2 as wk


def sampling_from_proto(msg: gen.SamplingParams) -> SamplingParams:
    """Unset fields take the engine defaults. Raises ValueError naming a bad field."""
    kwargs: dict = {}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "min_tokens", "prompt_logprobs", "n", "best_of"):
        if msg.HasField(name):
            kwargs[name] = getattr(msg, name)
    kwargs["logit_bias"] = dict(msg.logit_bias)
    kwargs["stop"] = list(msg.stop)
    kwargs["stop_token_ids"] = list(msg.stop_token_ids)
    kwargs["ignore_eos"] = msg.ignore_eos
    if msg.HasField("guided"):
        kwargs["guided"] = GuidedDecoding(msg.guided.kind, msg.guided.spec)
    return SamplingParams(**kwargs)


def choice_sampling_from_proto(msg: gen.SamplingParams) -> SamplingParams:
    """A worker's sampling parameters: one choice (the router splits a request's n / best_of)."""
    params = sampling_from_proto(msg)
    if params.num_choices > 1:
        raise ValueError("sampling.n / best_of: a worker runs one choice; the router splits a request's choices")
    return params


def sampling_to_proto(p: SamplingParams) -> gen.SamplingParams:
    msg = gen.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
        stop=p.stop, stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos,
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    if p.n != 1:
        msg.n = p.n
    if p.best_of is not None:
        msg.best_of = p.best_of
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"):
        setattr(msg, name, getattr(p, name))
    msg.logit_bias.update(p.logit_bias)
    if p.guided is not None:
        msg.guided.kind, msg.guided.spec = p.guided.kind, p.guided.spec
    return msg


def logprob_to_proto(lp: TokenLogprobs) -> gen.TokenLogprob:
    return gen.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob, top=[gen.Logprob(token_id=t, logprob=v) for t, v in lp.top],
        rank=lp.rank,
    )


def logprob_from_proto(msg: gen.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(msg.token_id, msg.logprob, [(t.token_id, t.logprob) for t in msg.top],
                         msg.rank if msg.HasField("rank") else None)


def unknown_fields(msg: Message, path: str = "") -> list[str]:
    """Field numbers present on the wire but not in this message's schema, as dotted paths."""
    found = [f"{path}#{f.field_number}" for f in UnknownFieldSet(msg)]
    for field, value in msg.ListFields():
        if field.message_type is None:
            continue
        items = list(value) if field.is_repeated else [value]
        for i, item in enumerate(items):
            if isinstance(item, Message):
                found += unknown_fields(item, f"{path}{field.name}{f'[{i}]' if len(items) > 1 else ''}.")
    return found



def _phase_stats(phase: str, t: PhaseTotals, batch_min: int = 0) -> wk.StepPhaseStats:
    return wk.StepPhaseStats(phase=phase, steps=t.steps, seconds=t.seconds, seqs=t.seqs, tokens=t.tokens,
                             context_tokens=t.context, batch_min=batch_min)


def step_stats_to_proto(totals: StepTotals) -> dict[str, list[wk.StepPhaseStats]]:
    """WorkerStats' `steps` (per phase) and `steps_by_batch` (per phase and batch-size bucket)."""
    phases, by_batch = totals.snapshots()
    return {"steps": [_phase_stats(p, t) for p, t in phases.items()],
            "steps_by_batch": [_phase_stats(p, t, lo) for (p, lo), t in by_batch.items()]}


def prefix_cache_to_proto(request: wk.StatsRequest, changes: Callable[[int], CacheChanges],
                          block_size: int, tier_changes: Callable[[int], CacheChanges | None] | None = None,
                          tier_id: str = "") -> dict[str, wk.PrefixCacheEvents]:
    """The `prefix_cache` field of a worker's Stats answer: what `changes(cursor)` returns, and its
    offload tier's `tier_changes(tier_cursor)` where it has one, when the request asked for it
    (`WorkerStats(**...)`; empty otherwise)."""
    if not request.prefix_cache_events:
        return {}
    c = changes(request.prefix_cache_cursor)
    events = wk.PrefixCacheEvents(cursor=c.cursor, snapshot=c.snapshot, stored=c.stored, removed=c.removed,
                                  block_size=block_size)
    t = tier_changes(request.tier_cursor) if tier_changes is not None else None
    if t is not None:
        events.tier_id, events.tier_cursor, events.tier_snapshot = tier_id, t.cursor, t.snapshot
        events.tier_stored.extend(t.stored)
        events.tier_removed.extend(t.removed)
    return {"prefix_cache": events}


def tier_stats_to_proto(tier_id: str, stats: TierStats | None) -> dict[str, Any]:
    """The offload tier's WorkerStats fields (`WorkerStats(**...)`; empty without a tier)."""
    if stats is None:
        return {}
    return {"tier_id": tier_id, "tier_capacity_bytes": stats.capacity_bytes, "tier_used_bytes": stats.used_bytes,
            "tier_blocks": stats.blocks, "tier_saves": stats.saves, "tier_hits": stats.hits,
            "tier_misses": stats.misses, "tier_evictions": stats.evictions}
