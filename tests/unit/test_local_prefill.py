"""The local-prefill rule: short prompts go to the decode worker only when the prefill workers are busier."""

from __future__ import annotations

import pytest

from router.local_prefill import LocalPrefillPolicy
from router.worker_pool import WorkerPool


def test_zero_turns_it_off():
    p = LocalPrefillPolicy(0)
    assert not p.enabled
    assert not p.local(10, 10_000, 0)
    assert not p.local(10, None, 0)


def test_short_prompts_go_local_when_they_would_queue_behind_more_than_they_add():
    p = LocalPrefillPolicy(256)
    assert not p.local(100, 0, 0)  # idle prefill worker: remote
    assert not p.local(100, 99, 0)  # less queued there than it costs here
    assert p.local(100, 100, 0)  # ties go local
    assert not p.local(100, 150, 60)  # the decode worker already prefills 60 tokens
    assert not p.local(257, 10_000, 0)  # too long for the decode worker
    assert p.local(256, None, 0)  # no prefill worker healthy: local rather than fail


def test_negative_is_refused():
    with pytest.raises(ValueError, match="max_tokens"):
        LocalPrefillPolicy(-1)


def test_pool_counts_queued_and_pending_prefill_tokens():
    pool = WorkerPool(stats_interval_s=3600)
    try:
        assert pool.prefill_queued() is None  # no prefill worker
        pool.set_workers([("p0", "prefill", "127.0.0.1:1"), ("p1", "prefill", "127.0.0.1:2"),
                          ("d0", "decode", "127.0.0.1:3")])
        assert pool.prefill_queued() == 0
        w = pool.take("prefill", tokens=300)
        assert pool.prefill_queued() == 0  # the other one is idle
        pool.add_pending_prefill(200)  # bound for the prefill workers, not yet given to one
        assert pool.prefill_queued() == 100  # its share per healthy prefill worker
        pool.add_pending_prefill(-200)
        pool.release(w, 300)
        assert pool.prefill_queued() == 0
        d = pool.workers("decode")[0]
        pool.add_local(d, 40)
        assert d.local_tokens == 40
        pool.add_local(d, -40)
        assert d.local_tokens == 0
    finally:
        pool.close()
