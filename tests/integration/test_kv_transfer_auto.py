"""`auto` picks a process group when both caches are on GPUs (NCCL; gloo stands in for it here, the
same path), shared memory for a decode worker on this node, a TCP data connection for one on
another node, and gRPC when none of them works."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
import torch

from decode_worker import DecodeEngine
from engine import Engine, EngineConfig, SamplingParams
from kv_transfer import create_sender

pytestmark = pytest.mark.slow
PARAMS = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture
def receivers(checkpoint):
    path = str(checkpoint("llama-gqa"))
    made = []

    def make(backend: str, **options) -> DecodeEngine:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        port = server.add_insecure_port("127.0.0.1:0")
        engine = Engine(EngineConfig(model=path, num_blocks=32, max_model_len=256), "decode")
        decode = DecodeEngine(engine, backend=backend, server=server, endpoint=f"127.0.0.1:{port}", **options)
        server.start()
        made.append((decode, server))
        return decode

    yield make
    for decode, server in made:
        decode.close()
        server.stop(0).wait()


def _transfer(decode: DecodeEngine, sender) -> None:
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    for layer in range(decode.num_layers):
        sender.send_layer(ticket, layer, torch.full(decode.layer_shape(len(ticket.block_ids)), layer + 1.0))
    sender.commit(ticket, 7, None)
    cache = decode.engine.kv_caches
    assert all(torch.all(cache[l][:, ticket.block_ids] == l + 1.0) for l in range(decode.num_layers))
    assert decode.has_work()


@pytest.mark.parametrize("receiver_backend, expected",
                         [("auto", "shm"), ("shm", "shm"), ("tcp", "tcp"), ("grpc", "grpc")])
def test_auto_sender_picks_shm_on_this_node_then_tcp_then_grpc(receivers, receiver_backend, expected):
    decode = receivers(receiver_backend)
    sender = create_sender("auto", decode.compat_hash, timeout_s=10)
    try:
        _transfer(decode, sender)
        assert sender.backend_for(decode.receiver.endpoint) == expected
        assert set(sender.bytes_sent) == {expected}
        if receiver_backend == "auto":  # CPU caches: no process group on either side
            assert sender.dist is None and not decode.receiver.planes["torch_distributed"].pairs
    finally:
        sender.close()


def test_auto_passes_in_place_down_to_its_shm_part(receivers):
    """AutoReceiver hands keywords down its cooperative chain (torch_distributed -> tcp -> shm):
    in_place=False keeps the decode cache private, so an auto sender on this node copies through
    its segments; the default shares it and writes in place."""
    private, shared = receivers("auto", in_place=False), receivers("auto")
    assert private.receiver.planes["shm"].shared is None and shared.receiver.planes["shm"].shared is not None
    sender = create_sender("auto", shared.compat_hash, timeout_s=10)
    try:
        for decode in (private, shared):
            _transfer(decode, sender)
            assert sender.backend_for(decode.receiver.endpoint) == "shm"
        assert sender.shm.plane.in_place_endpoints == [shared.receiver.endpoint]
    finally:
        sender.close()


def test_auto_between_two_accelerated_caches_takes_a_process_group(receivers):
    """Both sides with process groups (NCCL between CUDA caches; gloo stands in on CPUs): auto takes
    torch_distributed before shm, and falls back to shm when the receiver hosts none."""
    grouped = receivers("auto", dist_backend="gloo")
    plain = receivers("auto")  # a CPU cache: no store, no groups
    sender = create_sender("auto", grouped.compat_hash, timeout_s=10, dist_backend="gloo")
    try:
        _transfer(grouped, sender)
        assert sender.backend_for(grouped.receiver.endpoint) == "torch_distributed"
        assert set(sender.bytes_sent) == {"torch_distributed"}
        assert len(grouped.receiver.planes["torch_distributed"].pairs) == 1
        _transfer(plain, sender)
        assert sender.backend_for(plain.receiver.endpoint) == "shm" and "shm" in sender.bytes_sent
    finally:
        sender.close()


def test_a_group_whose_first_exchange_fails_is_refused_at_the_handshake_and_auto_takes_shm(receivers, monkeypatch):
    """A pair of ranks that cannot talk (NCCL refuses two ranks on one GPU) fails while it is being
    built, not at a request's first layer: auto then moves the KV through shared memory."""
    from kv_transfer import torch_dist_group

    first_exchange = torch_dist_group._first_exchange

    def refused(pg, rank, device, timeout_s):
        if rank == 1:  # the sender's side, as NCCL's "duplicate GPU" error would
            raise RuntimeError("ncclInvalidUsage: Duplicate GPU detected")
        first_exchange(pg, rank, device, 1.0)  # the receiver's side waits for it in vain

    monkeypatch.setattr(torch_dist_group, "_first_exchange", refused)
    grouped = receivers("auto", dist_backend="gloo")
    sender = create_sender("auto", grouped.compat_hash, timeout_s=10, dist_backend="gloo")
    try:
        _transfer(grouped, sender)
        assert sender.backend_for(grouped.receiver.endpoint) == "shm" and set(sender.bytes_sent) == {"shm"}
    finally:
        sender.close()


def test_auto_across_nodes_takes_the_data_connection(receivers):
    """An auto receiver that says it is on another node: shm is refused, the data connection is used."""
    decode = receivers("auto")
    decode.receiver.planes["shm"].node_id = "elsewhere/another-boot"
    sender = create_sender("auto", decode.compat_hash, timeout_s=10)
    try:
        _transfer(decode, sender)
        assert sender.backend_for(decode.receiver.endpoint) == "tcp"
        assert len(decode.receiver.planes["tcp"].connections) == 1
    finally:
        sender.close()


def test_auto_falls_back_to_grpc_when_the_data_port_cannot_be_reached(receivers):
    decode = receivers("auto")
    decode.receiver.planes["shm"].node_id = "elsewhere/another-boot"
    decode.receiver.planes["tcp"].data_port = 1  # advertised, but nothing listens there
    sender = create_sender("auto", decode.compat_hash, timeout_s=10)
    try:
        _transfer(decode, sender)
        assert sender.backend_for(decode.receiver.endpoint) == "grpc"
        assert not sender.tcp.plane.links  # refused at connect: no data connection was kept
    finally:
        sender.close()
