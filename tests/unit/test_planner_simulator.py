"""Planner simulator: one request costs the cost model's sum; Little's law; KV capacity; policies."""

from __future__ import annotations

import math
import random

import pytest

from planner.cost_model import FittedCostModel
from planner.simulator import ClusterSpec, Simulator, WorkerSpec

KVB = 9216  # bytes per token (the tiny model in float32)


def _cost(capacity: int = 1_000_000) -> FittedCostModel:
    return FittedCostModel(prefill=(0.01, 1e-4, 1e-8), decode=(0.005, 1e-6, 1e-3),
                           kv_capacity_tokens=capacity, kv_bytes_per_token=KVB)


def _cluster(mode: str, n_prefill: int = 1, n_decode: int = 1, capacity: int = 1_000_000, **kw) -> ClusterSpec:
    worker = WorkerSpec(_cost(capacity), max_num_batched_tokens=2048, max_num_seqs=256, block_size=16, link_gbps=2.0)
    return ClusterSpec(mode, [worker] * n_prefill if mode == "disaggregated" else [], [worker] * n_decode, **kw)


def _poisson(n: int, rate: float, seed: int = 0) -> list[float]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def test_a_single_disaggregated_request_costs_the_sum_of_its_steps():
    c = _cost()
    cluster = _cluster("disaggregated", kv_latency_s=0.002, layerwise=False, router_in_s=0.003,
                       first_token_out_s=0.004, token_out_s=0.001)
    res = Simulator(cluster).run([5.0], [300], [20])
    prefill = c.prefill_time(300, 300 * 300)
    transfer = 300 * KVB / 2e9 + 0.002
    ttft = 0.003 + prefill + transfer + 0.004
    # 19 decode steps, the first with context 301 (prompt + the first token), one token each
    decode = sum(c.decode_time(1, 301 + i) for i in range(19))
    assert res.ttft[0] == pytest.approx(ttft, rel=1e-9)
    assert res.e2e[0] == pytest.approx(0.003 + prefill + transfer + decode + 0.001, rel=1e-9)
    assert res.tpot[0] == pytest.approx((decode + 0.001 - 0.004) / 19, rel=1e-9)
    assert (res.prefill_steps, res.decode_steps, res.finished) == (1, 19, 1)


def test_a_prefill_step_measured_with_its_kv_transfer_in_it_is_not_charged_the_transfer_again():
    """Live step costs come from the prefill worker's own step counters, which include sending the KV
    and the commit (PrefillEngine.step): the prompt is committed when its step ends, also while the
    decode worker is in a step (that wait was inside the measured step too)."""
    c = _cost()
    cluster = _cluster("disaggregated", kv_latency_s=0.002, layerwise=False, router_in_s=0.003,
                       first_token_out_s=0.004, token_out_s=0.001, transfer_in_step=True)
    res = Simulator(cluster).run([5.0], [300], [20])
    prefill = c.prefill_time(300, 300 * 300)
    assert res.ttft[0] == pytest.approx(0.003 + prefill + 0.004, rel=1e-9)
    decode = sum(c.decode_time(1, 301 + i) for i in range(19))
    assert res.e2e[0] == pytest.approx(0.003 + prefill + decode + 0.001, rel=1e-9)
    # a second prompt finishing while the decode worker runs the first one's steps: no lock wait added
    # the second arrives (at the router at t) inside the first one's 4th decode step: its Reserve
    # waits for that step's end (T4), its prefill step then commits it at once
    t = 0.003 + prefill + sum(c.decode_time(1, 301 + i) for i in range(3)) + 1e-4
    t4 = 0.003 + prefill + sum(c.decode_time(1, 301 + i) for i in range(4))
    two = Simulator(cluster).run([0.0, t - 0.003], [300, 10], [50, 2])
    assert two.ttft[1] == pytest.approx(t4 + c.prefill_time(10, 10 * 10) + 0.004 - (t - 0.003), rel=1e-9)


def test_a_commit_waits_for_the_decode_step_in_progress_when_the_measured_steps_left_that_wait_out():
    """Step costs fitted with the commit's lock wait taken out (calibrate_bench, commit_waits_lock): a
    prompt whose prefill step ends while the decode worker is in a step is committed when that step
    ends, and the prefill worker waits with it (the wait counts in its step time, as the worker's
    own counters have it)."""
    c = _cost()
    cluster = _cluster("disaggregated", router_in_s=0.003, first_token_out_s=0.004, token_out_s=0.001,
                       transfer_in_step=True, commit_waits_lock=True)
    prefill = c.prefill_time(300, 300 * 300)
    step = [c.decode_time(1, 301 + i) for i in range(50)]
    # the second reaches the router inside the first one's 4th decode step: its Reserve returns at
    # that step's end (T4), its 10-token prefill (11 ms) ends inside the 6th decode step (6.3 ms each)
    t = 0.003 + prefill + sum(step[:3]) + 1e-4
    t4 = 0.003 + prefill + sum(step[:4])
    p10 = c.prefill_time(10, 10 * 10)
    assert t4 + step[4] < t4 + p10 < t4 + step[4] + step[5]
    two = Simulator(cluster).run([0.0, t - 0.003], [300, 10], [50, 2])
    t6 = t4 + step[4] + step[5]
    assert two.ttft[1] == pytest.approx(t6 + 0.004 - (t - 0.003), rel=1e-9)
    assert two.stats["prefill_step_s"] == pytest.approx(prefill + (t6 - t4), rel=1e-9)
    # the first prompt's commit found the decode worker idle: nothing added
    assert two.ttft[0] == pytest.approx(0.003 + prefill + 0.004, rel=1e-9)


def test_a_single_colocated_request_costs_the_sum_of_its_steps_and_long_prompts_are_chunked():
    c = _cost()
    res = Simulator(_cluster("colocated")).run([0.0], [3000], [5])
    # 3000 tokens under a 2048-token budget: a 2048 chunk, then 952 attending over 2048 cached
    prefill = c.prefill_time(2048, 2048 * 2048) + c.prefill_time(952, 952 * 3000, 2048)
    decode = sum(c.decode_time(1, 3001 + i) for i in range(4))
    assert res.ttft[0] == pytest.approx(prefill, rel=1e-9)
    assert res.e2e[0] == pytest.approx(prefill + decode, rel=1e-9)
    assert res.prefill_steps == 2


def test_a_one_token_output_ends_at_the_first_token():
    res = Simulator(_cluster("disaggregated")).run([0.0, 0.0], [100, 100], [1, 1])
    assert res.finished == 2 and res.decode_steps == 0 and math.isnan(res.tpot[0])  # no TPOT
    assert res.e2e == res.ttft


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_littles_law_holds_at_steady_state(mode):
    n, rate = 4000, 4.0
    rng = random.Random(1)
    prompts = [rng.randint(20, 400) for _ in range(n)]
    outputs = [rng.randint(2, 60) for _ in range(n)]
    res = Simulator(_cluster(mode, 2, 2)).run(_poisson(n, rate), prompts, outputs)
    assert res.finished == n
    # L (time-average requests in the system, integrated by the simulator as it runs)
    # = lambda (the offered rate) x W (mean time in the system, from each request's own times)
    mean_in_system = res.stats["in_system_area"] / res.duration_s
    w = sum(res.e2e) / n
    assert mean_in_system == pytest.approx(rate * w, rel=0.05)
    assert n / res.duration_s == pytest.approx(rate, rel=0.05)  # stable: throughput = arrival rate


def test_kv_capacity_limits_decode_concurrency():
    n = 200
    prompts, outputs = [160] * n, [80] * n  # 10 blocks at reservation, 15 when done
    arrivals = [0.0] * n
    small = Simulator(_cluster("disaggregated", capacity=40 * 16)).run(arrivals, prompts, outputs)
    big = Simulator(_cluster("disaggregated", capacity=4000 * 16)).run(arrivals, prompts, outputs)
    assert small.finished == big.finished == n
    # a reservation needs its prompt's 10 blocks plus one per running sequence: at most 4 of 40 blocks
    assert 1 <= small.max_decode_batch <= 4
    assert big.max_decode_batch > 20
    assert max(small.ttft) > max(big.ttft)  # the rest waited for blocks


def test_max_num_seqs_caps_the_decode_batch_and_the_rest_wait():
    """As DecodeEngine.step: committed sequences beyond max_num_seqs keep their blocks and join as
    running ones finish."""
    n = 12
    worker = WorkerSpec(_cost(), max_num_batched_tokens=2048, max_num_seqs=3, block_size=16, link_gbps=2.0)
    capped = Simulator(ClusterSpec("disaggregated", [worker], [worker])).run([0.0] * n, [64] * n, [30] * n)
    free = Simulator(_cluster("disaggregated")).run([0.0] * n, [64] * n, [30] * n)
    assert capped.finished == free.finished == n
    assert capped.max_decode_batch == 3 and free.max_decode_batch > 3
    assert max(capped.e2e) > max(free.e2e)


def test_a_live_prefill_slope_stretches_prefill_steps_by_the_tokens_streamed_meanwhile():
    """WorkerSpec.prefill_load_slope (live calibration): a prefill step takes (1 + slope x decode
    tokens/s at its start) times its cost; with nothing decoding it costs just the model's."""
    c = _cost()
    slow = WorkerSpec(c, max_num_batched_tokens=2048, max_num_seqs=256, block_size=16, link_gbps=2.0,
                      prefill_load_slope=0.01)
    plain = WorkerSpec(c, max_num_batched_tokens=2048, max_num_seqs=256, block_size=16, link_gbps=2.0)
    alone = Simulator(ClusterSpec("disaggregated", [slow], [plain], host_cores=2)).run([0.0], [300], [5])
    assert alone.ttft[0] == pytest.approx(Simulator(_cluster("disaggregated")).run([0.0], [300], [5]).ttft[0])
    # a second prompt arrives while the first one decodes: its prefill step is stretched
    arrivals, prompts, outputs = [0.0, 0.5], [300, 300], [200, 5]
    base = Simulator(ClusterSpec("disaggregated", [plain], [plain], host_cores=2)).run(arrivals, prompts, outputs)
    res = Simulator(ClusterSpec("disaggregated", [slow], [plain], host_cores=2)).run(arrivals, prompts, outputs)
    tps = 1 / c.decode_time(1, 301 + 90)  # one sequence decoding, about 90 steps in
    step = c.prefill_time(300, 300 * 300)
    assert res.ttft[1] - base.ttft[1] == pytest.approx(step * 0.01 * tps, rel=0.05)


def test_an_overfull_colocated_worker_preempts_and_recomputes_yet_finishes_everything():
    n = 40
    res = Simulator(_cluster("colocated", capacity=60 * 16)).run([0.0] * n, [100] * n, [400] * n)
    assert res.finished == n and res.preemptions > 0
    assert not any(math.isnan(x) for x in res.e2e)


def test_router_spreads_requests_over_workers_and_more_workers_cut_latency():
    n = 600
    rng = random.Random(2)
    prompts = [rng.randint(50, 600) for _ in range(n)]
    outputs = [rng.randint(5, 50) for _ in range(n)]
    arrivals = _poisson(n, 6.0)
    one = Simulator(_cluster("disaggregated", 1, 1)).run(arrivals, prompts, outputs)
    two = Simulator(_cluster("disaggregated", 2, 2)).run(arrivals, prompts, outputs)
    busy = two.stats["busy_s"]  # prefill 0, prefill 1, decode 0, decode 1
    # decode: fewest requests in flight (they stay for the whole output): balanced. Prefill: fewest
    # queued prompt tokens, ties to the first worker (as WorkerPool.pick): the second one takes
    # work only while the first has some queued
    assert busy[2] == pytest.approx(busy[3], rel=0.4)
    assert busy[0] > busy[1] > 0
    assert sorted(two.ttft)[n // 2] < sorted(one.ttft)[n // 2]


def test_transfers_into_one_decode_worker_share_its_link():
    # two prefill workers finish a prompt each at the same time; both KV caches go to the one decode
    # worker, whose link carries one transfer at a time: the second waits for the first
    cluster = _cluster("disaggregated", 2, 1, kv_latency_s=0.0, layerwise=False)
    slow = WorkerSpec(_cost(), 2048, 256, 16, link_gbps=0.01)  # 10 MB/s: 1000 x 9216 B take 0.92 s
    cluster.decode = [slow]
    res = Simulator(cluster).run([0.0, 0.0], [1000, 1000], [2, 2])
    step = _cost().prefill_time(1000, 1000 * 1000)
    one = 1000 * KVB / 0.01e9
    assert sorted(res.ttft) == pytest.approx([step + one, step + 2 * one], rel=1e-9)


def test_early_stop_once_too_many_requests_miss_the_slo():
    n = 500
    res = Simulator(_cluster("colocated")).run([0.0] * n, [500] * n, [10] * n, slo_ttft_s=0.5, max_misses=10)
    assert res.stopped_early and res.finished < n


def test_a_prompt_prefilled_before_is_served_from_the_prefix_cache():
    c = _cost()
    keys = [[("p", j) for j in range(300 // 16)]]  # 18 full blocks of a 300-token prompt
    sim = Simulator(_cluster("colocated"), keep_caches=True)
    cold = sim.run([0.0], [300], [2], block_keys=keys)
    warm = sim.run([0.0], [300], [2], block_keys=keys)  # the same prompt again, same worker
    assert cold.ttft[0] == pytest.approx(c.prefill_time(300, 300 * 300), rel=1e-9)
    # 18 x 16 = 288 tokens cached: 12 computed, attending over 300
    assert warm.ttft[0] == pytest.approx(c.prefill_time(12, 12 * 300, 288), rel=1e-9)
    assert warm.stats["cached_tokens"] == [288]
    fresh = Simulator(_cluster("colocated")).run([0.0], [300], [2], block_keys=keys)
    assert fresh.ttft[0] == cold.ttft[0]  # without keep_caches every run starts cold


def test_local_prefill_sends_short_prompts_to_the_decode_worker_only_while_the_prefill_worker_is_busy():
    prompts = [200] * 300
    outputs = [20] * 300
    quiet = Simulator(_cluster("disaggregated", local_prefill_max_tokens=512)).run(
        [i * 1.0 for i in range(20)], prompts[:20], outputs[:20])
    assert quiet.stats["local_prefills"] == 0  # one at a time: the prefill worker is idle at each arrival
    arrivals = _poisson(300, 30.0, seed=3)  # more prompt tokens than one prefill worker computes
    fixed = Simulator(_cluster("disaggregated")).run(arrivals, prompts, outputs)
    local = Simulator(_cluster("disaggregated", local_prefill_max_tokens=512)).run(arrivals, prompts, outputs)
    assert fixed.stats["local_prefills"] == 0
    assert 0 < local.stats["local_prefills"] < 300
    assert local.finished == fixed.finished == 300
    p50 = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    assert p50(local.ttft) < 0.8 * p50(fixed.ttft)  # the decode worker takes prefill work off the queue
    too_long = Simulator(_cluster("disaggregated", local_prefill_max_tokens=199)).run(arrivals, prompts, outputs)
    assert too_long.stats["local_prefills"] == 0


def test_mixed_steps_advance_the_running_batch_while_a_local_prompt_prefills():
    arrivals = _poisson(300, 30.0, seed=3)
    prompts, outputs = [200] * 300, [20] * 300
    first = Simulator(_cluster("disaggregated", local_prefill_max_tokens=512)).run(arrivals, prompts, outputs)
    mixed = Simulator(_cluster("disaggregated", local_prefill_max_tokens=512, mixed_steps=True)).run(
        arrivals, prompts, outputs)
    assert mixed.finished == first.finished == 300 and mixed.stats["local_prefills"] > 0
    p50 = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    assert p50(mixed.tpot) < p50(first.tpot)  # no decode step waits for a whole local prefill
