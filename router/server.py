"""The router: the public `PDCluster` gRPC service in front of the prefill and decode workers.

One `Generate` call:

    check the API key, validate + tokenize  ->  admission (router/admission.py)  ->  the
    orchestrator (router/orchestrator.py) reserves, prefills and relays on a pair of workers, and
    retries on another pair from the tokens already sent  ->  each batch of tokens is detokenized
    incrementally and checked for stop strings here  ->  final message with finish reason, usage
    and the timing breakdown.

A client disconnect or Abort aborts the request on every worker it reached, which frees its blocks.
Every wait is bounded by the request deadline (the router's timeout, or the client's if sooner).

Observability: each request's latencies and outcome go to `self.metrics` (router/metrics.py; the
per-request recorder rides on `ActiveRequest`), log lines about a request carry its id
(common/logs.py), and the server answers `grpc.health.v1.Health` and reflection.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import threading
import time
import uuid

import grpc

from common.logs import request_context
from engine.builtin_model import resolve_model_path
from engine.config import ModelConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.guided import GuidedDecoder
from engine.request_checks import resolve_max_model_len, validate_request, validate_sampling
from engine.sampling_params import SamplingParams
from engine.tokenizer import load_tokenizer
from proto import generate_pb2 as gen
from proto import generate_pb2_grpc as gen_grpc
from proto.convert import sampling_from_proto, unknown_fields
from proto.serving import Malformed, add_health_and_reflection, add_servicer, bind_server, read_tls
from router import metrics as router_metrics
from router.admission import RETRY_AFTER_METADATA, Admission, AdmissionLimits, Refused
from router.choices import ChoiceMerge
from router.local_prefill import LocalPrefillPolicy
from router.metrics import RouterMetrics
from router.orchestrator import ActiveRequest, Orchestrator, Progress, RequestError
from router.prefix_policy import RoutingPolicy
from router.worker_pool import WorkerPool

log = logging.getLogger("pdcluster.router")
SERVICE_NAME = gen.DESCRIPTOR.services_by_name["PDCluster"].full_name  # "pdcluster.v1.PDCluster"
MAX_MESSAGE_BYTES = 8 << 20  # a public request is a prompt and its parameters: far below this
MAX_REQUEST_ID = 256
_REQUEST_ID = re.compile(r"[!-~]+")  # printable ASCII, no space; "#" is reserved (retries' ids on the workers)
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 16, 1024, 1024


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
        prefix_aware: bool = True,
        local_prefill_uncached_tokens: int = 0,
        reserve_overlap_max_tokens: int = 0,
    ) -> None:
        """`tls_cert` / `tls_key`: PEM files; with both, the public port serves TLS only, and a second,
        plaintext port on 127.0.0.1 (`local_address`) serves the HTTP API in this process.
        `local_prefill_max_tokens` (disaggregated): prompts up to this long may be prefilled on their
        decode worker when the prefill workers are busier (router/local_prefill.py); 0: never.
        `prefix_aware`: pick workers by what their prefix caches hold as well as by load, and let a
        decode worker share the blocks of a prompt it holds (False: by load only, all KV moves);
        `local_prefill_uncached_tokens` (disaggregated): a prompt whose part its decode worker does
        not hold is at most this long is prefilled there (router/prefix_policy.py); 0: never.
        `reserve_overlap_max_tokens` (disaggregated): a prompt up to this long goes to its prefill
        worker while its decode worker reserves, the ticket following (router/orchestrator.py); 0: never."""
        path = resolve_model_path(model)
        self.model_name = model_name or model
        self.model_cfg = ModelConfig.from_pretrained(path)
        self.tokenizer = load_tokenizer(path)
        self.guided = GuidedDecoder(path, self.model_cfg.vocab_size)  # checks constraints (grammars cached)
        # no token is longer than this many characters (a byte-level token string has a character per byte)
        self._max_token_chars = max(map(len, self.tokenizer.get_vocab()), default=1) if self.tokenizer else 1
        self.max_model_len = resolve_max_model_len(self.model_cfg, max_model_len)
        self.mode = mode
        self.request_timeout_s = request_timeout_s
        self.api_keys = set(api_keys or [])
        self.admission = Admission(AdmissionLimits(max_requests, max_queued_prompt_tokens))
        self.pool = WorkerPool(cluster_secret=cluster_secret, policy=RoutingPolicy(
            prefix_aware=prefix_aware,
            local_prefill_uncached_tokens=local_prefill_uncached_tokens if mode == "disaggregated" else 0))
        self.metrics = RouterMetrics(self.pool.workers, mode)
        self.metrics.watch_admission(self.admission)
        router_metrics.set_current(self.metrics.registry)  # what router.metrics.render() serves
        self.orchestrator = Orchestrator(
            self.pool, mode, self.max_model_len, max_retries,
            LocalPrefillPolicy(local_prefill_max_tokens if mode == "disaggregated" else 0), self.metrics,
            reserve_overlap_max_tokens)
        self._active: dict[str, list[ActiveRequest]] = {}  # client request id -> its choices' requests
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

    @property
    def max_retries(self) -> int:
        """Attempts after the first, per request, on a worker failure."""
        return self.orchestrator.max_retries

    @max_retries.setter
    def max_retries(self, n: int) -> None:
        self.orchestrator.max_retries = n

    @property
    def local_prefill(self) -> LocalPrefillPolicy:
        return self.orchestrator.local_prefill

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
            validate_sampling(params, self.model_cfg.vocab_size)
            if params.guided is not None:  # the workers would refuse it; say so here, with the reason
                self.guided.check(params.guided)
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
        actives: list[ActiveRequest] = []
        try:
            self._check_auth(context)
            ids, params = self._parse(request)
            rid = self._request_id(request)
            count = params.num_choices  # choice k of several is "<id>#<k>" on the workers (router/choices.py)
            actives = [ActiveRequest(rid if count == 1 else f"{rid}#{k}", self.metrics.request(arrival))
                       for k in range(count)]
            self._admit(rid, len(ids), actives)
        except RequestError as e:
            for m in [a.metrics for a in actives] or [self.metrics.request(arrival)]:
                m.error(e.code)
            log.warning("refused: %s: %s", e.code.name, e, extra={"request_id": request.request_id or None})
            self._fail(context, e)
        context.add_callback(lambda: self._abort_all(actives))  # client went away (or the call ended)
        deadline = arrival + self.request_timeout_s
        remaining = context.time_remaining()  # the client's own deadline, if it set one
        if remaining is not None:
            deadline = min(deadline, time.monotonic() + remaining)
        with request_context(rid):
            log.info("admitted: %d prompt tokens, max_tokens %d%s", len(ids), params.max_tokens,
                     f", {count} choices" if count > 1 else "")
            try:
                if count == 1:
                    yield from self._generate(actives[0], ids, params, arrival, deadline)
                    actives[0].done = True
                else:
                    run = functools.partial(self._choice, rid, actives, ids, params, arrival, deadline)
                    yield from ChoiceMerge(count, params.n, run, deadline, params.logprobs is None).messages()
            except RequestError as e:
                if count == 1:
                    actives[0].metrics.error(e.code)
                log.warning("failed: %s: %s", e.code.name, e)
                self._abort_all(actives)  # the other choices
                self._fail(context, e)
            finally:
                self._abort_all(actives)  # the choices still running when the client went away
                for a in actives:
                    a.metrics.close()  # ended without a final message or an error: the client went away
                    a.done = True
                    a.admitted.release()
                with self._lock:
                    if self._active.get(rid) is actives:
                        del self._active[rid]

    def _admit(self, rid: str, prompt_tokens: int, actives: list[ActiveRequest]) -> None:
        """Admission control for each choice; the request is known under `rid` from here."""
        with self._lock:
            if rid in self._active:
                raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already running")
            if len(actives) > self.admission.limits.max_requests:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"sampling: {len(actives)} choices (n / best_of) are more than the router's "
                                   f"max_requests ({self.admission.limits.max_requests}) in flight")
            try:
                for k, a in enumerate(actives):  # only the first choice prefills the whole prompt
                    a.admitted = self.admission.admit(prompt_tokens if k == 0 else 0)
            except Refused as e:
                for a in actives:
                    if a.admitted is not None:
                        a.admitted.release()
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), e.retry_after_s) from None
            self._active[rid] = actives

    def _abort_all(self, actives: list[ActiveRequest]) -> None:
        for a in actives:
            self.orchestrator.abort(a)  # a no-op for one that is done

    def _choice(self, rid: str, actives: list[ActiveRequest], ids: list[int], params: SamplingParams,
                arrival: float, deadline: float, k: int):
        """Choice k's messages, under the client's request id (router/choices.py runs it on a thread
        of its own)."""
        active = actives[k]
        choice = params.choice_params(k)
        if params.num_choices > params.n and choice.logprobs is None:  # they rank best_of's choices
            choice = dataclasses.replace(choice, logprobs=0)
        with request_context(active.request_id):
            try:
                for msg in self._generate(active, ids, choice, arrival, deadline):
                    msg.request_id = rid
                    yield msg
                active.done = True
            except RequestError as e:
                active.metrics.error(e.code)
                raise

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
        actives = self._active.get(request.request_id)
        if actives is not None:
            self._abort_all(actives)
        return gen.AbortResponse(found=actives is not None)

    # ------------------------------------------------------------------ the answer
    def _generate(self, active: ActiveRequest, ids: list[int], params: SamplingParams, arrival: float,
                  deadline: float):
        """The orchestrator's messages, detokenized here, then the final message with the finish
        reason, usage and timing breakdown."""
        run = Progress(ids, params)
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.min_tokens) if self.tokenizer else None
        output = functools.partial(self._chunk, active.request_id, detok=detok)
        finish, final = yield from self.orchestrator.run(active, run, output, arrival, deadline)
        timing = run.timing
        if detok is not None:
            final.text += detok.flush()
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
    def _chunk(rid: str, tokens: list[int], logprobs: list, detok: IncrementalDetokenizer | None,
               ) -> tuple[gen.GenerateResponse, bool]:
        """Tokens -> the message carrying them and their text; True when a stop string ended the output."""
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


