"""The gRPC KV transfer backend over a real server on loopback, into a real DecodeEngine.

Mirrors tests/unit/test_kv_transfer.py (the in-process conformance tests): bytes land exactly in the
reserved blocks, every forged or malformed message is refused with a clear error before it touches
the cache, aborts free blocks, a dead receiver fails within the timeout; and a prefill -> gRPC ->
decode run gives the same greedy tokens as the offline `LLM`.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
import zlib
from concurrent import futures

import grpc
import pytest
import torch

from decode_worker import DecodeEngine
from engine import Engine, EngineConfig, SamplingParams
from kv_transfer import KVTransferError, create_receiver, create_sender
from kv_transfer.grpc_backend import MESSAGE_OPTIONS, GrpcReceiver, GrpcSender, wire_dtype
from proto import kv_transfer_pb2, kv_transfer_pb2_grpc

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(max_tokens=4, temperature=0.0)
OTHER_HASH = "0123456789abcdef"


def _decode_engine(checkpoint) -> Engine:
    cfg = EngineConfig(model=str(checkpoint("llama-gqa")), num_blocks=32, max_model_len=256)
    return Engine(cfg, "decode")


@pytest.fixture(autouse=True)
def no_leftover_threads():
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5.0
    while True:
        extra = [t for t in threading.enumerate() if t not in before and t.is_alive() and not t.daemon]
        if not extra or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not extra, f"threads left running: {extra}"


@pytest.fixture
def server():
    """A server owned by the test, as the decode worker owns its own (the receiver only registers)."""
    executor = futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="test-decode-server")
    srv = grpc.server(executor, options=MESSAGE_OPTIONS)
    port = srv.add_insecure_port("127.0.0.1:0")
    yield srv, f"127.0.0.1:{port}"
    srv.stop(grace=None).wait()
    executor.shutdown(wait=True)


@pytest.fixture
def decode(checkpoint, server):
    srv, endpoint = server
    d = DecodeEngine(_decode_engine(checkpoint), backend="grpc", server=srv, endpoint=endpoint)
    srv.start()
    yield d
    d.close()


@pytest.fixture
def sender(decode):
    s = GrpcSender(decode.compat_hash, timeout_s=5.0)
    yield s
    s.close()


@pytest.fixture
def stub(decode):
    channel = grpc.insecure_channel(decode.receiver.endpoint, options=MESSAGE_OPTIONS)
    yield kv_transfer_pb2_grpc.KVReceiverStub(channel)
    channel.close()


def _layer(decode, ticket, seed=0, extra_blocks=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(decode.layer_shape(len(ticket.block_ids) + extra_blocks), generator=g)


def _cache_is_zero(decode) -> bool:
    return all(torch.all(c == 0) for c in decode.engine.runner.kv_caches)


def _message(ticket, layer, kv, **override):
    payload = kv.contiguous().numpy().tobytes()
    fields = dict(
        transfer_id=ticket.transfer_id, auth_token=ticket.auth_token, layer=layer, dtype=wire_dtype(kv.dtype),
        shape=list(kv.shape), checksum=zlib.crc32(payload), payload=payload,
    )
    fields.update(override)
    return kv_transfer_pb2.KVLayer(**fields)


# ------------------------------------------------------------------------------------ conformance
def test_layers_land_in_the_reserved_blocks_and_commit_admits(decode, sender):
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    assert ticket.backend == "grpc" and ticket.kv_endpoint == decode.receiver.endpoint
    assert len(ticket.block_ids) == 3 and decode.engine.block_manager.num_used_blocks == 3
    layers = [_layer(decode, ticket, seed=layer) for layer in range(decode.num_layers)]
    for layer, kv in enumerate(layers):
        sender.send_layer(ticket, layer, kv)
    sender.commit(ticket, 7, None)
    cache = decode.engine.runner.kv_caches
    for layer, kv in enumerate(layers):
        assert torch.equal(cache[layer][:, ticket.block_ids], kv)  # bit-exact
        untouched = [b for b in range(32) if b not in ticket.block_ids]
        assert torch.all(cache[layer][:, untouched] == 0)
    assert decode.has_work() and decode.num_reserved == 0 and decode.receiver.num_pending == 0
    assert sender.num_in_flight == 0


def test_flush_waits_for_the_receivers_acknowledgement(decode, sender):
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    kv = _layer(decode, ticket)
    sender.send_layer(ticket, 0, kv)
    sender.send_layer(ticket, 1, kv)
    assert sender.flush(ticket) == 2 and decode.receiver.num_pending == 1
    assert torch.equal(decode.engine.runner.kv_caches[1][:, ticket.block_ids], kv)


def test_many_transfers_in_flight_from_several_threads(decode, sender):
    tickets = [decode.reserve(f"r{i}", list(range(3, 20 + 9 * i)), PARAMS) for i in range(4)]
    layers = {t.transfer_id: [_layer(decode, t, seed=10 * i + l) for l in range(decode.num_layers)]
              for i, t in enumerate(tickets)}

    def push(subset):
        for layer in range(decode.num_layers):
            for t in subset:
                sender.send_layer(t, layer, layers[t.transfer_id][layer])

    threads = [threading.Thread(target=push, args=(tickets[i::2],)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for t in reversed(tickets):  # commits in any order
        sender.commit(t, 5, None)
    cache = decode.engine.runner.kv_caches
    for t in tickets:
        for layer in range(decode.num_layers):
            assert torch.equal(cache[layer][:, t.block_ids], layers[t.transfer_id][layer])
    assert decode.num_reserved == 0 and len(decode._committed) == 4


def test_own_server_with_fewer_threads_than_open_streams(checkpoint):
    """Without a server the receiver serves on its own port; a commit never waits behind open streams."""
    d = DecodeEngine(_decode_engine(checkpoint), backend="grpc", max_workers=2)
    s = GrpcSender(d.compat_hash, timeout_s=5.0)
    try:
        assert d.receiver.endpoint.startswith("127.0.0.1:")
        tickets = [d.reserve(f"r{i}", list(range(3, 30)), PARAMS) for i in range(5)]
        for layer in range(d.num_layers):
            for t in tickets:  # five streams open, two server threads
                s.send_layer(t, layer, _layer(d, t, seed=layer))
        start = time.monotonic()
        for t in reversed(tickets):  # the last-opened stream is still queued behind the others
            s.commit(t, 5, None)
        assert time.monotonic() - start < 5.0 and d.num_reserved == 0
    finally:
        s.close()
        d.close()
    # default kwargs work too, and close() stops the server it started
    r = create_receiver("grpc", d)
    endpoint = r.endpoint
    r.close()
    s2 = create_sender("grpc", d.compat_hash, timeout_s=2.0)
    try:
        ticket = dataclasses.replace(tickets[0], kv_endpoint=endpoint)
        with pytest.raises(KVTransferError, match="UNAVAILABLE"):
            s2.send_layer(ticket, 0, _layer(d, ticket))
            s2.commit(ticket, 5, None)
    finally:
        s2.close()


@pytest.mark.parametrize(
    "tamper, message",
    [
        (dict(transfer_id="not-a-transfer"), "NOT_FOUND: unknown transfer id"),
        (dict(auth_token="forged"), "PERMISSION_DENIED: bad auth token"),
    ],
)
def test_receiver_refuses_unknown_transfer_and_bad_token(decode, sender, tamper, message):
    ticket = decode.reserve("r1", list(range(3, 20)), PARAMS)
    forged = dataclasses.replace(ticket, **tamper)
    sender.send_layer(forged, 0, _layer(decode, ticket))
    with pytest.raises(KVTransferError, match=message):
        sender.flush(forged)
    with pytest.raises(KVTransferError, match=message):
        sender.commit(forged, 7, None)
    assert _cache_is_zero(decode) and decode.num_reserved == 1


def test_receiver_refuses_wrong_shape_and_layer(decode, sender):
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    sender.send_layer(ticket, 0, _layer(decode, ticket, extra_blocks=1))
    with pytest.raises(KVTransferError, match="INVALID_ARGUMENT: layer 0: shape"):
        sender.flush(ticket)
    sender.send_layer(ticket, decode.num_layers, _layer(decode, ticket))
    with pytest.raises(KVTransferError, match="INVALID_ARGUMENT: layer .* out of range"):
        sender.flush(ticket)
    sender.send_layer(ticket, 0, _layer(decode, ticket))  # a good layer still goes through
    assert sender.flush(ticket) == 1
    with pytest.raises(KVTransferError, match=r"FAILED_PRECONDITION: commit of .* before layers \[1\]"):
        sender.commit(ticket, 7, None)
    assert torch.all(decode.engine.runner.kv_caches[1] == 0) and decode.num_reserved == 1
    assert decode.engine.block_manager.num_used_blocks == 3


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
        (_message(ticket, 0, kv, first_block=1), grpc.StatusCode.INVALID_ARGUMENT, "split layers"),
        (_message(ticket, 0, kv, auth_token="x"), grpc.StatusCode.PERMISSION_DENIED, "bad auth token"),
    ]
    for msg, code, message in cases:
        with pytest.raises(grpc.RpcError) as info:
            stub.SendLayers(iter([msg]), timeout=5)
        assert info.value.code() == code and message in info.value.details(), (code, info.value.details())
    assert _cache_is_zero(decode)
    # a stream that fails part-way keeps what was accepted before the bad message, nothing after
    with pytest.raises(grpc.RpcError, match="checksum mismatch"):
        stub.SendLayers(iter([good, _message(ticket, 1, kv, checksum=good.checksum ^ 1)]), timeout=5)
    assert torch.equal(decode.engine.runner.kv_caches[0][:, ticket.block_ids], kv)
    assert torch.all(decode.engine.runner.kv_caches[1] == 0)
    ack = stub.SendLayers(iter([_message(ticket, 1, kv)]), timeout=5)
    assert ack.ok and ack.layers_received == 1
    ack = stub.Commit(kv_transfer_pb2.KVCommit(transfer_id=ticket.transfer_id, auth_token=ticket.auth_token,
                                               first_token=9, num_layers=2), timeout=5)
    assert ack.ok and decode.has_work()


def test_incompatible_layout_is_refused_at_handshake_before_any_bytes_move(decode, stub):
    response = stub.Handshake(kv_transfer_pb2.HandshakeRequest(compat_hash=OTHER_HASH), timeout=5)
    assert not response.ok and response.compat_hash == decode.compat_hash
    assert OTHER_HASH in response.reason and decode.compat_hash in response.reason
    assert stub.Handshake(kv_transfer_pb2.HandshakeRequest(compat_hash=decode.compat_hash), timeout=5).ok

    ticket = decode.reserve("r1", list(range(3, 20)), PARAMS)
    other = GrpcSender(OTHER_HASH, timeout_s=5.0)
    try:
        with pytest.raises(KVTransferError, match="incompatible KV layout"):  # the ticket says so already
            other.send_layer(ticket, 0, _layer(decode, ticket))
        # a ticket claiming the sender's layout: the receiver refuses at the handshake
        forged = dataclasses.replace(ticket, compat_hash=OTHER_HASH)
        other.send_layer(forged, 0, _layer(decode, ticket))
        refused = f"refused the handshake: .*{OTHER_HASH}.*{decode.compat_hash}"
        with pytest.raises(KVTransferError, match=refused):
            other.commit(forged, 7, None)
        with pytest.raises(KVTransferError, match="refused the handshake"):  # cached: refused at once
            other.send_layer(forged, 1, _layer(decode, ticket))
    finally:
        other.close()
    assert _cache_is_zero(decode) and decode.num_reserved == 1


def test_abort_of_a_reserved_transfer_frees_its_blocks(decode, sender):
    bm = decode.engine.block_manager
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    sender.send_layer(ticket, 0, _layer(decode, ticket))
    sender.abort(ticket, "prefill failed")
    assert bm.num_used_blocks == 0 and decode.num_reserved == 0 and decode.receiver.num_pending == 0
    sender.send_layer(ticket, 1, _layer(decode, ticket))  # a late message is refused
    with pytest.raises(KVTransferError, match="NOT_FOUND: unknown transfer id"):
        sender.flush(ticket)
    with pytest.raises(KVTransferError, match="NOT_FOUND: unknown transfer id"):
        sender.abort(ticket, "again")
    ticket2 = decode.reserve("r2", list(range(3, 40)), PARAMS)
    assert decode.abort_request("r2") and bm.num_used_blocks == 0
    sender.send_layer(ticket2, 0, _layer(decode, ticket2))
    with pytest.raises(KVTransferError, match="NOT_FOUND: unknown transfer id"):
        sender.commit(ticket2, 7, None)
    assert sender.num_in_flight == 0  # commit and abort forget a transfer, even when they fail


def test_a_receiver_that_is_gone_fails_within_the_timeout(decode, server):
    srv, _ = server
    sender = GrpcSender(decode.compat_hash, timeout_s=1.0)
    try:
        ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
        sender.send_layer(ticket, 0, _layer(decode, ticket))
        assert sender.flush(ticket) == 1  # connected and handshaken
        srv.stop(grace=None).wait()
        start = time.monotonic()
        with pytest.raises(KVTransferError, match="UNAVAILABLE|timed out|DEADLINE_EXCEEDED"):
            sender.send_layer(ticket, 1, _layer(decode, ticket))
            sender.commit(ticket, 7, None)
        with pytest.raises(KVTransferError):
            sender.abort(ticket, "receiver gone")
        assert time.monotonic() - start < 5.0
    finally:
        sender.close()


def test_a_receiver_that_never_answers_fails_within_the_timeout(decode):
    """A port that accepts connections but never speaks HTTP/2: every RPC hits its deadline."""
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)
        ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
        ticket = dataclasses.replace(ticket, kv_endpoint=f"127.0.0.1:{hole.getsockname()[1]}")
        sender = GrpcSender(decode.compat_hash, timeout_s=2.0)
        try:
            start = time.monotonic()
            for layer in range(decode.num_layers):  # the forward pass does not wait on the network
                sender.send_layer(ticket, layer, _layer(decode, ticket))
            assert time.monotonic() - start < 1.0
            with pytest.raises(KVTransferError, match="DEADLINE_EXCEEDED|timed out"):
                sender.commit(ticket, 7, None)
            with pytest.raises(KVTransferError, match="DEADLINE_EXCEEDED|timed out|UNAVAILABLE"):
                sender.abort(ticket, "stuck")
            assert time.monotonic() - start < 8.0
        finally:
            sender.close()
    assert _cache_is_zero(decode)


# ------------------------------------------------------------------------------------ end to end
PROMPTS = [list(range(3, 40)), [7, 1, 300, 42, 42, 9], list(range(100, 117)), [5] * 70]


def _run_disaggregated(checkpoint, decode, params):
    """Reserve on decode, prefill over gRPC, decode; returns the decode side's sequences by prompt."""
    from prefill_worker import PrefillEngine

    path = str(checkpoint("llama-gqa"))
    prefill_engine = Engine(EngineConfig(model=path, num_blocks=64, max_model_len=256), "prefill")
    sender = create_sender("grpc", prefill_engine.runner.compat_hash, timeout_s=10.0)
    prefill = PrefillEngine(prefill_engine, sender)
    try:
        rids = [f"q{i}" for i in range(len(PROMPTS))]
        for rid, prompt in zip(rids, PROMPTS):
            ticket = decode.reserve(rid, prompt, params)
            assert ticket is not None and ticket.backend == "grpc"
            prefill.add(rid, prompt, params, ticket)
        first = {}
        while prefill.has_work():
            for r in prefill.step():
                assert r.error is None and r.finish_reason is None, r
                first[r.request_id] = r.first_token
        assert sorted(first) == rids and decode.num_reserved == 0 and sender.num_in_flight == 0
        finished = {}
        for _ in range(100):
            for seq in decode.step():
                if seq.finish_reason is not None:
                    finished[seq.request_id] = seq
            if len(finished) == len(rids):
                break
        for rid, prompt in zip(rids, PROMPTS):  # decode continues from the token prefill committed
            assert finished[rid].token_ids[len(prompt)] == first[rid]
        return [finished[rid] for rid in rids]
    finally:
        sender.close()


def test_prefill_over_grpc_then_decode_matches_the_offline_llm(checkpoint, decode):
    from pdcluster import LLM

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    seqs = _run_disaggregated(checkpoint, decode, params)
    llm = LLM(str(checkpoint("llama-gqa")), num_blocks=128, max_model_len=256)
    try:
        want = llm.generate(PROMPTS, params)
    finally:
        llm.decode.close()
    assert [s.token_ids[len(p):] for s, p in zip(seqs, PROMPTS)] == [o.token_ids for o in want]
    for seq, out in zip(seqs, want):
        # decode's logprobs start with the first token's, which travelled in the Commit message
        assert len(seq.logprobs) == len(out.logprobs) == 8
        for got, ref in zip(seq.logprobs, out.logprobs):
            assert got.token_id == ref.token_id and got.logprob == pytest.approx(ref.logprob, abs=1e-5)
            assert [t for t, _ in got.top] == [t for t, _ in ref.top]
            assert [p for _, p in got.top] == pytest.approx([p for _, p in ref.top], abs=1e-5)


def test_int8_compression_moves_a_quarter_of_the_bytes_within_a_half_step(decode):
    from kv_transfer.compression import quantize_int8

    sender = GrpcSender(decode.compat_hash, timeout_s=10, compression="int8")
    try:
        ticket = decode.reserve("r-int8", list(range(3, 40)), PARAMS)
        layers = [_layer(decode, ticket, seed=layer) for layer in range(decode.num_layers)]
        for layer, kv in enumerate(layers):
            sender.send_layer(ticket, layer, kv)
        sender.commit(ticket, 7, None)
        cache = decode.engine.runner.kv_caches
        for layer, kv in enumerate(layers):
            got = cache[layer][:, ticket.block_ids]
            _, scales = quantize_int8(kv)
            assert torch.all((got - kv).abs() <= scales[:, :, None, None, None] / 2 + 1e-6)
    finally:
        sender.close()
