"""What is particular to the shm KV transfer backend (bytes through /dev/shm, control over a real
gRPC server on loopback, into a real DecodeEngine): only metadata crosses the control channel,
segments are reused and unlinked, hand-built messages naming hostile, short, misaligned or missing
segments are refused, a receiver on another node (or without a shared /dev/shm, or without shm at
all) is refused at the handshake, close unlinks everything, and nothing is left in /dev/shm or
mapped afterwards. These are about the copying path (the receiver's cache stays private); writing
into a shared cache in place is tests/integration/test_kv_transfer_shm_in_place.py.

The conformance tests every backend passes (bytes land in the reserved blocks, refusals, abort,
timeouts, a segment corrupted after its checksum, prefill -> decode matches the offline `LLM`, the
throughput print) are in tests/integration/test_kv_transfer_conformance.py.
"""

from __future__ import annotations

import itertools
import os

import grpc
import pytest
import torch

from decode_worker import DecodeEngine
from kv_transfer.checksum import checksum
from kv_transfer import KVTransferError
from kv_transfer.control_receiver import GrpcReceiver
from kv_transfer.shm_cache import SHM_DIR
from kv_transfer.shm_receiver import ShmReceiver
from kv_transfer.shm_sender import ShmSender
from kv_transfer.wire import MESSAGE_OPTIONS, wire_dtype
from proto import kv_transfer_pb2, kv_transfer_pb2_grpc
from tests.integration.kv_helpers import (
    assert_refused, backend_fixtures,
    OURS, PARAMS, cache_is_zero as _cache_is_zero, decode_engine as _decode_engine, layer as _layer, mapped_segments as _mapped_segments,
    ours_in_shm as _ours_in_shm,
    spy_on_messages,
)

pytestmark = pytest.mark.slow


# Around every test: no threads, nothing of ours in /dev/shm or mapped. The receiver's cache stays
# private: these tests are about the segments (the copying path; writing in place is
# tests/integration/test_kv_transfer_shm_in_place.py).
no_leftovers, decode, sender = backend_fixtures("shm", in_place=False)


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


def _message(ticket, layer, kv, name, offset=0, **override):
    data = kv.contiguous().numpy().tobytes()
    fields = dict(
        transfer_id=ticket.transfer_id, auth_token=ticket.auth_token, layer=layer, dtype=wire_dtype(kv.dtype),
        shape=list(kv.shape), checksum=checksum(data),
        shm_name=name, shm_offset=offset, shm_nbytes=len(data),
    )
    fields.update(override)
    return kv_transfer_pb2.KVLayer(**fields)


def _slabs(sender) -> list[str]:
    return [n for n in sender.plane.segments if n != sender.plane._probe.name]


# ------------------------------------------------------------------------------------ shm only
def test_only_metadata_crosses_the_control_channel(decode, sender):
    sent = spy_on_messages(sender)
    assert isinstance(sender, ShmSender) and isinstance(decode.receiver, ShmReceiver)
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    kv = _layer(decode, ticket)
    for layer in range(decode.num_layers):
        sender.send_layer(ticket, layer, kv)
    assert len(_slabs(sender)) == 1  # the transfer's layers share one segment
    assert sender.flush(ticket) == decode.num_layers
    msg = sent[0]
    assert msg.payload == b"" and msg.shm_name.startswith(OURS) and msg.shm_nbytes == kv.numel() * 4
    assert msg.checksum == checksum(kv.numpy().tobytes())


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
    assert not sender.plane.segments and not _ours_in_shm()


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
        (_message(ticket, 0, kv, name, 4096, first_block=1), invalid, "outside the transfer"),
        (_message(ticket, 0, kv, name, 4096, auth_token="x"), denied, "bad auth token"),
        (_message(ticket, 0, kv, "../x", transfer_id="t"), grpc.StatusCode.NOT_FOUND, "unknown transfer id"),
    ]
    assert_refused(stub, cases)
    assert _cache_is_zero(decode)
    # a stream that fails part-way keeps what was accepted before the bad message, nothing after
    with pytest.raises(grpc.RpcError, match="checksum mismatch"):
        stub.SendLayers(iter([_message(ticket, 0, kv, name, 4096), _message(ticket, 1, kv, bad)]), timeout=5)
    assert torch.equal(decode.engine.kv_caches[0][:, ticket.block_ids], kv)
    assert torch.all(decode.engine.kv_caches[1] == 0)
    # an inline payload (a grpc sender) is taken too
    inline = _message(ticket, 1, kv, "", shm_nbytes=0, payload=data)
    ack = stub.SendLayers(iter([inline]), timeout=5)
    assert ack.ok and ack.layers_received == 1
    ack = stub.Commit(kv_transfer_pb2.KVCommit(transfer_id=ticket.transfer_id, auth_token=ticket.auth_token,
                                               first_token=9, num_layers=2), timeout=5)
    assert ack.ok and decode.has_work()
    # live segments stay mapped (senders reuse theirs), read-only; none once they are gone
    assert 0 < decode.receiver.planes["shm"].num_mappings <= 3 and _mapped_segments()
    assert all(line.split()[1].startswith("r--s") for line in _mapped_segments())
    for n in (name, bad, short):
        os.rename(os.path.join(SHM_DIR, n), os.path.join(SHM_DIR, n + "-moved"))
    decode.receiver.planes["shm"].sweep()
    assert decode.receiver.planes["shm"].num_mappings == 0 and not _mapped_segments()
    for n in (name, bad, short):
        os.rename(os.path.join(SHM_DIR, n + "-moved"), os.path.join(SHM_DIR, n))  # for the fixture to unlink


def test_a_receiver_on_another_node_is_refused(decode, sender, monkeypatch):
    ticket = decode.reserve("r1", list(range(3, 20)), PARAMS)
    sender.connect(decode.receiver.endpoint)  # same node: fine

    monkeypatch.setattr(decode.receiver.planes["shm"], "node_id", "elsewhere/0000")
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
    monkeypatch.setattr(decode.receiver.planes["shm"], "shm_dir", "/nonexistent")
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


def test_close_with_transfers_in_flight_unlinks_everything(decode):
    s = ShmSender(decode.compat_hash, timeout_s=5.0)
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    s.send_layer(ticket, 0, _layer(decode, ticket))
    assert _ours_in_shm()
    s.close()
    assert not _ours_in_shm()
    with pytest.raises(KVTransferError, match="closed"):
        s.send_layer(ticket, 1, _layer(decode, ticket))
