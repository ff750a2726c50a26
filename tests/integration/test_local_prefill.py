"""Disaggregated mode with local prefill: short prompts go to the decode worker when the prefill
worker is busier, and every output equals transformers' greedy generate token for token.

Real gRPC servers of both workers and the router in this process (no Ray needed for this)."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest

from engine.config import EngineConfig
from pdcluster.client import Client
from pdcluster.local_cluster import LocalCluster

pytestmark = pytest.mark.slow


def _cluster(path: str, max_tokens: int):
    # a small token budget: a local prompt is chunked into the decode worker's mixed steps
    cfg = EngineConfig(model=path, num_blocks=256, max_model_len=256, num_threads=1, max_num_batched_tokens=32, max_num_seqs=16,
                       dtype="float32")
    return LocalCluster(cfg, prefill={"kv_timeout_s": 5.0},
                        router={"request_timeout_s": 60, "local_prefill_max_tokens": max_tokens})


def test_busy_prefill_worker_sends_short_prompts_to_the_decode_worker_token_identical(path, reference, monkeypatch):
    c = _cluster(path, max_tokens=48)
    router, (prefill, decode) = c.router, c.workers
    step = prefill.prefill.step

    def slow_step():  # the tiny model prefills in a millisecond: make the prefill worker's queue build up
        time.sleep(0.05)
        return step()

    monkeypatch.setattr(prefill.prefill, "step", slow_step)
    try:
        prompts = [[(5 + 7 * i + 3 * j) % 120 + 3 for j in range(20 + 9 * i)] for i in range(12)]  # 20..119 tokens
        with Client(router.address) as client, cf.ThreadPoolExecutor(12) as pool:
            outs = list(pool.map(lambda p: client.complete(p, max_tokens=10, temperature=0.0, ignore_eos=True),
                                 prompts))
        local = router.metrics.local_prefills._value.get()
        assert 0 < local < len(prompts), local  # some prompts went local, not all
        assert router.pool.workers("decode")[0].local_tokens == 0  # every local prompt's count released
        assert router.pool.prefill_queued() == 0  # and every remote one's, pending and queued
        assert decode.stats().local_prefills == local  # prompts prefilled on the decode worker
        for p, out in zip(prompts, outs):
            assert out.token_ids == reference(p, 10), len(p)
        assert c.wait_blocks_free()
    finally:
        c.stop()


def test_idle_prefill_worker_takes_every_prompt_and_zero_turns_it_off(path):
    for max_tokens in (0, 48):
        with _cluster(path, max_tokens) as c:
            router, (_prefill, decode) = c.router, c.workers
            with Client(router.address) as client:
                for i in range(3):  # one at a time: the prefill worker is idle at each arrival
                    client.complete([5 + i, 6, 7, 8, 9], max_tokens=4, temperature=0.0, ignore_eos=True)
            assert router.metrics.local_prefills._value.get() == 0
            assert decode.stats().local_prefills == 0  # none prefilled on the decode worker


def test_a_decode_worker_refuses_a_local_prefill_its_free_blocks_cannot_hold(path):
    with _cluster(path, max_tokens=64) as c:
        _router, (_prefill, decode) = c.router, c.workers
        from engine.sampling_params import SamplingParams

        room = decode.engine.load().blocks_free * decode.engine.cfg.block_size  # no sequence runs: no headroom kept
        assert decode.engine.fits(room) and not decode.engine.fits(room + 1)
        assert not decode.decode.add_local("x", [5] * (room + 1), SamplingParams(max_tokens=1))
        assert decode.decode.add_local("y", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
        assert decode.decode.queued_prompt_tokens() in (0, 3)  # 0 once the engine thread took it
        assert c.wait_blocks_free()


def test_a_local_prefill_aborted_mid_stream_frees_its_blocks(path):
    with _cluster(path, max_tokens=64) as c:
        router, (prefill, _decode) = c.router, c.workers
        prefill.stop()  # no prefill worker: a short prompt is prefilled locally rather than failing
        deadline = time.monotonic() + 10
        while router.pool.prefill_queued() is not None and time.monotonic() < deadline:
            time.sleep(0.1)  # the router's stats poll finds it gone
        with Client(router.address) as client:
            stream = client.stream([9, 8, 7, 6, 5] * 4, max_tokens=200, temperature=0.0, ignore_eos=True)
            next(stream)
            stream.close()  # the client goes away mid-stream
        assert router.metrics.local_prefills._value.get() == 1
        assert c.wait_blocks_free()
        assert router.pool.workers("decode")[0].local_tokens == 0  # released when the stream ended early
