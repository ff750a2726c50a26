"""The torch_distributed KV transfer backend: bytes over a gloo point-to-point pair, control over gRPC.

Mirrors the shm conformance tests (tests/integration/test_kv_transfer_shm.py) into a real
DecodeEngine with backend="torch_distributed", plus what is particular to a process group
channel: refused messages never post a recv, a refused or failed transfer resets the pair, an
unreachable store is refused at connect, a sender in another OS process works, and no store,
group or thread is left after each test. Ends with a throughput print for a 64 MiB layer.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import socket
import subprocess
import sys
import threading
import time
import zlib
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch

from decode_worker import DecodeEngine
from engine import Engine, EngineConfig, SamplingParams
from kv_transfer import KVTransferError, TransferTicket, create_receiver, create_sender
from kv_transfer.grpc_backend import MESSAGE_OPTIONS, GrpcReceiver
from kv_transfer.torch_dist_backend import TorchDistReceiver, TorchDistSender

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(max_tokens=4, temperature=0.0)
OTHER_HASH = "0123456789abcdef"
REPO = Path(__file__).resolve().parents[2]


def _decode_engine(checkpoint) -> Engine:
    cfg = EngineConfig(model=str(checkpoint("llama-gqa")), num_blocks=32, max_model_len=256)
    return Engine(cfg, "decode")


def _port_is_closed(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return True
    return False


@pytest.fixture(autouse=True)
def no_leftover_threads():
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5.0
    while True:
        extra = [t for t in threading.enumerate() if t not in before and t.is_alive()
                 and (not t.daemon or t.name.startswith("kv-dist-pair"))]
        if not extra or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not extra, f"threads left running: {extra}"


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
    d = DecodeEngine(_decode_engine(checkpoint), backend="torch_distributed", server=srv, endpoint=endpoint,
                     timeout_s=5.0)
    srv.start()
    port = d.receiver._store.port
    yield d
    d.close()
    assert not d.receiver.pairs and d.receiver._store is None
    gc.collect()
    assert _port_is_closed(port), "the receiver's TCPStore is still listening"


@pytest.fixture
def sender(decode):
    s = create_sender("torch_distributed", decode.compat_hash, timeout_s=5.0)
    yield s
    s.close()
    assert not s.pairs


class _RecvSpy:
    """Stands in for a receiver pair's process group: counts the recvs posted."""

    def __init__(self, pg):
        self.pg, self.recvs = pg, 0

    def recv(self, *args):
        self.recvs += 1
        return self.pg.recv(*args)

    def __getattr__(self, name):
        return getattr(self.pg, name)


def _spy_on_pairs(decode, sender) -> _RecvSpy:
    sender.connect(decode.receiver.endpoint)
    (key,) = decode.receiver.pairs
    pair = decode.receiver._pairs[key]
    assert pair.ready.wait(5) and pair.pg is not None
    pair.pg = spy = _RecvSpy(pair.pg)
    return spy


def _layer(decode, ticket, seed=0, extra_blocks=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(decode.layer_shape(len(ticket.block_ids) + extra_blocks), generator=g)


def _cache_is_zero(decode) -> bool:
    return all(torch.all(c == 0) for c in decode.engine.runner.kv_caches)


# ------------------------------------------------------------------------------------ conformance
def test_layers_land_in_the_reserved_blocks_and_only_metadata_crosses_grpc(decode, sender):
    assert isinstance(sender, TorchDistSender) and isinstance(decode.receiver, TorchDistReceiver)
    sent = []
    original = sender._layer_message

    def spy(*args):
        msg = original(*args)
        sent.append(msg)
        return msg

    sender._layer_message = spy
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    assert ticket.backend == "torch_distributed" and len(ticket.block_ids) == 3
    layers = [_layer(decode, ticket, seed=layer) for layer in range(decode.num_layers)]
    for layer, kv in enumerate(layers):
        buffer = kv.clone()
        sender.send_layer(ticket, layer, buffer)
        buffer.zero_()  # the caller may reuse its buffer at once: the layer was copied
    sender.commit(ticket, 7, None)
    cache = decode.engine.runner.kv_caches
    for layer, kv in enumerate(layers):
        assert torch.equal(cache[layer][:, ticket.block_ids], kv)  # bit-exact
        untouched = [b for b in range(32) if b not in ticket.block_ids]
        assert torch.all(cache[layer][:, untouched] == 0)
    assert decode.has_work() and decode.num_reserved == 0 and decode.receiver.num_pending == 0
    assert sender.num_in_flight == 0
    assert len(sent) == decode.num_layers
    assert [m.dist_tag for m in sent] == list(range(decode.num_layers))
    for msg, kv in zip(sent, layers):
        assert msg.payload == b"" and msg.dist_pair == sender.pairs[decode.receiver.endpoint]
        assert msg.checksum == zlib.crc32(kv.numpy().tobytes())


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
    assert sender.flush(tickets[0]) == decode.num_layers
    for t in reversed(tickets):  # commits in any order
        sender.commit(t, 5, None)
    cache = decode.engine.runner.kv_caches
    for t in tickets:
        for layer in range(decode.num_layers):
            assert torch.equal(cache[layer][:, t.block_ids], layers[t.transfer_id][layer])
    assert decode.num_reserved == 0 and len(decode._committed) == 4
    assert len(decode.receiver.pairs) == 1  # one pair carried them all


@pytest.mark.parametrize(
    "tamper, message",
    [
        (dict(transfer_id="not-a-transfer"), "NOT_FOUND: unknown transfer id"),
        (dict(auth_token="forged"), "PERMISSION_DENIED: bad auth token"),
    ],
)
def test_unknown_transfer_and_bad_token_are_refused_before_any_recv(decode, sender, tamper, message):
    spy = _spy_on_pairs(decode, sender)
    old_pair = sender.pairs[decode.receiver.endpoint]
    ticket = decode.reserve("r1", list(range(3, 20)), PARAMS)
    forged = dataclasses.replace(ticket, **tamper)
    sender.send_layer(forged, 0, _layer(decode, ticket))
    with pytest.raises(KVTransferError, match=message):
        sender.flush(forged)
    assert spy.recvs == 0 and _cache_is_zero(decode) and decode.num_reserved == 1
    # the unmatched send cannot stay on the channel: the pair was dropped, the next transfer makes a new one
    assert decode.receiver.endpoint not in sender.pairs
    with pytest.raises(KVTransferError, match=message):
        sender.commit(forged, 7, None)
    kv = _layer(decode, ticket, seed=3)
    for layer in range(decode.num_layers):
        sender.send_layer(ticket, layer, kv)
    sender.commit(ticket, 7, None)
    assert sender.pairs[decode.receiver.endpoint] != old_pair and old_pair not in decode.receiver.pairs
    assert torch.equal(decode.engine.runner.kv_caches[1][:, ticket.block_ids], kv)


def test_wrong_shape_and_layer_are_refused_before_any_recv(decode, sender):
    spy = _spy_on_pairs(decode, sender)
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    sender.send_layer(ticket, 0, _layer(decode, ticket, extra_blocks=1))
    with pytest.raises(KVTransferError, match="INVALID_ARGUMENT: layer 0: shape"):
        sender.flush(ticket)
    sender.send_layer(ticket, decode.num_layers, _layer(decode, ticket))
    with pytest.raises(KVTransferError, match="INVALID_ARGUMENT: layer .* out of range"):
        sender.flush(ticket)
    assert spy.recvs == 0
    sender.send_layer(ticket, 0, _layer(decode, ticket))  # a good layer still goes through (new pair)
    assert sender.flush(ticket) == 1
    with pytest.raises(KVTransferError, match=r"FAILED_PRECONDITION: commit of .* before layers \[1\]"):
        sender.commit(ticket, 7, None)
    assert torch.all(decode.engine.runner.kv_caches[1] == 0) and decode.num_reserved == 1


def test_bytes_corrupted_after_their_checksum_are_refused(decode, sender):
    original = sender._post_send
    posted = []

    def corrupting(pair, tensor, tag):
        posted.append(tag)
        if len(posted) == 2:  # layer 1: flip a bit after the crc32 went into the message
            tensor.view(-1).view(torch.int32)[25] ^= 1
        return original(pair, tensor, tag)

    sender._post_send = corrupting
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
    assert decode.num_reserved == 1


def test_incompatible_or_unsuitable_receivers_are_refused_at_handshake(decode, checkpoint, monkeypatch):
    ticket = decode.reserve("r1", list(range(3, 20)), PARAMS)
    other = TorchDistSender(OTHER_HASH, timeout_s=5.0)
    try:
        forged = dataclasses.replace(ticket, compat_hash=OTHER_HASH)
        other.send_layer(forged, 0, _layer(decode, ticket))
        with pytest.raises(KVTransferError, match=f"refused the handshake: .*{OTHER_HASH}"):
            other.commit(forged, 7, None)
        with pytest.raises(KVTransferError, match="refused the handshake"):  # cached
            other.send_layer(forged, 1, _layer(decode, ticket))
        assert not other.pairs and not decode.receiver.pairs
    finally:
        other.close()

    # a store the sender cannot reach (firewalled, another network): a clear refusal at connect
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{hole.getsockname()[1]}"  # bound, never listening: connection refused
        monkeypatch.setattr(decode.receiver, "store_address", dead)
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


def test_a_grpc_sender_is_taken_too(decode):
    s = create_sender("grpc", decode.compat_hash, timeout_s=5.0)
    try:
        ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
        kv = _layer(decode, ticket)
        for layer in range(decode.num_layers):
            s.send_layer(ticket, layer, kv)
        s.commit(ticket, 7, None)
        assert torch.equal(decode.engine.runner.kv_caches[0][:, ticket.block_ids], kv)
        assert not decode.receiver.pairs
    finally:
        s.close()


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
    assert sender.num_in_flight == 0
    ticket3 = decode.reserve("r3", list(range(3, 40)), PARAMS)  # the channel still works afterwards
    for layer in range(decode.num_layers):
        sender.send_layer(ticket3, layer, _layer(decode, ticket3))
    sender.commit(ticket3, 7, None)
    assert decode.num_reserved == 0


def test_a_receiver_that_is_gone_fails_within_the_timeout(decode, server):
    srv, _ = server
    sender = TorchDistSender(decode.compat_hash, timeout_s=1.0)
    try:
        ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
        sender.send_layer(ticket, 0, _layer(decode, ticket))
        assert sender.flush(ticket) == 1
        srv.stop(grace=None).wait()
        decode.receiver.close()  # its store and groups go too
        start = time.monotonic()
        with pytest.raises(KVTransferError, match="UNAVAILABLE|timed out|DEADLINE_EXCEEDED"):
            sender.send_layer(ticket, 1, _layer(decode, ticket))
            sender.commit(ticket, 7, None)
        with pytest.raises(KVTransferError):
            sender.abort(ticket, "receiver gone")
        assert time.monotonic() - start < 5.0 and sender.num_in_flight == 0
    finally:
        sender.close()


def test_a_receiver_that_never_answers_fails_within_the_timeout(decode):
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)
        ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
        ticket = dataclasses.replace(ticket, kv_endpoint=f"127.0.0.1:{hole.getsockname()[1]}")
        sender = TorchDistSender(decode.compat_hash, timeout_s=2.0)
        try:
            start = time.monotonic()
            for layer in range(decode.num_layers):
                sender.send_layer(ticket, layer, _layer(decode, ticket))
            assert time.monotonic() - start < 1.0  # send_layer never waits on the network
            with pytest.raises(KVTransferError, match="DEADLINE_EXCEEDED|timed out"):
                sender.commit(ticket, 7, None)
            assert time.monotonic() - start < 8.0
        finally:
            sender.close()
    assert _cache_is_zero(decode)


def test_close_with_transfers_in_flight(decode):
    s = TorchDistSender(decode.compat_hash, timeout_s=5.0)
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    s.send_layer(ticket, 0, _layer(decode, ticket))
    s.connect(decode.receiver.endpoint)
    assert s.pairs
    s.close()
    assert not s.pairs
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
print("child-done", sorted(sender.pairs) == [])
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
    cache = decode.engine.runner.kv_caches
    for layer in range(decode.num_layers):
        g = torch.Generator().manual_seed(layer)
        assert torch.equal(cache[layer][:, ticket.block_ids], torch.randn(shape, generator=g))
    assert decode.num_reserved == 0 and decode.has_work()


# ------------------------------------------------------------------------------------ end to end
PROMPTS = [list(range(3, 40)), [7, 1, 300, 42, 42, 9], list(range(100, 117)), [5] * 70]


def test_prefill_over_torch_distributed_then_decode_matches_the_offline_llm(checkpoint, decode):
    from pdcluster import LLM
    from prefill_worker import PrefillEngine

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    path = str(checkpoint("llama-gqa"))
    prefill_engine = Engine(EngineConfig(model=path, num_blocks=64, max_model_len=256), "prefill")
    sender = create_sender("torch_distributed", prefill_engine.runner.compat_hash, timeout_s=10.0)
    prefill = PrefillEngine(prefill_engine, sender)
    try:
        rids = [f"q{i}" for i in range(len(PROMPTS))]
        for rid, prompt in zip(rids, PROMPTS):
            ticket = decode.reserve(rid, prompt, params)
            assert ticket is not None and ticket.backend == "torch_distributed"
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


def test_throughput_of_a_64_mib_layer_against_grpc_and_shm(capsys):
    """Not an assertion on speed: prints MB/s (send_layer .. commit returned) for each backend."""
    blocks = 1024
    kv = torch.randn(_BigSink(0).layer_shape(blocks))
    assert kv.numel() * 4 == 64 << 20
    rates = {}
    for backend in ("torch_distributed", "shm", "grpc"):
        sink = _BigSink(blocks)
        receiver = create_receiver(backend, sink)
        sender = create_sender(backend, sink.compat_hash, timeout_s=30.0)
        try:
            times = []
            for i in range(3):  # the first warms up: connection, handshake, group / segment
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
        print("\n64 MiB layer: " + ", ".join(f"{b} {r:.0f} MB/s" for b, r in rates.items()))
