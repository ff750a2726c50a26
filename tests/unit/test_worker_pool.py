"""The router's worker choice (router/worker_pool.py): counted at the moment of the choice."""

import grpc
import pytest

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from proto import worker_pb2 as wk
from proto.convert import prefix_cache_to_proto
from router.prefix_index import PromptBlocks
from router.worker_pool import WorkerPool


class _Channel:
    def close(self) -> None:
        pass


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


class _Down(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "down"


class _Worker:
    """A prefill worker's Stats over a real block manager's prefix cache; `before_answer` runs after
    the answer is taken and before it arrives (another poll landing meanwhile); `down` fails it."""

    def __init__(self) -> None:
        self.bm = BlockManager(num_blocks=8, block_size=4)
        self.before_answer = lambda: None
        self.down = False

    def Stats(self, request: wk.StatsRequest, timeout: float) -> wk.WorkerStats:
        if self.down:
            raise _Down()
        answer = wk.WorkerStats(**prefix_cache_to_proto(request, self.bm.events.since, self.bm.block_size))
        self.before_answer()
        return answer

    def cache(self, tokens: list[int]) -> None:
        seq = Sequence("s", tokens, len(tokens), SamplingParams())
        self.bm.allocate(seq)
        seq.num_computed_tokens = len(tokens)
        self.bm.cache_full_blocks(seq)
        self.bm.free(seq)


def test_the_poll_keeps_the_prefix_index_and_the_choice_follows_it():
    workers = {"127.0.0.1:3": _Worker(), "127.0.0.1:4": _Worker()}
    pool = WorkerPool(stats_interval_s=3600.0, connect=lambda role, address: (_Channel(), workers[address]))
    try:
        pool.set_workers([("p0", "prefill", "127.0.0.1:3"), ("p1", "prefill", "127.0.0.1:4")])
        p0, p1 = pool.workers("prefill")
        prompt = PromptBlocks(list(range(1, 14)))  # 13 tokens: 12 can be hits
        workers["127.0.0.1:4"].cache(prompt.token_ids)
        for w in (p0, p1):
            assert pool.check(w)
        p0.inflight_tokens = 5  # p1 holds the prefix: 1 uncached + 0 queued against 13 + 5
        taken = pool.take_for("prefill", prompt)
        assert (taken.worker, taken.cached_tokens, taken.counted_tokens) == (p1, 12, 1)
        assert p1.inflight_tokens == 1
        pool.release(p1, taken.counted_tokens)

        # an answer whose change list is older than one applied meanwhile is left out
        w1 = workers["127.0.0.1:4"]
        old = p1.cache_cursor

        def another_poll_lands() -> None:  # the worker evicts the prefix; a newer poll reports it
            w1.bm.allocate(Sequence("x", [50] * 32, 32, SamplingParams()))
            newer = w1.bm.events.since(old)
            pool.index.apply("p1", wk.PrefixCacheEvents(cursor=newer.cursor, removed=newer.removed, block_size=4))
            p1.cache_cursor = newer.cursor

        w1.before_answer = another_poll_lands
        assert pool.check(p1)
        assert p1.cache_cursor > old and pool.index.cached_tokens("p1", prompt) == 0  # not rolled back
        w1.before_answer = lambda: None

        # a worker that stops answering is out of rotation and its cache unknown until a snapshot
        p0_worker = workers["127.0.0.1:3"]
        p0_worker.cache(prompt.token_ids)
        assert pool.check(p0) and pool.index.cached_tokens("p0", prompt) == 12
        p0_worker.down = True
        assert not pool.check(p0) and p0.cache_cursor == 0 and pool.index.cached_tokens("p0", prompt) == 0
        p0_worker.down = False
        assert pool.check(p0) and pool.index.cached_tokens("p0", prompt) == 12  # the snapshot brings it back
    finally:
        pool.close()
