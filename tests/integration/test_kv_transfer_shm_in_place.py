"""The shm backend writing into the decode worker's shared cache in place (kv_transfer/shm_cache.py),
over a real gRPC server on loopback into a real DecodeEngine: layers land with no segment made and
only metadata on the control channel; the write fence keeps a stale sender out of blocks that are
no longer its transfer's and makes the receiver's clear wait for a write in progress; a receiver
that cannot make its shared cache falls back to the copying path; a restarted receiver's new cache
is mapped; nothing is left in /dev/shm or mapped afterwards.

The conformance suite (tests/integration/test_kv_transfer_conformance.py) runs on this path too
("shm"), and on the copying path ("shm+segments").
"""

from __future__ import annotations

import errno
import os
import threading
import time

import grpc
import pytest
import torch

from decode_worker import DecodeEngine
from kv_transfer import KVFaults, KVTransferError, create_sender
from kv_transfer.shm_sender import ShmSender
from kv_transfer.shm_cache import _lock, _unlock, fcntl
from proto import kv_transfer_pb2, kv_transfer_pb2_grpc
from tests.integration.kv_helpers import (
    transfer,
    backend_fixtures,
    PARAMS,
    cache_is_zero,
    decode_engine,
    grpc_server,
    layer,
    live_decode,
    live_sender,
    mapped_segments,
    ours_in_shm,
    spy_on_messages,
)

pytestmark = pytest.mark.slow


no_leftovers, decode, sender = backend_fixtures("shm", connect=True)


def _refused(endpoint: str, msg: kv_transfer_pb2.KVLayer, why: str) -> None:
    """A hand-built layer message sent on its own stream is refused with `why`."""
    channel = grpc.insecure_channel(endpoint)
    try:
        with pytest.raises(grpc.RpcError, match=why):
            kv_transfer_pb2_grpc.KVReceiverStub(channel).SendLayers(iter([msg]), timeout=5)
    finally:
        channel.close()


def test_layers_land_in_place_with_no_segment_and_only_metadata_sent(decode, sender):
    shared = decode.receiver.planes["shm"].shared
    assert shared is not None and sender.plane.in_place_endpoints == [decode.receiver.endpoint]
    # the engine's cache is the shared segment's memory
    assert decode.engine.kv_caches[0].data_ptr() == shared.cache[0].data_ptr()
    sent = spy_on_messages(sender)
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    layers = [layer(decode, ticket, seed=i) for i in range(decode.num_layers)]
    for i, kv in enumerate(layers):
        sender.send_layer(ticket, i, kv)
        # the bytes are in the blocks before the message is even read
        assert torch.equal(decode.engine.kv_caches[i][:, ticket.block_ids], kv)
    assert sender.plane.segments == [sender.plane._probe.name]  # no segment made for the transfer
    assert sender.flush(ticket) == decode.num_layers
    assert len(sent) == decode.num_layers and all(
        m.shm_in_place and not m.payload and m.shm_name == shared.name and not m.shm_nbytes
        and not m.shm_checksummed for m in sent)
    assert (shared.fence[ticket.block_ids] != 0).all()
    sender.commit(ticket, 7, None)
    assert (shared.fence == 0).all() and decode.num_reserved == 0 and decode.has_work()


def test_verified_layers_carry_the_checksum_of_their_blocks(decode, sender):
    sender.plane.verify_in_place = True
    sent = spy_on_messages(sender)
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    for i in range(decode.num_layers):
        sender.send_layer(ticket, i, layer(decode, ticket, seed=i))
    assert sender.flush(ticket) == decode.num_layers
    shared = decode.receiver.planes["shm"].shared
    assert [m.checksum for m in sent] == [shared.digest(i, ticket.block_ids) for i in range(decode.num_layers)]
    assert all(m.shm_checksummed for m in sent)
    sender.commit(ticket, 7, None)


def test_a_stale_sender_cannot_write_into_blocks_given_to_another_transfer(decode, sender):
    old = decode.reserve("r1", list(range(3, 40)), PARAMS)
    sender.send_layer(old, 0, layer(decode, old, seed=1))
    sender.flush(old)
    assert decode.abort_request("r1")  # the decode side drops it (a cancel, an expiry)
    for i in range(10):  # until the old blocks belong to another transfer
        new = decode.reserve(f"r{i + 2}", list(range(3, 40)), PARAMS)
        if set(new.block_ids) & set(old.block_ids):
            break
    assert set(new.block_ids) & set(old.block_ids)
    before = [c.clone() for c in decode.engine.kv_caches]
    sender.send_layer(old, 1, layer(decode, old, seed=2))  # late: written nowhere, refused
    with pytest.raises(KVTransferError, match="NOT_FOUND: unknown transfer id"):
        sender.flush(old)
    assert all(torch.equal(a, b) for a, b in zip(before, decode.engine.kv_caches))
    # a forged token cannot write either (the fence tag is derived from it)
    forged = type(new)(**{**new.__dict__, "auth_token": "0" * 32})
    sender.send_layer(forged, 0, layer(decode, new, seed=3))
    with pytest.raises(KVTransferError, match="PERMISSION_DENIED|bad auth token"):
        sender.flush(forged)
    assert all(torch.equal(a, b) for a, b in zip(before, decode.engine.kv_caches))
    for i in range(decode.num_layers):  # the rightful owner still can
        sender.send_layer(new, i, layer(decode, new, seed=10 + i))
    sender.commit(new, 7, None)
    assert torch.equal(decode.engine.kv_caches[1][:, new.block_ids], layer(decode, new, seed=11))


def test_clearing_the_fence_waits_for_a_write_in_progress(decode, sender):
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    sender.send_layer(ticket, 0, layer(decode, ticket))
    (_, mapping), = sender.plane._caches.values()
    first = ticket.block_ids[0]
    _lock(mapping._fd, fcntl.LOCK_SH, first, 1.0)  # the sender's lock, as during a layer's copy
    dropped = threading.Event()
    worker = threading.Thread(target=lambda: (decode.abort_request("r1"), dropped.set()))
    try:
        worker.start()
        time.sleep(0.3)
        assert not dropped.is_set() and decode.num_reserved == 1  # blocks not freed under a writer
    finally:
        _unlock(mapping._fd, first)
    worker.join(timeout=5)
    assert dropped.is_set() and decode.num_reserved == 0 and decode.engine.block_manager.num_used_blocks == 0


def test_a_receiver_without_room_for_its_shared_cache_falls_back_to_segments(checkpoint, monkeypatch, caplog):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)  # a full /dev/shm (a container's 64 MiB one)
    with grpc_server() as (srv, endpoint), live_decode(checkpoint, "shm", srv, endpoint) as d:
        monkeypatch.undo()
        assert d.receiver.planes["shm"].shared is None and "stays private" in caplog.text
        assert not [n for n in ours_in_shm() if "-cache-" in n]
        with live_sender("shm", d.compat_hash) as s:
            s.connect(d.receiver.endpoint)
            assert s.plane.in_place_endpoints == []
            ticket = d.reserve("r1", list(range(3, 40)), PARAMS)
            transfer(s, d, ticket, layer(d, ticket))


def test_in_place_messages_to_a_private_cache_are_refused(checkpoint, decode):
    with grpc_server() as (srv, endpoint), live_decode(checkpoint, "shm", srv, endpoint, in_place=False) as private:
        t2 = private.reserve("r1", list(range(3, 40)), PARAMS)
        # a message claiming in-place bytes for a receiver that has no shared cache
        msg = kv_transfer_pb2.KVLayer(transfer_id=t2.transfer_id, auth_token=t2.auth_token, layer=0,
                                      dtype="float32", shape=list(private.layer_shape(3)), shm_in_place=True,
                                      shm_name=decode.receiver.planes["shm"].shared.name)
        _refused(endpoint, msg, "not in shared memory")
        assert cache_is_zero(private) and private.receiver.num_pending == 1


def test_a_restarted_receiver_is_mapped_anew(checkpoint):
    """A decode worker restarted on the same address has a new shared cache: the sender notices that
    its mapping's segment is gone, handshakes again and writes into the new one; a message naming the
    old cache is refused, never taken for bytes that are not there."""
    d = DecodeEngine(decode_engine(checkpoint), backend="shm")
    endpoint = d.receiver.endpoint
    port = int(endpoint.rsplit(":", 1)[1])
    with live_sender("shm", d.compat_hash) as s:
        s.connect(endpoint)
        old = d.receiver.planes["shm"].shared.name
        sent = spy_on_messages(s)
        ticket = d.reserve("r1", list(range(3, 40)), PARAMS)
        s.send_layer(ticket, 0, layer(d, ticket))
        s.flush(ticket)
        d.close()
        d = DecodeEngine(decode_engine(checkpoint), backend="shm", port=port)
        try:
            stale = sent[0]  # what the sender wrote into the old cache, replayed to the new receiver
            t2 = d.reserve("r2", list(range(3, 40)), PARAMS)
            stale.transfer_id, stale.auth_token = t2.transfer_id, t2.auth_token
            _refused(endpoint, stale, "it restarted")
            assert cache_is_zero(d)
            for i in range(d.num_layers):
                s.send_layer(t2, i, layer(d, t2, seed=i))
            s.commit(t2, 7, None)
            assert d.receiver.planes["shm"].shared.name != old and s.plane.in_place_endpoints == [endpoint]
            for i in range(d.num_layers):
                assert torch.equal(d.engine.kv_caches[i][:, t2.block_ids], layer(d, t2, seed=i))
        finally:
            d.close()
    assert not mapped_segments() and not ours_in_shm()


def test_close_unmaps_the_cache_and_the_receiver_unlinks_it(decode):
    name = decode.receiver.planes["shm"].shared.name

    def mappings() -> int:
        with open("/proc/self/maps") as f:
            return sum(name in line for line in f)

    receiver_only = mappings()
    s = ShmSender(decode.compat_hash, timeout_s=5.0)
    s.connect(decode.receiver.endpoint)
    assert s.plane.in_place_endpoints == [decode.receiver.endpoint] and mappings() > receiver_only
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    s.send_layer(ticket, 0, layer(decode, ticket))  # the sender's mapping in use
    s.close()
    assert mappings() == receiver_only  # the sender's mapping is gone
    assert os.path.exists(os.path.join("/dev/shm", name))
    decode.close()
    assert not os.path.exists(os.path.join("/dev/shm", name))  # unlinked; the engine keeps its memory


def test_layer_messages_ride_in_the_commit_and_are_checked_there(decode, sender):
    """Written in place, a layer's message is held back: no SendLayers stream, one Commit carrying
    them, whose layers the receiver checks as if they had come on a stream."""
    sender.plane.verify_in_place = True
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    for i in range(decode.num_layers):
        sender.send_layer(ticket, i, layer(decode, ticket, seed=i))
    transfer = sender._transfers[ticket.transfer_id]
    assert not transfer.streams and len(transfer.deferred) == decode.num_layers
    sender.commit(ticket, 7, None)
    assert decode.num_reserved == 0 and decode.has_work()

    bad = decode.reserve("r2", list(range(3, 40)), PARAMS)
    for i in range(decode.num_layers):
        sender.send_layer(bad, i, layer(decode, bad, seed=i))
    (_, mapping), = sender.plane._caches.values()
    mapping._layers[1, 1, bad.block_ids[-1]].reshape(-1).view(torch.uint8)[7] ^= 0x01  # after its checksum
    with pytest.raises(KVTransferError, match="Commit to .* DATA_LOSS: checksum mismatch for layer 1"):
        sender.commit(bad, 7, None)
    assert decode.num_reserved == 1 and decode.receiver.num_pending == 1  # not committed; an abort frees it
    sender.abort(bad, "corrupt")
    assert decode.num_reserved == 0 and decode.engine.block_manager.num_used_blocks == 3


def test_fault_injection_reaches_the_layers_a_commit_carries(decode):
    """kv_transfer.faults treats the layers riding in a commit as layers: a corrupted one is refused
    (DATA_LOSS) and a dropped one leaves the commit short; the transfer is not committed either way."""
    for spec, refusal in (("corrupt=1,on=layer,count=1", "DATA_LOSS: checksum mismatch for layer 0"),
                          ("drop=1,on=layer,count=1", r"FAILED_PRECONDITION: commit of .* before layers \[0\]")):
        s = create_sender("shm", decode.compat_hash, timeout_s=5.0, faults=KVFaults.parse(spec))
        try:
            s.connect(decode.receiver.endpoint)
            ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
            for i in range(decode.num_layers):
                s.send_layer(ticket, i, layer(decode, ticket, seed=i))
            with pytest.raises(KVTransferError, match=refusal):
                s.commit(ticket, 7, None)
            assert decode.num_reserved == 1
            s.abort(ticket, "fault")
            assert decode.num_reserved == 0
        finally:
            s.close()
