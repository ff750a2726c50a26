"""The router's orchestration (router/orchestrator.py) driven step by step with fake workers: no
network, no model. Each fake decode worker "generates" token 1000 + i for completion index i (so a
resumed attempt must continue the numbering), keeps its reservations until they finish or are
aborted, and every fake records the calls it saw in one shared log, which the tests compare."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest

from engine.prefix_hash import block_hashes
from engine.sampling_params import SamplingParams
from proto import generate_pb2 as gen
from proto import worker_pb2 as wk
from router.admission import Admission
from router.local_prefill import LocalPrefillPolicy
from router.metrics import RouterMetrics
from router.orchestrator import ActiveRequest, Orchestrator, Progress, RequestError
from router.worker_pool import WorkerPool

FIRST = 1000  # the token at completion index i is FIRST + i


class RpcFailure(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class FakeStream:
    def __init__(self, chunks: Iterator[wk.TokenChunk], log: list, wid: str, rid: str) -> None:
        self._chunks, self._log, self._wid, self._rid = chunks, log, wid, rid

    def __iter__(self) -> Iterator[wk.TokenChunk]:
        return self._chunks

    def cancel(self) -> bool:
        self._log.append((self._wid, "cancel", self._rid))
        return True


class FakeCall:
    """A prefill sent with its ticket to follow (`Prefill.future`): answered at AttachTicket,
    cancelled by Abort."""

    def __init__(self, request: wk.PrefillRequest) -> None:
        self.request = request
        self.done: list = []
        self.outcome: wk.PrefillResponse | grpc.RpcError | None = None

    def add_done_callback(self, fn) -> None:
        self.done.append(fn)

    def settle(self, outcome: wk.PrefillResponse | grpc.RpcError) -> None:
        if self.outcome is None:
            self.outcome = outcome
            for fn in self.done:
                fn(self)

    def result(self) -> wk.PrefillResponse:
        assert self.outcome is not None, "no AttachTicket or Abort settled the prefill"
        if isinstance(self.outcome, grpc.RpcError):
            raise self.outcome
        return self.outcome


class FakePrefill:
    """A fake worker's Prefill: called (its ticket given) or `.future` (its ticket follows)."""

    def __init__(self, worker: FakeWorker) -> None:
        self.worker = worker

    def __call__(self, request: wk.PrefillRequest, timeout: float) -> wk.PrefillResponse:
        self.worker._call("Prefill", request, request.request_id)
        return wk.PrefillResponse(first_token=FIRST + request.resume_offset)

    def future(self, request: wk.PrefillRequest, timeout: float) -> FakeCall:
        self.worker._call("Prefill", request, request.request_id)
        call = self.worker.calls[request.request_id] = FakeCall(request)
        return call


class FakeWorker:
    """A worker's RPCs. Script it with `errors[rpc]` (status codes raised by the next calls),
    `break_after` (the decode stream fails after that many tokens of the attempt, the finish reason
    not sent yet, and the worker is dead from then on) and `hang_at` (the stream stalls at that token until its timeout)."""

    def __init__(self, wid: str, log: list) -> None:
        self.wid, self.log = wid, log
        self.errors: dict[str, list[grpc.StatusCode]] = {}
        self.requests: dict[str, list] = {}
        self.reserved: dict[str, wk.ReserveRequest] = {}  # request id -> its reservation (its blocks)
        self.break_after: int | None = None
        self.hang_at: int | None = None
        self.during_reserve = lambda: None
        self.dead = False
        self.Prefill = FakePrefill(self)
        self.calls: dict[str, FakeCall] = {}  # prefills whose ticket follows, by request id

    def _call(self, rpc: str, request, rid: str = "") -> None:
        self.log.append((self.wid, rpc, rid))
        self.requests.setdefault(rpc, []).append(request)
        if self.dead:
            raise RpcFailure(grpc.StatusCode.UNAVAILABLE, "connection refused")
        if self.errors.get(rpc):
            raise RpcFailure(self.errors[rpc].pop(0), f"{self.wid} says no")

    def Reserve(self, request: wk.ReserveRequest, timeout: float) -> wk.ReserveResponse:
        self._call("Reserve", request, request.request_id)
        self.during_reserve()
        self.reserved[request.request_id] = request
        ticket = None if request.run_prefill else wk.TransferTicket(transfer_id=request.transfer_id)
        return wk.ReserveResponse(ticket=ticket)

    def Stream(self, request: wk.StreamRequest, timeout: float) -> FakeStream:
        self._call("Stream", request, request.request_id)
        return FakeStream(self._tokens(request.request_id, timeout), self.log, self.wid, request.request_id)

    def _tokens(self, rid: str, timeout: float) -> Iterator[wk.TokenChunk]:
        res = self.reserved[rid]
        for i in range(res.max_tokens + 1):
            if rid not in self.reserved:  # aborted: the stream ends
                return
            if i == self.break_after:
                self.dead = True
                self.reserved.clear()  # a dead worker's blocks are gone with it
                raise RpcFailure(grpc.StatusCode.UNAVAILABLE, "Socket closed")
            if i == self.hang_at:
                time.sleep(timeout)
                raise RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            last = i == res.max_tokens - 1 and self.break_after != res.max_tokens
            if last:
                del self.reserved[rid]
            yield wk.TokenChunk(request_id=rid, start_index=i, token_ids=[FIRST + res.resume_offset + i],
                                finish_reason="length" if last else "")

    def AttachTicket(self, request: wk.AttachTicketRequest, timeout: float) -> gen.AbortResponse:
        self._call("AttachTicket", request, request.request_id)
        call = self.calls[request.request_id]
        call.settle(wk.PrefillResponse(first_token=FIRST + call.request.resume_offset))
        return gen.AbortResponse(found=True)

    def Abort(self, request: gen.AbortRequest, timeout: float) -> gen.AbortResponse:
        self._call("Abort", request, request.request_id)
        if request.request_id in self.calls:
            self.calls[request.request_id].settle(RpcFailure(grpc.StatusCode.CANCELLED, "aborted"))
        return gen.AbortResponse(found=self.reserved.pop(request.request_id, None) is not None)

    def Stats(self, request: wk.StatsRequest, timeout: float) -> wk.WorkerStats:
        self._call("Stats", request)
        return wk.WorkerStats(worker_id=self.wid)

    def close(self) -> None:
        pass


class Cluster:
    """An orchestrator over a `WorkerPool` of fake workers (worker id = address)."""

    def __init__(self, mode: str = "disaggregated", workers: tuple[str, ...] = ("d1", "d2", "p1", "p2"),
                 max_retries: int = 2, local_prefill_max_tokens: int = 0, reserve_overlap_max_tokens: int = 0) -> None:
        self.log: list[tuple[str, str, str]] = []
        self.fakes = {wid: FakeWorker(wid, self.log) for wid in workers}
        self.pool = WorkerPool(stats_interval_s=3600.0, connect=lambda role, address: (self.fakes[address],) * 2)
        role = {"d": "colocated" if mode == "colocated" else "decode", "p": "prefill"}
        self.pool.set_workers([(wid, role[wid[0]], wid) for wid in workers])
        self.metrics = RouterMetrics()
        self.orch = Orchestrator(self.pool, mode, 1024, max_retries, LocalPrefillPolicy(local_prefill_max_tokens),
                                 self.metrics, reserve_overlap_max_tokens)
        self.admission = Admission()

    def __getitem__(self, wid: str) -> FakeWorker:
        return self.fakes[wid]

    def start(self, max_tokens: int = 4, prompt: tuple[int, ...] = (5, 6, 7), timeout_s: float = 10.0,
              stop_at: int | None = None) -> tuple[Iterator[gen.GenerateResponse], ActiveRequest, Progress]:
        """A request's generator (not started yet), its state and its progress."""
        active = ActiveRequest("r", self.metrics.request(), self.admission.admit(len(prompt)))
        run = Progress(list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))

        def output(tokens: list[int], logprobs: list) -> tuple[gen.GenerateResponse, bool]:
            if stop_at in tokens:  # a stop string completed at that token
                tokens = tokens[: tokens.index(stop_at) + 1]
            return gen.GenerateResponse(request_id="r", token_ids=tokens), stop_at in tokens

        now = time.monotonic()
        return self.orch.run(active, run, output, now, now + timeout_s), active, run

    def calls(self, *rpcs: str) -> list[tuple[str, str, str]]:
        """The log so far (only `rpcs`, when given), then cleared."""
        out = [c for c in self.log if not rpcs or c[1] in rpcs]
        self.log.clear()
        return out

    def idle(self) -> bool:
        """Nothing reserved on any worker and nothing counted in the pool."""
        return (not any(f.reserved for f in self.fakes.values())
                and all(w.inflight == w.inflight_tokens == w.local_tokens == 0 for w in self.pool.workers())
                and self.pool.prefill_queued() in (0, None))

    def retries(self) -> float:
        return self.metrics.registry.get_sample_value("pdcluster_request_retries_total")

    def close(self) -> None:
        self.pool.close()


@pytest.fixture
def cluster():
    made: list[Cluster] = []

    def make(**kw) -> Cluster:
        made.append(Cluster(**kw))
        return made[-1]

    yield make
    for c in made:
        c.close()


def finish(g: Iterator[gen.GenerateResponse]) -> tuple[list[int], str, gen.GenerateResponse]:
    """Run the generator to its end: the tokens of its messages, then its finish reason and final message."""
    tokens = []
    while True:
        try:
            tokens += next(g).token_ids
        except StopIteration as e:
            reason, final = e.value
            return tokens, reason, final


def test_disaggregated_reserve_stream_prefill_then_relay(cluster):
    c = cluster()
    g, active, run = c.start(max_tokens=4)
    assert list(next(g).token_ids) == [FIRST]  # the prefill's first token
    assert c.calls() == [("d1", "Reserve", "r"), ("d1", "Stream", "r"), ("p1", "Prefill", "r")]
    reserve, prefill = c["d1"].requests["Reserve"][0], c["p1"].requests["Prefill"][0]
    assert not reserve.run_prefill and list(reserve.token_ids) == [5, 6, 7] and reserve.max_tokens == 4
    assert prefill.ticket.transfer_id == reserve.transfer_id and list(prefill.token_ids) == [5, 6, 7]
    assert c.pool.workers("decode")[0].inflight == 1  # counted on d1 while the request runs
    assert list(next(g).token_ids) == [FIRST + 1]  # the stream's copy of the first token is skipped
    assert list(next(g).token_ids) == [FIRST + 2]
    tokens, reason, final = finish(g)
    assert (tokens, reason, list(final.token_ids)) == ([], "length", [FIRST + 3])  # the last rides on the final
    assert run.tokens == [FIRST + i for i in range(4)] and run.attempts == 0 and not run.local
    assert c.calls() == [("d1", "cancel", "r")] and c.idle() and active.reached == [
        (c.pool.workers("decode")[0], "r"), (c.pool.workers("prefill")[0], "r")]


def test_a_short_prompt_is_prefilled_while_its_decode_worker_reserves(cluster):
    """reserve_overlap_max_tokens: the prefill goes out before Reserve with its ticket to follow,
    the ticket follows once the decode worker answered; a longer prompt goes the usual way."""
    c = cluster(reserve_overlap_max_tokens=3)
    g, active, run = c.start(max_tokens=2)
    assert list(next(g).token_ids) == [FIRST]
    assert c.calls() == [("p1", "Prefill", "r"), ("d1", "Reserve", "r"), ("d1", "Stream", "r"),
                         ("p1", "AttachTicket", "r")]
    prefill, attach = c["p1"].requests["Prefill"][0], c["p1"].requests["AttachTicket"][0]
    assert prefill.ticket_follows and not prefill.HasField("ticket")
    assert attach.ticket.transfer_id == c["d1"].requests["Reserve"][0].transfer_id
    assert finish(g)[1] == "length" and run.tokens == [FIRST, FIRST + 1] and c.idle()
    g, _, _ = c.start(max_tokens=2, prompt=(5, 6, 7, 8))
    assert finish(g)[1] == "length"
    assert c.calls("Prefill", "Reserve", "AttachTicket") == [("d1", "Reserve", "r"), ("p1", "Prefill", "r")]
    assert not c["p1"].requests["Prefill"][1].ticket_follows and c.idle()


def test_a_prefill_sent_before_a_reservation_that_failed_is_aborted(cluster):
    """Every decode worker fails to reserve: the early prefill is aborted with the attempt, and the
    retry prefills early again (on the same prefill worker: not a suspect)."""
    c = cluster(reserve_overlap_max_tokens=16, max_retries=1)
    c["d1"].errors["Reserve"] = [grpc.StatusCode.UNAVAILABLE]
    c["d2"].errors["Reserve"] = [grpc.StatusCode.UNAVAILABLE]
    g, _, run = c.start(max_tokens=2)
    assert finish(g)[1] == "length" and run.attempts == 1
    assert c.calls("Prefill", "Abort", "AttachTicket") == [("p1", "Prefill", "r"), ("p1", "Abort", "r"),
                                                           ("p1", "Prefill", "r#retry1"),
                                                           ("p1", "AttachTicket", "r#retry1")]
    assert c["p1"].calls["r"].outcome.code() == grpc.StatusCode.CANCELLED and c.idle()


def test_an_early_prefill_is_aborted_when_the_decode_worker_prefills_after_all(cluster):
    """The first decode worker is full; the next one takes the prompt to prefill itself (local
    prefill): the prefill sent early is aborted and no ticket follows."""
    class AfterD1(LocalPrefillPolicy):  # local once d1 was tried
        def local(self, prompt_tokens: int, prefill_queued: int | None, local_queued: int) -> bool:
            return ("d1", "Reserve", "r") in c.log

    c = cluster(reserve_overlap_max_tokens=16)
    c.orch.local_prefill = AfterD1(16)
    c["d1"].errors["Reserve"] = [grpc.StatusCode.RESOURCE_EXHAUSTED]
    g, _, run = c.start(max_tokens=2)
    assert finish(g)[1] == "length" and run.local
    assert c.calls("Prefill", "Abort", "AttachTicket", "Reserve") == [
        ("p1", "Prefill", "r"), ("d1", "Reserve", "r"), ("d2", "Reserve", "r"), ("p1", "Abort", "r")]
    assert c["d2"].requests["Reserve"][0].run_prefill and c.idle()


def test_colocated_reserves_with_run_prefill_and_relays_every_token(cluster):
    c = cluster(mode="colocated", workers=("d1", "d2"))
    g, _, run = c.start(max_tokens=3)
    assert list(next(g).token_ids) == [FIRST]
    assert c.calls() == [("d1", "Reserve", "r"), ("d1", "Stream", "r")]
    assert c["d1"].requests["Reserve"][0].run_prefill
    tokens, reason, final = finish(g)
    assert (tokens, reason, list(final.token_ids)) == ([FIRST + 1], "length", [FIRST + 2])
    assert run.local and c.calls("Prefill", "Abort") == [] and c.idle()


def test_a_short_prompt_is_prefilled_on_the_decode_worker_when_the_prefill_workers_are_busier(cluster):
    c = cluster(local_prefill_max_tokens=16)
    busy = [c.pool.take("prefill", tokens=100) for _ in range(2)]  # 100 prompt tokens queued on each
    g, _, run = c.start(max_tokens=2)
    assert list(next(g).token_ids) == [FIRST]
    assert c.calls() == [("d1", "Reserve", "r"), ("d1", "Stream", "r")]
    assert c["d1"].requests["Reserve"][0].run_prefill
    assert c.pool.workers("decode")[0].local_tokens == 0  # counted until its first token
    assert c.metrics.registry.get_sample_value("pdcluster_local_prefills_total") == 1
    assert finish(g)[1] == "length" and run.local
    for w in busy:
        c.pool.release(w, 100)
    assert c.idle()


def test_the_local_prefill_rule_counts_only_what_the_decode_worker_lacks(cluster):
    """A 40-token prompt whose first 32 its decode worker holds (an earlier turn) costs it 8
    tokens: under local_prefill_max_tokens 16 and behind 20 queued at the prefill workers it
    goes local, and 8, not 40, are counted on the decode worker until its first token."""
    c = cluster(workers=("d1", "p1"), local_prefill_max_tokens=16)
    prompt = tuple(range(5, 45))
    c.pool.index.apply("d1", wk.PrefixCacheEvents(snapshot=True, block_size=16,
                                                  stored=block_hashes(list(prompt), 16)[:2]))
    busy = c.pool.take("prefill", tokens=20)
    counted, add_local = [], c.pool.add_local
    c.pool.add_local = lambda w, n: (counted.append(n), add_local(w, n))
    g, _, run = c.start(max_tokens=2, prompt=prompt)
    assert list(next(g).token_ids) == [FIRST]
    assert counted == [8, -8]
    assert c["d1"].requests["Reserve"][0].run_prefill and c.calls("Prefill") == []
    assert finish(g)[1] == "length" and run.local
    c.pool.release(busy, 20)
    assert c.idle()


def test_a_full_decode_worker_passes_the_request_to_the_next_one(cluster):
    c = cluster()
    c["d1"].errors["Reserve"] = [grpc.StatusCode.RESOURCE_EXHAUSTED]
    g, _, _ = c.start(max_tokens=2)
    assert list(next(g).token_ids) == [FIRST]
    assert c.calls() == [("d1", "Reserve", "r"), ("d2", "Reserve", "r"), ("d2", "Stream", "r"),
                         ("p1", "Prefill", "r")]  # a full worker is not a failed one: no Stats, no retry
    assert finish(g)[1] == "length" and c.retries() == 0 and c.idle()


def test_when_every_decode_worker_is_full_the_request_waits_then_gives_up_at_its_deadline(cluster):
    c = cluster()
    c["d1"].errors["Reserve"] = [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
    c["d2"].errors["Reserve"] = [grpc.StatusCode.RESOURCE_EXHAUSTED]
    g, _, _ = c.start(max_tokens=2)
    assert finish(g)[1] == "length"
    assert c.calls("Reserve") == [("d1", "Reserve", "r"), ("d2", "Reserve", "r"),  # both full: wait
                                  ("d1", "Reserve", "r"), ("d2", "Reserve", "r")]  # d1 still full, d2 takes it
    c["d1"].errors["Reserve"] = [grpc.StatusCode.RESOURCE_EXHAUSTED] * 1000
    c["d2"].errors["Reserve"] = [grpc.StatusCode.RESOURCE_EXHAUSTED] * 1000
    g, _, _ = c.start(max_tokens=2, timeout_s=0.1)
    with pytest.raises(RequestError) as err:
        finish(g)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(err.value) == "no KV capacity before the request deadline" and c.idle()


def test_a_broken_decode_stream_resumes_on_another_pair_from_the_tokens_already_sent(cluster):
    c = cluster()
    c["d1"].break_after = 2  # d1 dies after completion tokens 0 and 1
    g, active, run = c.start(max_tokens=5)
    assert [list(next(g).token_ids) for _ in range(2)] == [[FIRST], [FIRST + 1]]
    c.calls()
    assert list(next(g).token_ids) == [FIRST + 2]  # the retry's first token: none repeated, none missing
    assert c.calls() == [
        ("d1", "cancel", "r"),
        ("d1", "Abort", "r"), ("p1", "Abort", "r"),  # what the failed attempt reached
        ("d1", "Stats", ""),  # the suspect is asked for its health at once (and is out of rotation)
        ("d2", "Reserve", "r#retry1"), ("d2", "Stream", "r#retry1"), ("p1", "Prefill", "r#retry1"),
    ]
    reserve, prefill = c["d2"].requests["Reserve"][0], c["p1"].requests["Prefill"][1]
    assert list(reserve.token_ids) == [5, 6, 7, FIRST, FIRST + 1] and reserve.num_prompt_tokens == 5
    assert reserve.max_tokens == 3 and reserve.resume_offset == 2
    assert list(prefill.token_ids) == [5, 6, 7, FIRST, FIRST + 1] and prefill.resume_offset == 2
    assert not c.pool.workers("decode")[0].healthy
    tokens, reason, final = finish(g)
    assert tokens + list(final.token_ids) == [FIRST + 3, FIRST + 4] and reason == "length"
    assert run.tokens == [FIRST + i for i in range(5)] and run.attempts == 1 and c.retries() == 1
    assert [r for _, r in active.reached] == ["r#retry1", "r#retry1"] and c.idle()


def test_a_failed_prefill_frees_the_decode_reservation_and_retries_on_other_workers(cluster):
    c = cluster()
    c["p1"].errors["Prefill"] = [grpc.StatusCode.UNAVAILABLE]
    g, _, run = c.start(max_tokens=2)
    assert list(next(g).token_ids) == [FIRST]
    assert c.calls() == [
        ("d1", "Reserve", "r"), ("d1", "Stream", "r"), ("p1", "Prefill", "r"),
        ("d1", "cancel", "r"), ("d1", "Abort", "r"), ("p1", "Abort", "r"),
        ("p1", "Stats", ""), ("d1", "Stats", ""),  # the prefill worker, the decode worker, or the link
        ("d2", "Reserve", "r#retry1"), ("d2", "Stream", "r#retry1"), ("p2", "Prefill", "r#retry1"),
    ]
    assert "r" not in c["d1"].reserved  # its blocks were freed by the abort
    reserve = c["d2"].requests["Reserve"][0]
    assert reserve.resume_offset == 0 and reserve.max_tokens == 2 and list(reserve.token_ids) == [5, 6, 7]
    assert finish(g)[1] == "length" and run.attempts == 1 and c.idle()


def test_after_max_retries_the_request_fails_unavailable_naming_the_last_failure(cluster):
    c = cluster(workers=("d1", "d2", "p1"), max_retries=1)
    c["p1"].errors["Prefill"] = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL]
    g, active, run = c.start()
    with pytest.raises(RequestError) as err:
        next(g)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert str(err.value) == ("request r failed on a worker 2 times (router.max_retries is 1); last: "
                              "prefill on p1 (KV to d2) failed: INTERNAL: p1 says no")
    assert c.calls("Reserve", "Prefill", "Abort") == [
        ("d1", "Reserve", "r"), ("p1", "Prefill", "r"), ("d1", "Abort", "r"), ("p1", "Abort", "r"),
        ("d2", "Reserve", "r#retry1"), ("p1", "Prefill", "r#retry1"),  # p1 again: the only prefill worker
        ("d2", "Abort", "r#retry1"), ("p1", "Abort", "r#retry1"),
    ]
    assert run.attempts == 2 and c.retries() == 1 and active.cancelled and c.idle()


def test_a_request_error_from_a_worker_is_not_retried(cluster):
    c = cluster()
    c["p1"].errors["Prefill"] = [grpc.StatusCode.INVALID_ARGUMENT]
    g, _, run = c.start()
    with pytest.raises(RequestError) as err:
        next(g)
    assert (err.value.code, str(err.value)) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                "prefill on p1 (KV to d1): p1 says no")
    assert c.calls("Abort") == [("d1", "Abort", "r"), ("p1", "Abort", "r")] and run.attempts == 0 and c.idle()


def test_a_client_cancel_aborts_the_request_on_every_worker_it_reached(cluster):
    c = cluster()
    g, active, _ = c.start(max_tokens=8)
    next(g), next(g)
    c.calls()
    c.orch.abort(active)  # the client went away (the servicer's callback) or called Abort
    assert c.calls() == [("d1", "Abort", "r"), ("p1", "Abort", "r")] and active.cancelled
    with pytest.raises(RequestError) as err:
        next(g)  # d1's stream ends once aborted
    assert (err.value.code, str(err.value)) == (grpc.StatusCode.CANCELLED, "request r was aborted")
    assert c.retries() == 0 and c.idle()


def test_a_cancel_that_lands_while_reserve_is_in_flight_still_frees_the_reservation(cluster):
    c = cluster()
    g, active, _ = c.start()
    c["d1"].during_reserve = lambda: c.orch.abort(active)  # no worker reached yet: nothing to abort
    with pytest.raises(RequestError) as err:
        next(g)
    assert err.value.code == grpc.StatusCode.CANCELLED
    assert c.calls() == [("d1", "Reserve", "r"), ("d1", "Abort", "r"),  # as soon as d1 counts as reached
                         ("d1", "Abort", "r")]  # and again as the request fails
    assert c.idle()


def test_a_stop_string_ends_the_request_and_aborts_it_on_the_workers(cluster):
    c = cluster()
    g, _, _ = c.start(max_tokens=8, stop_at=FIRST + 2)
    tokens, reason, final = finish(g)
    assert (tokens, reason, list(final.token_ids)) == ([FIRST, FIRST + 1], "stop", [FIRST + 2])
    assert c.calls("Abort") == [("d1", "Abort", "r"), ("p1", "Abort", "r")] and c.idle()


def test_the_deadline_ends_the_request_with_nothing_left_reserved(cluster):
    c = cluster()
    c["d1"].hang_at = 2  # the stream stalls until the call's own timeout (the request's deadline)
    g, _, run = c.start(max_tokens=8, timeout_s=0.3)
    next(g), next(g)
    c.calls()
    with pytest.raises(RequestError) as err:
        next(g)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert str(err.value) == "request r exceeded its deadline (stream from decode worker d1)"
    assert c.calls("Abort", "Reserve") == [("d1", "Abort", "r"), ("p1", "Abort", "r")]  # no retry
    assert run.attempts == 0 and c.idle()


def test_a_resumed_request_with_nothing_left_to_generate_finishes_without_a_worker(cluster):
    c = cluster()
    c["d1"].break_after = 3  # dies after the last token, before the chunk that finishes the request
    g, _, run = c.start(max_tokens=3)
    tokens, reason, final = finish(g)
    assert tokens == [FIRST, FIRST + 1, FIRST + 2] and (reason, list(final.token_ids)) == ("length", [])
    assert c.calls("Reserve") == [("d1", "Reserve", "r")] and run.attempts == 1 and c.idle()
