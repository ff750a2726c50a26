"""The router's worker choice (router/worker_pool.py): counted at the moment of the choice."""

import pytest

from router.worker_pool import WorkerPool


@pytest.fixture
def pool():
    p = WorkerPool(stats_interval_s=3600.0)  # no Stats poll during the test (channels never connect)
    p.set_workers([("c0", "colocated", "127.0.0.1:1"), ("c1", "colocated", "127.0.0.1:2"),
                   ("p0", "prefill", "127.0.0.1:3"), ("p1", "prefill", "127.0.0.1:4")])
    yield p
    p.close()


def test_requests_taken_back_to_back_go_to_different_workers(pool):
    # the second request arrives before the first one's Reserve returned: it must see that load
    first = pool.take("colocated")
    second = pool.take("colocated")
    assert {first.worker_id, second.worker_id} == {"c0", "c1"}
    assert first.inflight == second.inflight == 1
    pool.release(first)
    assert pool.take("colocated") is first  # now the least loaded again
    assert first.inflight == 1


def test_prefill_goes_by_queued_prompt_tokens(pool):
    long_one = pool.take("prefill", tokens=1000)
    assert long_one.inflight_tokens == 1000
    shorts = [pool.take("prefill", tokens=100) for _ in range(3)]
    assert all(w is not long_one for w in shorts)  # 300 queued tokens there is still less than 1000
    pool.release(long_one, 1000)
    assert (long_one.inflight, long_one.inflight_tokens) == (0, 0)


def test_avoided_workers_only_when_no_other_and_excluded_never(pool):
    assert pool.take("colocated", avoid={"c0"}).worker_id == "c1"
    assert pool.take("colocated", avoid={"c0"}).worker_id == "c1"  # c0 idle, but avoided
    assert pool.take("colocated", exclude={"c1"}, avoid={"c0"}).worker_id == "c0"  # nothing else left
    assert pool.take("colocated", exclude={"c0", "c1"}) is None
    assert pool.take("decode") is None
