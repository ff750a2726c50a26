"""Planner search: ranking, the Pareto frontier, goodput by simulation, plans as cluster.yaml."""

from __future__ import annotations

import random

import pytest

from pdcluster.cluster_config import ClusterConfig
from planner.catalog import load_catalog
from planner.models import PRESETS
from planner.plan import Plan, PlanContext, Pool, build_cluster
from planner.report import cluster_dict, kind, why_mode
from planner.search import Evaluation, Searcher, SearchSpace, SLOTarget, pareto, rank
from planner.workload import load_plan_workload

SLO = SLOTarget(ttft_ms=1000, tpot_ms=60, percentile=90)


def _ev(cost: float, goodput: float, label: str = "x", meets: bool | None = None) -> Evaluation:
    plan = Plan("colocated", None, Pool(label, 1))
    return Evaluation(plan, cost, 0.0, goodput, meets_target=meets)


def _dominates(a: Evaluation, b: Evaluation) -> bool:
    return (a.cost_per_hour <= b.cost_per_hour and a.goodput >= b.goodput
            and (a.cost_per_hour < b.cost_per_hour or a.goodput > b.goodput))


def test_a_dominated_plan_is_never_ranked_first():
    cheap_good, dominated = _ev(10.0, 10.0, "a"), _ev(12.0, 9.0, "b")
    assert rank([dominated, cheap_good])[0] is cheap_good
    same_cost_less_goodput = _ev(10.0, 8.0, "c")
    assert rank([same_cost_less_goodput, cheap_good])[0] is cheap_good
    rng = random.Random(0)
    for _ in range(500):
        evals = [_ev(rng.choice([1.0, 2.0, 3.0, 4.5]), rng.choice([0.0, 1.0, 2.0, 3.0, 5.0]), str(i))
                 for i in range(rng.randint(1, 8))]
        first = rank(evals)[0]
        assert not any(_dominates(e, first) for e in evals), (first, evals)
        meets = [_ev(e.cost_per_hour, e.goodput, e.plan.decode.hardware, rng.random() < 0.6) for e in evals]
        first = rank(meets, target=1.0)[0]
        assert not any(e.meets_target and _dominates(e, first) for e in meets)


def test_pareto_frontier_keeps_only_undominated_plans():
    evals = [_ev(1, 1), _ev(2, 3), _ev(2, 2), _ev(3, 3), _ev(4, 5), _ev(5, 0)]
    front = pareto(evals)
    assert [(e.cost_per_hour, e.goodput) for e in front] == [(1, 1), (2, 3), (4, 5)]
    assert all(not any(_dominates(o, f) for o in evals) for f in front)


@pytest.fixture(scope="module")
def searcher() -> Searcher:
    ctx = PlanContext(PRESETS["Llama-3-8B"], load_catalog())
    w = load_plan_workload("synthetic", 3000, synthetic_input="lognormal:1000:0.5",
                           synthetic_output="lognormal:150:0.5", seed=1)
    return Searcher(ctx, w, SLO, min_requests=300, min_span_s=10.0)


def test_goodput_is_the_rate_where_the_slo_breaks(searcher):
    cluster = build_cluster(Plan("colocated", None, Pool("A100-80GB", 1)), searcher.ctx)
    g = searcher.max_rate(cluster, 1.0)
    assert g > 0
    assert searcher.simulate(cluster, g)[0]  # meets the SLO at its goodput ...
    assert not searcher.simulate(cluster, g * 1.25)[0]  # ... and not far above it


def test_search_ranks_by_goodput_per_dollar_and_first_is_undominated(searcher):
    space = SearchSpace(["H100-SXM", "A100-80GB"], ["H100-SXM", "A100-80GB"], tps=(1,), max_workers=2)
    result = searcher.search(space, verify=4)
    assert result.ranked and all(e.verified for e in result.ranked)
    best = result.ranked[0]
    assert best.goodput > 0
    assert [e.goodput_per_dollar for e in result.ranked] == sorted((e.goodput_per_dollar for e in result.ranked),
                                                                    reverse=True)
    assert not any(_dominates(e, best) for e in result.ranked)
    assert best in pareto(result.ranked)


def test_target_rate_gives_the_cheapest_plan_that_meets_it(searcher):
    space = SearchSpace(["A100-80GB"], ["A100-80GB"], tps=(1,), max_workers=6)
    result = searcher.search(space, target_rate=8.0, verify=3)
    best = result.ranked[0]
    assert best.meets_target and best.ttft_ms <= SLO.ttft_ms and best.tpot_ms <= SLO.tpot_ms
    meeting = [e for e in result.ranked if e.meets_target]
    assert best.cost_per_hour == min(e.cost_per_hour for e in meeting)


@pytest.mark.parametrize("plan", [
    Plan("disaggregated", Pool("H100-SXM", 2, tp=2), Pool("A100-80GB", 3), 8192, 128),
    Plan("colocated", None, Pool("L40S", 4)),
])
def test_a_plan_becomes_a_cluster_yaml_that_the_schema_accepts(plan):
    ctx = PlanContext(PRESETS["Llama-3-8B"], load_catalog())
    d = cluster_dict(plan, ctx, SLO, "/models/llama-3-8b", longest=3000)
    cfg = ClusterConfig.from_dict(d)
    assert cfg.mode == plan.mode and cfg.engine.max_num_batched_tokens == plan.max_num_batched_tokens
    assert [p.replicas for p in cfg.pools] == [p.count for p in plan.pools]
    assert [p.resources["num_gpus"] for p in cfg.pools] == [p.tp for p in plan.pools]
    assert [p.tensor_parallel_size for p in cfg.pools] == [p.tp for p in plan.pools]  # runs as planned
    assert cfg.model.max_model_len == 4096 and cfg.slo.tpot_ms == 60
    # the SLO controller on where there are roles to move between, giving workers back down to one
    assert cfg.controller.enabled == (plan.mode == "disaggregated")
    assert [p.replica_bounds for p in cfg.pools] == [((1 if cfg.controller.enabled else p.count), p.count)
                                                     for p in plan.pools]


def test_a_cpu_plan_pins_one_core_per_worker():
    coeffs = {"prefill": {"a": 0.01, "b": 2e-4, "c": 1e-7}, "decode": {"a": 0.007, "b": 4e-6, "c": 4e-4},
              "kv_capacity_tokens": 58240, "kv_bytes_per_token": 9216, "model_shape": {"name": "tiny"}}
    ctx = PlanContext(PRESETS["Llama-3-8B"], load_catalog(), coefficients=coeffs)
    d = cluster_dict(Plan("disaggregated", Pool("cpu", 1), Pool("cpu", 1)), ctx, SLO, "builtin:tiny-llama", 1000)
    cfg = ClusterConfig.from_dict(d)
    assert cfg.model.dtype == "float32" and cfg.engine.num_threads == 1
    assert all(p.hardware == "cpu" and p.resources == {"num_cpus": 1.0} for p in cfg.pools)
    cpus = [p.cpus for p in cfg.pools]
    assert all(c is None for c in cpus) or len({c for c in cpus}) == 2


def test_a_node_pool_of_limited_size_caps_the_plans(searcher):
    space = SearchSpace(["H100-SXM", "A100-80GB"], ["A100-80GB"], ("disaggregated",), tps=(1,), max_workers=4,
                        max_devices={"H100-SXM": 2})
    result = searcher.search(space, verify=2)
    assert result.composed and result.ranked
    for e in result.composed + result.ranked:
        assert e.plan.prefill.hardware != "H100-SXM" or e.plan.prefill.count <= 2


def test_a_target_rate_never_grows_a_plan_past_its_node_pools(searcher):
    """verify_target adds workers while a plan misses the target; never beyond --pools HW:N."""
    space = SearchSpace(["A100-80GB"], ["A100-80GB"], ("colocated",), tps=(1,), max_workers=8,
                        max_devices={"A100-80GB": 2})
    small = Evaluation(Plan("colocated", None, Pool("A100-80GB", 2)), 1.0, 0.0, 1.0)
    capped = searcher.verify_target(small, 1000.0, space)  # far beyond two GPUs
    assert capped.plan.decode.count == 2 and not capped.meets_target
    assert searcher.verify_target(small, 1000.0).plan.decode.count > 2  # without limits it grows


def test_mooncake_hash_ids_become_prefix_keys_that_follow_the_text():
    from dataclasses import replace

    from planner.workload import PlanWorkload

    base = load_plan_workload("synthetic", 2, synthetic_input="fixed:96", synthetic_output="fixed:8")
    w = replace(base, hash_ids=[[1, 2, 3], [1, 2, 9]], trace_block=32)
    a, b = w.block_keys(16)
    # engine block j ends at token 16j + 15, in trace block (16j + 15) // 32: 0, 0, 1, 1, 2, 2
    assert len(a) == len(b) == 6
    assert a[:4] == b[:4] and a[4] != b[4] and a[5] != b[5]
    assert len(set(a)) == 6  # a key stands for its whole prefix and its position
    assert isinstance(w.head(1), PlanWorkload) and w.head(1).block_keys(16) == [a]
    assert base.block_keys(16) is None  # no hash ids: every prompt is its own


def test_search_simulates_mooncake_with_prefix_caching():
    ctx = PlanContext(PRESETS["Llama-3-8B"], load_catalog())
    w = load_plan_workload("mooncake-conv", 400, max_context=8192)
    with_keys = Searcher(ctx, w, SLO, min_requests=400)
    assert with_keys.block_keys is not None
    without = Searcher(ctx, w, SLO, min_requests=400)
    without.block_keys = None
    cluster = build_cluster(Plan("colocated", None, Pool("A100-80GB", 1)), ctx)
    hit, miss = with_keys.simulate(cluster, 2.0, early_stop=False)[4], without.simulate(cluster, 2.0, early_stop=False)[4]
    mean = lambda xs: sum(xs) / len(xs)
    assert mean(hit.ttft) < mean(miss.ttft)  # shared conversation prefixes are not prefilled again


def _cpu_ctx() -> PlanContext:
    coeffs = {"prefill": {"a": 0.01, "b": 2e-4, "c": 1e-7}, "decode": {"a": 0.007, "b": 4e-6, "c": 4e-4},
              "kv_capacity_tokens": 58240, "kv_bytes_per_token": 9216, "model_shape": {"name": "Llama-3-8B"}}
    return PlanContext(PRESETS["Llama-3-8B"], load_catalog(), coefficients=coeffs)


def test_cpu_disaggregated_plans_are_also_tried_with_local_prefill_and_the_yaml_carries_it():
    ctx = _cpu_ctx()
    w = load_plan_workload("synthetic", 600, synthetic_input="lognormal:300:0.5",
                           synthetic_output="lognormal:40:0.5", seed=1)
    searcher = Searcher(ctx, w, SLO, min_requests=200, min_span_s=10.0)
    result = searcher.search(SearchSpace(["cpu"], ["cpu"], tps=(1,), max_workers=1), verify=3)
    labels = [e.plan.label() for e in result.ranked]
    assert "P 1x cpu | D 1x cpu" in labels and "P 1x cpu | D 1x cpu + local prefill <= 512" in labels
    line = why_mode(result.ranked)
    assert line.startswith(f"why {kind(result.ranked[0].plan)}:")
    for k in ("colocated", "disaggregated (fixed split)", "disaggregated + local prefill"):
        assert k in line
    local = next(e.plan for e in result.ranked if e.plan.local_prefill_max_tokens)
    assert build_cluster(local, ctx).local_prefill_max_tokens == 512
    cfg = ClusterConfig.from_dict(cluster_dict(local, ctx, SLO, "builtin:tiny-llama", 1000))
    assert cfg.router.local_prefill_max_tokens == 512 and cfg.mode == "disaggregated"
    gpu = SearchSpace(["A100-80GB"], ["A100-80GB"], ("disaggregated",), tps=(1,), max_workers=1)
    assert not any(e.plan.local_prefill_max_tokens for e in Searcher(
        PlanContext(PRESETS["Llama-3-8B"], load_catalog()), w, SLO, min_requests=200).search(gpu, verify=2).composed)


def test_the_attainment_criterion_counts_requests_meeting_both_bounds():
    from planner.search import evaluate
    from planner.simulator import SimResult

    # 10 requests: 1 misses TTFT only, 1 misses TPOT only -> each percentile is within its bound at p80,
    # but only 8 of 10 (80%) meet both
    ttft = [0.1] * 9 + [2.0]
    tpot = [0.01] * 8 + [0.2, 0.01]
    res = SimResult(ttft, tpot, [1.0] * 10, 10, 10.0)
    p80 = SLOTarget(1000, 50, 80.0)
    assert evaluate(res, p80)[0] and evaluate(res, p80)[3] == pytest.approx(0.8)
    assert evaluate(res, SLOTarget(1000, 50, 80.0, "attainment"))[0]
    assert not evaluate(res, SLOTarget(1000, 50, 85.0, "attainment"))[0]
    with pytest.raises(ValueError, match="criterion"):
        SLOTarget(1000, 50, 90.0, "mean")


def test_auto_gives_each_disaggregated_plan_its_decode_pools_threshold_and_the_yaml_carries_it():
    from planner.reuse import plan_threshold

    ctx = _cpu_ctx()
    w = load_plan_workload("synthetic", 600, synthetic_input="lognormal:300:0.5",
                           synthetic_output="lognormal:40:0.5", seed=1)
    searcher = Searcher(ctx, w, SLO, min_requests=200, min_span_s=10.0)
    space = SearchSpace(["cpu"], ["cpu"], ("disaggregated",), tps=(1,), max_workers=1,
                        cpu_local_prefill_max_tokens=0, local_prefill_uncached_tokens=None)
    plan = searcher.search(space, verify=1).ranked[0].plan
    want = plan_threshold(None, ctx, w, SLO, plan.decode, plan.max_num_batched_tokens)
    assert want > 0 and want % ctx.block_size == 0 and plan.local_prefill_uncached_tokens == want
    assert build_cluster(plan, ctx).local_prefill_uncached_tokens == want
    cfg = ClusterConfig.from_dict(cluster_dict(plan, ctx, SLO, "builtin:tiny-llama", 1000))
    assert cfg.router.local_prefill_uncached_tokens == want
    assert plan_threshold(0, ctx, w, SLO, plan.decode, 2048) == 0  # a given value is kept
