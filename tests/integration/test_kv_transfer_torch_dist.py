"""What is particular to the torch_distributed KV transfer backend (bytes over a gloo point-to-point
pair, control over a real gRPC server on loopback, into a real DecodeEngine): only metadata crosses
gRPC, refused messages never post a recv, a refused transfer resets the pair, an unreachable store
or a receiver without the backend is refused at connect, a receiver on the sender's GPU is refused
before any group is built (and `auto` takes shm to it), a grpc sender is taken too, close with
transfers in flight, a sender in another OS process works, and no store, group or thread is left.
Order under NCCL's matching rule (many transfers in flight on one pair) is in
tests/integration/test_kv_transfer_torch_dist_order.py.

The conformance tests every backend passes (bytes land in the reserved blocks, refusals, abort,
timeouts, bytes corrupted after their checksum, prefill -> decode matches the offline `LLM`, the
throughput print) are in tests/integration/test_kv_transfer_conformance.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from decode_worker import DecodeEngine
from kv_transfer.checksum import checksum
from kv_transfer import KVTransferError, create_sender
from kv_transfer.control_receiver import GrpcReceiver
from kv_transfer.shm_receiver import node_id
from kv_transfer.torch_dist_receiver import TorchDistReceiver
from kv_transfer.torch_dist_sender import TorchDistSender
from tests.integration.kv_helpers import (
    transfer,
    backend_fixtures,
    PARAMS, cache_is_zero as _cache_is_zero, decode_engine as _decode_engine, layer as _layer, spy_on_messages, spy_on_pairs as _spy_on_pairs,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


# The receiver is closed after each test with its TCPStore and process groups checked gone.
no_leftovers, decode, sender = backend_fixtures("torch_distributed")


# ------------------------------------------------------------------------------------ torch_distributed only
def test_only_metadata_crosses_grpc(decode, sender):
    assert isinstance(sender, TorchDistSender) and isinstance(decode.receiver, TorchDistReceiver)
    sent = spy_on_messages(sender)
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    layers = [_layer(decode, ticket, seed=layer) for layer in range(decode.num_layers)]
    for layer, kv in enumerate(layers):
        sender.send_layer(ticket, layer, kv)
    sender.commit(ticket, 7, None)
    assert decode.has_work() and decode.num_reserved == 0
    assert len(sent) == decode.num_layers
    assert [m.dist_tag for m in sent] == list(range(decode.num_layers))
    for msg, kv in zip(sent, layers):
        assert msg.payload == b"" and msg.dist_pair == sender.plane.pairs[decode.receiver.endpoint]
        assert msg.checksum == checksum(kv.numpy().tobytes())


@pytest.mark.parametrize(
    "tamper, message",
    [
        (dict(transfer_id="not-a-transfer"), "NOT_FOUND: unknown transfer id"),
        (dict(auth_token="forged"), "PERMISSION_DENIED: bad auth token"),
    ],
)
def test_unknown_transfer_and_bad_token_are_refused_before_any_recv(decode, sender, tamper, message):
    spy = _spy_on_pairs(decode, sender)
    old_pair = sender.plane.pairs[decode.receiver.endpoint]
    ticket = decode.reserve("r1", list(range(3, 20)), PARAMS)
    forged = dataclasses.replace(ticket, **tamper)
    sender.send_layer(forged, 0, _layer(decode, ticket))
    with pytest.raises(KVTransferError, match=message):
        sender.flush(forged)
    assert spy.recvs == 0 and _cache_is_zero(decode) and decode.num_reserved == 1
    # the unmatched send cannot stay on the channel: the pair was dropped, the next transfer makes a new one
    assert decode.receiver.endpoint not in sender.plane.pairs
    with pytest.raises(KVTransferError, match=message):
        sender.commit(forged, 7, None)
    kv = _layer(decode, ticket, seed=3)
    for layer in range(decode.num_layers):
        sender.send_layer(ticket, layer, kv)
    sender.commit(ticket, 7, None)
    assert sender.plane.pairs[decode.receiver.endpoint] != old_pair
    assert old_pair not in decode.receiver.planes["torch_distributed"].pairs
    assert torch.equal(decode.engine.kv_caches[1][:, ticket.block_ids], kv)


def test_unreachable_store_or_a_receiver_without_the_backend_is_refused(decode, checkpoint, monkeypatch):
    ticket = decode.reserve("r1", list(range(3, 20)), PARAMS)

    # a store the sender cannot reach (firewalled, another network): a clear refusal at connect
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{hole.getsockname()[1]}"  # bound, never listening: connection refused
        monkeypatch.setattr(decode.receiver.planes["torch_distributed"], "store_address", dead)
        far = TorchDistSender(decode.compat_hash, timeout_s=1.0)
        try:
            start = time.monotonic()
            with pytest.raises(KVTransferError, match=f"cannot reach the KV receiver's store at {dead}"):
                far.connect(decode.receiver.endpoint)
            assert time.monotonic() - start < 5.0
            with pytest.raises(KVTransferError, match="cannot reach"):  # cached for the endpoint
                far.send_layer(ticket, 0, _layer(decode, ticket))
        finally:
            far.close()
    monkeypatch.undo()

    # a grpc receiver
    d = DecodeEngine(_decode_engine(checkpoint), backend="grpc")
    s = TorchDistSender(d.compat_hash, timeout_s=5.0)
    try:
        assert isinstance(d.receiver, GrpcReceiver) and not isinstance(d.receiver, TorchDistReceiver)
        with pytest.raises(KVTransferError, match="does not take the torch_distributed backend"):
            s.connect(d.receiver.endpoint)
    finally:
        s.close()
        d.close()
    assert _cache_is_zero(decode) and decode.num_reserved == 1


def test_a_receiver_on_this_workers_gpu_is_refused_before_any_group_and_auto_takes_shm(decode, checkpoint):
    """Two workers sharing one GPU (num_gpus 0.5 each) cannot form an NCCL pair: the handshake
    compares the GPUs (`gpu_identity`, set here by hand: gloo stands in for NCCL on CPUs) and
    neither side builds a group; `auto` moves that KV through shared memory, and still takes a
    process group to a receiver on another GPU."""
    one_gpu = f"{node_id()}/0b42632a-bc5c-f731-724b-6936a19c4b24"
    decode.receiver.planes["torch_distributed"].gpu_id = one_gpu
    s = TorchDistSender(decode.compat_hash, timeout_s=5.0)
    try:
        s.plane.gpu_id = one_gpu
        with pytest.raises(KVTransferError, match="has its KV cache on this worker's GPU"):
            s.connect(decode.receiver.endpoint)
        assert not s.plane.pairs and not decode.receiver.planes["torch_distributed"].pairs
    finally:
        s.close()

    d = DecodeEngine(_decode_engine(checkpoint), backend="auto", dist_backend="gloo", timeout_s=5.0)
    d.receiver.planes["torch_distributed"].gpu_id = one_gpu
    senders = [create_sender("auto", d.compat_hash, timeout_s=5.0, dist_backend="gloo") for _ in range(2)]
    try:
        senders[0].dist.plane.gpu_id = one_gpu
        senders[1].dist.plane.gpu_id = f"{node_id()}/5d1c0e77-0000-4e1a-9c4f-1f2e3d4c5b6a"  # another GPU
        for i, (s, backend) in enumerate(zip(senders, ["shm", "torch_distributed"])):
            ticket = d.reserve(f"r{i}", list(range(3 + i, 40)), PARAMS)
            transfer(s, d, ticket, _layer(d, ticket, seed=i))
            assert s.backend_for(d.receiver.endpoint) == backend and set(s.bytes_sent) == {backend}
        assert len(d.receiver.planes["torch_distributed"].pairs) == 1  # the other GPU's only
    finally:
        for s in senders:
            s.close()
        d.close()


def test_a_grpc_sender_is_taken_too(decode):
    s = create_sender("grpc", decode.compat_hash, timeout_s=5.0)
    try:
        ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
        transfer(s, decode, ticket, _layer(decode, ticket))
        assert not decode.receiver.planes["torch_distributed"].pairs
    finally:
        s.close()


def test_close_with_transfers_in_flight(decode):
    s = TorchDistSender(decode.compat_hash, timeout_s=5.0)
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    s.send_layer(ticket, 0, _layer(decode, ticket))
    s.connect(decode.receiver.endpoint)
    assert s.plane.pairs
    s.close()
    assert not s.plane.pairs
    with pytest.raises(KVTransferError, match="closed"):
        s.send_layer(ticket, 1, _layer(decode, ticket))


# ------------------------------------------------------------------------------------ two processes
_CHILD = r"""
import json, sys, torch
from kv_transfer import TransferTicket, create_sender
args = json.loads(sys.argv[1])
ticket = TransferTicket(**args["ticket"])
sender = create_sender("torch_distributed", args["compat_hash"], timeout_s=20.0)
try:
    for layer in range(args["num_layers"]):
        g = torch.Generator().manual_seed(layer)
        sender.send_layer(ticket, layer, torch.randn(args["shape"], generator=g))
    sender.commit(ticket, 11, None)
finally:
    sender.close()
print("child-done", sorted(sender.plane.pairs) == [])
"""


def test_a_sender_in_another_process(decode):
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    shape = list(decode.layer_shape(len(ticket.block_ids)))
    args = dict(ticket=dataclasses.asdict(ticket), compat_hash=decode.compat_hash,
                num_layers=decode.num_layers, shape=shape)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(args)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "child-done True" in out.stdout
    cache = decode.engine.kv_caches
    for layer in range(decode.num_layers):
        g = torch.Generator().manual_seed(layer)
        assert torch.equal(cache[layer][:, ticket.block_ids], torch.randn(shape, generator=g))
    assert decode.num_reserved == 0 and decode.has_work()
