"""The conformance suite every KV transfer backend passes, over a real gRPC server on loopback into
a real DecodeEngine, part one: bytes land exactly in the reserved blocks, flush and commit, many
transfers in flight, a server with fewer threads than open streams; and a prefill -> transfer ->
decode run gives the same greedy tokens (and logprobs) as the offline `LLM`. Refusals and failures
are in test_kv_transfer_conformance_refusals.py; what is particular to one backend in
tests/integration/test_kv_transfer_<backend>.py. Ends with a throughput print of every backend for
a 64 MiB layer.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from decode_worker import DecodeEngine
from engine import SamplingParams
from kv_transfer import KVTransferError, TransferTicket, create_receiver, create_sender
from tests.integration.kv_helpers import (
    BACKENDS, PARAMS, PROMPTS, BigSink, clean, conformance_fixture, decode_engine,
    layer as _layer, run_disaggregated,
)

pytestmark = pytest.mark.slow
kv = conformance_fixture()


# ------------------------------------------------------------------------------------ conformance
def test_layers_land_in_the_reserved_blocks_and_commit_admits(kv):
    decode, sender = kv.decode, kv.sender
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    assert ticket.backend == kv.backend and ticket.kv_endpoint == decode.receiver.endpoint
    assert len(ticket.block_ids) == 3 and decode.engine.block_manager.num_used_blocks == 3
    layers = [_layer(decode, ticket, seed=layer) for layer in range(decode.num_layers)]
    for layer, kv_ in enumerate(layers):
        sender.send_layer(ticket, layer, kv_.clone())  # handed over (KVSender.send_layer)
    sender.commit(ticket, 7, None)
    cache = decode.engine.kv_caches
    for layer, kv_ in enumerate(layers):
        assert torch.equal(cache[layer][:, ticket.block_ids], kv_)  # bit-exact
        untouched = [b for b in range(32) if b not in ticket.block_ids]
        assert torch.all(cache[layer][:, untouched] == 0)
    assert decode.has_work() and decode.num_reserved == 0 and decode.receiver.num_pending == 0
    assert kv.idle()


def test_flush_waits_for_the_receivers_acknowledgement(kv):
    decode, sender = kv.decode, kv.sender
    ticket = decode.reserve("r1", list(range(3, 40)), PARAMS)
    kv_ = _layer(decode, ticket)
    sender.send_layer(ticket, 0, kv_)
    sender.send_layer(ticket, 1, kv_)
    assert sender.flush(ticket) == 2 and decode.receiver.num_pending == 1
    assert torch.equal(decode.engine.kv_caches[1][:, ticket.block_ids], kv_)


def test_many_transfers_in_flight_from_several_threads(kv):
    decode, sender = kv.decode, kv.sender
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
    if kv.backend == "shm" and decode.receiver.planes["shm"].shared is None:  # a segment per transfer in flight
        assert len([n for n in sender.plane.segments if n != sender.plane._probe.name]) == 4
    assert sender.flush(tickets[0]) == decode.num_layers
    for t in reversed(tickets):  # commits in any order
        sender.commit(t, 5, None)
    cache = decode.engine.kv_caches
    for t in tickets:
        for layer in range(decode.num_layers):
            assert torch.equal(cache[layer][:, t.block_ids], layers[t.transfer_id][layer])
    assert decode.num_reserved == 0 and len(decode._committed) == 4 and kv.idle()
    if kv.backend == "torch_distributed":
        assert len(decode.receiver.planes["torch_distributed"].pairs) == 1  # one pair carried them all
    if kv.backend == "tcp":
        assert len(decode.receiver.planes["tcp"].connections) == 1  # one connection carried them all
        assert len(sender.plane.links) == 1


@pytest.mark.parametrize("backend", ["grpc", "shm", "tcp"])
def test_own_server_with_fewer_threads_than_open_streams(checkpoint, backend):
    """Without a server the receiver serves on its own port; a commit never waits behind open streams."""
    with clean(backend):
        d = DecodeEngine(decode_engine(checkpoint), backend=backend, max_workers=2)
        s = create_sender(backend, d.compat_hash, timeout_s=5.0)
        try:
            assert d.receiver.endpoint.startswith("127.0.0.1:")
            # handshake first, as `up` does: a handshake sent along with the first streams could queue
            # behind them on the two server threads (what is tested here is the commits)
            s.connect(d.receiver.endpoint)
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
        r = create_receiver(backend, d)
        endpoint = r.endpoint
        r.close()
        s2 = create_sender(backend, d.compat_hash, timeout_s=2.0)
        try:
            ticket = dataclasses.replace(tickets[0], kv_endpoint=endpoint)
            with pytest.raises(KVTransferError, match="UNAVAILABLE"):
                s2.send_layer(ticket, 0, _layer(d, ticket))
                s2.commit(ticket, 5, None)
        finally:
            s2.close()


# ------------------------------------------------------------------------------------ end to end
def test_prefill_then_decode_matches_the_offline_llm(checkpoint, kv):
    from pdcluster import LLM

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    seqs = run_disaggregated(checkpoint, kv.decode, kv.backend, params)
    llm = LLM(str(checkpoint("llama-gqa")), num_blocks=128, max_model_len=256, mode="disaggregated")
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


# ------------------------------------------------------------------------------------ throughput
def test_throughput_of_a_64_mib_layer_for_every_backend(capsys):
    """Not an assertion on speed: prints MB/s (send_layer .. commit returned) for each backend."""
    blocks = 1024
    kv_ = torch.randn(BigSink(0).layer_shape(blocks))
    assert kv_.numel() * 4 == 64 << 20
    rates = {}
    for backend in BACKENDS:
        with clean(backend):
            sink = BigSink(blocks)
            receiver = create_receiver(backend, sink)
            sender = create_sender(backend, sink.compat_hash, timeout_s=30.0)
            try:
                times = []
                for i in range(3):  # the first warms up: connection, handshake, group / segment
                    ticket = TransferTicket(f"t{i}", receiver.endpoint, list(range(blocks)), "bench", "tok",
                                            16 * blocks, backend)
                    receiver.expect(ticket)
                    start = time.perf_counter()
                    sender.send_layer(ticket, 0, kv_)
                    sender.commit(ticket, 1, None)
                    times.append(time.perf_counter() - start)
                assert torch.equal(sink.cache, kv_)
                rates[backend] = 64 * 1.048576 / min(times[1:])
            finally:
                sender.close()
                receiver.close()
    with capsys.disabled():
        print("\n64 MiB layer: " + ", ".join(f"{b} {r:.0f} MB/s" for b, r in rates.items()))
