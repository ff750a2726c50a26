"""KV-cache-centric serving through real servers: the router's prefix index follows the workers'
caches, a conversation's next turn reuses its decode worker's blocks (only the blocks after them
move, or none when the decode worker prefills the rest itself), prompts that share a prefix go to
the prefill worker holding it, and every output equals transformers' greedy generate.

Real gRPC servers of the workers and the router in this process (no Ray needed for this)."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest

from engine.config import EngineConfig
from pdcluster.local_cluster import LocalCluster
from proto import worker_pb2 as wk
from tests.reference import hf_greedy

pytestmark = pytest.mark.slow
BS = 16  # block size of the engines below


def _cluster(path: str, num_prefill: int = 1, num_decode: int = 1, backend: str = "grpc", **router) -> LocalCluster:
    cfg = EngineConfig(model=path, num_blocks=256, block_size=BS, max_model_len=512, num_threads=1,
                       max_num_batched_tokens=64, max_num_seqs=16, dtype="float32")
    kv = {"kv_backend": backend}
    return LocalCluster(cfg, num_prefill, num_decode, prefill={"kv_timeout_s": 10.0, **kv}, decode=kv,
                        router={"request_timeout_s": 60, **router})


def _wait_index(c: LocalCluster, timeout_s: float = 10.0) -> None:
    """Until the router has heard from every worker (and its prefix cache, when it routes by prefix)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if all(w.stats is not None and (w.cache_cursor or not c.router.pool.policy.prefix_aware)
               for w in c.router.pool.workers()):
            return
        time.sleep(0.05)
    raise AssertionError("the router's prefix index never heard from every worker")


def _held(decode) -> list[bytes]:
    """The block hashes a decode worker's prefix cache holds, as its Stats tell the router."""
    return list(decode.stats(wk.StatsRequest(prefix_cache_events=True)).prefix_cache.stored)


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 31 + 7 * j) % 120 + 3 for j in range(n)]


def _turn(client, prompt: list[int], n: int = 8) -> list[int]:
    return client.complete(prompt, max_tokens=n, temperature=0.0, ignore_eos=True).token_ids


@pytest.mark.parametrize("backend", ["grpc", "shm", "tcp", "torch_distributed"])
def test_next_turn_reuses_the_decode_workers_blocks_and_sends_only_the_rest(path, reference, backend):
    _next_turn_reuses_blocks(path, reference, backend)


def test_a_latent_attention_moe_models_next_turn_reuses_its_blocks_too(checkpoint):
    """The same with DeepSeek-V3's latent attention and routed experts: a block is latent rows."""
    path = str(checkpoint("deepseek-v3"))
    _next_turn_reuses_blocks(path, hf_greedy(path), "tcp")


def _next_turn_reuses_blocks(path, reference, backend):
    with _cluster(path, backend=backend) as c:
        (prefill,), (decode,) = c.prefill_workers, c.decode_workers
        _wait_index(c)
        with c.client() as client:
            p1 = _prompt(1, 70)
            a1 = _turn(client, p1)
            assert a1 == reference(p1, 8)
            sent1 = sum(prefill.stats().kv_bytes_sent.values())
            p2 = p1 + a1 + _prompt(2, 20)  # 98 tokens: the decode worker holds blocks 0..4 (77 computed)
            a2 = _turn(client, p2)
            assert a2 == reference(p2, 8)
        stats = decode.stats()
        assert decode.decode.committed_cached_tokens == 4 * BS  # 77 computed tokens: four full blocks
        sent2 = sum(prefill.stats().kv_bytes_sent.values()) - sent1
        per_block = decode.engine.kv_bytes_per_block
        assert sent1 == 5 * per_block  # 70 tokens: five blocks
        assert sent2 == (7 - 4) * per_block  # 98 tokens: seven blocks, four held
        assert stats.kv_bytes_not_sent == 4 * per_block
        assert c.router.metrics.routed_cached_tokens.labels("decode")._value.get() == 4 * BS
        assert c.wait_blocks_free()


def test_a_short_uncached_part_is_prefilled_on_the_decode_worker_token_identical(path, reference):
    with _cluster(path, local_prefill_uncached_tokens=32) as c:
        (prefill,), (decode,) = c.prefill_workers, c.decode_workers
        _wait_index(c)
        with c.client() as client:
            p1 = _prompt(3, 70)  # nothing cached: 70 uncached tokens go to the prefill worker
            a1 = _turn(client, p1)
            p2 = p1 + a1 + _prompt(4, 20)  # 98 - 64 held = 34 > 32: still remote
            a2 = _turn(client, p2)
            p3 = p2 + a2 + _prompt(5, 10)  # 116 tokens, 96 held (105 computed): 20 uncached, local
            a3 = _turn(client, p3)
        assert [a1, a2, a3] == [reference(p, 8) for p in (p1, p2, p3)]
        stats = decode.stats()
        assert stats.local_prefills == 1 == c.router.metrics.local_prefills._value.get()
        assert (stats.prompt_tokens, stats.prefix_cache_hit_tokens) == (len(p3), 96)  # prefilled here: 20 computed
        assert stats.kv_bytes_not_sent == (4 + 8) * decode.engine.kv_bytes_per_block  # p2's 4 held, p3's 8 blocks
        assert prefill.stats().prompt_tokens == len(p1) + len(p2)
        assert c.wait_blocks_free()


@pytest.mark.parametrize("prefix_aware", [True, False])
def test_prompts_sharing_a_prefix_go_to_the_prefill_worker_holding_it(path, reference, monkeypatch, prefix_aware):
    with _cluster(path, num_prefill=2, prefix_aware=prefix_aware) as c:
        for p in c.prefill_workers:  # a queue builds up while a prompt is prefilled
            step = p.prefill.step
            monkeypatch.setattr(p.prefill, "step", lambda step=step: (time.sleep(0.03), step())[1])
        _wait_index(c)
        s1, s2 = _prompt(6, 64), _prompt(7, 64)
        with c.client() as client, cf.ThreadPoolExecutor(2) as pool:

            def both(first: list[int], second: list[int]) -> list[list[int]]:
                a = pool.submit(_turn, client, first)
                time.sleep(0.01)  # `first` is queued on its prefill worker when `second` arrives
                b = pool.submit(_turn, client, second)
                return [a.result(), b.result()]

            prompts = [s1 + _prompt(8, 10), s2 + _prompt(9, 10)]
            outs = both(*prompts)  # one on each prefill worker
            later = [s2 + _prompt(10, 10), s1 + _prompt(11, 10)]
            outs += both(*later)  # by prefix: each to the worker that holds it; by load: the reverse
        assert outs == [reference(p, 8) for p in prompts + later]
        hits = [p.stats().prefix_cache_hit_tokens for p in c.prefill_workers]
        assert sorted(hits) == ([64, 64] if prefix_aware else [0, 0]), hits
        assert c.wait_blocks_free()


def test_a_conversation_goes_on_elsewhere_when_its_decode_worker_dies(path, reference):
    with _cluster(path, num_decode=2) as c:
        d0, d1 = c.decode_workers
        _wait_index(c)
        with c.client() as client:
            p1 = _prompt(12, 70)
            a1 = _turn(client, p1)
            holder, other = (d0, d1) if _held(d0) else (d1, d0)
            assert not _held(other)
            holder.stop(grace=0)
            p2 = p1 + a1 + _prompt(13, 20)
            a2 = _turn(client, p2)
        assert [a1, a2] == [reference(p1, 8), reference(p2, 8)]
        assert _held(other)  # it took turn 2 (from its prompt: the dead worker's blocks are gone)
        assert other.stats().kv_blocks_used == 0 or c.wait_blocks_free()


def test_a_ticket_whose_held_prefix_does_not_match_its_blocks_is_refused(path):
    from engine.sampling_params import SamplingParams
    from kv_transfer import TransferTicket

    with _cluster(path) as c:
        (prefill,), (decode,) = c.prefill_workers, c.decode_workers
        prompt, params = _prompt(14, 40), SamplingParams(max_tokens=2)
        ticket = decode.decode.reserve("t", prompt, params)  # nothing cached: three blocks
        try:
            for cached, blocks, match in ((5, ticket.block_ids, "multiple of the block size"),
                                          (48, ticket.block_ids, "below the prompt's 40 tokens"),
                                          (16, ticket.block_ids, "has 3 blocks for tokens 16..40")):
                bad = TransferTicket(**{**ticket.__dict__, "cached_tokens": cached, "block_ids": blocks})
                with pytest.raises(ValueError, match=match):
                    prefill.prefill.add("t", prompt, params, bad)
        finally:
            decode.decode.abort_request("t")
        assert c.wait_blocks_free()
