"""The shm KV transfer backend: bytes through /dev/shm, control over a real gRPC server on loopback.

Mirrors tests/integration/test_kv_transfer_grpc.py (the same conformance tests) into a real
DecodeEngine with backend="shm", plus what is particular to shared memory: a corrupted segment is
refused, segments are reused and unlinked, the receiver never keeps a mapping, a receiver on
another node (or without a shared /dev/shm) is refused at the handshake, and nothing is left in
/dev/shm afterwards. Ends with a throughput print, shm against grpc, for a 64 MiB layer.
"""

from __future__ import annotations

import dataclasses
import gc
import glob
import itertools
import os
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
from kv_transfer import KVTransferError, TransferTicket, create_receiver, create_sender
from kv_transfer.grpc_backend import MESSAGE_OPTIONS, GrpcReceiver, wire_dtype
from kv_transfer.shm_backend import SHM_DIR, ShmReceiver, ShmSender
from proto import kv_transfer_pb2, kv_transfer_pb2_grpc

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(max_tokens=4, temperature=0.0)
OTHER_HASH = "0123456789abcdef"
OURS = f"pdkv-{os.getpid()}-"  # every segment this process makes (sender's and the tests' own)


def _ours_in_shm() -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(SHM_DIR, OURS + "*")))


def _mapped_segments() -> list[str]:
    with open("/proc/self/maps") as f:
        return [line.strip() for line in f if "/pdkv-" in line]


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


@pytest.fixture(autouse=True)
def no_leftover_shm():
    """Set up before (torn down after) every sender: nothing of ours stays in /dev/shm or mapped."""
    assert not _ours_in_shm()
    yield
    gc.collect()
    assert not _ours_in_shm(), "segments left in /dev/shm"
    assert not _mapped_segments(), "segments still mapped"


@pytest.fixture
def server():
    executor = futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="test-decode-server")
    srv = grpc.server(executor, options=MESSAGE_OPTIONS)
    port = srv.add_insecure_port("127.0.0.1:0")
    yield srv, f"127.0.0.1:{port}"
    srv.stop(grace=None).wait()
    executor.shutdown(wait=True)


@pytest.fixture
def decode(checkpoint, server):
    srv, endpoint = server
    d = DecodeEngine(_decode_engine(checkpoint), backend="shm", server=srv, endpoint=endpoint)
    srv.start()
    yield d
    d.close()


@pytest.fixture
def sender(decode):
    s = create_sender("shm", decode.compat_hash, timeout_s=5.0)
    yield s
    s.close()


@pytest.fixture
def stub(decode):
    channel = grpc.insecure_channel(decode.receiver.endpoint, options=MESSAGE_OPTIONS)
    yield kv_transfer_pb2_grpc.KVReceiverStub(channel)
    channel.close()


_seg_ids = itertools.count()


@pytest.fixture
def segment():
    """`segment(data)` -> name of a /dev/shm segment holding `data` (made by the test, unlinked after)."""
    made = []

    def make(data: bytes) -> str:
        name = f"{OURS}test-{next(_seg_ids)}"
        with open(os.path.join(SHM_DIR, name), "wb") as f:
            f.write(data)
        made.append(name)
        return name

    yield make
    for name in made:
        os.unlink(os.path.join(SHM_DIR, name))


def _layer(decode, ticket, seed=0, extra_blocks=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(decode.layer_shape(len(ticket.block_ids) + extra_blocks), generator=g)


def _cache_is_zero(decode) -> bool:
    return all(torch.all(c == 0) for c in decode.engine.runner.kv_caches)


def _message(ticket, layer, kv, name, offset=0, **override):
    data = kv.contiguous().numpy().tobytes()
    fields = dict(
        transfer_id=ticket.transfer_id, auth_token=ticket.auth_token, layer=layer, dtype=wire_dtype(kv.dtype),
        shape=list(kv.shape), checksum=zlib.crc32(data),
        shm_name=name, shm_offset=offset, shm_nbytes=len(data),
    )
    fields.update(override)
    return kv_transfer_pb2.KVLayer(**fields)


def _slabs(sender) -> list[str]:
    return [n for n in sender.segments if n != sender._probe.name]


# ------------------------------------------------------------------------------------ conformance
def test_layers_land_in_the_reserved_blocks_and_commit_admits(decode, sender):
    assert isinstance(sender, ShmSender) and isinstance(decode.receiver, ShmReceiver)
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    assert ticket.backend == "shm" and ticket.kv_endpoint == decode.receiver.endpoint
    assert len(ticket.block_ids) == 3 and decode.engine.block_manager.num_used_blocks == 3
    layers = [_layer(decode, ticket, seed=layer) for layer in range(decode.num_layers)]
    for layer, kv in enumerate(layers):
        sender.send_layer(ticket, layer, kv)
    assert len(_slabs(sender)) == 1  # the transfer's layers share one segment
    sender.commit(ticket, 7, None)
    cache = decode.engine.runner.kv_caches
    for layer, kv in enumerate(layers):
        assert torch.equal(cache[layer][:, ticket.block_ids], kv)  # bit-exact
        untouched = [b for b in range(32) if b not in ticket.block_ids]
        assert torch.all(cache[layer][:, untouched] == 0)
    assert decode.has_work() and decode.num_reserved == 0 and decode.receiver.num_pending == 0
    assert sender.num_in_flight == 0 and not sender._leases


def test_only_metadata_crosses_the_control_channel(decode, sender):
    sent = []
    original = sender._layer_message

    def spy(*args):
        msg = original(*args)
        sent.append(msg)
        return msg

    sender._layer_message = spy
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    kv = _layer(decode, ticket)
    sender.send_layer(ticket, 0, kv)
    assert sender.flush(ticket) == 1
    (msg,) = sent
    assert msg.payload == b"" and msg.shm_name.startswith(OURS) and msg.shm_nbytes == kv.numel() * 4
    assert msg.checksum == zlib.crc32(kv.numpy().tobytes())


def test_segments_are_reused_across_transfers_and_unlinked(decode, sender):
    def transfer(s, rid):
        ticket = decode.reserve(rid, list(range(3, 40)), PARAMS)
        for layer in range(decode.num_layers):
            s.send_layer(ticket, layer, _layer(decode, ticket, seed=layer))
        s.commit(ticket, 7, None)
        decode.abort_request(rid)

    transfer(sender, "r1")
    first = _slabs(sender)
    assert len(first) == 1 and all(os.path.exists(os.path.join(SHM_DIR, n)) for n in first)
    transfer(sender, "r2")
    assert _slabs(sender) == first  # pooled, not made again

    # without a pool, a transfer's segments are unlinked at its commit and at its abort; with
    # small slabs, the first transfer grows its space, later ones get one slab sized for all layers
    lean = ShmSender(decode.compat_hash, timeout_s=5.0, slab_bytes=4096, pool_bytes=0)
    try:
        for rid, made_per_transfer in (("r3", decode.num_layers), ("r4", 1)):
            ticket = decode.reserve(rid, list(range(3, 40)), PARAMS)
            for layer in range(decode.num_layers):
                lean.send_layer(ticket, layer, _layer(decode, ticket))
            made = _slabs(lean)
            assert len(made) == made_per_transfer  # (a layer of 3 blocks is 12 KiB)
            lean.commit(ticket, 7, None)
            decode.abort_request(rid)
            assert not _slabs(lean) and not any(os.path.exists(os.path.join(SHM_DIR, n)) for n in made)
        ticket = decode.reserve("r5", list(range(3, 40)), PARAMS)
        lean.send_layer(ticket, 0, _layer(decode, ticket))
        made = _slabs(lean)
        lean.abort(ticket, "changed my mind")
        assert not _slabs(lean) and not any(os.path.exists(os.path.join(SHM_DIR, n)) for n in made)
    finally:
        lean.close()
    sender.close()  # close unlinks the pool and the probe
    assert not sender.segments and not _ours_in_shm()


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
    assert len(_slabs(sender)) == 4  # one per transfer in flight
    for t in reversed(tickets):  # commits in any order
        sender.commit(t, 5, None)
    cache = decode.engine.runner.kv_caches
    for t in tickets:
        for layer in range(decode.num_layers):
            assert torch.equal(cache[layer][:, t.block_ids], layers[t.transfer_id][layer])
    assert decode.num_reserved == 0 and len(decode._committed) == 4


def test_own_server_with_fewer_threads_than_open_streams(checkpoint):
    d = DecodeEngine(_decode_engine(checkpoint), backend="shm", max_workers=2)
    s = ShmSender(d.compat_hash, timeout_s=5.0)
    try:
        assert d.receiver.endpoint.startswith("127.0.0.1:")
        tickets = [d.reserve(f"r{i}", list(range(3, 30)), PARAMS) for i in range(5)]
        for layer in range(d.num_layers):
            for t in tickets:  # five streams open, two server threads
                s.send_layer(t, layer, _layer(d, t, seed=layer))
        start = time.monotonic()
        for t in reversed(tickets):
            s.commit(t, 5, None)
        assert time.monotonic() - start < 5.0 and d.num_reserved == 0
    finally:
        s.close()
        d.close()
    r = create_receiver("shm", d)
    endpoint = r.endpoint
    r.close()
    s2 = create_sender("shm", d.compat_hash, timeout_s=2.0)
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
    assert _cache_is_zero(decode) and decode.num_reserved == 1 and not sender._leases


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


def test_a_segment_corrupted_after_its_checksum_is_refused(decode, sender):
    """The sender's own path: a byte flips in the segment after the crc32 went into the message."""
    original = sender._layer_message

    def corrupting(ticket, layer, *rest):
        msg = original(ticket, layer, *rest)
        if layer == 1:
            region = rest[-1]
            region.slab.mm[region.offset + 100] ^= 0x01
        return msg

    sender._layer_message = corrupting
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    kv = _layer(decode, ticket)
    sender.send_layer(ticket, 0, kv)
    sender.send_layer(ticket, 1, kv)
    with pytest.raises(KVTransferError, match="DATA_LOSS: checksum mismatch for layer 1"):
        sender.flush(ticket)
    cache = decode.engine.runner.kv_caches
    assert torch.equal(cache[0][:, ticket.block_ids], kv) and torch.all(cache[1] == 0)
    with pytest.raises(KVTransferError, match=r"before layers \[1\]"):
        sender.commit(ticket, 7, None)
    assert decode.num_reserved == 1 and not sender._leases


def test_receiver_refuses_corrupted_and_malformed_messages(decode, stub, segment):
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    kv = _layer(decode, ticket)
    data = kv.numpy().tobytes()
    name = segment(b"\0" * 4096 + data)  # the layer at offset 4096
    flipped = bytearray(data)
    flipped[100] ^= 0x01
    bad = segment(bytes(flipped))
    short = segment(data[:-4])
    invalid, denied = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED
    cases = [
        (_message(ticket, 0, kv, bad), grpc.StatusCode.DATA_LOSS, "checksum mismatch"),
        (_message(ticket, 0, kv, name, offset=4092), grpc.StatusCode.DATA_LOSS, "checksum mismatch"),
        (_message(ticket, 0, kv, name, 4096, dtype="float16"), invalid,
         "dtype 'float16', expected float32"),
        (_message(ticket, 0, kv, name, 4096, dtype="int64"), invalid, "dtype 'int64'"),
        (_message(ticket, 0, kv, name, 4096, shape=[2, 3, 16, 2, 15]), invalid,
         "payload has"),
        (_message(ticket, 0, kv, short), invalid, "outside shared memory segment"),
        (_message(ticket, 0, kv, name, offset=1 << 40), invalid, "outside shared"),
        (_message(ticket, 0, kv, name, 4097), invalid, "not aligned"),
        (_message(ticket, 0, kv, name, 4096, shm_nbytes=0), invalid, "empty range"),
        (_message(ticket, 0, kv, OURS + "gone"), invalid, "not found"),
        (_message(ticket, 0, kv, "../../etc/passwd"), invalid, "bad shared memory segment"),
        (_message(ticket, 0, kv, "other-file"), invalid, "bad shared memory segment"),
        (_message(ticket, 0, kv, name, 4096, payload=b"x"), invalid, "both an inline"),
        (_message(ticket, 0, kv, name, 4096, compression="int8"), invalid, "inline (grpc) only"),
        (_message(ticket, 0, kv, name, 4096, first_block=1), invalid, "split layers"),
        (_message(ticket, 0, kv, name, 4096, auth_token="x"), denied, "bad auth token"),
        (_message(ticket, 0, kv, "../x", transfer_id="t"), grpc.StatusCode.NOT_FOUND, "unknown transfer id"),
    ]
    for msg, code, message in cases:
        with pytest.raises(grpc.RpcError) as info:
            stub.SendLayers(iter([msg]), timeout=5)
        assert info.value.code() == code and message in info.value.details(), (code, info.value.details())
    assert _cache_is_zero(decode)
    # a stream that fails part-way keeps what was accepted before the bad message, nothing after
    with pytest.raises(grpc.RpcError, match="checksum mismatch"):
        stub.SendLayers(iter([_message(ticket, 0, kv, name, 4096), _message(ticket, 1, kv, bad)]), timeout=5)
    assert torch.equal(decode.engine.runner.kv_caches[0][:, ticket.block_ids], kv)
    assert torch.all(decode.engine.runner.kv_caches[1] == 0)
    # an inline payload (a grpc sender) is taken too
    inline = _message(ticket, 1, kv, "", shm_nbytes=0, payload=data)
    ack = stub.SendLayers(iter([inline]), timeout=5)
    assert ack.ok and ack.layers_received == 1
    ack = stub.Commit(kv_transfer_pb2.KVCommit(transfer_id=ticket.transfer_id, auth_token=ticket.auth_token,
                                               first_token=9, num_layers=2), timeout=5)
    assert ack.ok and decode.has_work()
    assert not _mapped_segments()  # every message's mapping was closed, refused or not


def test_incompatible_layout_is_refused_at_handshake_before_any_bytes_move(decode, stub):
    response = stub.Handshake(kv_transfer_pb2.HandshakeRequest(compat_hash=OTHER_HASH), timeout=5)
    assert not response.ok and response.compat_hash == decode.compat_hash
    assert OTHER_HASH in response.reason and decode.compat_hash in response.reason
    assert stub.Handshake(kv_transfer_pb2.HandshakeRequest(compat_hash=decode.compat_hash), timeout=5).ok

    ticket = decode.reserve("r1", list(range(3, 20)), PARAMS)
    other = ShmSender(OTHER_HASH, timeout_s=5.0)
    try:
        with pytest.raises(KVTransferError, match="incompatible KV layout"):
            other.send_layer(ticket, 0, _layer(decode, ticket))
        forged = dataclasses.replace(ticket, compat_hash=OTHER_HASH)
        other.send_layer(forged, 0, _layer(decode, ticket))
        refused = f"refused the handshake: .*{OTHER_HASH}.*{decode.compat_hash}"
        with pytest.raises(KVTransferError, match=refused):
            other.commit(forged, 7, None)
        with pytest.raises(KVTransferError, match="refused the handshake"):  # cached: refused at once
            other.send_layer(forged, 1, _layer(decode, ticket))
        assert not other._leases  # nothing was copied for the refused endpoint
    finally:
        other.close()
    assert _cache_is_zero(decode) and decode.num_reserved == 1


def test_a_receiver_on_another_node_is_refused(decode, sender, monkeypatch):
    ticket = decode.reserve("r1", list(range(3, 20)), PARAMS)
    sender.connect(decode.receiver.endpoint)  # same node: fine

    monkeypatch.setattr(decode.receiver, "node_id", "elsewhere/0000")
    far = ShmSender(decode.compat_hash, timeout_s=5.0)
    try:
        with pytest.raises(KVTransferError, match="shm needs both workers on one node: .* on elsewhere/0000"):
            far.connect(decode.receiver.endpoint)
        with pytest.raises(KVTransferError, match="shm needs both workers on one node"):  # cached
            far.send_layer(ticket, 0, _layer(decode, ticket))
        with pytest.raises(KVTransferError, match="shm needs both workers on one node"):
            far.commit(ticket, 7, None)
    finally:
        far.close()
    monkeypatch.undo()

    # this host, but the receiver cannot see the sender's /dev/shm (another container)
    monkeypatch.setattr(decode.receiver, "shm_dir", "/nonexistent")
    walled = ShmSender(decode.compat_hash, timeout_s=5.0)
    try:
        walled_off = "shm needs both workers on one node sharing /dev/shm.*cannot see"
        with pytest.raises(KVTransferError, match=walled_off):
            walled.connect(decode.receiver.endpoint)
    finally:
        walled.close()
    assert _cache_is_zero(decode) and decode.num_reserved == 1


def test_a_receiver_without_shm_is_refused(checkpoint):
    d = DecodeEngine(_decode_engine(checkpoint), backend="grpc")
    s = ShmSender(d.compat_hash, timeout_s=5.0)
    try:
        assert isinstance(d.receiver, GrpcReceiver) and not isinstance(d.receiver, ShmReceiver)
        ticket = d.reserve("r1", list(range(3, 20)), PARAMS)
        s.send_layer(ticket, 0, _layer(d, ticket))
        with pytest.raises(KVTransferError, match="does not take the shm backend"):
            s.commit(ticket, 7, None)
        assert _cache_is_zero(d)
    finally:
        s.close()
        d.close()


def test_abort_of_a_reserved_transfer_frees_its_blocks(decode, sender):
    bm = decode.engine.block_manager
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    sender.send_layer(ticket, 0, _layer(decode, ticket))
    sender.abort(ticket, "prefill failed")
    assert bm.num_used_blocks == 0 and decode.num_reserved == 0 and decode.receiver.num_pending == 0
    assert not sender._leases
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
    assert sender.num_in_flight == 0 and not sender._leases  # forgotten, even when they fail


def test_a_receiver_that_is_gone_fails_within_the_timeout(decode, server):
    srv, _ = server
    sender = ShmSender(decode.compat_hash, timeout_s=1.0)
    try:
        ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
        sender.send_layer(ticket, 0, _layer(decode, ticket))
        assert sender.flush(ticket) == 1
        srv.stop(grace=None).wait()
        start = time.monotonic()
        with pytest.raises(KVTransferError, match="UNAVAILABLE|timed out|DEADLINE_EXCEEDED"):
            sender.send_layer(ticket, 1, _layer(decode, ticket))
            sender.commit(ticket, 7, None)
        with pytest.raises(KVTransferError):
            sender.abort(ticket, "receiver gone")
        assert time.monotonic() - start < 5.0 and not sender._leases
    finally:
        sender.close()


def test_a_receiver_that_never_answers_fails_within_the_timeout(decode):
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)
        ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
        ticket = dataclasses.replace(ticket, kv_endpoint=f"127.0.0.1:{hole.getsockname()[1]}")
        sender = ShmSender(decode.compat_hash, timeout_s=2.0)
        try:
            start = time.monotonic()
            for layer in range(decode.num_layers):
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


def test_close_with_transfers_in_flight_unlinks_everything(decode):
    s = ShmSender(decode.compat_hash, timeout_s=5.0)
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    s.send_layer(ticket, 0, _layer(decode, ticket))
    assert _ours_in_shm()
    s.close()
    assert not _ours_in_shm()
    with pytest.raises(KVTransferError, match="closed"):
        s.send_layer(ticket, 1, _layer(decode, ticket))


# ------------------------------------------------------------------------------------ end to end
PROMPTS = [list(range(3, 40)), [7, 1, 300, 42, 42, 9], list(range(100, 117)), [5] * 70]


def test_prefill_over_shm_then_decode_matches_the_offline_llm(checkpoint, decode):
    from pdcluster import LLM
    from prefill_worker import PrefillEngine

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    path = str(checkpoint("llama-gqa"))
    prefill_engine = Engine(EngineConfig(model=path, num_blocks=64, max_model_len=256), "prefill")
    sender = create_sender("shm", prefill_engine.runner.compat_hash, timeout_s=10.0)
    prefill = PrefillEngine(prefill_engine, sender)
    try:
        rids = [f"q{i}" for i in range(len(PROMPTS))]
        for rid, prompt in zip(rids, PROMPTS):
            ticket = decode.reserve(rid, prompt, params)
            assert ticket is not None and ticket.backend == "shm"
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
        for rid, prompt in zip(rids, PROMPTS):
            assert finished[rid].token_ids[len(prompt)] == first[rid]
        seqs = [finished[rid] for rid in rids]
    finally:
        sender.close()

    llm = LLM(path, num_blocks=128, max_model_len=256)
    try:
        want = llm.generate(PROMPTS, params)
    finally:
        llm.decode.close()
    assert [s.token_ids[len(p):] for s, p in zip(seqs, PROMPTS)] == [o.token_ids for o in want]
    for seq, out in zip(seqs, want):
        assert len(seq.logprobs) == len(out.logprobs) == 8
        for got, ref in zip(seq.logprobs, out.logprobs):
            assert got.token_id == ref.token_id and got.logprob == pytest.approx(ref.logprob, abs=1e-5)
            assert [t for t, _ in got.top] == [t for t, _ in ref.top]
            assert [p for _, p in got.top] == pytest.approx([p for _, p in ref.top], abs=1e-5)


# ------------------------------------------------------------------------------------ throughput
class _BigSink:
    """One 64 MiB layer (1024 blocks of 16 tokens x 8 heads x 64 dims, K and V, float32)."""

    compat_hash = "bench"
    num_layers = 1
    kv_dtype = torch.float32

    def __init__(self, num_blocks: int) -> None:
        self.cache = torch.zeros(self.layer_shape(num_blocks))

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, 16, 8, 64)

    def write_layer(self, ticket, layer, kv):
        self.cache.copy_(kv)

    def commit(self, ticket, first_token, logprob):
        pass

    def abort(self, ticket, reason):
        pass


def test_throughput_of_a_64_mib_layer_shm_against_grpc(capsys):
    """Not an assertion on speed: prints MB/s (send_layer .. commit returned) for each backend."""
    blocks = 1024
    kv = torch.randn(_BigSink(0).layer_shape(blocks))
    assert kv.numel() * 4 == 64 << 20
    rates = {}
    for backend in ("shm", "grpc"):
        sink = _BigSink(blocks)
        receiver = create_receiver(backend, sink)
        sender = create_sender(backend, sink.compat_hash, timeout_s=30.0)
        try:
            times = []
            for i in range(4):  # the first warms up: connection, handshake, segment
                ticket = TransferTicket(f"t{i}", receiver.endpoint, list(range(blocks)), "bench", "tok",
                                        16 * blocks, backend)
                receiver.expect(ticket)
                start = time.perf_counter()
                sender.send_layer(ticket, 0, kv)
                sender.commit(ticket, 1, None)
                times.append(time.perf_counter() - start)
            assert torch.equal(sink.cache, kv)
            rates[backend] = 64 * 1.048576 / min(times[1:])
        finally:
            sender.close()
            receiver.close()
    with capsys.disabled():
        print(f"\n64 MiB layer: shm {rates['shm']:.0f} MB/s, grpc {rates['grpc']:.0f} MB/s "
              f"({rates['shm'] / rates['grpc']:.1f}x)")
