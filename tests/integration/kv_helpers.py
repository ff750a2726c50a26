"""Shared pieces of the KV transfer integration tests: a real DecodeEngine receiver on a real gRPC
server on loopback, per backend, with that backend's cleanliness checks; layers, prompts, the
disaggregated prefill -> decode run, and a 64 MiB sink for the throughput print.

Used by tests/integration/test_kv_transfer_conformance*.py (the suite every backend passes) and by
the per-backend files (what is particular to one backend).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import glob
import os
import socket
import threading
import time
from concurrent import futures
from typing import Iterator

import grpc
import pytest
import torch

from decode_worker import DecodeEngine
from engine import Engine, EngineConfig, SamplingParams
from kv_transfer import create_sender
from kv_transfer.shm_cache import SHM_DIR
from kv_transfer.wire import MESSAGE_OPTIONS

BACKENDS = ["grpc", "shm", "torch_distributed", "tcp"]
PARAMS = SamplingParams(max_tokens=4, temperature=0.0)
OTHER_HASH = "0123456789abcdef"
PROMPTS = [list(range(3, 40)), [7, 1, 300, 42, 42, 9], list(range(100, 117)), [5] * 70]
OURS = f"pdkv-{os.getpid()}-"  # every /dev/shm segment this process makes (senders' and tests' own)


def decode_engine(checkpoint) -> Engine:
    cfg = EngineConfig(model=str(checkpoint("llama-gqa")), num_blocks=32, max_model_len=256)
    return Engine(cfg, "decode")


def layer(decode, ticket, seed=0, extra_blocks=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(decode.layer_shape(len(ticket.block_ids) + extra_blocks), generator=g)


def cache_is_zero(decode) -> bool:
    return all(torch.all(c == 0) for c in decode.engine.kv_caches)


# ------------------------------------------------------------------------------------ cleanliness
def ours_in_shm() -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(SHM_DIR, OURS + "*")))


def mapped_segments() -> list[str]:
    """Mappings of our segments, except a closed receiver's own shared cache (unlinked, mapped once):
    its DecodeEngine keeps using that memory while it lives."""
    with open("/proc/self/maps") as f:
        lines = [line.strip() for line in f if "/pdkv-" in line]
    caches = collections.Counter(line.split()[-2] for line in lines if "-cache-" in line)
    return [line for line in lines
            if "-cache-" not in line or caches[line.split()[-2]] > 1 or not line.endswith("(deleted)")]


def port_is_closed(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return True
    return False


@contextlib.contextmanager
def no_leftover_threads(daemon_prefix: str | None = None) -> Iterator[None]:
    """No thread started inside is still running afterwards (non-daemon ones, and daemon ones
    named `daemon_prefix...`)."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5.0
    while True:
        extra = [t for t in threading.enumerate() if t not in before and t.is_alive()
                 and (not t.daemon or (daemon_prefix is not None and t.name.startswith(daemon_prefix)))]
        if not extra or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not extra, f"threads left running: {extra}"


DAEMON_THREADS = {"torch_distributed": "kv-dist-pair", "tcp": "kv-tcp"}


@contextlib.contextmanager
def no_leftover_shm() -> Iterator[None]:
    """Nothing of ours stays in /dev/shm or mapped into this process."""
    assert not ours_in_shm()
    yield
    gc.collect()
    assert not ours_in_shm(), "segments left in /dev/shm"
    assert not mapped_segments(), "segments still mapped"


@contextlib.contextmanager
def clean(backend: str) -> Iterator[None]:
    """The backend's own leftovers check: threads for all, /dev/shm for shm, pair threads for
    torch_distributed (its store and groups are checked where the receiver closes), connection
    threads for tcp (its data port is checked where the receiver closes)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(no_leftover_threads(DAEMON_THREADS.get(backend)))
        if backend == "shm":
            stack.enter_context(no_leftover_shm())
        yield


def sender_is_idle(backend: str, sender) -> bool:
    """Nothing held for a transfer that is over (shm: no segment leases)."""
    return sender.num_in_flight == 0 and (backend != "shm" or not sender.plane._leases)


# ------------------------------------------------------------------------------------ a live receiver
@contextlib.contextmanager
def grpc_server() -> Iterator[tuple[grpc.Server, str]]:
    """A server owned by the test, as the decode worker owns its own (the receiver only registers)."""
    executor = futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="test-decode-server")
    srv = grpc.server(executor, options=MESSAGE_OPTIONS)
    port = srv.add_insecure_port("127.0.0.1:0")
    try:
        yield srv, f"127.0.0.1:{port}"
    finally:
        srv.stop(grace=None).wait()
        executor.shutdown(wait=True)


@contextlib.contextmanager
def live_decode(checkpoint, backend: str, srv: grpc.Server, endpoint: str, **kwargs) -> Iterator[DecodeEngine]:
    """A DecodeEngine with `backend`'s receiver (and its options `kwargs`) registered on `srv`
    (started here); closed after, with torch_distributed's store and process groups, and tcp's data
    port, checked gone."""
    if backend in ("torch_distributed", "tcp"):
        kwargs.setdefault("timeout_s", 5.0)
    d = DecodeEngine(decode_engine(checkpoint), backend=backend, server=srv, endpoint=endpoint, **kwargs)
    srv.start()
    port = d.receiver.planes["torch_distributed"]._store.port if backend == "torch_distributed" else None
    yield d
    d.close()
    if backend == "tcp":
        assert not d.receiver.planes["tcp"].connections and d.receiver.planes["tcp"].buffered_bytes == 0
        data_port = d.receiver.planes["tcp"].data_port
        assert port_is_closed(data_port), "the receiver's data port is still listening"
    if backend == "torch_distributed":
        assert not d.receiver.planes["torch_distributed"].pairs
        assert d.receiver.planes["torch_distributed"]._store is None
        gc.collect()
        assert port_is_closed(port), "the receiver's TCPStore is still listening"


@contextlib.contextmanager
def live_sender(backend: str, compat_hash: str, timeout_s: float = 5.0):
    s = create_sender(backend, compat_hash, timeout_s=timeout_s)
    try:
        yield s
    finally:
        s.close()
    if backend == "torch_distributed":
        assert not s.plane.pairs
    if backend == "tcp":
        assert not s.plane.links


def backend_fixtures(backend: str, connect: bool = False, **decode_kwargs):
    """The fixtures a backend's test file starts with, returned as (no_leftovers, decode, sender):
    the backend's leftovers check around every test (autouse), a live DecodeEngine receiver with
    `decode_kwargs` on its own gRPC server, and a sender to it (connected first when `connect`)."""

    @pytest.fixture(autouse=True)
    def no_leftovers():
        with clean(backend):
            yield

    @pytest.fixture
    def decode(checkpoint):
        with grpc_server() as (srv, endpoint), live_decode(checkpoint, backend, srv, endpoint, **decode_kwargs) as d:
            yield d

    @pytest.fixture
    def sender(decode):
        with live_sender(backend, decode.compat_hash) as s:
            if connect:
                s.connect(decode.receiver.endpoint)
            yield s

    return no_leftovers, decode, sender


def transfer(sender, decode, ticket, kv: torch.Tensor, first_token: int = 7) -> None:
    """`kv` sent as every layer of `ticket` and committed; checked to be in the reserved blocks."""
    for i in range(decode.num_layers):
        sender.send_layer(ticket, i, kv)
    sender.commit(ticket, first_token, None)
    assert torch.equal(decode.engine.kv_caches[0][:, ticket.block_ids], kv)


def assert_refused(stub, cases: list) -> None:
    """Each hand-built (message, status code, detail) of `cases`, sent on a stream of its own, is
    refused with that code and a detail containing that text."""
    for msg, code, message in cases:
        with pytest.raises(grpc.RpcError) as info:
            stub.SendLayers(iter([msg]), timeout=5)
        assert info.value.code() == code and message in info.value.details(), (code, info.value.details())


# ------------------------------------------------------------------------------------ torch_distributed
class RecvSpy:
    """Stands in for a receiver pair's process group: counts the recvs posted."""

    def __init__(self, pg):
        self.pg, self.recvs = pg, 0

    def recv(self, *args):
        self.recvs += 1
        return self.pg.recv(*args)

    def __getattr__(self, name):
        return getattr(self.pg, name)


def spy_on_messages(sender) -> list:
    """The `KVLayer` messages `sender` builds from now on (appended as they are built)."""
    sent = []
    original = sender._layer_message

    def spy(*args):
        msg = original(*args)
        sent.append(msg)
        return msg

    sender._layer_message = spy
    return sent


def spy_on_pairs(decode, sender) -> RecvSpy:
    """torch_distributed: connect, and count the recvs the receiver's pair posts from now on."""
    sender.connect(decode.receiver.endpoint)
    (key,) = decode.receiver.planes["torch_distributed"].pairs
    pair = decode.receiver.planes["torch_distributed"]._pairs[key]
    assert pair.ready.wait(5) and pair.pg is not None
    pair.pg = spy = RecvSpy(pair.pg)
    return spy


# ------------------------------------------------------------------------------------ end to end
def run_disaggregated(checkpoint, decode, backend: str, params) -> list:
    """Reserve on decode, prefill with `backend`'s sender, decode; returns the finished sequences."""
    from prefill_worker import PrefillEngine

    path = str(checkpoint("llama-gqa"))
    prefill_engine = Engine(EngineConfig(model=path, num_blocks=64, max_model_len=256), "prefill")
    sender = create_sender(backend, prefill_engine.compat_hash, timeout_s=10.0)
    prefill = PrefillEngine(prefill_engine, sender)
    try:
        rids = [f"q{i}" for i in range(len(PROMPTS))]
        for rid, prompt in zip(rids, PROMPTS):
            ticket = decode.reserve(rid, prompt, params)
            assert ticket is not None and ticket.backend == backend
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


# ------------------------------------------------------------------------------------ throughput
class BigSink:
    """One 64 MiB layer (1024 blocks of 16 tokens x 8 heads x 64 dims, K and V, float32)."""

    compat_hash = "bench"
    num_layers = 1
    kv_dtype = torch.float32

    def __init__(self, num_blocks: int) -> None:
        self.cache = torch.zeros(self.layer_shape(num_blocks))

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, 16, 8, 64)

    def write_layer(self, ticket, layer, kv, first_block=0):
        self.cache[:, first_block : first_block + kv.shape[1]].copy_(kv)

    def commit(self, ticket, first_token, logprob):
        pass

    def abort(self, ticket, reason):
        pass


@dataclasses.dataclass
class Live:
    """One backend's live receiver (a DecodeEngine on a real server) and a matching sender."""

    backend: str
    server: grpc.Server
    decode: DecodeEngine
    sender: object

    def idle(self, sender=None) -> bool:
        return sender_is_idle(self.backend, self.sender if sender is None else sender)

    def new_sender(self, compat_hash=None, timeout_s=5.0):
        return create_sender(self.backend, compat_hash or self.decode.compat_hash, timeout_s=timeout_s)


def conformance_fixture():
    """The conformance files' `kv` fixture: a `Live` per backend, and the backend's leftovers checks
    (threads, /dev/shm segments and mappings, store and groups) after. "shm" writes layers into the
    decode cache in place; "shm+segments" is shm's copying path."""

    @pytest.fixture(params=[*BACKENDS, "shm+segments"])
    def kv(request, checkpoint):
        backend = request.param.split("+")[0]
        options = {"in_place": False} if request.param == "shm+segments" else {}
        with clean(backend), grpc_server() as (srv, endpoint), \
                live_decode(checkpoint, backend, srv, endpoint, **options) as decode, \
                live_sender(backend, decode.compat_hash) as sender:
            if backend == "shm":  # as a prefill worker does at start-up: in place from the first layer
                sender.connect(decode.receiver.endpoint)
                in_place = sender.plane.in_place_endpoints == [decode.receiver.endpoint]
                assert in_place == (request.param == "shm")
            yield Live(backend, srv, decode, sender)

    return kv
