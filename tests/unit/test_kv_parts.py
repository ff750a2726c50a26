"""KV in parts between tensor-parallel workers (kv_transfer/parts.py): the plan moves every KV head to
every receiving rank exactly once from a rank that holds it, and a decode worker takes a transfer
sent in parts only once its parts cover every KV head, each written into its heads' slice."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from decode_worker import DecodeEngine
from engine import Engine, EngineConfig, SamplingParams
from engine.tp_layout import kv_head_range
from kv_transfer import KVTransferError, create_sender
from kv_transfer.base import parse_part_id, part_id
from kv_transfer.parts import plan

PARAMS = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("a", [1, 2, 4, 8])
@pytest.mark.parametrize("b", [1, 2, 4, 8])
def test_plan_moves_every_head_to_every_rank_once_from_a_holder(k, a, b):
    if (k % a and a % k) or (k % b and b % k):
        with pytest.raises(ValueError, match="must divide"):
            plan(k, a, b)
        return
    got: dict[int, list[int]] = {r: [] for r in range(b)}
    for p in plan(k, a, b):
        src_first, src_n = kv_head_range(k, a, p.src)
        assert src_first <= p.first_head and p.first_head + p.num_heads <= src_first + src_n  # the sender holds them
        got[p.dst] += range(p.first_head, p.first_head + p.num_heads)
    for r in range(b):
        first, n = kv_head_range(k, b, r)
        assert got[r] == list(range(first, first + n))


def test_replicated_heads_are_sent_by_the_replicas_in_turn():
    assert [(p.src, p.dst) for p in plan(1, 2, 2)] == [(0, 0), (1, 1)]  # MQA 2 -> 2: no rank sends twice
    assert [(p.src, p.dst, p.first_head, p.num_heads) for p in plan(4, 2, 1)] == [(0, 0, 0, 2), (1, 0, 2, 2)]


def test_part_ids_name_the_transfer_rank_and_heads():
    assert parse_part_id(part_id("req-1#retry1-ab", 1, 2, 2)) == ("req-1#retry1-ab", 2, 2)
    assert parse_part_id("req-1") is None


@pytest.fixture
def decode(checkpoint):
    path = str(checkpoint("llama-gqa", num_attention_heads=8, num_key_value_heads=4))
    d = DecodeEngine(Engine(EngineConfig(model=path, num_blocks=32, max_model_len=256), "decode"))
    yield d
    d.close()


def _part(decode, ticket, first, n, fill):
    shape = list(decode.layer_shape(len(ticket.block_ids)))
    shape[3] = n
    return ticket.part(0, first, n, ticket.kv_endpoint), torch.full(shape, fill)


def test_parts_land_in_their_heads_and_the_transfer_commits_once_they_cover_all(decode):
    sender = create_sender("inproc", decode.compat_hash)
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    halves = [_part(decode, ticket, 0, 2, 1.0), _part(decode, ticket, 2, 2, 2.0)]
    for part, kv in halves[:1]:
        for layer in range(decode.num_layers):
            sender.send_layer(part, layer, kv)
        sender.commit(part, 0, None)
    with pytest.raises(KVTransferError, match=r"KV heads \[2, 3\] .* did not arrive"):
        sender.commit(ticket, 7, None)  # half the heads: refused, the reservation stays
    assert decode.num_reserved == 1
    part, kv = halves[1]
    for layer in range(decode.num_layers):
        sender.send_layer(part, layer, kv)
    sender.commit(part, 0, None)
    sender.commit(ticket, 7, None)
    assert decode.num_reserved == 0 and decode.has_work()
    cache = decode.engine.kv_caches[0][:, ticket.block_ids]
    assert torch.all(cache[:, :, :, :2] == 1.0) and torch.all(cache[:, :, :, 2:] == 2.0)


def test_parts_outside_the_held_heads_or_of_the_wrong_shape_or_token_are_refused(decode):
    sender = create_sender("inproc", decode.compat_hash)
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    part, kv = _part(decode, ticket, 3, 2, 1.0)
    with pytest.raises(KVTransferError, match=r"KV heads \[3, 5\) are not among the heads \[0, 4\)"):
        sender.send_layer(part, 0, kv)
    part, kv = _part(decode, ticket, 0, 2, 1.0)
    with pytest.raises(KVTransferError, match="shape"):
        sender.send_layer(part, 0, torch.ones(*kv.shape[:3], 3, kv.shape[4]))
    with pytest.raises(KVTransferError, match="bad auth token"):
        sender.send_layer(dataclasses.replace(part, auth_token="forged"), 0, kv)
    orphan = dataclasses.replace(part, transfer_id=part_id("no-such-transfer", 0, 0, 2))
    with pytest.raises(KVTransferError, match="unknown transfer id"):
        sender.send_layer(orphan, 0, kv)
    assert torch.all(decode.engine.kv_caches[0] == 0)


def test_an_aborted_transfer_forgets_its_parts_and_frees_its_blocks(decode):
    sender = create_sender("inproc", decode.compat_hash)
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    part, kv = _part(decode, ticket, 0, 4, 1.0)
    sender.send_layer(part, 0, kv)
    sender.abort(ticket, "prefill failed")
    assert decode.num_reserved == 0 and decode.engine.block_manager.num_used_blocks == 0
    assert decode.receiver.num_pending == 0
    with pytest.raises(KVTransferError, match="unknown transfer id"):
        sender.send_layer(part, 1, kv)
