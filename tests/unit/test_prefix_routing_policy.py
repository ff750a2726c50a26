"""The routing policy's cost model, the prefix index and the cache change log it follows (pure
Python: no servers)."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.cache_events import CacheEvents
from engine.prefix_hash import block_hashes, chain_hash, extend_hashes
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from proto import worker_pb2 as wk
from router.prefix_index import PrefixIndex, PromptBlocks
from router.prefix_policy import Candidate, RoutingPolicy

P = RoutingPolicy()


def test_prefill_cost_is_uncached_plus_queued_tokens():
    a = Candidate("a", cached_tokens=96, queued_tokens=50)
    b = Candidate("b", cached_tokens=0, queued_tokens=0)
    assert P.prefill_cost(128, a) == 32 + 50 and P.prefill_cost(128, b) == 128
    assert P.pick_prefill(128, [b, a]).worker == "a"
    assert P.pick_prefill(128, [b, Candidate("a", 96, 97)]).worker == "b"  # 129 > 128: the queue outweighs the hit
    assert RoutingPolicy(prefix_aware=False).pick_prefill(128, [b, a]).worker == "b"  # by load only


def test_ties_go_to_fewer_requests_then_the_first_listed():
    x, y = Candidate("x", 0, 10, inflight=2), Candidate("y", 0, 10, inflight=1)
    assert P.pick_prefill(64, [x, y]).worker == "y"
    assert P.pick_prefill(64, [y, Candidate("z", 0, 10, inflight=1)]).worker == "y"
    assert P.pick_prefill(64, []) is None and P.pick_decode([]) is None


def test_a_worker_without_the_prefix_is_picked_by_load():
    cold = [Candidate("d0", 0, inflight=3, free_blocks=10), Candidate("d1", 0, inflight=1, free_blocks=5)]
    assert P.pick_decode(cold).worker == "d1"
    assert P.pick_decode([Candidate("d0", 0, inflight=1, free_blocks=5),
                          Candidate("d1", 0, inflight=1, free_blocks=9)]).worker == "d1"


def test_decode_goes_to_the_longest_prefix_unless_that_worker_is_much_busier():
    holder, idle = Candidate("d0", 64, inflight=5), Candidate("d1", 0, inflight=1)
    assert P.pick_decode([idle, holder]).worker == "d0"  # 4 more requests: within decode_imbalance
    assert P.pick_decode([idle, Candidate("d0", 64, inflight=6)]).worker == "d1"
    assert RoutingPolicy(prefix_aware=False).pick_decode([idle, holder]).worker == "d1"


def test_conditional_disaggregation_threshold():
    local = RoutingPolicy(local_prefill_uncached_tokens=32)
    assert local.prefill_on_decode(100, 68) and not local.prefill_on_decode(100, 67)
    assert not P.prefill_on_decode(10, 0)  # 0: always a prefill worker
    assert not RoutingPolicy(prefix_aware=False, local_prefill_uncached_tokens=32).prefill_on_decode(100, 96)
    with pytest.raises(ValueError, match="local_prefill_uncached_tokens must be >= 0"):
        RoutingPolicy(local_prefill_uncached_tokens=-1)


def test_change_log_nets_out_and_falls_back_to_a_snapshot():
    ev = CacheEvents(max_events=4)
    first = ev.since(0)
    assert first.snapshot and first.stored == []
    ev.stored(b"a")
    ev.stored(b"b")
    ev.removed(b"a")
    c = ev.since(first.cursor)
    assert not c.snapshot and c.stored == [b"b"] and c.removed == [b"a"]
    ev.removed(b"b")
    ev.stored(b"b")  # evicted and cached again: only stored
    d = ev.since(c.cursor)
    assert d.stored == [b"b"] and d.removed == []
    for h in (b"c", b"d", b"e", b"f", b"g"):
        ev.stored(h)
    late = ev.since(d.cursor)  # the log no longer reaches back: everything held
    assert late.snapshot and sorted(late.stored) == [b"b", b"c", b"d", b"e", b"f", b"g"]
    assert ev.since(late.cursor + 10).snapshot  # a cursor from another life of the worker


def _events(c) -> wk.PrefixCacheEvents:
    return wk.PrefixCacheEvents(cursor=c.cursor, snapshot=c.snapshot, stored=c.stored, removed=c.removed,
                                block_size=4)


def test_the_index_follows_a_block_managers_cache_including_late_evictions():
    bm, index = BlockManager(num_blocks=4, block_size=4), PrefixIndex()
    prompt = list(range(1, 14))  # 13 tokens: three full blocks, the last two usable as hits
    blocks = PromptBlocks(prompt)
    seq = Sequence("r", prompt, len(prompt), SamplingParams())
    bm.allocate(seq)
    seq.num_computed_tokens = len(prompt)
    bm.cache_full_blocks(seq)
    bm.free(seq)
    c = bm.events.since(0)
    index.apply("w", _events(c))
    assert index.cached_tokens("w", blocks) == 12  # all three full blocks: the 13th token is computed afresh
    assert index.cached_tokens("w", PromptBlocks(prompt[:12])) == 8  # 12 tokens: the last block is computed
    assert index.cached_tokens("other", blocks) == 0
    other = Sequence("s", [50] * 16, 16, SamplingParams())
    bm.allocate(other)  # takes every free block: the cached ones are evicted
    assert index.cached_tokens("w", blocks) == 12  # not reported yet: the index is late, not wrong-footed
    index.apply("w", _events(bm.events.since(c.cursor)))
    assert index.cached_tokens("w", blocks) == 0
    index.expect("w", blocks)  # sent there: expected before the worker reports it
    assert index.cached_tokens("w", blocks) == 12
    index.forget("w")
    assert index.cached_tokens("w", blocks) == 0
    index.apply("w", _events(bm.events.since(0)))  # a snapshot replaces what was known
    index.expect("w", PromptBlocks([9] * 8))  # not in the cache, only expected: gone with the next snapshot
    index.apply("w", _events(bm.events.since(0)))
    assert index.cached_tokens("w", PromptBlocks([9] * 9)) == 0


def test_a_prompts_hashes_are_computed_once_and_grow_with_its_answer():
    blocks = PromptBlocks(list(range(20)))
    first = blocks.hashes(4)
    assert blocks.hashes(4) is first and len(first) == 5
    longer = blocks.extended([20, 21, 22, 23])
    assert longer.hashes(4) == block_hashes(list(range(24)), 4) and len(first) == 5  # the original is kept


def test_hashes_are_the_block_managers():
    ids = list(range(40))
    assert block_hashes(ids, 16) == [chain_hash(None, ids[:16]), chain_hash(chain_hash(None, ids[:16]), ids[16:32])]
    grown = extend_hashes(block_hashes(ids[:16], 16), ids, 16, 2)  # a sequence's hashes grow as it does
    assert grown == block_hashes(ids, 16) and extend_hashes(list(grown), ids, 16, 1) == grown


def test_status_shows_each_workers_hit_rate():
    from cli.main import hit_rate

    assert hit_rate({"prompt_tokens": 4096, "prefix_cache_hit_tokens": 1536}) == "37.5% of 4096"
    assert hit_rate({"prompt_tokens": 0}) == "0 tokens" and hit_rate({}) == "-"
