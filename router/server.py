"""The router: the public `PDCluster` gRPC service, orchestrating prefill and decode workers.

One `Generate` call, disaggregated mode:

    validate + tokenize  ->  pick decode D, D.Reserve (blocks + ticket; RESOURCE_EXHAUSTED: another D
    or wait)  ->  open D.Stream  ->  pick prefill P, P.Prefill(ticket): P pushes KV into D's blocks
    and returns the first token  ->  relay D's tokens, detokenizing incrementally  ->  final message
    with finish reason, usage and the timing breakdown.

Colocated mode: D.Reserve(run_prefill=True) and relay D.Stream (the worker does both phases).
Any failure or client disconnect aborts the request on both workers, which frees its blocks.
Every wait is bounded by the request deadline.

Observability: each request's latencies and outcome go to `self.metrics` (router/metrics.py; the
per-request recorder rides on `_Active`), log lines about a request carry its id
(pdcluster/logs.py), and the server answers `grpc.health.v1.Health` and reflection.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

import grpc

from engine.builtin_model import resolve_model_path
from engine.config import ModelConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.engine import validate_request
from engine.model_runner import resolve_max_model_len
from engine.sampling_params import SamplingParams
from engine.tokenizer import load_tokenizer
from pdcluster.logs import request_context
from proto import generate_pb2 as gen
from proto import generate_pb2_grpc as gen_grpc
from proto import worker_pb2 as wk
from proto.serving import add_health_and_reflection, bind_server
from proto.convert import sampling_from_proto, sampling_to_proto, unknown_fields
from router import metrics as router_metrics
from router.metrics import RequestMetrics, RouterMetrics
from router.worker_pool import WorkerHandle, WorkerPool

log = logging.getLogger("pdcluster.router")
SERVICE_NAME = gen.DESCRIPTOR.services_by_name["PDCluster"].full_name  # "pdcluster.v1.PDCluster"


class RequestError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Active:
    request_id: str
    metrics: RequestMetrics
    workers: list[WorkerHandle] = field(default_factory=list)
    done: bool = False
    cancelled: bool = False  # aborted by the client: stop at the next step, abort what was reached

    def add_worker(self, w: WorkerHandle, router: "RouterServer") -> None:
        """Record a worker the request reached; if it was cancelled meanwhile, abort there now."""
        self.workers.append(w)
        if self.cancelled:
            router._abort(self, force=True)
            raise RequestError(grpc.StatusCode.CANCELLED, f"request {self.request_id} was aborted")


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
    ) -> None:
        path = resolve_model_path(model)
        self.model_name = model_name or model
        self.model_cfg = ModelConfig.from_pretrained(path)
        self.tokenizer = load_tokenizer(path)
        self.max_model_len = resolve_max_model_len(self.model_cfg, max_model_len)
        self.mode = mode
        self.request_timeout_s = request_timeout_s
        self.api_keys = set(api_keys or [])
        self.pool = WorkerPool()
        self.metrics = RouterMetrics(self.pool.workers, mode)
        router_metrics.set_current(self.metrics.registry)  # what router.metrics.render() serves
        self._active: dict[str, _Active] = {}
        self._lock = threading.Lock()
        self.server, self.address = bind_server(host, port, 512, "router")
        gen_grpc.add_PDClusterServicer_to_server(self, self.server)
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
            ids = self.tokenizer.encode(request.text)
        else:
            ids = list(request.token_ids.ids)
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as e:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {e}") from None
        if params.stop and self.tokenizer is None:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "sampling.stop: needs a tokenizer; use stop_token_ids")
        try:
            validate_request(ids, params, self.model_cfg.vocab_size, self.max_model_len)
        except ValueError as e:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"prompt: {e}") from None
        return ids, params

    # ------------------------------------------------------------------ RPCs
    def Generate(self, request: gen.GenerateRequest, context: grpc.ServicerContext):
        arrival = time.monotonic()
        metrics = self.metrics.request(arrival)
        try:
            self._check_auth(context)
            ids, params = self._parse(request)
            rid = request.request_id if request.HasField("request_id") and request.request_id else uuid.uuid4().hex
            active = _Active(rid, metrics)
            with self._lock:
                if rid in self._active:
                    raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already running")
                self._active[rid] = active
        except RequestError as e:
            metrics.error(e.code)
            log.warning("refused: %s: %s", e.code.name, e, extra={"request_id": request.request_id or None})
            context.abort(e.code, str(e))
        context.add_callback(lambda: self._abort(active))  # client went away (or the call ended)
        deadline = arrival + self.request_timeout_s
        with request_context(rid):
            log.info("admitted: %d prompt tokens, max_tokens %d", len(ids), params.max_tokens)
            try:
                yield from self._generate(active, ids, params, arrival, deadline)
            except RequestError as e:
                metrics.error(e.code)
                log.warning("failed: %s: %s", e.code.name, e)
                self._abort(active)
                context.abort(e.code, str(e))
            finally:
                metrics.close()  # ended without a final message or an error: the client went away
                active.done = True
                with self._lock:
                    if self._active.get(rid) is active:
                        del self._active[rid]

    def Abort(self, request: gen.AbortRequest, context: grpc.ServicerContext) -> gen.AbortResponse:
        try:
            self._check_auth(context)
        except RequestError as e:
            context.abort(e.code, str(e))
        active = self._active.get(request.request_id)
        if active is not None:
            self._abort(active)
        return gen.AbortResponse(found=active is not None)

    def _abort(self, active: _Active, force: bool = False) -> None:
        if active.done and not force:
            return
        active.cancelled = True
        for w in list(active.workers):
            try:
                w.stub.Abort(gen.AbortRequest(request_id=active.request_id), timeout=5.0)
            except grpc.RpcError:
                pass

    # ------------------------------------------------------------------ orchestration
    def _reserve(self, active: _Active, ids: list[int], params: SamplingParams, deadline: float):
        """Reserve on the least-loaded decode worker; wait (bounded) while all are full."""
        rid = active.request_id
        role = "colocated" if self.mode == "colocated" else "decode"
        req = wk.ReserveRequest(request_id=rid, num_prompt_tokens=len(ids), max_tokens=params.max_tokens,
                                sampling=sampling_to_proto(params), token_ids=ids, run_prefill=self.mode == "colocated",
                                transfer_id=f"{rid}-{uuid.uuid4().hex[:12]}")
        delay = 0.01
        while True:
            tried: set[str] = set()
            while (w := self.pool.pick(role, tried)) is not None:
                tried.add(w.worker_id)
                try:
                    resp = w.stub.Reserve(req, timeout=max(0.1, deadline - time.monotonic()))
                    return w, resp.ticket
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                        raise RequestError(e.code(), e.details()) from None
                    if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        log.warning("reserve on %s failed: %s %s", w.worker_id, e.code(), e.details())
            if not tried:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, f"no healthy {role} worker")
            if active.cancelled:
                raise RequestError(grpc.StatusCode.CANCELLED, f"request {rid} was aborted")
            if time.monotonic() + delay > deadline:
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, "no KV capacity before the request deadline")
            time.sleep(delay)
            delay = min(delay * 2, 0.2)

    def _generate(self, active: _Active, ids: list[int], params: SamplingParams, arrival: float, deadline: float):
        rid = active.request_id
        timing = gen.Timing()
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop) if self.tokenizer else None
        decode, ticket = self._reserve(active, ids, params, deadline)
        active.metrics.running()
        log.debug("reserved KV on %s", decode.worker_id)
        active.add_worker(decode, self)
        self.pool.acquire(decode)
        try:
            timing.router_queue_ms = (time.monotonic() - arrival) * 1e3
            stream = decode.stub.Stream(wk.StreamRequest(request_id=rid), timeout=max(0.1, deadline - time.monotonic()))
            emitted = 0
            msg: gen.GenerateResponse | None = None  # built but not yet sent
            token_times: list[float] = []
            finish = ""
            if self.mode != "colocated":
                first = self._prefill(active, ids, params, ticket, deadline)
                timing.prefill_queue_ms = first.prefill_queue_ms
                timing.prefill_compute_ms = first.prefill_compute_ms
                timing.kv_transfer_ms = first.kv_transfer_ms
                token_times.append(time.monotonic())
                active.metrics.tokens(token_times[-1])
                log.debug("first token: %d prompt tokens cached; prefill queue %.1f ms, compute %.1f ms, "
                          "kv transfer %.1f ms", first.num_cached_tokens, first.prefill_queue_ms,
                          first.prefill_compute_ms, first.kv_transfer_ms)
                emitted = 1
                finish = first.finish_reason
                lps = [first.first_token_logprob] if first.HasField("first_token_logprob") else []
                msg, stopped = self._chunk(rid, [first.first_token], lps, detok)
                if stopped:
                    finish = "stop"
                if finish:
                    self._abort(active)
                    stream.cancel()
                else:
                    yield msg
                    msg = None
            if not finish:
                for chunk in stream:
                    if chunk.start_index <= 1 and chunk.decode_queue_ms:
                        timing.decode_queue_ms = chunk.decode_queue_ms
                    skip = max(0, emitted - chunk.start_index)
                    new = list(chunk.token_ids[skip:])
                    lps = list(chunk.logprobs[skip:])
                    if new:
                        msg, stopped = self._chunk(rid, new, lps, detok)
                        token_times.extend([time.monotonic()] * len(msg.token_ids))
                        active.metrics.tokens(token_times[-1])
                        emitted += len(msg.token_ids)
                        if stopped:
                            finish = "stop"
                            self._abort(active)
                            stream.cancel()
                            break
                        if not chunk.finish_reason:
                            yield msg
                            msg = None
                    if chunk.finish_reason:
                        finish = chunk.finish_reason
                        break
                if not finish:
                    raise RequestError(grpc.StatusCode.UNAVAILABLE, f"decode worker {decode.worker_id} ended the stream early")
            final = msg if msg is not None else gen.GenerateResponse(request_id=rid)  # unsent last tokens, if any
            if detok is not None:
                final.text += detok.flush()
            final.finish_reason = finish
            final.usage.prompt_tokens = len(ids)
            final.usage.completion_tokens = emitted
            timing.ttft_ms = (token_times[0] - arrival) * 1e3 if token_times else 0.0
            if self.mode == "colocated":
                timing.prefill_compute_ms = max(0.0, timing.ttft_ms - timing.router_queue_ms - timing.decode_queue_ms)
            if len(token_times) > 1:
                timing.mean_tpot_ms = (token_times[-1] - token_times[0]) / (len(token_times) - 1) * 1e3
            final.timing.CopyFrom(timing)
            active.metrics.finished(final)
            log.info("finished: %s, %d tokens, ttft %.1f ms, e2e %.1f ms", finish, emitted, timing.ttft_ms,
                     active.metrics.e2e_s * 1e3)
            yield final
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.CANCELLED and active.done:
                return
            raise RequestError(grpc.StatusCode.UNAVAILABLE if code != grpc.StatusCode.DEADLINE_EXCEEDED else code,
                               f"request {rid} failed on a worker: {code.name}: {e.details()}") from None
        finally:
            self.pool.release(decode)

    def _prefill(self, active: _Active, ids, params, ticket, deadline) -> wk.PrefillResponse:
        prefill = self.pool.pick("prefill")
        if prefill is None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "no healthy prefill worker")
        active.add_worker(prefill, self)
        log.debug("prefill on %s", prefill.worker_id)
        self.pool.acquire(prefill, len(ids))
        try:
            return prefill.stub.Prefill(
                wk.PrefillRequest(request_id=active.request_id, token_ids=ids, sampling=sampling_to_proto(params),
                                  ticket=ticket),
                timeout=max(0.1, deadline - time.monotonic()),
            )
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


