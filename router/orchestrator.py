"""One request's walk through the workers: reserve, prefill, relay, and retry from where it broke.

Disaggregated mode, one attempt:

    pick decode D, D.Reserve (blocks + ticket; RESOURCE_EXHAUSTED: another D, or wait while every D
    is full)  ->  open D.Stream  ->  pick prefill P, P.Prefill(ticket): P pushes KV into D's blocks
    and returns the first token  ->  relay D's tokens

A prompt of at most `reserve_overlap_max_tokens` tokens overlaps the two: P.Prefill(ticket_follows)
goes out just before D.Reserve, and P.AttachTicket(ticket) once D answered; P computes meanwhile and
holds the K/V it computed before the ticket came.

Colocated mode: D.Reserve(run_prefill=True) and relay D.Stream (the worker does both phases).
Disaggregated with a `LocalPrefillPolicy` on: a short prompt that would queue behind more prompt
tokens at the prefill workers goes the colocated way on its decode worker (router/local_prefill.py).
`Orchestrator.abort` (a client's disconnect or Abort) aborts the request on every worker it reached,
which frees its blocks. Every wait is bounded by the request's deadline.

Failures: when a decode stream breaks, a prefill or its KV transfer fails, or no worker of a role
answers, the attempt is aborted where it reached and the request goes on from what the client
already has: the next attempt reserves on another pair (the workers that failed are avoided, and
asked for their health at once) with prompt + tokens already sent as its prompt, max_tokens less
those tokens and `resume_offset` = their number (so seeded sampling draws as the first attempt
would have). The client's stream continues with no token repeated or missing. After `max_retries`
retries the request fails with UNAVAILABLE naming the last failure. A retry's id on the workers is
"<request id>#retry<n>" ("#" is refused in client ids).

Workers are reached only through the stubs `WorkerPool` hands out (`DecodeStub`, `PrefillStub`);
tokens become messages through the caller's `Output` (detokenization and stop strings live there).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from engine.sampling_params import SamplingParams
from proto import generate_pb2 as gen
from proto import worker_pb2 as wk
from proto.convert import sampling_to_proto
from router.admission import Admitted
from router.local_prefill import LocalPrefillPolicy
from router.metrics import RequestMetrics, RouterMetrics
from router.prefix_index import PromptBlocks
from router.worker_pool import WorkerHandle, WorkerPool

log = logging.getLogger("pdcluster.router")


class TokenStream(Protocol):
    """D.Stream's answer: its chunks, and `cancel()` (a no-op once it finished)."""

    def __iter__(self) -> Iterator[wk.TokenChunk]: ...

    def cancel(self) -> bool: ...


class DecodeStub(Protocol):
    """The RPCs the router calls on a decode (or colocated) worker; each raises grpc.RpcError."""

    def Reserve(self, request: wk.ReserveRequest, timeout: float) -> wk.ReserveResponse: ...

    def Stream(self, request: wk.StreamRequest, timeout: float) -> TokenStream: ...

    def Abort(self, request: gen.AbortRequest, timeout: float) -> Any: ...


class PrefillStub(Protocol):
    """The RPCs the router calls on a prefill worker; each raises grpc.RpcError. `Prefill.future`
    (as gRPC's stubs have it) sends a prefill whose ticket follows."""

    Prefill: Any  # (request: wk.PrefillRequest, timeout: float) -> wk.PrefillResponse; and .future

    def AttachTicket(self, request: wk.AttachTicketRequest, timeout: float) -> Any: ...

    def Abort(self, request: gen.AbortRequest, timeout: float) -> Any: ...


# tokens (with their logprobs) that reached the router -> the message that carries them to the client,
# and whether a stop string ended the output (the tokens after it are left out of the message)
Output = Callable[[list[int], list[gen.TokenLogprob]], "tuple[gen.GenerateResponse, bool]"]


class RequestError(Exception):
    """The request cannot go on: its status and message for the client."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s  # a refusal's hint, sent as trailing metadata retry-after-ms


class AttemptFailed(Exception):
    """An attempt failed where another pair of workers may succeed (a worker died or stopped
    answering, a KV transfer failed): the request goes on from what the client already has."""

    def __init__(self, message: str, suspects: list[WorkerHandle]) -> None:
        super().__init__(message)
        self.suspects = suspects  # workers that may be at fault: avoided by this request's next attempt


@dataclass
class ActiveRequest:
    request_id: str
    metrics: RequestMetrics
    admitted: Admitted | None = None  # its place in admission control
    # (worker, the request's id there) for every worker an attempt reached; a retry's id is
    # "<request id>#retry<n>", so a late abort of a failed attempt never hits the next one
    reached: list[tuple[WorkerHandle, str]] = field(default_factory=list)
    done: bool = False
    cancelled: bool = False  # aborted by the client: stop at the next step, abort what was reached


@dataclass
class Progress:
    """What survives a retry: the tokens the client has (or will get in the final message), their
    arrival times, and the timing breakdown of the attempt that produced the first token."""

    prompt: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    timing: gen.Timing = field(default_factory=gen.Timing)
    attempts: int = 0
    local: bool = False  # the first token came from a prefill on the decode worker (or a colocated one)


@dataclass
class _Early:
    """A prefill sent before its ticket: the worker, and the call in flight (a grpc.Future)."""

    worker: WorkerHandle
    call: Any
    sent_at: float


def worker_request_id(rid: str, attempt: int) -> str:
    """The request's id on the workers for `attempt` (0: the first)."""
    return rid if attempt == 0 else f"{rid}#retry{attempt}"


def _cancelled(active: ActiveRequest) -> RequestError:
    return RequestError(grpc.StatusCode.CANCELLED, f"request {active.request_id} was aborted")


class Orchestrator:
    def __init__(self, pool: WorkerPool, mode: str, max_model_len: int, max_retries: int,
                 local_prefill: LocalPrefillPolicy, metrics: RouterMetrics, reserve_overlap_max_tokens: int = 0,
                 ) -> None:
        self.pool, self.mode, self.max_model_len = pool, mode, max_model_len
        # disaggregated: prompts up to this long are prefilled while their decode worker reserves
        self.reserve_overlap_max_tokens = reserve_overlap_max_tokens if mode == "disaggregated" else 0
        self.max_retries = max_retries  # attempts after the first, per request, on a worker failure
        self.local_prefill = local_prefill
        self.metrics = metrics

    # ------------------------------------------------------------------ the request
    def run(self, active: ActiveRequest, run: Progress, output: Output, arrival: float, deadline: float,
            ) -> Generator[gen.GenerateResponse, None, tuple[str, gen.GenerateResponse]]:
        """Attempts until one finishes; each retry resumes from the tokens the client already has on
        another pair of workers (the failed ones avoided), at most `max_retries` times. Yields the
        messages to send now; returns (finish reason, the final message with any tokens not sent
        yet). A RequestError aborts the request on every worker it reached before it is raised."""
        try:
            return (yield from self._attempts(active, run, output, arrival, deadline))
        except RequestError:
            self.abort(active)
            raise

    def _attempts(self, active: ActiveRequest, run: Progress, output: Output, arrival: float, deadline: float,
                  ) -> Generator[gen.GenerateResponse, None, tuple[str, gen.GenerateResponse]]:
        rid = active.request_id
        avoid: set[str] = set()
        while True:
            try:
                return (yield from self._attempt(active, run, output, arrival, deadline, avoid))
            except AttemptFailed as e:
                reached = [(w, r) for w, r in active.reached if r == worker_request_id(rid, run.attempts)]
                self.abort_on(reached, timeout_s=1.0)
                active.reached = [x for x in active.reached if x not in reached]
                for w in e.suspects:
                    avoid.add(w.worker_id)
                    self.pool.check(w)
                run.attempts += 1
                if active.cancelled:
                    raise _cancelled(active) from None
                if run.attempts > self.max_retries:
                    raise RequestError(grpc.StatusCode.UNAVAILABLE,
                                       f"request {rid} failed on a worker {run.attempts} times (router.max_retries "
                                       f"is {self.max_retries}); last: {e}") from None
                pause = min(0.05 * 2 ** run.attempts, 0.5)
                if time.monotonic() + pause >= deadline:
                    raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                       f"request {rid} reached its deadline while failing over; last: {e}") from None
                self.metrics.retries.inc()
                log.warning("retry %d of %d with %d tokens already sent, after: %s", run.attempts, self.max_retries,
                            len(run.tokens), e)
                time.sleep(pause)

    def abort(self, active: ActiveRequest, force: bool = False) -> None:
        """Stop the request: abort it on every worker it reached (unless it is done, or `force`)."""
        if active.done and not force:
            return
        active.cancelled = True
        self.abort_on(list(active.reached))

    @staticmethod
    def abort_on(reached: list[tuple[WorkerHandle, str]], timeout_s: float = 5.0) -> None:
        """Abort each (worker, request id there); a worker that does not answer frees the request by
        itself (decode: the reservation's lease, the stream's deadline; prefill: its own timeout)."""
        for w, worker_rid in reached:
            try:
                w.stub.Abort(gen.AbortRequest(request_id=worker_rid), timeout=timeout_s)
            except grpc.RpcError:
                pass

    def _reached(self, active: ActiveRequest, w: WorkerHandle, worker_rid: str) -> None:
        """Record a worker the request reached; if it was cancelled meanwhile, abort there now."""
        active.reached.append((w, worker_rid))
        if active.cancelled:
            self.abort(active, force=True)
            raise _cancelled(active)

    # ------------------------------------------------------------------ one attempt
    def _reserve(self, active: ActiveRequest, rid: str, blocks: PromptBlocks, params: SamplingParams,
                 offset: int, deadline: float, avoid: set[str], before_remote: Callable[[], None] = lambda: None,
                 ) -> tuple[WorkerHandle, wk.TransferTicket | None, int]:
        """Reserve on the decode worker the routing policy picks (the longest cached prefix among
        the nearly least loaded), those in `avoid` last; wait (bounded) while all are full. `rid` is
        the request's id on the worker (a retry's differs). The ticket is None when the worker
        prefills the prompt itself (colocated, conditional disaggregation, or a local prefill); then
        the last item is the prompt tokens it computes (those its prefix cache is not expected to hold).
        `before_remote` runs before each Reserve whose prompt goes to a prefill worker."""
        ids = blocks.token_ids
        role = "colocated" if self.mode == "colocated" else "decode"
        req = wk.ReserveRequest(request_id=rid, num_prompt_tokens=len(ids), max_tokens=params.max_tokens,
                                sampling=sampling_to_proto(params), token_ids=ids, run_prefill=self.mode == "colocated",
                                transfer_id=f"{rid}-{uuid.uuid4().hex[:12]}", resume_offset=offset,
                                reuse_cached_prefix=self.pool.policy.prefix_aware)
        delay = 0.01
        while True:
            tried: set[str] = set()
            full, failed, last = False, [], ""
            while (taken := self.pool.take_for(role, blocks, tried, avoid)) is not None:  # counted on w from here
                w, cached = taken.worker, taken.cached_tokens
                tried.add(w.worker_id)
                pending = 0
                if self.mode != "colocated":
                    uncached = self.pool.policy.uncached(len(ids), cached)  # what w computes if local
                    req.run_prefill = self.pool.policy.prefill_on_decode(len(ids), cached) or (
                        self.local_prefill.enabled and self.local_prefill.local(
                            uncached, self.pool.prefill_queued(), w.local_tokens))
                    if not req.run_prefill:
                        pending = len(ids)
                        self.pool.add_pending_prefill(pending)  # seen by requests arriving meanwhile
                if pending:
                    try:
                        before_remote()
                    except BaseException:
                        self.pool.release(w)
                        self.pool.add_pending_prefill(-pending)
                        raise
                try:
                    resp = w.stub.Reserve(req, timeout=max(0.1, min(deadline - time.monotonic(), 30.0)))
                    self.metrics.routed(role, len(ids), cached, params.max_tokens)
                    if req.run_prefill:
                        return w, None, max(1, self.pool.policy.uncached(len(ids), cached))  # the last token always
                    return w, resp.ticket, 0
                except grpc.RpcError as e:
                    self.pool.release(w)
                    if pending:
                        self.pool.add_pending_prefill(-pending)
                    if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                        raise RequestError(e.code(), e.details()) from None
                    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        full = True
                        continue
                    log.warning("reserve on %s failed: %s %s", w.worker_id, e.code(), e.details())
                    failed.append(w)
                    last = f"reserve on {role} worker {w.worker_id} failed: {e.code().name}: {e.details()}"
            if not tried:
                raise AttemptFailed(f"no healthy {role} worker", [])
            if not full:  # none is merely full: every one failed
                raise AttemptFailed(last, failed)
            if active.cancelled:
                raise _cancelled(active)
            if time.monotonic() + delay > deadline:
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, "no KV capacity before the request deadline")
            time.sleep(delay)
            delay = min(delay * 2, 0.2)

    def _attempt(self, active: ActiveRequest, run: Progress, output: Output, arrival: float, deadline: float,
                 avoid: set[str]) -> Generator[gen.GenerateResponse, None, tuple[str, gen.GenerateResponse]]:
        """One pair of workers: reserve, prefill, relay. Yields the messages to send now; returns
        (finish reason, the final message with any tokens not sent yet). Raises AttemptFailed when a
        worker or a transfer failed, RequestError when the request itself cannot go on."""
        rid = active.request_id
        wrid = worker_request_id(rid, run.attempts)
        offset = len(run.tokens)
        prompt = run.prompt + run.tokens
        if offset >= run.params.max_tokens or len(prompt) >= self.max_model_len:  # nothing left to generate
            return "length", gen.GenerateResponse(request_id=rid)
        # a resume: the client has the prompt's logprobs already (and the prompt may use the prefix cache)
        params = run.params if not offset else dataclasses.replace(run.params, max_tokens=run.params.max_tokens - offset,
                                                                   prompt_logprobs=None)
        blocks = PromptBlocks(prompt)
        early: _Early | None = None

        def prefill_early() -> None:  # the prompt is short: prefill it while the decode worker reserves
            nonlocal early
            if early is None and len(prompt) <= self.reserve_overlap_max_tokens:
                early = self._prefill_early(active, wrid, blocks, params, offset, deadline, avoid)

        decode, ticket, computed = self._reserve(active, wrid, blocks, params, offset, deadline, avoid,
                                                 prefill_early)  # counted on decode; a failure aborts `early` too
        local = ticket is None  # the decode worker prefills (colocated, or a local prefill)
        if early is not None and local:  # another decode worker took it to prefill after all
            self.abort_on([(early.worker, wrid)], timeout_s=1.0)
            active.reached.remove((early.worker, wrid))
            early = None
        # prompt tokens this attempt has counted in the pool until they are handed on: bound for a
        # prefill worker (counted by _reserve) until _prefill takes one; a local prefill's on the
        # decode worker until its first token
        pending = 0 if local else len(prompt)
        local_tokens = computed if local and self.mode != "colocated" else 0
        if local_tokens:
            self.pool.add_local(decode, local_tokens)
            self.metrics.local_prefills.inc()
            log.debug("prefill on decode worker %s (%d prompt tokens)", decode.worker_id, local_tokens)
        stream = None
        try:
            active.metrics.running()
            log.debug("reserved KV on %s", decode.worker_id)
            self._reached(active, decode, wrid)
            if not run.attempts:  # until the prompt went to the worker that computes it
                run.timing.router_queue_ms = ((early.sent_at if early is not None else time.monotonic()) - arrival) * 1e3
            stream = decode.stub.Stream(wk.StreamRequest(request_id=wrid), timeout=max(0.1, deadline - time.monotonic()))
            seen = 0  # tokens of this attempt's sequence handled
            if not run.tokens:
                run.local = local
            if not local:
                self.pool.add_pending_prefill(-pending)
                pending = 0
                first = self._prefill(active, wrid, blocks, params, offset, ticket, deadline, avoid, decode, early)
                if not run.tokens:
                    run.timing.prefill_queue_ms = first.prefill_queue_ms
                    run.timing.prefill_compute_ms = first.prefill_compute_ms
                    run.timing.kv_transfer_ms = first.kv_transfer_ms
                log.debug("first token: %d prompt tokens cached; prefill queue %.1f ms, compute %.1f ms, "
                          "kv transfer %.1f ms", first.num_cached_tokens, first.prefill_queue_ms,
                          first.prefill_compute_ms, first.kv_transfer_ms)
                seen = 1
                # committed: the prompt's blocks are in the decode worker's prefix cache from now (the
                # later choices of a request with several find them there)
                if not first.finish_reason:
                    self.pool.index.expect(decode.worker_id, blocks)
                lps = [first.first_token_logprob] if first.HasField("first_token_logprob") else []
                opening = not run.tokens  # the client's first message: it carries the prompt's logprobs
                msg, stopped = self._take(active, run, output, [first.first_token], lps)
                if opening:
                    msg.prompt_logprobs.extend(first.prompt_logprobs)
                finish = "stop" if stopped else first.finish_reason
                if finish:
                    self.abort(active)
                    return finish, msg
                yield msg
            for chunk in stream:
                if local_tokens and chunk.token_ids:  # the first token: its prefill is done
                    self.pool.add_local(decode, -local_tokens)
                    local_tokens = 0
                if chunk.start_index <= 1 and chunk.decode_queue_ms and not run.timing.decode_queue_ms:
                    run.timing.decode_queue_ms = chunk.decode_queue_ms
                if chunk.finish_reason == "abort":
                    raise AttemptFailed(f"decode worker {decode.worker_id} aborted the request (engine error)",
                                        [decode])
                skip = max(0, seen - chunk.start_index)
                new = list(chunk.token_ids[skip:])
                msg = None
                if new:
                    opening = not run.tokens
                    msg, stopped = self._take(active, run, output, new, list(chunk.logprobs[skip:]))
                    if opening:
                        msg.prompt_logprobs.extend(chunk.prompt_logprobs)
                    seen += len(new)
                    if stopped:
                        self.abort(active)
                        return "stop", msg
                if chunk.finish_reason:
                    # its prompt and answer stay in the decode worker's prefix cache (a next turn's prefix)
                    self.pool.index.expect(decode.worker_id, blocks.extended(run.tokens[offset:-1]))
                    return chunk.finish_reason, msg or gen.GenerateResponse(request_id=rid)
                if msg is not None:
                    yield msg
            if active.cancelled:
                raise _cancelled(active)
            raise AttemptFailed(f"decode worker {decode.worker_id} ended the stream early", [decode])
        except grpc.RpcError as e:
            raise self._failure(active, f"stream from decode worker {decode.worker_id}", e, [decode], deadline) from None
        finally:
            if stream is not None:
                stream.cancel()  # a no-op once it finished
            if pending:  # failed before a prefill worker took it
                self.pool.add_pending_prefill(-pending)
            if local_tokens:  # ended before its first token
                self.pool.add_local(decode, -local_tokens)
            self.pool.release(decode)

    def _prefill_request(self, prefill: WorkerHandle, taken: Any, rid: str, blocks: PromptBlocks,
                         params: SamplingParams, offset: int, ticket: wk.TransferTicket | None) -> wk.PrefillRequest:
        """The prefill worker `taken` names counts as reached by the caller; None: the ticket follows."""
        self.metrics.routed("prefill", len(blocks.token_ids), taken.cached_tokens)
        log.debug("prefill on %s (%d prompt tokens expected cached there, %s)", prefill.worker_id,
                  taken.cached_tokens, "ticket follows" if ticket is None else
                  f"{ticket.cached_tokens} on the decode worker")
        source = self.pool.tier_source(prefill, blocks, taken.cached_tokens)
        self.pool.index.expect(prefill.worker_id, blocks)
        return wk.PrefillRequest(request_id=rid, token_ids=blocks.token_ids, sampling=sampling_to_proto(params),
                                 ticket=ticket, resume_offset=offset, tier_source=source,
                                 ticket_follows=ticket is None)

    def _prefill_early(self, active: ActiveRequest, rid: str, blocks: PromptBlocks, params: SamplingParams,
                       offset: int, deadline: float, avoid: set[str]) -> _Early | None:
        """Send the prefill now, its ticket to follow (AttachTicket); None when no prefill worker is
        there (the usual path finds out once the decode worker reserved)."""
        taken = self.pool.take_for("prefill", blocks, avoid=avoid)
        if taken is None:
            return None
        prefill = taken.worker
        try:
            self._reached(active, prefill, rid)
            request = self._prefill_request(prefill, taken, rid, blocks, params, offset, None)
            sent_at = time.monotonic()
            call = prefill.stub.Prefill.future(request, timeout=max(0.1, deadline - sent_at))
        except BaseException:
            self.pool.release(prefill, taken.counted_tokens)
            raise
        call.add_done_callback(lambda _: self.pool.release(prefill, taken.counted_tokens))
        return _Early(prefill, call, sent_at)

    def _prefill(self, active: ActiveRequest, rid: str, blocks: PromptBlocks, params: SamplingParams, offset: int,
                 ticket: wk.TransferTicket, deadline: float, avoid: set[str], decode: WorkerHandle,
                 early: _Early | None = None) -> wk.PrefillResponse:
        """The prefill's answer: from the worker `early` sent it to (given its ticket now), or sent here."""
        taken = None
        if early is None:
            taken = self.pool.take_for("prefill", blocks, avoid=avoid)
            if taken is None:
                raise AttemptFailed("no healthy prefill worker", [])
        prefill = early.worker if early is not None else taken.worker
        timeout = max(0.1, deadline - time.monotonic())
        try:
            if early is not None:
                prefill.stub.AttachTicket(wk.AttachTicketRequest(request_id=rid, ticket=ticket), timeout=timeout)
                return early.call.result()  # bounded by the call's deadline; raises its RpcError
            self._reached(active, prefill, rid)
            return prefill.stub.Prefill(self._prefill_request(prefill, taken, rid, blocks, params, offset, ticket),
                                        timeout=timeout)
        except grpc.RpcError as e:
            # the prefill worker, the decode worker (KV receiver) or the link between them
            raise self._failure(active, f"prefill on {prefill.worker_id} (KV to {decode.worker_id})", e,
                                [prefill, decode], deadline) from None
        except grpc.FutureCancelledError:
            raise _cancelled(active) from None
        finally:
            if taken is not None:
                self.pool.release(prefill, taken.counted_tokens)

    @staticmethod
    def _failure(active: ActiveRequest, what: str, e: grpc.RpcError, suspects: list[WorkerHandle],
                 deadline: float) -> Exception:
        """A worker RPC's error as a RequestError (the request cannot go on) or an AttemptFailed."""
        code = e.code()
        if active.cancelled:
            return _cancelled(active)
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
            return RequestError(code, f"{what}: {e.details()}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() >= deadline - 0.05:
            return RequestError(code, f"request {active.request_id} exceeded its deadline ({what})")
        return AttemptFailed(f"{what} failed: {code.name}: {e.details()}", suspects)

    @staticmethod
    def _take(active: ActiveRequest, run: Progress, output: Output, tokens: list[int], logprobs: list,
              ) -> tuple[gen.GenerateResponse, bool]:
        """Tokens reached the router: they are the client's now (a retry starts after them)."""
        msg, stopped = output(tokens, logprobs)
        now = time.monotonic()
        if not run.tokens and active.admitted is not None:
            active.admitted.started()  # its prompt no longer waits for prefill
        run.tokens.extend(msg.token_ids)
        run.token_times.extend([now] * len(msg.token_ids))
        active.metrics.tokens(now)
        return msg, stopped
