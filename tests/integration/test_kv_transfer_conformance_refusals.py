"""The conformance suite every KV transfer backend passes, part two: forged or malformed transfers
are refused before they touch the cache, a payload corrupted after its checksum is refused, an
incompatible layout is refused at the handshake, aborts free blocks, and a dead or silent receiver
fails within the timeout.
"""

from __future__ import annotations

import dataclasses
import socket
import time

import grpc
import pytest
import torch

from kv_transfer import KVTransferError
from kv_transfer.wire import MESSAGE_OPTIONS
from proto import kv_transfer_pb2, kv_transfer_pb2_grpc
from tests.integration.kv_helpers import (
    OTHER_HASH, PARAMS, cache_is_zero, conformance_fixture, layer as _layer, spy_on_pairs,
)

pytestmark = pytest.mark.slow
kv = conformance_fixture()


# ------------------------------------------------------------------------------------ corruption hooks
# Each flips one bit of layer `target`'s bytes on the sender's own path, after the checksum went into
# the message: the receiver must refuse it with DATA_LOSS.
def _corrupt_grpc(sender, target: int) -> None:
    original = sender._layer_message

    def corrupting(ticket, layer, *rest):
        msg = original(ticket, layer, *rest)
        if layer == target:  # the inline payload
            flipped = bytearray(msg.payload)
            flipped[100] ^= 0x01
            msg.payload = bytes(flipped)
        return msg

    sender._layer_message = corrupting


def _corrupt_shm(sender, target: int) -> None:
    original = sender._layer_message
    sender.plane.verify_in_place = True  # written in place, a layer is checked only when it carries a checksum

    def corrupting(ticket, layer, *rest):
        msg = original(ticket, layer, *rest)
        if layer == target and msg.shm_in_place:  # a byte of the first block in the receiver's cache
            (_, mapping), = sender.plane._caches.values()
            mapping._layers[layer, 0, ticket.block_ids[0]].reshape(-1).view(torch.uint8)[100] ^= 0x01
        elif layer == target:  # the segment the message points at (rest: dtype, shape, payload, first block)
            region = rest[2]
            region.slab.mm[region.offset + 100] ^= 0x01
        return msg

    sender._layer_message = corrupting


def _corrupt_torch_distributed(sender, target: int) -> None:
    original = sender.plane._post_send
    posted = []

    def corrupting(pair, tensor, tag):
        posted.append(tag)
        if len(posted) == target + 1:  # the tensor about to be sent over the pair
            tensor.view(-1).view(torch.int32)[25] ^= 1
        return original(pair, tensor, tag)

    sender.plane._post_send = corrupting


def _corrupt_tcp(sender, target: int) -> None:
    original = sender.plane._queue_frame
    queued = []

    def corrupting(link, tag, staged):
        queued.append(tag)
        if len(queued) == target + 1:  # the bytes about to be written to the data connection
            staged.views[0][100] ^= 1
        return original(link, tag, staged)

    sender.plane._queue_frame = corrupting


CORRUPT = {"grpc": _corrupt_grpc, "shm": _corrupt_shm, "torch_distributed": _corrupt_torch_distributed,
           "tcp": _corrupt_tcp}


@pytest.mark.parametrize(
    "tamper, message",
    [
        (dict(transfer_id="not-a-transfer"), "NOT_FOUND: unknown transfer id"),
        (dict(auth_token="forged"), "PERMISSION_DENIED: bad auth token"),
    ],
)
def test_receiver_refuses_unknown_transfer_and_bad_token(kv, tamper, message):
    decode, sender = kv.decode, kv.sender
    ticket = decode.reserve("r1", list(range(3, 20)), PARAMS)
    forged = dataclasses.replace(ticket, **tamper)
    sender.send_layer(forged, 0, _layer(decode, ticket))
    with pytest.raises(KVTransferError, match=message):
        sender.flush(forged)
    with pytest.raises(KVTransferError, match=message):
        sender.commit(forged, 7, None)
    assert cache_is_zero(decode) and decode.num_reserved == 1 and kv.idle()


def test_receiver_refuses_wrong_shape_and_layer_and_an_early_commit(kv):
    decode, sender = kv.decode, kv.sender
    # torch_distributed: refused before any recv is posted (the next good layer goes over a new pair)
    spy = spy_on_pairs(decode, sender) if kv.backend == "torch_distributed" else None
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    sender.send_layer(ticket, 0, _layer(decode, ticket, extra_blocks=1))
    with pytest.raises(KVTransferError, match="INVALID_ARGUMENT: layer 0: shape"):
        sender.flush(ticket)
    sender.send_layer(ticket, decode.num_layers, _layer(decode, ticket))
    with pytest.raises(KVTransferError, match="INVALID_ARGUMENT: layer .* out of range"):
        sender.flush(ticket)
    assert cache_is_zero(decode) and (spy is None or spy.recvs == 0)
    sender.send_layer(ticket, 0, _layer(decode, ticket))  # a good layer still goes through
    assert sender.flush(ticket) == 1
    with pytest.raises(KVTransferError, match=r"FAILED_PRECONDITION: commit of .* before layers \[1\]"):
        sender.commit(ticket, 7, None)
    assert torch.all(decode.engine.kv_caches[1] == 0) and decode.num_reserved == 1
    assert decode.engine.block_manager.num_used_blocks == 3


def test_bytes_corrupted_after_their_checksum_are_refused(kv):
    decode, sender = kv.decode, kv.sender
    CORRUPT[kv.backend](sender, 1)
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    kv_ = _layer(decode, ticket)
    sender.send_layer(ticket, 0, kv_.clone())  # handed over: the hook may flip the bytes it was given
    sender.send_layer(ticket, 1, kv_.clone())
    with pytest.raises(KVTransferError, match="DATA_LOSS: checksum mismatch for layer 1"):
        sender.flush(ticket)
    cache = decode.engine.kv_caches
    assert torch.equal(cache[0][:, ticket.block_ids], kv_)
    in_place = kv.backend == "shm" and decode.receiver.planes["shm"].shared is not None
    if not in_place:  # in place: in blocks not yet live
        assert torch.all(cache[1] == 0)
    with pytest.raises(KVTransferError, match=r"before layers \[1\]"):
        sender.commit(ticket, 7, None)
    assert decode.num_reserved == 1 and kv.idle()


def test_incompatible_layout_is_refused_at_handshake_before_any_bytes_move(kv):
    decode = kv.decode
    channel = grpc.insecure_channel(decode.receiver.endpoint, options=MESSAGE_OPTIONS)
    try:
        stub = kv_transfer_pb2_grpc.KVReceiverStub(channel)
        response = stub.Handshake(kv_transfer_pb2.HandshakeRequest(compat_hash=OTHER_HASH), timeout=5)
        assert not response.ok and response.compat_hash == decode.compat_hash
        assert OTHER_HASH in response.reason and decode.compat_hash in response.reason
        assert stub.Handshake(kv_transfer_pb2.HandshakeRequest(compat_hash=decode.compat_hash), timeout=5).ok
    finally:
        channel.close()

    ticket = decode.reserve("r1", list(range(3, 20)), PARAMS)
    other = kv.new_sender(OTHER_HASH)
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
        if kv.backend == "shm":
            assert not other.plane._leases  # nothing was copied for the refused endpoint
        if kv.backend == "torch_distributed":
            assert not other.plane.pairs
            assert not decode.receiver.planes["torch_distributed"].pairs  # no group was made
        if kv.backend == "tcp":
            assert not other.plane.links
            assert not decode.receiver.planes["tcp"].connections  # no data connection was made
    finally:
        other.close()
    assert cache_is_zero(decode) and decode.num_reserved == 1


def test_abort_of_a_reserved_transfer_frees_its_blocks(kv):
    decode, sender = kv.decode, kv.sender
    bm = decode.engine.block_manager
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    sender.send_layer(ticket, 0, _layer(decode, ticket))
    sender.abort(ticket, "prefill failed")
    assert bm.num_used_blocks == 0 and decode.num_reserved == 0 and decode.receiver.num_pending == 0
    assert kv.idle()
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
    assert kv.idle()  # commit and abort forget a transfer, even when they fail
    ticket3 = decode.reserve("r3", list(range(3, 40)), PARAMS)  # the channel still works afterwards
    for layer in range(decode.num_layers):
        sender.send_layer(ticket3, layer, _layer(decode, ticket3))
    sender.commit(ticket3, 7, None)
    assert decode.num_reserved == 0 and not cache_is_zero(decode)


def test_a_receiver_that_is_gone_fails_within_the_timeout(kv):
    decode = kv.decode
    sender = kv.new_sender(timeout_s=1.0)
    try:
        ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
        sender.send_layer(ticket, 0, _layer(decode, ticket))
        assert sender.flush(ticket) == 1  # connected and handshaken
        kv.server.stop(grace=None).wait()
        if kv.backend == "torch_distributed":
            decode.receiver.close()  # its store and groups go too
        start = time.monotonic()
        with pytest.raises(KVTransferError, match="UNAVAILABLE|timed out|DEADLINE_EXCEEDED"):
            sender.send_layer(ticket, 1, _layer(decode, ticket))
            sender.commit(ticket, 7, None)
        with pytest.raises(KVTransferError):
            sender.abort(ticket, "receiver gone")
        assert time.monotonic() - start < 5.0 and kv.idle(sender)
    finally:
        sender.close()


def test_a_receiver_that_never_answers_fails_within_the_timeout(kv):
    """A port that accepts connections but never speaks HTTP/2: every RPC hits its deadline."""
    decode = kv.decode
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)
        ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
        ticket = dataclasses.replace(ticket, kv_endpoint=f"127.0.0.1:{hole.getsockname()[1]}")
        sender = kv.new_sender(timeout_s=2.0)
        try:
            start = time.monotonic()
            for layer in range(decode.num_layers):  # the forward pass does not wait on the network
                sender.send_layer(ticket, layer, _layer(decode, ticket))
            assert time.monotonic() - start < 1.0
            with pytest.raises(KVTransferError, match="DEADLINE_EXCEEDED|timed out"):
                sender.commit(ticket, 7, None)
            if kv.backend != "torch_distributed":
                with pytest.raises(KVTransferError, match="DEADLINE_EXCEEDED|timed out|UNAVAILABLE"):
                    sender.abort(ticket, "stuck")
            assert time.monotonic() - start < 8.0
        finally:
            sender.close()
    assert cache_is_zero(decode)
