"""The simulator's parts one at a time: the router's choice and fit rule, a decode worker's running
batch and preemption, a prefill worker's KV transfer, the engine's admission rule they share."""

from __future__ import annotations

import pytest

from engine.admission_rule import blocks_needed, prompt_fits
from planner.cost_model import FittedCostModel
from planner.sim_cluster import SimCluster
from planner.sim_request import Outcomes, SimRequest
from planner.simulator import ClusterSpec, WorkerSpec

KVB = 9216


def _worker(capacity: int = 1_000_000, link: float = 2.0, seqs: int = 256) -> WorkerSpec:
    cost = FittedCostModel(prefill=(0.01, 1e-4, 1e-8), decode=(0.005, 1e-6, 1e-3),
                           kv_capacity_tokens=capacity, kv_bytes_per_token=KVB)
    return WorkerSpec(cost, max_num_batched_tokens=2048, max_num_seqs=seqs, block_size=16, link_gbps=link)


def _cluster(spec: ClusterSpec, n: int = 8) -> SimCluster:
    return SimCluster(spec, Outcomes(n, spec.first_token_out_s, None, None, None, 0, None))


def test_the_admission_rule_keeps_a_block_per_running_sequence():
    assert blocks_needed(1, 16) == 1 and blocks_needed(16, 16) == 1 and blocks_needed(17, 16) == 2
    assert prompt_fits(32, 16, 3, 5)  # 2 blocks + 3 running <= 5 free
    assert not prompt_fits(33, 16, 3, 5)
    assert prompt_fits(32, 16, 3, 5.0) and not prompt_fits(32, 16, 3, 4.99)  # the simulator's estimate


def test_the_router_reserves_on_the_decode_worker_with_fewest_in_flight_then_most_free_blocks():
    sim = _cluster(ClusterSpec("disaggregated", [_worker()], [_worker(), _worker(), _worker()]))
    d0, d1, d2 = sim.decode
    d0.inflight, d1.inflight, d2.inflight = 1, 0, 0
    d1.reserved = 10  # fewer free blocks than d2
    s = SimRequest(0, 0.0, 100, 5)
    assert sim.router.try_reserve(s, 0.0)
    assert s.d is d2 and d2.inflight == 1 and d2.reserved == s.need == blocks_needed(100, 16)
    assert s.p is sim.prefill[0] and sim.prefill[0].inflight_tokens == 100


def test_a_request_that_fits_nowhere_waits_in_order_and_is_retried_when_blocks_free():
    sim = _cluster(ClusterSpec("disaggregated", [_worker()], [_worker(capacity=16 * 10)]))
    d = sim.decode[0]
    d.reserved = 5  # 5 free blocks
    first, second = SimRequest(0, 0.0, 6 * 16, 5), SimRequest(1, 0.0, 16, 5)
    sim.router.arrive(first, 0.0)
    sim.router.arrive(second, 0.0)  # would fit, but waits behind the first (FIFO)
    assert list(sim.router.waiting) == [first, second] and first.d is None
    d.reserved = 0
    sim.router.retry(0.0)
    assert not sim.router.waiting and first.d is d and second.d is d


def test_a_reserve_waits_for_the_decode_step_in_progress():
    sim = _cluster(ClusterSpec("disaggregated", [_worker()], [_worker()]))
    d = sim.decode[0]
    d.locked = d.busy = True
    s = SimRequest(0, 0.0, 100, 5)
    assert sim.router.try_reserve(s, 0.0)
    assert s.p is None and d.inflight == 1 and len(d.lock_waiters) == 1
    d.release_lock(1.0)
    assert s.p is sim.prefill[0] and not d.lock_waiters


def test_local_prefill_keeps_a_short_prompt_on_its_decode_worker_when_the_prefill_queue_is_longer():
    sim = _cluster(ClusterSpec("disaggregated", [_worker()], [_worker()], local_prefill_max_tokens=200))
    p, d = sim.prefill[0], sim.decode[0]
    p.inflight_tokens = 500
    s = SimRequest(0, 0.0, 100, 5)
    assert sim.router.try_reserve(s, 0.0)
    assert s.local and s.need == 0 and d.reserved == 0 and d.local_tokens == 100 and s.p is None
    assert sim.out.local_prefills == 1 and d.chunked == [s]  # its prefill step started at once


def test_the_running_batch_is_kept_as_aggregates_and_the_newest_sequence_is_preempted():
    sim = _cluster(ClusterSpec("colocated", [], [_worker(capacity=16 * 40)]))
    d = sim.decode[0]
    a, b = SimRequest(0, 0.0, 100, 50), SimRequest(1, 0.0, 200, 50)
    d.join(a)
    d.k = 3
    d.join(b)
    d.k = 5  # a has 105 tokens now, b 202
    assert d.used_blocks() == pytest.approx((105 + 202) / 16 + 1)
    d.num_blocks = 20  # (307 / 16 + 1) + 2 / 16 > 20: b goes
    assert d.decode_rows() == 1
    assert list(d.running) == [0] and d.waiting[0] is b and (b.done, b.tokens) == (2, 202)
    assert sim.out.preemptions == 1


def test_a_layerwise_transfer_leaves_with_the_first_layer_and_holds_both_links():
    spec = ClusterSpec("disaggregated", [_worker(link=4.0)], [_worker(link=1.0)], num_layers=4,
                       kv_latency_s=0.001)
    sim = _cluster(spec)
    p, d = sim.prefill[0], sim.decode[0]
    s = SimRequest(0, 0.0, 1000, 5)
    s.d, s.p = d, p
    p.step_start = 1.0
    p.prompt_done(s, 2.0)  # the step ran 1.0 -> 2.0
    dur = 1000 * KVB / 1e9  # the slower link
    end = max(1.25 + dur, 2.0 + dur / 4)
    assert p.link_free == d.link_free == end and p.pending_commits == 1
    assert sim.heap[0][0] == end + 0.001
