"""The router: the public `PDCluster` gRPC service, orchestrating prefill and decode workers.

One `Generate` call, disaggregated mode:

    validate + tokenize  ->  pick decode D, D.Reserve (blocks + ticket; RESOURCE_EXHAUSTED: another D
    or wait)  ->  open D.Stream  ->  pick prefill P, P.Prefill(ticket): P pushes KV into D's blocks
    and returns the first token  ->  relay D's tokens, detokenizing incrementally  ->  final message
    with finish reason, usage and the timing breakdown.

Colocated mode: D.Reserve(run_prefill=True) and relay D.Stream (the worker does both phases).
Disaggregated with `local_prefill_max_tokens` > 0: a short prompt that would queue behind more
prompt tokens at the prefill workers goes the colocated way on its decode worker
(router/local_prefill.py).
A client disconnect or Abort aborts the request on every worker it reached, which frees its blocks.
Every wait is bounded by the request deadline (the router's timeout, or the client's if sooner).

Failures (router/server.py `_attempt` / `_failure`): when a decode stream breaks, a prefill or its
KV transfer fails, or no worker of a role answers, the attempt is aborted where it reached and the
request goes on from what the client already has: the next attempt reserves on another pair (the
workers that failed are avoided, and asked for their health at once) with prompt + tokens already
sent as its prompt, max_tokens less those tokens and `resume_offset` = their number (so seeded
sampling draws as the first attempt would have). The client's stream continues with no token
repeated or missing. After `max_retries` retries the request fails with UNAVAILABLE naming the
last failure. A retry's id on the workers is "<request id>#retry<n>" ("#" is refused in client ids).

Observability: each request's latencies and outcome go to `self.metrics` (router/metrics.py; the
per-request recorder rides on `_Active`), log lines about a request carry its id
(common/logs.py), and the server answers `grpc.health.v1.Health` and reflection.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
import uuid
from dataclasses import dataclass, field

import grpc

from common.logs import request_context
from engine.builtin_model import resolve_model_path
from engine.config import ModelConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.request_checks import resolve_max_model_len, validate_request
from engine.sampling_params import SamplingParams
from engine.tokenizer import load_tokenizer
from proto import generate_pb2 as gen
from proto import generate_pb2_grpc as gen_grpc
from proto import worker_pb2 as wk
from proto.convert import sampling_from_proto, sampling_to_proto, unknown_fields
from proto.serving import Malformed, add_health_and_reflection, add_servicer, bind_server, read_tls
from router import metrics as router_metrics
from router.admission import RETRY_AFTER_METADATA, Admission, AdmissionLimits, Admitted, Refused
from router.local_prefill import LocalPrefillPolicy
from router.metrics import RequestMetrics, RouterMetrics
from router.worker_pool import WorkerHandle, WorkerPool

log = logging.getLogger("pdcluster.router")
SERVICE_NAME = gen.DESCRIPTOR.services_by_name["PDCluster"].full_name  # "pdcluster.v1.PDCluster"
MAX_MESSAGE_BYTES = 8 << 20  # a public request is a prompt and its parameters: far below this
MAX_REQUEST_ID = 256
_REQUEST_ID = re.compile(r"[!-~]+")  # printable ASCII, no space; "#" is reserved (retries' ids on the workers)
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 16, 1024, 1024


class RequestError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s  # a refusal's hint, sent as trailing metadata retry-after-ms


class _Retry(Exception):
    """An attempt failed where another pair of workers may succeed (a worker died or stopped
    answering, a KV transfer failed): the request goes on from what the client already has."""

    def __init__(self, message: str, suspects: list[WorkerHandle]) -> None:
        super().__init__(message)
        self.suspects = suspects  # workers that may be at fault: avoided by this request's next attempt


@dataclass
class _Active:
    request_id: str
    metrics: RequestMetrics
    admitted: Admitted | None = None  # its place in admission control
    # (worker, the request's id there) for every worker an attempt reached; a retry's id is
    # "<request id>#retry<n>", so a late abort of a failed attempt never hits the next one
    reached: list[tuple[WorkerHandle, str]] = field(default_factory=list)
    done: bool = False
    cancelled: bool = False  # aborted by the client: stop at the next step, abort what was reached

    def add_worker(self, w: WorkerHandle, worker_rid: str, router: "RouterServer") -> None:
        """Record a worker the request reached; if it was cancelled meanwhile, abort there now."""
        self.reached.append((w, worker_rid))
        if self.cancelled:
            router._abort(self, force=True)
            raise RequestError(grpc.StatusCode.CANCELLED, f"request {self.request_id} was aborted")


@dataclass
class _Progress:
    """What survives a retry: the tokens the client has (or will get in the final message), their
    arrival times, and the timing breakdown of the attempt that produced the first token."""

    prompt: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    timing: gen.Timing = field(default_factory=gen.Timing)
    attempts: int = 0
    local: bool = False  # the first token came from a prefill on the decode worker (or a colocated one)


class RouterServer(gen_grpc.PDClusterServicer):
    def __init__(
        self,
        model: str,
        max_model_len: int | None = None,
        mode: str = "disaggregated",
        host: str = "127.0.0.1",
        port: int = 0,
        request_timeout_s: float = 600.0,
        api_keys: list[str] | None = None,
        model_name: str | None = None,
        max_retries: int = 2,
        max_requests: int = AdmissionLimits.max_requests,
        max_queued_prompt_tokens: int = AdmissionLimits.max_queued_prompt_tokens,
        cluster_secret: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        local_prefill_max_tokens: int = 0,
    ) -> None:
        """`tls_cert` / `tls_key`: PEM files; with both, the public port serves TLS only, and a second,
        plaintext port on 127.0.0.1 (`local_address`) serves the HTTP API in this process.
        `local_prefill_max_tokens` (disaggregated): prompts up to this long may be prefilled on their
        decode worker when the prefill workers are busier (router/local_prefill.py); 0: never."""
        path = resolve_model_path(model)
        self.model_name = model_name or model
        self.model_cfg = ModelConfig.from_pretrained(path)
        self.tokenizer = load_tokenizer(path)
        # no token is longer than this many characters (a byte-level token string has a character per byte)
        self._max_token_chars = max(map(len, self.tokenizer.get_vocab()), default=1) if self.tokenizer else 1
        self.max_model_len = resolve_max_model_len(self.model_cfg, max_model_len)
        self.mode = mode
        self.request_timeout_s = request_timeout_s
        self.api_keys = set(api_keys or [])
        self.max_retries = max_retries  # attempts after the first, per request, on a worker failure
        self.local_prefill = LocalPrefillPolicy(local_prefill_max_tokens if mode == "disaggregated" else 0)
        self.admission = Admission(AdmissionLimits(max_requests, max_queued_prompt_tokens))
        self.pool = WorkerPool(cluster_secret=cluster_secret)
        self.metrics = RouterMetrics(self.pool.workers, mode)
        self.metrics.watch_admission(self.admission)
        router_metrics.set_current(self.metrics.registry)  # what router.metrics.render() serves
        self._active: dict[str, _Active] = {}
        self._lock = threading.Lock()
        tls = read_tls(tls_cert, tls_key)
        self.server, self.address = bind_server(host, port, 512, "router", max_message_bytes=MAX_MESSAGE_BYTES,
                                                tls=tls)
        self.tls = tls is not None
        self.local_address = self.address  # where the HTTP API (same process) calls Generate
        if tls is not None:
            self.local_address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        add_servicer(self.server, self, gen.DESCRIPTOR.services_by_name["PDCluster"], gen)
        self.health = add_health_and_reflection(self.server, [SERVICE_NAME])
        self.server.start()
        self.health.serving()

    def set_workers(self, workers: list[tuple[str, str, str]]) -> None:
        self.pool.set_workers(workers)

    def stop(self, grace: float = 1.0) -> None:
        self.health.stopping()
        self.server.stop(grace).wait(grace + 1)
        self.pool.close()
        router_metrics.clear_current(self.metrics.registry)

    # ------------------------------------------------------------------ validation
    def _check_auth(self, context: grpc.ServicerContext) -> None:
        if not self.api_keys:
            return
        md = dict(context.invocation_metadata())
        key = md.get("x-api-key") or md.get("authorization", "").removeprefix("Bearer ").strip()
        if key not in self.api_keys:
            raise RequestError(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key")

    @staticmethod
    def _request_id(request: gen.GenerateRequest) -> str:
        if not request.HasField("request_id") or not request.request_id:
            return uuid.uuid4().hex
        rid = request.request_id
        if len(rid) > MAX_REQUEST_ID or not _REQUEST_ID.fullmatch(rid) or "#" in rid:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"request_id: {rid[:64]!r}{'...' if len(rid) > 64 else ''} is not allowed; allowed: "
                               f"1 to {MAX_REQUEST_ID} printable ASCII characters, no space and no '#'")
        return rid

    def _parse(self, request: gen.GenerateRequest) -> tuple[list[int], SamplingParams]:
        unknown = unknown_fields(request)
        if unknown:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"unknown fields in request: {', '.join(unknown)}")
        if request.model and request.model != self.model_name:
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"model {request.model!r} is not served here; "
                                                          f"this cluster serves {self.model_name!r}")
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "prompt: set either text or token_ids")
        if kind == "text":
            if not request.text:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "prompt: text is empty")
            if self.tokenizer is None:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "prompt: this model has no tokenizer; send token_ids")
            if len(request.text) > self.max_model_len * self._max_token_chars:  # too long whatever it tokenizes to
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"prompt: text of {len(request.text)} characters is longer than max_model_len "
                                   f"{self.max_model_len} tokens can be")
            ids = self.tokenizer.encode(request.text)
        else:
            ids = list(request.token_ids.ids)
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as e:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {e}") from None
        stop = request.sampling.stop
        if len(stop) > MAX_STOP_STRINGS or any(len(x) > MAX_STOP_CHARS for x in stop):
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.stop: at most {MAX_STOP_STRINGS} strings "
                                                                f"of at most {MAX_STOP_CHARS} characters each")
        if len(request.sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"sampling.stop_token_ids: at most {MAX_STOP_TOKEN_IDS} token ids")
        if params.stop and self.tokenizer is None:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "sampling.stop: needs a tokenizer; use stop_token_ids")
        try:
            validate_request(ids, params, self.model_cfg.vocab_size, self.max_model_len)
        except ValueError as e:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"prompt: {e}") from None
        return ids, params

    # ------------------------------------------------------------------ RPCs
    def Generate(self, request: gen.GenerateRequest | Malformed, context: grpc.ServicerContext):
        if isinstance(request, Malformed):
            self.metrics.request().error(grpc.StatusCode.INVALID_ARGUMENT)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.describe())
        arrival = time.monotonic()
        metrics = self.metrics.request(arrival)
        try:
            self._check_auth(context)
            ids, params = self._parse(request)
            rid = self._request_id(request)
            active = _Active(rid, metrics)
            with self._lock:
                if rid in self._active:
                    raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already running")
                try:
                    active.admitted = self.admission.admit(len(ids))
                except Refused as e:
                    raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), e.retry_after_s) from None
                self._active[rid] = active
        except RequestError as e:
            metrics.error(e.code)
            log.warning("refused: %s: %s", e.code.name, e, extra={"request_id": request.request_id or None})
            self._fail(context, e)
        context.add_callback(lambda: self._abort(active))  # client went away (or the call ended)
        deadline = arrival + self.request_timeout_s
        remaining = context.time_remaining()  # the client's own deadline, if it set one
        if remaining is not None:
            deadline = min(deadline, time.monotonic() + remaining)
        with request_context(rid):
            log.info("admitted: %d prompt tokens, max_tokens %d", len(ids), params.max_tokens)
            try:
                yield from self._generate(active, ids, params, arrival, deadline)
            except RequestError as e:
                metrics.error(e.code)
                log.warning("failed: %s: %s", e.code.name, e)
                self._abort(active)
                self._fail(context, e)
            finally:
                metrics.close()  # ended without a final message or an error: the client went away
                active.done = True
                active.admitted.release()
                with self._lock:
                    if self._active.get(rid) is active:
                        del self._active[rid]

    @staticmethod
    def _fail(context: grpc.ServicerContext, e: RequestError) -> None:
        if e.retry_after_s is not None:
            context.set_trailing_metadata(((RETRY_AFTER_METADATA, str(int(e.retry_after_s * 1e3))),))
        context.abort(e.code, str(e))

    def Abort(self, request: gen.AbortRequest | Malformed, context: grpc.ServicerContext) -> gen.AbortResponse:
        try:
            self._check_auth(context)
        except RequestError as e:
            context.abort(e.code, str(e))
        if isinstance(request, Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.describe())
        active = self._active.get(request.request_id)
        if active is not None:
            self._abort(active)
        return gen.AbortResponse(found=active is not None)

    def _abort(self, active: _Active, force: bool = False) -> None:
        if active.done and not force:
            return
        active.cancelled = True
        self._abort_on(list(active.reached))

    @staticmethod
    def _abort_on(reached: list[tuple[WorkerHandle, str]], timeout_s: float = 5.0) -> None:
        """Abort each (worker, request id there); a worker that does not answer frees the request by
        itself (decode: the reservation's lease, the stream's deadline; prefill: its own timeout)."""
        for w, worker_rid in reached:
            try:
                w.stub.Abort(gen.AbortRequest(request_id=worker_rid), timeout=timeout_s)
            except grpc.RpcError:
                pass

    # ------------------------------------------------------------------ orchestration
    def _reserve(self, active: _Active, rid: str, ids: list[int], params: SamplingParams, offset: int,
                 deadline: float, avoid: set[str]) -> tuple[WorkerHandle, wk.TransferTicket | None]:
        """Reserve on the least-loaded decode worker, those in `avoid` last; wait (bounded) while
        all are full. `rid` is the request's id on the worker (a retry's differs). The ticket is None
        when the worker prefills the prompt itself (colocated, or a local prefill)."""
        role = "colocated" if self.mode == "colocated" else "decode"
        req = wk.ReserveRequest(request_id=rid, num_prompt_tokens=len(ids), max_tokens=params.max_tokens,
                                sampling=sampling_to_proto(params), token_ids=ids, run_prefill=self.mode == "colocated",
                                transfer_id=f"{rid}-{uuid.uuid4().hex[:12]}", resume_offset=offset)
        delay = 0.01
        while True:
            tried: set[str] = set()
            full, failed, last = False, [], ""
            while (w := self.pool.take(role, tried, avoid)) is not None:  # counted on w from here
                tried.add(w.worker_id)
                pending = 0
                if self.mode != "colocated":
                    req.run_prefill = self.local_prefill.enabled and self.local_prefill.local(
                        len(ids), self.pool.prefill_queued(), w.local_tokens)
                    if not req.run_prefill:
                        pending = len(ids)
                        self.pool.add_pending_prefill(pending)  # seen by requests arriving meanwhile
                try:
                    resp = w.stub.Reserve(req, timeout=max(0.1, min(deadline - time.monotonic(), 30.0)))
                    return w, resp.ticket if not req.run_prefill else None
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
                raise _Retry(f"no healthy {role} worker", [])
            if not full:  # none is merely full: every one failed
                raise _Retry(last, failed)
            if active.cancelled:
                raise RequestError(grpc.StatusCode.CANCELLED, f"request {active.request_id} was aborted")
            if time.monotonic() + delay > deadline:
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, "no KV capacity before the request deadline")
            time.sleep(delay)
            delay = min(delay * 2, 0.2)

    def _generate(self, active: _Active, ids: list[int], params: SamplingParams, arrival: float, deadline: float):
        """Attempts until one finishes; each retry resumes from the tokens the client already has on
        another pair of workers (the failed ones avoided), at most `max_retries` times."""
        rid = active.request_id
        run = _Progress(ids, params, IncrementalDetokenizer(self.tokenizer, ids, params.stop) if self.tokenizer else None)
        avoid: set[str] = set()
        while True:
            try:
                finish, final = yield from self._attempt(active, run, arrival, deadline, avoid)
                break
            except _Retry as e:
                reached = [(w, r) for w, r in active.reached if r == self._worker_rid(rid, run.attempts)]
                self._abort_on(reached, timeout_s=1.0)
                active.reached = [x for x in active.reached if x not in reached]
                for w in e.suspects:
                    avoid.add(w.worker_id)
                    self.pool.check(w)
                run.attempts += 1
                if active.cancelled:
                    raise RequestError(grpc.StatusCode.CANCELLED, f"request {rid} was aborted") from None
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
        timing = run.timing
        if run.detok is not None:
            final.text += run.detok.flush()
        final.finish_reason = finish
        final.usage.prompt_tokens = len(ids)
        final.usage.completion_tokens = len(run.tokens)
        times = run.token_times
        timing.ttft_ms = (times[0] - arrival) * 1e3 if times else 0.0
        if run.local:
            timing.prefill_compute_ms = max(0.0, timing.ttft_ms - timing.router_queue_ms - timing.decode_queue_ms)
        if len(times) > 1:
            timing.mean_tpot_ms = (times[-1] - times[0]) / (len(times) - 1) * 1e3
        final.timing.CopyFrom(timing)
        active.metrics.finished(final)
        log.info("finished: %s, %d tokens, ttft %.1f ms, e2e %.1f ms%s", finish, len(run.tokens), timing.ttft_ms,
                 active.metrics.e2e_s * 1e3, f", {run.attempts} retries" if run.attempts else "")
        yield final

    @staticmethod
    def _worker_rid(rid: str, attempt: int) -> str:
        return rid if attempt == 0 else f"{rid}#retry{attempt}"

    def _attempt(self, active: _Active, run: _Progress, arrival: float, deadline: float, avoid: set[str]):
        """One pair of workers: reserve, prefill, relay. Yields the messages to send now; returns
        (finish reason, the final message with any tokens not sent yet). Raises _Retry when a
        worker or a transfer failed, RequestError when the request itself cannot go on."""
        rid = active.request_id
        wrid = self._worker_rid(rid, run.attempts)
        offset = len(run.tokens)
        prompt = run.prompt + run.tokens
        if offset >= run.params.max_tokens or len(prompt) >= self.max_model_len:  # nothing left to generate
            return "length", gen.GenerateResponse(request_id=rid)
        params = run.params if not offset else dataclasses.replace(run.params, max_tokens=run.params.max_tokens - offset)
        decode, ticket = self._reserve(active, wrid, prompt, params, offset, deadline, avoid)  # counted on decode
        local = ticket is None  # the decode worker prefills (colocated, or a local prefill)
        # prompt tokens this attempt has counted in the pool until they are handed on: bound for a
        # prefill worker (counted by _reserve) until _prefill takes one; a local prefill's on the
        # decode worker until its first token
        pending = 0 if local else len(prompt)
        local_tokens = len(prompt) if local and self.mode != "colocated" else 0
        if local_tokens:
            self.pool.add_local(decode, local_tokens)
            self.metrics.local_prefills.inc()
            log.debug("prefill on decode worker %s (%d prompt tokens)", decode.worker_id, local_tokens)
        stream = None
        try:
            active.metrics.running()
            log.debug("reserved KV on %s", decode.worker_id)
            active.add_worker(decode, wrid, self)
            if not run.attempts:
                run.timing.router_queue_ms = (time.monotonic() - arrival) * 1e3
            stream = decode.stub.Stream(wk.StreamRequest(request_id=wrid), timeout=max(0.1, deadline - time.monotonic()))
            seen = 0  # tokens of this attempt's sequence handled
            if not run.tokens:
                run.local = local
            if not local:
                self.pool.add_pending_prefill(-pending)
                pending = 0
                first = self._prefill(active, wrid, prompt, params, offset, ticket, deadline, avoid, decode)
                if not run.tokens:
                    run.timing.prefill_queue_ms = first.prefill_queue_ms
                    run.timing.prefill_compute_ms = first.prefill_compute_ms
                    run.timing.kv_transfer_ms = first.kv_transfer_ms
                log.debug("first token: %d prompt tokens cached; prefill queue %.1f ms, compute %.1f ms, "
                          "kv transfer %.1f ms", first.num_cached_tokens, first.prefill_queue_ms,
                          first.prefill_compute_ms, first.kv_transfer_ms)
                seen = 1
                lps = [first.first_token_logprob] if first.HasField("first_token_logprob") else []
                msg, stopped = self._take(active, run, [first.first_token], lps)
                finish = "stop" if stopped else first.finish_reason
                if finish:
                    self._abort(active)
                    return finish, msg
                yield msg
            for chunk in stream:
                if local_tokens and chunk.token_ids:  # the first token: its prefill is done
                    self.pool.add_local(decode, -local_tokens)
                    local_tokens = 0
                if chunk.start_index <= 1 and chunk.decode_queue_ms and not run.timing.decode_queue_ms:
                    run.timing.decode_queue_ms = chunk.decode_queue_ms
                if chunk.finish_reason == "abort":
                    raise _Retry(f"decode worker {decode.worker_id} aborted the request (engine error)", [decode])
                skip = max(0, seen - chunk.start_index)
                new = list(chunk.token_ids[skip:])
                msg = None
                if new:
                    msg, stopped = self._take(active, run, new, list(chunk.logprobs[skip:]))
                    seen += len(new)
                    if stopped:
                        self._abort(active)
                        return "stop", msg
                if chunk.finish_reason:
                    return chunk.finish_reason, msg or gen.GenerateResponse(request_id=rid)
                if msg is not None:
                    yield msg
            if active.cancelled:
                raise RequestError(grpc.StatusCode.CANCELLED, f"request {rid} was aborted")
            raise _Retry(f"decode worker {decode.worker_id} ended the stream early", [decode])
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

    def _failure(self, active: _Active, what: str, e: grpc.RpcError, suspects: list[WorkerHandle],
                 deadline: float) -> Exception:
        """A worker RPC's error as a RequestError (the request cannot go on) or a _Retry."""
        code = e.code()
        if active.cancelled:
            return RequestError(grpc.StatusCode.CANCELLED, f"request {active.request_id} was aborted")
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
            return RequestError(code, f"{what}: {e.details()}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() >= deadline - 0.05:
            return RequestError(code, f"request {active.request_id} exceeded its deadline ({what})")
        return _Retry(f"{what} failed: {code.name}: {e.details()}", suspects)

    def _take(self, active: _Active, run: _Progress, tokens: list[int], logprobs: list,
              ) -> tuple[gen.GenerateResponse, bool]:
        """Tokens reached the router: they are the client's now (a retry starts after them)."""
        msg, stopped = self._chunk(active.request_id, tokens, logprobs, run.detok)
        now = time.monotonic()
        if not run.tokens:
            active.admitted.started()  # its prompt no longer waits for prefill
        run.tokens.extend(msg.token_ids)
        run.token_times.extend([now] * len(msg.token_ids))
        active.metrics.tokens(now)
        return msg, stopped

    def _prefill(self, active: _Active, rid: str, ids: list[int], params: SamplingParams, offset: int,
                 ticket: wk.TransferTicket, deadline: float, avoid: set[str], decode: WorkerHandle,
                 ) -> wk.PrefillResponse:
        prefill = self.pool.take("prefill", avoid=avoid, tokens=len(ids))
        if prefill is None:
            raise _Retry("no healthy prefill worker", [])
        try:
            active.add_worker(prefill, rid, self)
            log.debug("prefill on %s", prefill.worker_id)
            return prefill.stub.Prefill(
                wk.PrefillRequest(request_id=rid, token_ids=ids, sampling=sampling_to_proto(params), ticket=ticket,
                                  resume_offset=offset),
                timeout=max(0.1, deadline - time.monotonic()),
            )
        except grpc.RpcError as e:
            # the prefill worker, the decode worker (KV receiver) or the link between them
            raise self._failure(active, f"prefill on {prefill.worker_id} (KV to {decode.worker_id})", e,
                                [prefill, decode], deadline) from None
        finally:
            self.pool.release(prefill, len(ids))

    def _chunk(self, rid: str, tokens: list[int], logprobs: list, detok: IncrementalDetokenizer | None):
        text = ""
        stopped = False
        if detok is not None:
            for i, t in enumerate(tokens):
                text += detok.add(t)
                if detok.stopped:  # the tokens after the one that completed the stop string are dropped
                    stopped = True
                    tokens, logprobs = tokens[: i + 1], logprobs[: i + 1]
                    break
        return gen.GenerateResponse(request_id=rid, token_ids=tokens, text=text, logprobs=logprobs), stopped


