"""The KV offload tier (engine/kv_tier.py): blocks written and read back byte for byte, only for the
context they were computed in; the size kept least recently used first; two engines of a node
sharing one directory; nothing left behind by the last engine, or by engines that died; and the
block manager evicting to it and recalling from it with its accounting exact."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.block_manager import BlockManager
from engine.kv_tier import DIR_PREFIX, KVTier, TierLink, sweep_dead_tiers
from engine.prefix_hash import block_hashes
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BS = 4
TOKENS = tuple(range(10, 10 + BS))


def _caches(blocks: int = 8, dtype: torch.dtype = torch.float32, planes: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(planes, blocks, BS, 2, 8, generator=g).to(dtype) for _ in range(3)]


def _tier(tmp_path: Path, capacity: int = 1 << 20, layout: str = "L", name: str = "t") -> KVTier:
    return KVTier(tmp_path / f"{DIR_PREFIX}{name}", layout, capacity, rescan_s=0.0)


def _h(i: int) -> bytes:
    return bytes([i]) * 16


@pytest.mark.parametrize("dtype, planes", [(torch.float32, 2), (torch.bfloat16, 2), (torch.uint8, 2), (torch.float32, 1)])
def test_a_block_comes_back_byte_for_byte(tmp_path: Path, dtype: torch.dtype, planes: int) -> None:
    caches = _caches(dtype=dtype, planes=planes)
    link = TierLink(_tier(tmp_path), lambda: caches)
    assert link.save(2, _h(1), _h(0), TOKENS)
    assert link.holds(_h(1))
    want = [c[:, 2].clone() for c in caches]
    assert link.load(5, _h(1), _h(0), TOKENS)
    assert all(torch.equal(c[:, 5], w) for c, w in zip(caches, want))


def test_a_block_is_served_only_to_the_context_it_was_computed_in(tmp_path: Path) -> None:
    caches = _caches()
    tier = _tier(tmp_path)
    link = TierLink(tier, lambda: caches)
    link.save(0, _h(1), _h(0), TOKENS)
    assert not link.load(1, _h(1), _h(9), TOKENS)  # another parent
    assert not link.load(1, _h(1), _h(0), (1, 2, 3, 4))  # other tokens
    assert not link.load(1, _h(2), _h(0), TOKENS)  # not there
    other = TierLink(KVTier(tier.path, "another model", 1 << 20), lambda: caches)
    assert not other.holds(_h(1)) and not other.load(1, _h(1), _h(0), TOKENS)
    assert tier.snapshot_stats().misses == 3 and tier.snapshot_stats().hits == 0
    # a torn or foreign file under the right name is a miss, never wrong KV
    path = next(tier.path.glob("*.kv"))
    path.write_bytes(path.read_bytes()[:100])
    assert not link.load(1, _h(1), _h(0), TOKENS)


def test_the_size_is_kept_least_recently_used_first(tmp_path: Path) -> None:
    caches = _caches()
    link = TierLink(_tier(tmp_path), lambda: caches)
    link.save(0, _h(1), None, TOKENS)
    size = link.tier.snapshot_stats().used_bytes
    tier = _tier(tmp_path, capacity=3 * size, name="small")
    link = TierLink(tier, lambda: caches)
    for i in (1, 2, 3):
        link.save(i, _h(i), None, TOKENS)
    assert link.load(7, _h(1), None, TOKENS)  # 1 is now the most recently used
    link.save(4, _h(4), None, TOKENS)  # evicts 2, the least recently used
    assert [link.holds(_h(i)) for i in (1, 2, 3, 4)] == [True, False, True, True]
    s = tier.snapshot_stats()
    assert (s.blocks, s.used_bytes, s.evictions, s.saves) == (3, 3 * size, 1, 4)
    assert tier.changes(tier.changes(0).cursor).stored == []  # nothing new since
    got = tier.changes(2)
    assert set(got.removed) == {_h(2)} and set(got.stored) == {_h(3), _h(4)}


def test_two_engines_of_a_node_share_one_tier(tmp_path: Path) -> None:
    a_caches, b_caches = _caches(), _caches()
    b_caches[0].zero_()
    a = TierLink(_tier(tmp_path), lambda: a_caches)
    b = TierLink(_tier(tmp_path), lambda: b_caches)
    assert a.save(3, _h(1), None, TOKENS)
    assert b.load(6, _h(1), None, TOKENS)
    assert torch.equal(b_caches[0][:, 6], a_caches[0][:, 3])
    assert b.save(3, _h(1), None, TOKENS)  # held already: only touched
    assert b.tier.snapshot_stats().saves == 0
    snap = b.tier.changes(0)  # a new reader sees what the directory holds, whoever wrote it
    assert snap.snapshot and snap.stored == [_h(1)]


def test_the_last_engine_out_removes_the_directory(tmp_path: Path) -> None:
    a, b = _tier(tmp_path), _tier(tmp_path)
    a.close()
    assert a.path.exists()  # b still uses it
    b.close()
    assert not a.path.exists()


def test_a_tier_whose_engines_died_is_swept_by_the_next(tmp_path: Path) -> None:
    dead = tmp_path / f"{DIR_PREFIX}dead"
    (dead / "users").mkdir(parents=True)
    pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                         text=True, check=True).stdout.strip()
    (dead / "users" / f"{pid}-0").touch()
    (dead / "x.kv").write_bytes(b"0" * 100)
    live = tmp_path / f"{DIR_PREFIX}live"
    (live / "users").mkdir(parents=True)
    (live / "users" / f"{os.getpid()}-0").touch()
    young = tmp_path / f"{DIR_PREFIX}young"
    young.mkdir()
    old = time.time() - 3600
    for d in (dead, live):
        os.utime(d, (old, old))
    assert sweep_dead_tiers(tmp_path) == [dead]
    assert not dead.exists() and live.exists() and young.exists()


def test_a_tier_needs_a_size_and_its_own_directory_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="size"):
        _tier(tmp_path, capacity=0)
    with pytest.raises(ValueError, match=DIR_PREFIX):
        KVTier(tmp_path / "cache", "L", 1 << 20)


class _Recorder:
    """A tier that keeps blocks as the token ids they were saved with (for the block manager's accounting)."""

    def __init__(self) -> None:
        self.saved: dict[bytes, tuple] = {}
        self.loads: list[tuple[int, bytes]] = []

    def holds(self, h: bytes) -> bool:
        return h in self.saved

    def save(self, block_id: int, h: bytes, parent: bytes | None, token_ids: tuple[int, ...]) -> bool:
        self.saved[h] = (parent, token_ids)
        return True

    def load(self, block_id: int, h: bytes, parent: bytes | None, token_ids: tuple[int, ...]) -> bool:
        self.loads.append((block_id, h))
        return self.saved.get(h) == (parent, token_ids)


def _seq(rid: str, ids: list[int], **params: object) -> Sequence:
    return Sequence(rid, list(ids), len(ids), SamplingParams(**params), frozenset(), 1024)


def _prefilled(bm: BlockManager, rid: str, ids: list[int]) -> Sequence:
    """A sequence allocated and computed, its full blocks in the prefix cache (not freed yet)."""
    seq = _seq(rid, ids)
    bm.allocate(seq)
    seq.num_computed_tokens = len(ids)
    bm.cache_full_blocks(seq)
    return seq


def test_the_block_manager_evicts_to_the_tier_and_recalls_from_it() -> None:
    tier = _Recorder()
    bm = BlockManager(10, BS, tier=tier)
    first = list(range(1, 4 * BS + 2))  # 4 full blocks and one token
    bm.free(_prefilled(bm, "a", first))
    other = _seq("b", [7] * (10 * BS))  # takes every block: the 4 cached ones are evicted, to the tier
    bm.allocate(other)
    hashes = block_hashes(first, BS)
    assert set(tier.saved) == set(hashes[:4])
    assert tier.saved[hashes[1]] == (hashes[0], tuple(first[BS : 2 * BS]))
    bm.free(other)
    again = _seq("c", first + [99] * 3)
    bm.allocate(again)
    assert again.num_cached_tokens == 4 * BS and bm.tier_hits == 4
    assert [h for _, h in tier.loads] == hashes[:4]
    assert [bm.hash_to_block[h] for h in hashes[:4]] == again.block_table[:4]  # in the prefix cache again
    bm.check_invariants([again.block_table])
    more = _seq("d", first + [5] * 3)  # the recalled blocks serve the next prompt from memory
    bm.allocate(more)
    assert more.num_cached_tokens == 4 * BS and bm.tier_hits == 4
    bm.check_invariants([again.block_table, more.block_table])


def test_a_failed_recall_gives_its_block_back_and_prompt_logprobs_skip_the_tier() -> None:
    tier = _Recorder()
    bm = BlockManager(6, BS, tier=tier)
    ids = list(range(1, 3 * BS + 2))
    hashes = block_hashes(ids, BS)
    tier.saved[hashes[0]] = (None, tuple(ids[:BS]))
    tier.saved[hashes[1]] = (hashes[0], (0,) * BS)  # held, but for other tokens: load fails
    seq = _seq("a", ids)
    bm.allocate(seq)
    assert seq.num_cached_tokens == BS and bm.num_free_blocks == 6 - 4
    bm.check_invariants([seq.block_table])
    bm.free(seq)
    tier.loads.clear()
    logprobs = _seq("b", ids, prompt_logprobs=1)
    bm.allocate(logprobs)
    assert logprobs.num_cached_tokens == 0 and tier.loads == []


def test_the_routers_index_counts_a_nodes_tier_as_held_by_each_of_its_workers() -> None:
    from proto import worker_pb2 as wk
    from router.prefix_index import PrefixIndex, PromptBlocks

    ids = list(range(1, 5 * BS + 2))
    hashes = block_hashes(ids, BS)
    index = PrefixIndex()
    tier = "host:/dev/shm/pdkv-tier-a:0"
    index.apply("p0", wk.PrefixCacheEvents(snapshot=True, stored=hashes[:1], block_size=BS, tier_id=tier,
                                           tier_snapshot=True, tier_stored=hashes[1:3]))
    index.apply("p1", wk.PrefixCacheEvents(snapshot=True, block_size=BS, tier_id=tier, tier_stored=hashes[3:4]))
    index.apply("p2", wk.PrefixCacheEvents(snapshot=True, stored=hashes[:1], block_size=BS,
                                           tier_id="other:/dev/shm/pdkv-tier-a:0"))
    prompt = PromptBlocks(ids)
    assert index.cached_tokens("p0", prompt) == 4 * BS  # its own block, then three in its node's tier
    assert index.cached_tokens("p1", prompt) == 0  # the first block is in p0's memory only
    assert index.cached_tokens("p2", prompt) == BS  # another node's tier
    index.apply("p1", wk.PrefixCacheEvents(cursor=2, block_size=BS, tier_id=tier, tier_removed=hashes[1:2]))
    assert index.cached_tokens("p0", prompt) == BS and index.tier_blocks(tier) == 2
    index.forget("p0")  # a worker gone: its node's tier stays known through the others
    assert index.tier_blocks(tier) == 2 and index.cached_tokens("p0", prompt) == 0


def test_cluster_config_names_one_tier_per_cluster_and_the_status_shows_it() -> None:
    from cli.main import tier_lines
    from pdcluster.cluster_config import ClusterConfig
    from pdcluster.worker_launch import tier_path

    cfg = ClusterConfig.from_dict({"kv_cache": {"offload_mb": 64, "offload_dir": "/tmp"}})
    assert cfg.engine_kwargs()["kv_offload_bytes"] == 64 << 20
    a, b = tier_path("/tmp", "secret one"), tier_path("/tmp", "secret two")
    assert a != b and a == tier_path("/tmp", "secret one") and os.path.basename(a).startswith(DIR_PREFIX)
    workers = [{"worker_id": w, "tier_id": "h:/tmp/t:0", "tier_used_bytes": 3 << 20, "tier_capacity_bytes": 64 << 20,
                "tier_blocks": 20, "tier_saves": 10, "tier_hits": h, "tier_misses": 1, "tier_evictions": 0}
               for w, h in (("prefill-0", 3), ("decode-0", 0))]
    assert tier_lines(workers + [{"worker_id": "x"}]) == [
        "KV offload tier h:/tmp/t:0: 3.0 of 64 MiB, 20 blocks; saves 20, hits 3 (60.0% of lookups), "
        "evictions 0 (LRU); workers decode-0, prefill-0"]


def test_engine_config_refuses_a_tier_it_cannot_serve() -> None:
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(kv_offload_bytes=1 << 20, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(kv_offload_bytes=1 << 20, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="kv_offload_bytes"):
        EngineConfig(kv_offload_bytes=-1)


def test_the_router_names_another_nodes_worker_whose_tier_holds_more() -> None:
    from proto import worker_pb2 as wk
    from router.prefix_index import PrefixIndex, PromptBlocks
    from router.worker_pool import WorkerHandle, WorkerPool

    ids = list(range(1, 5 * BS + 2))
    hashes = block_hashes(ids, BS)
    pool = WorkerPool(stats_interval_s=3600.0)  # no Stats poll during the test (channels never connect)
    pool.set_workers([("p0", "prefill", "a:1"), ("d0", "decode", "b:1"), ("p1", "prefill", "b:2")])
    index: PrefixIndex = pool.index
    index.apply("p0", wk.PrefixCacheEvents(snapshot=True, block_size=BS, tier_id="A", tier_snapshot=True,
                                           tier_stored=hashes[:1]))
    index.apply("d0", wk.PrefixCacheEvents(snapshot=True, block_size=BS, tier_id="B", tier_snapshot=True,
                                           tier_stored=hashes[:4]))
    index.apply("p1", wk.PrefixCacheEvents(snapshot=True, block_size=BS, tier_id="B"))
    prompt = PromptBlocks(ids)
    p0 = next(w for w in pool.workers() if w.worker_id == "p0")
    assert index.other_tier("p0", prompt, BS) == (4, ["d0", "p1"])
    assert pool.tier_source(p0, prompt, BS) == wk.TierSource(address="b:1", blocks=4, role=wk.WORKER_ROLE_DECODE)
    assert pool.tier_source(p0, prompt, 4 * BS) is None  # it holds as much itself
    next(w for w in pool.workers() if w.worker_id == "d0").healthy = False
    assert pool.tier_source(p0, prompt, BS).address == "b:2"  # another worker of that node
    assert index.other_tier("p1", prompt, 0) == (1, ["p0"])
    index.apply("p9", wk.PrefixCacheEvents(snapshot=True, block_size=BS))  # a worker without a tier reads none
    assert index.other_tier("p9", prompt, 0) is None
    assert isinstance(p0, WorkerHandle)
    pool.close()


def test_a_tier_serves_its_blocks_files_in_prompt_order_and_takes_anothers(tmp_path: Path) -> None:
    from kv_transfer.tier_fetch import serve_blocks
    from proto import worker_pb2 as wk

    caches = _caches()
    a = TierLink(_tier(tmp_path, name="a"), lambda: caches)
    b = _tier(tmp_path, name="b")
    for i in (1, 2, 4):
        a.save(i, _h(i), _h(i - 1), TOKENS)
    got = list(serve_blocks(a.tier, wk.ReadTierRequest(hashes=[_h(1), _h(2), _h(3), _h(4)])))
    assert [blk.hash for blk in got] == [_h(1), _h(2)]  # up to the first it lacks
    assert list(serve_blocks(None, wk.ReadTierRequest(hashes=[_h(1)]))) == []
    assert all(b.put_file(blk.hash, blk.data) for blk in got)
    assert not b.put_file(_h(9), got[0].data)  # named for another block: refused
    assert not KVTier(b.path, "another model", 1 << 20).put_file(_h(1), got[0].data)
    other = [torch.zeros_like(c) for c in caches]
    assert TierLink(b, lambda: other).load(0, _h(2), _h(1), TOKENS)
    assert torch.equal(other[2][:, 0], caches[2][:, 2])


def test_a_recall_counts_each_block_it_looked_up_as_a_hit_or_a_miss(tmp_path: Path) -> None:
    """Through a real tier: the blocks read back are hits, the first one the tier lacks ends the
    recall as one miss (the status line's hit rate is hits over both)."""
    caches = _caches(blocks=10)
    link = TierLink(_tier(tmp_path), lambda: caches)
    bm = BlockManager(10, BS, tier=link)
    ids = list(range(1, 5 * BS + 2))  # 5 full blocks and one token
    a = _prefilled(bm, "a", ids)
    want = [caches[1][:, b].clone() for b in a.block_table[:5]]
    bm.free(a)
    bm.allocate(_seq("x", [7] * (10 * BS)))  # evicts a's five blocks into the tier
    before = link.tier.snapshot_stats()
    assert (before.saves, before.misses) == (5, 2)  # a's and x's first blocks were looked up, not found
    bm.free_blocks(list(range(10)))
    os.unlink(link.tier.path / link.tier._name(block_hashes(ids, BS)[3]))  # the 4th block lost
    b = _seq("b", ids)
    bm.allocate(b)
    s = link.tier.snapshot_stats()
    assert (b.num_cached_tokens, bm.tier_hits, s.hits, s.misses - before.misses) == (3 * BS, 3, 3, 1)
    assert all(torch.equal(caches[1][:, blk], w) for blk, w in zip(b.block_table[:3], want))
