"""Planner simulator: prefix caches on every worker and the router's routing policy
(router/prefix_policy.py): prefix-aware worker choice, decode-side reuse across turns, conditional
disaggregation; nothing changes where the policy has nothing to act on."""

from __future__ import annotations

import random

import pytest

from loadgen.arrivals import ArrivalConfig, arrival_offsets
from pdcluster.cluster_config import ClusterConfig
from planner.catalog import load_catalog
from planner.cli import main
from planner.cost_model import FittedCostModel
from planner.models import PRESETS
from planner.plan import Plan, PlanContext, Pool, build_cluster
from planner.report import cluster_dict
from planner.search import SLOTarget
from planner.sim_cache import PrefixCache, reuse_bound
from planner.simulator import ClusterSpec, Simulator, WorkerSpec

KVB = 9216


def _cost(capacity: int = 1_000_000) -> FittedCostModel:
    return FittedCostModel(prefill=(0.01, 1e-4, 1e-8), decode=(0.005, 1e-6, 1e-3),
                           kv_capacity_tokens=capacity, kv_bytes_per_token=KVB)


def _worker(capacity: int = 1_000_000) -> WorkerSpec:
    return WorkerSpec(_cost(capacity), max_num_batched_tokens=2048, max_num_seqs=256, block_size=16, link_gbps=2.0)


def _cluster(n_prefill: int = 1, n_decode: int = 1, prefill_capacity: int = 1_000_000, **kw) -> ClusterSpec:
    return ClusterSpec("disaggregated", [_worker(prefill_capacity)] * n_prefill, [_worker()] * n_decode,
                       layerwise=False, **kw)


def _poisson(n: int, rate: float) -> list[float]:
    return arrival_offsets(ArrivalConfig("poisson", rate), n).offsets


def _p50(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _shared_prefixes(n: int, groups: int, prefix_blocks: int, seed: int = 1) -> tuple[list[int], list[list]]:
    """Requests that each start with one of `groups` shared prefixes, then 64 tokens of their own."""
    rng = random.Random(seed)
    prompts, keys = [], []
    for i in range(n):
        g = rng.randrange(groups)
        prompts.append(prefix_blocks * 16 + 64)
        keys.append([("g", g, j) for j in range(prefix_blocks)] + [("r", i, j) for j in range(4)])
    return prompts, keys


def test_prefix_aware_finds_more_cached_prefixes_and_cuts_ttft_against_routing_by_load():
    # 16 shared prefixes of 1024 tokens; each prefill worker's cache holds about half of them, so
    # routing by load makes both workers cycle through all of them and evict what the next one needs
    n = 400
    prompts, keys = _shared_prefixes(n, groups=16, prefix_blocks=64)
    outputs = [8] * n
    arrivals = _poisson(n, 10.0)
    runs = {}
    for on in (True, False):
        spec = _cluster(2, 1, prefill_capacity=10_240, prefix_aware=on)
        runs[on] = Simulator(spec).run(arrivals, prompts, outputs, block_keys=keys)
    prefix, load = runs[True], runs[False]
    assert prefix.finished == load.finished == n
    hits = {on: sum(r.stats["cached_tokens"][:2]) for on, r in runs.items()}
    assert hits[True] > 1.5 * hits[False]
    assert hits[True] <= reuse_bound(arrivals, prompts, keys, 16)  # never past the bound
    assert _p50(prefix.ttft) < 0.8 * _p50(load.ttft)


def _conversation(turns: int, first: int = 320, answer: int = 33, message: int = 95) -> tuple[list[int], list[list]]:
    """One chat: each turn's prompt is the previous prompt, its answer and a new message; the keys
    name every full block of a turn's prompt and answer (a turn's blocks are the next one's prefix)."""
    prompts, keys, seq = [], [], []
    length = first
    for t in range(turns):
        prompts.append(length)
        total = length + answer
        seq = seq[:length // 16] + [("c", t, j) for j in range(len(seq[:length // 16]), total // 16)]
        keys.append(list(seq))
        length = total + message
    return prompts, keys


def test_a_decode_worker_keeps_a_finished_turn_and_only_the_new_blocks_move():
    c = _cost()
    prompts, keys = _conversation(2)  # turn 2: 448 tokens, of which 352 are turn 1's prompt and answer
    assert prompts == [320, 448]
    res = Simulator(_cluster()).run([0.0, 10.0], prompts, [33, 33], block_keys=keys)
    # the prefill worker holds turn 1's prompt (320 tokens) and computes the rest; the decode worker
    # holds 22 full blocks (352 tokens, all but the last token's block of prompt + answer): 96 move
    assert res.ttft[1] == pytest.approx(c.prefill_time(128, 128 * 448, 320) + 96 * KVB / 2e9, rel=1e-9)
    assert res.stats["kv_bytes_sent"] == (320 + 96) * KVB
    assert res.stats["kv_bytes_held"] == 352 * KVB
    assert res.stats["cached_tokens"] == [320, 0]


def test_conditional_disaggregation_prefills_a_short_uncached_part_on_the_decode_worker():
    c = _cost()
    prompts, keys = _conversation(2)
    local = Simulator(_cluster(local_prefill_uncached_tokens=96)).run([0.0, 10.0], prompts, [33, 33],
                                                                    block_keys=keys)
    assert local.stats["local_uncached"] == 1 and local.stats["kv_bytes_sent"] == 320 * KVB  # turn 1's only
    assert local.ttft[1] == pytest.approx(c.prefill_time(96, 96 * 448, 352), rel=1e-9)
    remote = Simulator(_cluster(local_prefill_uncached_tokens=95)).run([0.0, 10.0], prompts, [33, 33],
                                                                     block_keys=keys)
    assert remote.stats["local_uncached"] == 0 and remote.stats["kv_bytes_sent"] == (320 + 96) * KVB


def _chats(n: int, turns: int, think_s: float, seed: int = 0) -> tuple[list[float], list[int], list[list]]:
    rng = random.Random(seed)
    arrivals, prompts, keys = [], [], []
    for k in range(n):
        p, ks = _conversation(turns, first=rng.randint(200, 600))
        start = rng.uniform(0, 20)
        arrivals += [start + t * think_s for t in range(turns)]
        prompts += p
        keys += [[(k, *x) for x in row] for row in ks]
    return arrivals, prompts, keys


def test_later_turns_go_to_the_decode_worker_holding_the_conversation():
    arrivals, prompts, keys = _chats(100, turns=4, think_s=5.0)
    outputs = [33] * len(prompts)
    runs = {on: Simulator(_cluster(1, 3, prefix_aware=on)).run(arrivals, prompts, outputs, block_keys=keys)
            for on in (True, False)}
    held = {on: r.stats["kv_bytes_held"] for on, r in runs.items()}
    sent = {on: r.stats["kv_bytes_sent"] for on, r in runs.items()}
    assert held[True] > 1.5 * held[False]
    assert sent[True] < 0.7 * sent[False]
    # with conditional disaggregation most later turns move no KV at all
    cond = Simulator(_cluster(1, 3, local_prefill_uncached_tokens=256)).run(arrivals, prompts, outputs,
                                                                           block_keys=keys)
    assert cond.stats["local_uncached"] >= 60 and cond.stats["kv_bytes_sent"] < 0.6 * sent[True]
    assert cond.finished == len(prompts)


def test_routing_is_unchanged_where_the_policy_has_nothing_to_act_on():
    rng = random.Random(2)
    n = 300
    prompts = [rng.randint(50, 600) for _ in range(n)]
    outputs = [rng.randint(5, 50) for _ in range(n)]
    arrivals = _poisson(n, 8.0)
    # no block keys: prefix routing on and off route alike
    on = Simulator(_cluster(2, 2)).run(arrivals, prompts, outputs)
    off = Simulator(_cluster(2, 2, prefix_aware=False)).run(arrivals, prompts, outputs)
    assert on.ttft == off.ttft and on.e2e == off.e2e and on.stats["busy_s"] == off.stats["busy_s"]
    # one worker of each role: nothing to choose, with shared prefixes too; the prefill worker
    # computes the same, and only with prefix_aware does the decode worker share what it holds
    p, keys = _shared_prefixes(n, groups=4, prefix_blocks=16)
    on = Simulator(_cluster()).run(arrivals, p, outputs, block_keys=keys)
    off = Simulator(_cluster(prefix_aware=False)).run(arrivals, p, outputs, block_keys=keys)
    assert on.stats["cached_tokens"][0] == off.stats["cached_tokens"][0] > 0
    assert off.stats["kv_bytes_held"] == 0 and off.stats["kv_bytes_sent"] == sum(p) * KVB
    assert on.stats["kv_bytes_held"] > 0 and on.stats["kv_bytes_sent"] + on.stats["kv_bytes_held"] == sum(p) * KVB


def test_a_decode_cache_keeps_held_blocks_and_evicts_the_least_recently_used_free_ones():
    cache = PrefixCache()
    cache.store(["a", "b", "c"], cap=10)
    cache.hold(["a"])
    cache.trim(1)  # b goes first, a is held
    assert cache.holds("a") and not cache.holds("b") and cache.holds("c")
    assert cache.prefix_blocks(["a", "c", "x"], 3) == 2 and cache.prefix_blocks(["b", "a"], 2) == 0
    cache.release(["a"])
    cache.trim(1)  # a is now the most recently used free block
    assert cache.holds("a") and not cache.holds("c")
    assert reuse_bound([0.0, 1.0, 2.0], [50, 50, 50], [["x", "y", "z"], ["x", "y", "q"], ["p"]], 16) == 32


def test_the_plan_carries_the_routing_policy_into_the_simulation_and_the_cluster_yaml():
    ctx = PlanContext(PRESETS["Llama-3-8B"], load_catalog())
    plan = Plan("disaggregated", Pool("H100-SXM", 2), Pool("H100-SXM", 1), prefix_aware=False,
                local_prefill_uncached_tokens=128)
    spec = build_cluster(plan, ctx)
    assert not spec.prefix_aware and spec.local_prefill_uncached_tokens == 128 and spec.mixed_steps
    assert plan.with_counts(3, 2).local_prefill_uncached_tokens == 128
    cfg = ClusterConfig.from_dict(cluster_dict(plan, ctx, SLOTarget(1000, 50), "/m", 3000))
    assert cfg.router.prefix_aware is False and cfg.router.local_prefill_uncached_tokens == 128
    default = ClusterConfig.from_dict(cluster_dict(Plan("colocated", None, Pool("L40S", 2)), ctx,
                                                   SLOTarget(1000, 50), "/m", 3000))
    assert default.router.prefix_aware is True and default.router.local_prefill_uncached_tokens == 0


def test_plan_simulate_says_what_the_reuse_is_worth(capsys):
    assert main(["simulate", "--workload", "mooncake-conv", "--num-requests", "300", "--max-context", "8192",
                 "--model", "Llama-3-8B", "--prefill", "H100-SXM:2", "--decode", "H100-SXM:2", "--rate", "2",
                 "--compare-routing"]) == 0
    out = capsys.readouterr().out
    assert "prefix     hit " in out and "an infinite cache shared by all workers" in out
    assert "prefix-aware" in out and "load only" in out


def test_auto_threshold_is_the_longest_uncached_part_one_step_can_prefill_within_the_tpot_bound():
    from planner.reuse import uncached_threshold

    cost = _cost()
    n = uncached_threshold(cost, 0.05, 16, batch=8, context=1000, cap=2048)

    def step(u: int) -> float:
        return cost.decode_time(8, 8000) + cost.prefill_time(u, u * 1000 + u * (u + 1) // 2, 1000, 1)

    assert n % 16 == 0 and 0 < n < 2048 and step(n) <= 0.05 < step(n + 16)
    assert uncached_threshold(cost, 0.05, 16, batch=8, context=1000, cap=64) == 64  # one step's token budget
    assert uncached_threshold(cost, 0.02, 16, batch=8, context=1000, cap=2048) == 0  # the decode step alone is over


def test_plan_gives_each_disaggregated_plan_its_own_threshold_by_default(capsys):

    with pytest.raises(SystemExit):
        main(["simulate", "--workload", "azure-conv", "--prefill", "cpu", "--decode", "cpu", "--rate", "1",
              "--local-prefill-uncached-tokens", "auto"])
    assert "invalid int value: 'auto'" in capsys.readouterr().err


def test_an_offload_tier_brings_evicted_prefixes_back_up_to_the_bound():
    # 16 shared prefixes of 1024 tokens, two prefill workers each holding about a third of them:
    # without a tier they evict what later requests need; with a tier the size of all of them, every
    # repeat after the first is served from a cache or the tier
    n = 400
    prompts, keys = _shared_prefixes(n, groups=16, prefix_blocks=64)
    arrivals = _poisson(n, 10.0)
    runs = {tier: Simulator(_cluster(2, 1, prefill_capacity=6_000, tier_blocks=tier)).run(
        arrivals, prompts, [8] * n, block_keys=keys) for tier in (0, 16 * 64 + 64)}
    hits = {tier: sum(r.stats["cached_tokens"][:2]) for tier, r in runs.items()}
    bound = reuse_bound(arrivals, prompts, keys, 16)
    assert hits[0] < 0.8 * bound and 0.95 * bound <= hits[1088] <= bound
    assert runs[0].stats["tier_hit_blocks"] == 0 and runs[1088].stats["tier_hit_blocks"] > 0
    assert _p50(runs[1088].ttft) < _p50(runs[0].ttft)


def test_the_tier_cache_keeps_its_size_least_recently_used_first():
    from planner.sim_cache import TierCache

    tier = TierCache(2)
    cache = PrefixCache(tier)
    cache.store(["a", "b", "c"], cap=1)  # a and b trimmed out: to the tier
    assert list(tier.keys) == ["a", "b"] and cache.prefix_blocks(["a", "b", "c"], 3) == 2
    assert cache.use_prefix(["a"], 1) == 1 and tier.hit_blocks == 1  # a, read back, is the most recent
    cache.store(["d"], cap=0)  # c, then d trimmed into the tier: b, then a leave it (least recently used)
    assert list(tier.keys) == ["c", "d"]


def test_plan_writes_the_tier_and_simulate_reports_what_it_read_back(capsys):
    ctx = PlanContext(PRESETS["Llama-3-8B"], load_catalog(), kv_offload_mb=1024)
    plan = Plan("disaggregated", Pool("H100-SXM", 1), Pool("H100-SXM", 1))
    assert build_cluster(plan, ctx).tier_blocks == 1024 * 2**20 // (131072 * 16)
    assert cluster_dict(plan, ctx, SLOTarget(1.0, 0.05), "Llama-3-8B", 4096)["kv_cache"]["offload_mb"] == 1024
