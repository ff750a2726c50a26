"""The KV receiver refuses anything that does not match its reservation, and aborts free blocks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from decode_worker import DecodeEngine
from engine import Engine, EngineConfig, SamplingParams
from kv_transfer import KVTransferError, create_sender

PARAMS = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture
def decode(checkpoint):
    engine = Engine(EngineConfig(model=str(checkpoint("llama-gqa")), num_blocks=32, max_model_len=256), "decode")
    d = DecodeEngine(engine)
    yield d
    d.close()


@pytest.fixture
def sender(decode):
    return create_sender("inproc", decode.compat_hash)


def _layer(decode, ticket, fill=1.0):
    return torch.full(decode.layer_shape(len(ticket.block_ids)), fill)


def test_layers_land_in_the_reserved_blocks_and_commit_admits(decode, sender):
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    assert len(ticket.block_ids) == 3 and decode.engine.block_manager.num_used_blocks == 3
    for layer in range(decode.num_layers):
        sender.send_layer(ticket, layer, _layer(decode, ticket, layer + 1.0))
    cache = decode.engine.kv_caches
    for layer in range(decode.num_layers):
        assert torch.all(cache[layer][:, ticket.block_ids] == layer + 1.0)
    untouched = [b for b in range(32) if b not in ticket.block_ids]
    assert torch.all(cache[0][:, untouched] == 0)
    sender.commit(ticket, 7, None)
    assert decode.has_work() and decode.num_reserved == 0


@pytest.mark.parametrize(
    "tamper, message",
    [
        (dict(transfer_id="not-a-transfer"), "unknown transfer id"),
        (dict(auth_token="forged"), "bad auth token"),
    ],
)
def test_receiver_refuses_unknown_transfer_and_bad_token(decode, sender, tamper, message):
    ticket = decode.reserve("r1", list(range(3, 20)), PARAMS)
    forged = dataclasses.replace(ticket, **tamper)
    with pytest.raises(KVTransferError, match=message):
        sender.send_layer(forged, 0, _layer(decode, ticket))
    assert torch.all(decode.engine.kv_caches[0] == 0)


def test_receiver_refuses_wrong_shape_and_layer(decode, sender):
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    with pytest.raises(KVTransferError, match="shape"):
        sender.send_layer(ticket, 0, torch.ones(decode.layer_shape(len(ticket.block_ids) + 1)))
    with pytest.raises(KVTransferError, match="out of range"):
        sender.send_layer(ticket, decode.num_layers, _layer(decode, ticket))
    with pytest.raises(KVTransferError, match="before layers"):
        sender.commit(ticket, 7, None)
    assert torch.all(decode.engine.kv_caches[0] == 0)


def test_incompatible_layout_is_refused_before_any_bytes_move(decode):
    ticket = decode.reserve("r1", list(range(3, 20)), PARAMS)
    other = create_sender("inproc", "0123456789abcdef")
    with pytest.raises(KVTransferError, match="incompatible KV layout"):
        other.send_layer(ticket, 0, _layer(decode, ticket))


def test_abort_of_a_reserved_transfer_frees_its_blocks(decode, sender):
    bm = decode.engine.block_manager
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    sender.send_layer(ticket, 0, _layer(decode, ticket))
    sender.abort(ticket, "prefill failed")
    assert bm.num_used_blocks == 0 and decode.num_reserved == 0
    with pytest.raises(KVTransferError, match="unknown transfer id"):  # a late message is refused
        sender.send_layer(ticket, 1, _layer(decode, ticket))
    ticket2 = decode.reserve("r2", list(range(3, 40)), PARAMS)
    assert decode.abort_request("r2") and bm.num_used_blocks == 0
    with pytest.raises(KVTransferError, match="unknown transfer id"):
        sender.send_layer(ticket2, 0, _layer(decode, ticket2))


def test_reserve_returns_none_when_the_cache_is_full(decode):
    assert decode.reserve("big", list(range(3, 3 + 255)), PARAMS) is not None  # 16 of 32 blocks
    assert decode.reserve("big2", list(range(3, 3 + 255)), PARAMS) is not None
    assert decode.reserve("one-more", [5, 6, 7], PARAMS) is None


def test_unknown_backend_names_the_available_ones():
    with pytest.raises(ValueError, match="available: .*grpc.*inproc.*shm") as err:
        create_sender("carrier-pigeon", "x")
    assert "auto" in str(err.value)


def test_commit_with_a_token_outside_the_vocabulary_is_refused_and_frees_blocks(decode, sender):
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    for layer in range(decode.num_layers):
        sender.send_layer(ticket, layer, _layer(decode, ticket))
    with pytest.raises(KVTransferError, match="outside"):
        sender.commit(ticket, 10**6, None)
    assert decode.engine.block_manager.num_used_blocks == 0 and not decode.has_work()


def test_committed_sequences_beyond_max_num_seqs_wait_for_room(checkpoint):
    """The decode batch never exceeds engine.max_num_seqs: a committed sequence beyond it keeps its
    blocks and joins when a running one finishes, and still generates all its tokens."""
    cfg = EngineConfig(model=str(checkpoint("llama-gqa")), num_blocks=32, max_model_len=256, max_num_seqs=2,
                       max_num_batched_tokens=64)
    decode = DecodeEngine(Engine(cfg, "decode"))
    try:
        sender = create_sender("inproc", decode.compat_hash)
        lengths = {"r0": 2, "r1": 6, "r2": 3}
        for rid, n in lengths.items():
            ticket = decode.reserve(rid, list(range(3, 20)), dataclasses.replace(PARAMS, max_tokens=n, ignore_eos=True))
            for layer in range(decode.num_layers):
                sender.send_layer(ticket, layer, _layer(decode, ticket))
            sender.commit(ticket, 7, None)
        got: dict[str, int] = {}
        batches = []
        while decode.has_work():
            seqs = decode.step()
            batches.append(len(decode.engine.scheduler.running) + sum(s.finish_reason is not None for s in seqs))
            for s in seqs:
                got[s.request_id] = len(s.output_token_ids)
        assert max(batches) == 2 and batches[0] == 2
        assert got == lengths  # every sequence ran to its length, r2 after r0 made room
        assert decode.engine.block_manager.num_used_blocks == 0
    finally:
        decode.close()
