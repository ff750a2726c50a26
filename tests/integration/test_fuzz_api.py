"""Property-based fuzzing (hypothesis) of the public APIs: the router's gRPC Generate (well-typed messages
with out-of-range values, and raw bytes) and the OpenAI HTTP API (any JSON, near-valid bodies, raw
bytes, lone surrogates, oversized bodies). Never a crash, a 5xx or INTERNAL / UNKNOWN: always a 4xx or
INVALID_ARGUMENT naming the field; afterwards the cluster serves a valid request exactly as before and
holds no KV block. Real gRPC servers of the workers and the router in this process (no Ray)."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from pdcluster.client import Client
from pdcluster.local_cluster import LocalCluster
from proto import generate_pb2 as gen
from proto import generate_pb2_grpc as gen_grpc
from router.http_api import MAX_BODY_BYTES
from router.openai_protocol import CHAT_FIELDS, COMPLETION_FIELDS

pytestmark = pytest.mark.slow

MODEL = "builtin:tiny-llama"
MAX_LEN = 48  # every valid fuzzed request ends within this many tokens
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
# INVALID_ARGUMENT details start with the field they are about
FIELDS = ("prompt", "sampling", "request_id", "request:", "unknown fields", "model")
GRPC_REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED}


@pytest.fixture(scope="module")
def stack(builtin_path):
    cfg = EngineConfig(model=str(builtin_path), num_blocks=128, max_model_len=MAX_LEN, num_threads=1)
    c = LocalCluster(cfg, router={"model": MODEL, "request_timeout_s": 30}, http={})
    router, api, (prefill, decode) = c.router, c.http, c.workers
    channel = grpc.insecure_channel(router.address)
    with Client(router.address) as client:
        expected = client.complete("Once upon a time", max_tokens=8, temperature=0.0, ignore_eos=True).token_ids
    yield router, api, gen_grpc.PDClusterStub(channel), channel, expected
    channel.close()
    c.stop()
    assert decode.stats().kv_blocks_used == 0 and prefill.stats().kv_blocks_used == 0


def _still_serving(stack) -> None:
    router, api, _, _, expected = stack
    with Client(router.address) as client:
        assert client.complete("Once upon a time", max_tokens=8, temperature=0.0, ignore_eos=True).token_ids == expected
    r = httpx.post(f"http://{api.address}/v1/completions", timeout=30,
                   json={"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


# ------------------------------------------------------------------------------------------------ gRPC
U32, I32, U64 = st.integers(0, 2**32 - 1), st.integers(-(2**31), 2**31 - 1), st.integers(0, 2**64 - 1)
FLOATS = st.floats(width=32) | st.sampled_from([0.0, 0.5, 1.0, -1.0])


def _maybe(s):
    return st.none() | s


SAMPLING = st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(0, 8) | U32, "temperature": FLOATS, "top_p": FLOATS, "top_k": I32, "seed": U64,
    "stop": st.lists(st.text(max_size=12), max_size=4) | st.lists(st.just("x"), min_size=17, max_size=20),
    "stop_token_ids": st.lists(U32, max_size=4), "ignore_eos": st.booleans(), "logprobs": st.integers(0, 25) | U32,
})
REQUEST = st.fixed_dictionaries({"sampling": SAMPLING}, optional={
    "request_id": st.text(max_size=40) | st.text(min_size=250, max_size=300),
    "text": st.text(max_size=200) | st.text(min_size=2000, max_size=3000),
    "token_ids": st.lists(st.integers(0, 9000) | U32, max_size=60),
    "model": st.sampled_from(["", MODEL, "gpt-17"]) | st.text(max_size=8),
})


def _grpc_request(d: dict) -> gen.GenerateRequest:
    req = gen.GenerateRequest(sampling=gen.SamplingParams(**d["sampling"]))
    if "request_id" in d:
        req.request_id = d["request_id"]
    if "model" in d:
        req.model = d["model"]
    if "token_ids" in d:
        req.token_ids.ids.extend(d["token_ids"])
    if "text" in d:  # the oneof: the later one wins
        req.text = d["text"]
    return req


def _check_grpc(call) -> None:
    try:
        chunks = list(call())
        assert chunks and chunks[-1].finish_reason in ("stop", "length")
    except grpc.RpcError as e:
        assert e.code() in GRPC_REFUSALS, (e.code(), e.details())
        if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
            assert e.details().startswith(FIELDS), e.details()


def test_fuzzed_generate_requests_are_served_or_refused_naming_the_field(stack):
    _, _, stub, _, _ = stack

    @FUZZ
    @given(REQUEST)
    def check(d):
        _check_grpc(lambda: stub.Generate(_grpc_request(d), timeout=30))

    check()
    _still_serving(stack)


def test_fuzzed_bytes_are_refused_as_invalid_argument(stack):
    _, _, _, channel, _ = stack
    raw = channel.unary_stream("/pdcluster.v1.PDCluster/Generate", request_serializer=lambda b: b,
                               response_deserializer=gen.GenerateResponse.FromString)
    abort = channel.unary_unary("/pdcluster.v1.PDCluster/Abort", request_serializer=lambda b: b,
                                response_deserializer=gen.AbortResponse.FromString)
    valid = _grpc_request({"sampling": {"max_tokens": 2}, "text": "hello"}).SerializeToString()

    @FUZZ
    @given(st.binary(max_size=64) | st.builds(lambda b, i: valid[:i] + b + valid[i:], st.binary(max_size=8),
                                              st.integers(0, len(valid))))
    def check(data):
        _check_grpc(lambda: raw(data, timeout=30))
        try:
            abort(data, timeout=10)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith("request:"), e

    check()
    with pytest.raises(grpc.RpcError) as err:  # invalid UTF-8 in a string field
        list(raw(b"\x12\x02\xff\xfe", timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "GenerateRequest" in err.value.details()
    _still_serving(stack)


# ------------------------------------------------------------------------------------------------ HTTP
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                    max_leaves=12)
EDGE = (st.sampled_from([0, -1, 1, 2, 0.5, 1.5, 21, 2**32, 2**64, -(2**63), 1e300, float("nan"), "", "x", True, None,
                         [], {}, [1, 2], ["a"], {"include_usage": True}])
        | st.integers() | st.floats() | st.text(max_size=8) | JSON)
SURROGATE = st.text(st.characters(categories=["Cs"]), min_size=1, max_size=3)


def _body(fields: frozenset[str], base: dict) -> st.SearchStrategy:
    values = {name: EDGE for name in sorted(fields)}
    values["max_tokens"] = st.integers(-2, 8) | EDGE
    return st.builds(lambda extra, junk: {**base, **extra, **junk},
                     st.fixed_dictionaries({}, optional=values),
                     st.dictionaries(st.sampled_from(["n", "best_of", "tools", "bogus", "logit_bias", "echo"]), EDGE,
                                     max_size=1))


MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", ""]) | EDGE,
                                           "content": st.text(max_size=20) | EDGE}), max_size=3) | EDGE
BODIES = (
    st.tuples(st.just("/v1/completions"), _body(COMPLETION_FIELDS, {"prompt": "Hi"}))
    | st.tuples(st.just("/v1/completions"), _body(COMPLETION_FIELDS, {}))
    | st.tuples(st.just("/v1/chat/completions"),
                st.builds(lambda b, m: {**b, "messages": m}, _body(CHAT_FIELDS, {}), MESSAGES))
    | st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), JSON)
    | st.tuples(st.just("/v1/completions"), st.builds(lambda s: {"prompt": s}, SURROGATE))
    | st.tuples(st.just("/v1/completions"), st.builds(lambda s: {"prompt": "Hi", "stop": [s]}, SURROGATE))
)


def _check_http(r: httpx.Response, body: object) -> None:
    assert r.status_code < 500, (r.status_code, r.text, body)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and err["type"], r.text
        param = err["param"]
        if param is not None and isinstance(body, dict):  # the field named is one the body has
            names = (*body, "prompt", "messages", "top_logprobs")
            assert any(param == k or param.startswith((f"{k}.", f"{k}[")) for k in names), (param, body)
    elif r.headers["content-type"].startswith("application/json"):
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_fuzzed_http_bodies_get_4xx_naming_the_field_never_5xx(stack):
    _, api, _, _, _ = stack

    @FUZZ
    @given(BODIES)
    def check(case):
        path, body = case
        with httpx.Client(base_url=f"http://{api.address}", timeout=30) as http:
            r = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
            _check_http(r, body)

    check()
    _still_serving(stack)


def test_bytes_oversized_and_deep_bodies_are_4xx(stack):
    _, api, _, _, _ = stack
    url = f"http://{api.address}/v1/completions"

    @FUZZ
    @given(st.binary(max_size=64))
    def check(data):
        r = httpx.post(url, content=data, timeout=30)
        assert 400 <= r.status_code < 500 and r.json()["error"]["message"], (r.status_code, r.text)

    check()
    r = httpx.post(url, content=b"x" * (MAX_BODY_BYTES + 1), timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    big = json.dumps({"prompt": "a" * (MAX_BODY_BYTES // 2)}).encode()
    r = httpx.post(url, content=big, timeout=30)  # under the body limit, over what max_model_len allows
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(url, content=b"[" * 100_000 + b"]" * 100_000, timeout=30)
    assert r.status_code == 400
    _still_serving(stack)
