"""torch_distributed under NCCL's matching rule. NCCL ignores tags: it matches a pair's sends and
recvs in the order each side posts them. Here every send and recv of every pair is posted with one
fixed tag (`ByOrder`), so gloo too matches them purely by order, as NCCL would; then many transfers
in flight at once, from several threads, to one decode worker must each land in their own blocks,
byte for byte, and a refused layer or a send whose message never comes must not shift any later
match (the pair is dropped on both sides, and the next transfer makes a new one).

The ordering itself (`PairOrder`) is tested without process groups first (fast tier).
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from decode_worker import DecodeEngine
from engine import Engine, EngineConfig
from kv_transfer import KVTransferError, torch_dist_receiver, torch_dist_sender
from kv_transfer.torch_dist_group import SEQ_LIMIT, PairOrder
from kv_transfer.torch_dist_sender import TorchDistSender
from tests.integration.kv_helpers import PARAMS, clean, grpc_server

FIXED_TAG = 7
THREADS, PER_THREAD = 6, 4


# ------------------------------------------------------------------------------------ the order, alone
def test_the_receiver_posts_in_sequence_order_whatever_order_messages_come_in():
    order, posted, errors = PairOrder(), [], []

    def receive(seq: int) -> None:
        try:
            order.post_at(seq, lambda: posted.append(seq), 5.0)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=receive, args=(seq,)) for seq in (3, 1, 4, 0, 2)]
    for t in threads:
        t.start()
        time.sleep(0.01)  # each arrives while the earlier ones wait
    for t in threads:
        t.join(10)
    assert not errors and posted == [0, 1, 2, 3, 4]


def test_the_sender_numbers_its_sends_in_posting_order_and_wraps():
    order, posted = PairOrder(), []
    def post_50() -> None:
        for _ in range(50):
            order.post_next(posted.append)

    threads = [threading.Thread(target=post_50) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert posted == list(range(200))
    late = PairOrder(first=SEQ_LIMIT - 1)
    assert [late.post_next(lambda seq: seq)[0] for _ in range(2)] == [SEQ_LIMIT - 1, 0]


def test_a_gap_that_never_fills_times_out_and_a_closed_order_wakes_its_waiters():
    order = PairOrder()
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="send 0 of the pair never came") as info:
        order.post_at(1, lambda: pytest.fail("posted out of order"), 0.2)
    assert 0.2 <= time.monotonic() - start < 2.0 and info.value.status.name == "DEADLINE_EXCEEDED"

    failed = []

    def wait_for_its_turn() -> None:
        try:
            order.post_at(2, lambda: None, 10.0)
        except KVTransferError as e:
            failed.append(e)

    waiter = threading.Thread(target=wait_for_its_turn)
    waiter.start()
    time.sleep(0.05)
    order.close("group dropped")
    waiter.join(2)
    assert not waiter.is_alive() and [str(e) for e in failed] == ["group dropped"]
    with pytest.raises(KVTransferError, match="group dropped"):
        order.post_next(lambda seq: None)


def test_a_number_already_posted_is_refused_at_once():
    order = PairOrder()
    order.post_at(0, lambda: None, 1.0)
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="send 0 of the pair came twice"):
        order.post_at(0, lambda: None, 5.0)
    assert time.monotonic() - start < 1.0


# ------------------------------------------------------------------------------------ over gloo, by order
class ByOrder:
    """A pair's process group whose sends and recvs all carry one tag: gloo then matches a pair's
    operations in the order they are posted, as NCCL does."""

    def __init__(self, pg) -> None:
        self.pg = pg

    def send(self, tensors, dst, tag):
        return self.pg.send(tensors, dst, FIXED_TAG)

    def recv(self, tensors, src, tag):
        return self.pg.recv(tensors, src, FIXED_TAG)

    def __getattr__(self, name):
        return getattr(self.pg, name)


@pytest.fixture
def by_order(monkeypatch):
    """Every pair built from now on, on both sides, matches by order (its first exchange as usual)."""
    for module in (torch_dist_sender, torch_dist_receiver):
        build = module.build_pair
        monkeypatch.setattr(module, "build_pair", lambda *a, _build=build, **k: ByOrder(_build(*a, **k)))


@pytest.fixture
def decode(checkpoint, by_order):
    """A decode worker with room for every transfer of the test at once (4 layers)."""
    path = str(checkpoint("llama-gqa", num_hidden_layers=4))
    with clean("torch_distributed"), grpc_server() as (srv, endpoint):
        engine = Engine(EngineConfig(model=path, num_blocks=128, max_model_len=256), "decode")
        d = DecodeEngine(engine, backend="torch_distributed", server=srv, endpoint=endpoint, timeout_s=5.0)
        srv.start()
        try:
            yield d
        finally:
            d.close()
        assert not d.receiver.planes["torch_distributed"].pairs


def _kv(decode, ticket, layer: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((ticket.transfer_id, layer)) % (1 << 31))
    return torch.randn(decode.layer_shape(len(ticket.block_ids)), generator=g)


def _prompt(i: int) -> list[int]:
    """1 to 3 blocks (shapes differ between transfers), no prefix shared with another transfer."""
    return [3 + i] + [(i * 31 + j) % 200 + 20 for j in range(4 + 16 * (i % 3))]


def _send(sender, decode, ticket) -> None:
    for layer in range(decode.num_layers):
        sender.send_layer(ticket, layer, _kv(decode, ticket, layer))
    sender.commit(ticket, 7, None)


def _landed(decode, ticket) -> bool:
    cache = decode.engine.kv_caches
    return all(torch.equal(cache[layer][:, ticket.block_ids], _kv(decode, ticket, layer))
               for layer in range(decode.num_layers))


def _in_threads(run, tickets: list) -> None:
    """`run(some tickets)` on THREADS threads at once, each its share; all done within 120 s."""
    threads = [threading.Thread(target=run, args=(tickets[i::THREADS],)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)


@pytest.mark.slow
def test_many_transfers_in_flight_to_one_decode_worker_land_in_their_own_blocks(decode):
    sender = TorchDistSender(decode.compat_hash, timeout_s=10.0)
    tickets = [decode.reserve(f"r{i}", _prompt(i), PARAMS) for i in range(THREADS * PER_THREAD)]
    errors: list[BaseException] = []

    def run(mine) -> None:
        try:
            for ticket in mine:
                _send(sender, decode, ticket)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    try:
        sender.connect(decode.receiver.endpoint)
        (key,) = decode.receiver.planes["torch_distributed"].pairs
        _in_threads(run, tickets)
        assert not errors, errors[:3]
        assert decode.num_reserved == 0 and sender.num_in_flight == 0
        assert all(_landed(decode, ticket) for ticket in tickets)
        assert decode.receiver.planes["torch_distributed"].pairs == [key]  # one pair carried them all
    finally:
        sender.close()


@pytest.mark.slow
def test_refusals_among_transfers_in_flight_never_land_wrong_bytes(decode):
    """Every eighth transfer carries a forged token, the others are in flight beside them: each
    refusal drops the pair, so those in flight on it fail too, but a transfer that commits holds
    exactly its own bytes, nothing hangs, and the pair made afterwards carries the next transfer."""
    sender = TorchDistSender(decode.compat_hash, timeout_s=10.0)
    tickets = [decode.reserve(f"r{i}", _prompt(i), PARAMS) for i in range(THREADS * PER_THREAD)]
    forged = {t.transfer_id for t in tickets[::8]}
    committed: list = []

    def run(mine) -> None:
        for ticket in mine:
            try:
                _send(sender, decode, dataclasses.replace(ticket, auth_token="forged")
                      if ticket.transfer_id in forged else ticket)
                committed.append(ticket)
            except KVTransferError:
                sender.abort(ticket, "failed")  # frees its blocks

    try:
        _in_threads(run, tickets)
        assert not forged & {t.transfer_id for t in committed}
        assert committed, "every transfer failed beside the forged ones"
        assert all(_landed(decode, ticket) for ticket in committed)
        assert decode.num_reserved == 0 and sender.num_in_flight == 0
        later = decode.reserve("later", _prompt(99), PARAMS)
        _send(sender, decode, later)
        assert _landed(decode, later)
    finally:
        sender.close()


@pytest.mark.slow
def test_a_refused_layer_drops_the_pair_and_no_later_match_shifts(decode):
    """A layer refused at the receiver leaves its send unmatched: under NCCL the next recv posted on
    the pair would take its bytes. The receiver drops the pair at once, the sender resets it, and
    the transfers after it go over a new pair, each into its own blocks."""
    sender = TorchDistSender(decode.compat_hash, timeout_s=10.0)
    plane = decode.receiver.planes["torch_distributed"]
    try:
        sender.connect(decode.receiver.endpoint)
        (old,) = plane.pairs
        refused, later = (decode.reserve(f"r{i}", _prompt(i), PARAMS) for i in (0, 3))  # same shape
        forged = dataclasses.replace(refused, auth_token="forged")
        sender.send_layer(forged, 0, _kv(decode, refused, 0))
        with pytest.raises(KVTransferError, match="PERMISSION_DENIED"):
            sender.flush(forged)
        assert old not in plane.pairs and old not in sender.plane.pairs.values()
        _send(sender, decode, later)
        assert _landed(decode, later)
        assert plane.pairs == [sender.plane.pairs[decode.receiver.endpoint]] != [old]
        sender.abort(refused, "refused")
        assert decode.num_reserved == 0
    finally:
        sender.close()


@pytest.mark.slow
def test_a_send_whose_message_never_comes_fails_its_transfer_within_the_timeout(decode):
    """A gap in the pair's sequence (a number taken whose message never comes, as when a stream
    dies): the next layer waits for it at most the receiver's timeout, then fails; the pair is
    dropped on both sides, the abort frees the transfer's blocks, the next transfer makes a new pair."""
    sender = TorchDistSender(decode.compat_hash, timeout_s=10.0)
    plane = decode.receiver.planes["torch_distributed"]
    plane.timeout_s = 1.0
    try:
        sender.connect(decode.receiver.endpoint)
        (old,) = plane.pairs
        lost, later = (decode.reserve(f"r{i}", _prompt(i), PARAMS) for i in (0, 1))
        sender.plane._pairs[decode.receiver.endpoint].order.post_next(lambda seq: None)  # 0 taken, never sent
        sender.send_layer(lost, 0, _kv(decode, lost, 0))
        start = time.monotonic()
        with pytest.raises(KVTransferError, match="DEADLINE_EXCEEDED: .*send 0 of the pair never came"):
            sender.flush(lost)
        assert time.monotonic() - start < 5.0
        assert old not in plane.pairs and decode.receiver.endpoint not in sender.plane.pairs
        sender.abort(lost, "lost")
        _send(sender, decode, later)
        assert _landed(decode, later) and decode.num_reserved == 0
    finally:
        sender.close()
