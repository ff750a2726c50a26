"""What is particular to the gRPC KV transfer backend, over a real server on loopback into a real
DecodeEngine: hand-built forged and malformed messages are refused with the right status before
they touch the cache (a stream that fails part-way keeps only what came before), and int8
compression lands within half a quantization step; a layer larger than a message travels as several
runs of blocks, and the receiver completes it only when every block came.

The conformance tests every backend passes (bytes land in the reserved blocks, refusals, abort,
timeouts, corrupted payload, prefill -> decode matches the offline `LLM`) are in
tests/integration/test_kv_transfer_conformance.py.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from kv_transfer.checksum import checksum
from kv_transfer.control_sender import GrpcSender
from kv_transfer.wire import MESSAGE_OPTIONS, wire_dtype
from proto import kv_transfer_pb2, kv_transfer_pb2_grpc
from tests.integration.kv_helpers import PARAMS, assert_refused, backend_fixtures, cache_is_zero, layer as _layer

pytestmark = pytest.mark.slow


no_leftovers, decode, _ = backend_fixtures("grpc")


@pytest.fixture
def stub(decode):
    channel = grpc.insecure_channel(decode.receiver.endpoint, options=MESSAGE_OPTIONS)
    yield kv_transfer_pb2_grpc.KVReceiverStub(channel)
    channel.close()


def _message(ticket, layer, kv, **override):
    payload = kv.contiguous().numpy().tobytes()
    fields = dict(
        transfer_id=ticket.transfer_id, auth_token=ticket.auth_token, layer=layer, dtype=wire_dtype(kv.dtype),
        shape=list(kv.shape), checksum=checksum(payload), payload=payload,
    )
    fields.update(override)
    return kv_transfer_pb2.KVLayer(**fields)


def test_receiver_refuses_corrupted_and_malformed_messages(decode, stub):
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    kv = _layer(decode, ticket)
    good = _message(ticket, 0, kv)
    flipped = bytearray(good.payload)
    flipped[100] ^= 0x01
    cases = [
        (_message(ticket, 0, kv, payload=bytes(flipped)), grpc.StatusCode.DATA_LOSS, "checksum mismatch"),
        (_message(ticket, 0, kv, dtype="float16"), grpc.StatusCode.INVALID_ARGUMENT,
         "dtype 'float16', expected float32"),
        (_message(ticket, 0, kv, dtype="int64"), grpc.StatusCode.INVALID_ARGUMENT, "dtype 'int64'"),
        (_message(ticket, 0, kv, shape=[2, 3, 16, 2, 15]), grpc.StatusCode.INVALID_ARGUMENT, "payload has"),
        (_message(ticket, 0, kv, compression="zstd"), grpc.StatusCode.INVALID_ARGUMENT, "compression"),
        (_message(ticket, 0, kv, first_block=1), grpc.StatusCode.INVALID_ARGUMENT, "outside the transfer"),
        (_message(ticket, 0, kv, auth_token="x"), grpc.StatusCode.PERMISSION_DENIED, "bad auth token"),
    ]
    assert_refused(stub, cases)
    assert cache_is_zero(decode)
    # a stream that fails part-way keeps what was accepted before the bad message, nothing after
    with pytest.raises(grpc.RpcError, match="checksum mismatch"):
        stub.SendLayers(iter([good, _message(ticket, 1, kv, checksum=good.checksum ^ 1)]), timeout=5)
    assert torch.equal(decode.engine.kv_caches[0][:, ticket.block_ids], kv)
    assert torch.all(decode.engine.kv_caches[1] == 0)
    ack = stub.SendLayers(iter([_message(ticket, 1, kv)]), timeout=5)
    assert ack.ok and ack.layers_received == 1
    ack = stub.Commit(kv_transfer_pb2.KVCommit(transfer_id=ticket.transfer_id, auth_token=ticket.auth_token,
                                               first_token=9, num_layers=2), timeout=5)
    assert ack.ok and decode.has_work()


def test_int8_compression_moves_a_quarter_of_the_bytes_within_a_half_step(decode):
    from kv_transfer.compression import quantize_int8

    sender = GrpcSender(decode.compat_hash, timeout_s=10, compression="int8")
    try:
        ticket = decode.reserve("r-int8", list(range(3, 40)), PARAMS)
        layers = [_layer(decode, ticket, seed=layer) for layer in range(decode.num_layers)]
        for layer, kv in enumerate(layers):
            sender.send_layer(ticket, layer, kv)
        sender.commit(ticket, 7, None)
        cache = decode.engine.kv_caches
        for layer, kv in enumerate(layers):
            got = cache[layer][:, ticket.block_ids]
            _, scales = quantize_int8(kv)
            assert torch.all((got - kv).abs() <= scales[:, :, None, None, None] / 2 + 1e-6)
    finally:
        sender.close()


@pytest.mark.parametrize("compression", ["none", "int8"])
def test_a_large_layer_travels_as_runs_of_blocks_and_lands_whole(decode, compression):
    sender = GrpcSender(decode.compat_hash, timeout_s=10, compression=compression)
    sent = []
    make = sender._layer_message
    sender._layer_message = lambda *a, **k: sent.append(make(*a, **k)) or sent[-1]
    try:
        ticket = decode.reserve("r-split", list(range(3, 40)), PARAMS)  # 3 blocks of 16
        layers = [_layer(decode, ticket, seed=layer) for layer in range(decode.num_layers)]
        sender.plane.max_message_bytes = layers[0].nbytes // 3 + 1  # one block per message
        for layer, kv in enumerate(layers):
            sender.send_layer(ticket, layer, kv)
        sender.commit(ticket, 7, None)
        assert [(m.layer, m.first_block, m.shape[1]) for m in sent] == [
            (layer, b, 1) for layer in range(decode.num_layers) for b in range(3)]
        cache = decode.engine.kv_caches
        for layer, kv in enumerate(layers):
            got = cache[layer][:, ticket.block_ids]
            assert torch.equal(got, kv) if compression == "none" else torch.allclose(got, kv, atol=0.05)
    finally:
        sender.close()


def test_a_layer_with_a_missing_run_of_blocks_is_not_complete(decode, stub):
    ticket = decode.reserve("r-partial", list(range(3, 40)), PARAMS)
    kv = _layer(decode, ticket)
    messages = [_message(ticket, layer, kv[:, b : b + 1].contiguous(), first_block=b)
                for layer in range(decode.num_layers) for b in (0, 2)]  # block 1 never comes
    assert stub.SendLayers(iter(messages), timeout=5).ok
    with pytest.raises(grpc.RpcError) as info:
        stub.Commit(kv_transfer_pb2.KVCommit(transfer_id=ticket.transfer_id, auth_token=ticket.auth_token,
                                             first_token=9, num_layers=decode.num_layers), timeout=5)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "before layers [0, 1]" in info.value.details()
    overflow = _message(ticket, 0, kv[:, :2].contiguous(), first_block=2)  # blocks [2, 4) of 3
    with pytest.raises(grpc.RpcError, match="outside the transfer"):
        stub.SendLayers(iter([overflow]), timeout=5)


def test_hostile_messages_never_touch_another_requests_blocks(decode, stub):
    """Fuzzed KVLayer messages (hypothesis): forged ids and tokens, replays of a committed transfer, wrong
    layers, shapes, sizes, dtypes, offsets, checksums and compression. Each is refused, or, when it is a
    well-formed layer of the one transfer it names with that transfer's token, it writes only that
    transfer's blocks: the blocks of every other request are untouched, bit for bit."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    victim = decode.reserve("victim", list(range(3, 40)), PARAMS)
    target = decode.reserve("target", list(range(50, 70)), PARAMS)
    done = decode.reserve("done", list(range(80, 100)), PARAMS)
    for t in (victim, done):
        assert stub.SendLayers(iter([_message(t, i, _layer(decode, t, seed=i)) for i in range(2)]), timeout=5).ok
    replays = [_message(done, i, _layer(decode, done, seed=i)) for i in range(2)]
    assert stub.Commit(kv_transfer_pb2.KVCommit(transfer_id=done.transfer_id, auth_token=done.auth_token,
                                                first_token=9, num_layers=2), timeout=5).ok
    caches = decode.engine.kv_caches
    others = [b for b in range(caches[0].shape[1]) if b not in target.block_ids]
    before = [c[:, others].clone() for c in caches]
    good = _message(target, 0, _layer(decode, target))
    ids = st.sampled_from([victim.transfer_id, target.transfer_id, done.transfer_id, "", "x" * 300])
    tokens = st.sampled_from([victim.auth_token, target.auth_token, done.auth_token, "", "forged"])

    def build(tid, tok, layer, dtype, shape, first, payload, fix_sum, compression, scales):
        fields = dict(transfer_id=tid, auth_token=tok, layer=layer, dtype=dtype, shape=shape, first_block=first,
                      payload=payload, checksum=checksum(payload) if fix_sum else 12345)
        if compression is not None:
            fields.update(compression=compression, scales=scales)
        return kv_transfer_pb2.KVLayer(**fields)

    payloads = st.sampled_from([good.payload, good.payload[:-4], good.payload + b"\0" * 4, b""]) | st.binary(max_size=64)
    forged = st.builds(build, ids, tokens, st.integers(0, 3) | st.integers(0, 2**32 - 1),
                       st.sampled_from(["float32", "float16", "bfloat16", "int8", "", "complex128"]),
                       st.sampled_from([list(good.shape)]) | st.lists(st.integers(0, 40) | st.integers(-1, 2**40), max_size=6),
                       st.integers(0, 4) | st.integers(0, 2**32 - 1), payloads, st.booleans(),
                       st.none() | st.sampled_from(["int8", "zstd", ""]), st.binary(max_size=32))

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(forged | st.sampled_from(replays))
    def check(msg):
        try:
            stub.SendLayers(iter([msg]), timeout=5)
            accepted = True
        except grpc.RpcError as e:
            assert e.code() in (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.INVALID_ARGUMENT,
                                grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND), (e.code(), e.details())
            accepted = False
        if accepted:
            assert (msg.transfer_id, msg.auth_token) == (target.transfer_id, target.auth_token)
        for c, b in zip(caches, before):
            assert torch.equal(c[:, others], b)

    check()
    assert decode.num_reserved == 2  # victim and target: nothing was committed or freed by the noise
