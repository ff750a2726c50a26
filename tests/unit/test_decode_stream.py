"""A decode worker's token stream (decode_worker/service.py `_emit`): the first token of a sequence
whose KV a prefill worker committed came with that worker's reply, so the stream starts at token 1
and sends each later token once; a sequence prefilled here streams from token 0."""

from __future__ import annotations

import time

from decode_worker.service import DecodeWorkerService, _Stream
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from proto import worker_pb2 as wk


def _service(stream: _Stream) -> DecodeWorkerService:
    svc = DecodeWorkerService.__new__(DecodeWorkerService)  # the stream table and counters: no server, no engine
    svc._streams, svc.role = {"r": stream}, wk.WORKER_ROLE_COLOCATED
    svc._prompt_tokens = svc._cached_tokens = 0
    return svc


def _seq(outputs: list[int]) -> Sequence:
    seq = Sequence("r", [5, 6, 7], 3, SamplingParams(max_tokens=8), frozenset(), 64)
    for t in outputs:
        seq.append_token(t)
    return seq


def _chunks(stream: _Stream) -> list[tuple[int, list[int]]]:
    out = []
    while not stream.queue.empty():
        chunk = stream.queue.get()
        out.append((chunk.start_index, list(chunk.token_ids)))
    return out


def test_a_committed_stream_starts_after_the_prefill_workers_token():
    stream = _Stream(committed_at=time.monotonic())
    svc = _service(stream)
    seq = _seq([11, 12])  # 11 came with the Prefill reply, 12 is the first decode step's
    svc._emit(seq)
    seq.append_token(13)
    svc._emit(seq)
    assert _chunks(stream) == [(1, [12]), (2, [13])]


def test_a_stream_prefilled_here_starts_at_its_first_token():
    stream = _Stream(committed_at=time.monotonic(), local=True)
    svc = _service(stream)
    seq = _seq([11])
    svc._emit(seq)
    seq.append_token(12)
    svc._emit(seq)
    assert _chunks(stream) == [(0, [11]), (1, [12])]
