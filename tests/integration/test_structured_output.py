"""Structured output through the disaggregated cluster (the first token sampled under the mask on the
prefill worker, the rest on the decode worker, whose matcher rebuilds the state from the tokens):
every form of the OpenAI and vLLM fields over HTTP with the `openai` client, valid against its
schema for 200 generated schemas (hypothesis), greedy output equal to the offline engine on every
KV backend, and a decode worker stopped mid-stream: the request resumes elsewhere, still valid and
token-identical."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import threading

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.sampling_params import GuidedDecoding, SamplingParams
from pdcluster.local_cluster import LocalCluster
from tests.integration.openai_helpers import MODEL, builtin_engine, openai_client, serve_openai

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "pop": {"type": "integer", "minimum": 0, "maximum": 9999},
                                            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["city", "pop", "tags"], "additionalProperties": False}
MSGS = [{"role": "user", "content": "Describe a city as JSON."}]


@pytest.fixture(scope="module")
def cluster(builtin_path):
    with serve_openai(builtin_path, num_decode=2) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai_client(cluster)


@pytest.fixture(scope="module")
def llm(builtin_llm):
    return builtin_llm


def test_response_format_json_schema_chat_and_completions_stream_or_not(client):
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    for temperature in (0.0, 1.0):
        r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=128, temperature=temperature,
                                           seed=1, response_format=rf)
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        assert r.choices[0].finish_reason == "stop"
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=MODEL, messages=MSGS, max_tokens=128, temperature=temperature, seed=1, response_format=rf,
            stream=True) if c.choices)
        assert text == r.choices[0].message.content
    c = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=128, temperature=1.0, seed=2,
                                  extra_body={"response_format": rf})
    jsonschema.validate(json.loads(c.choices[0].text), SCHEMA)


@pytest.mark.parametrize("extra, check", [
    ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    ({"structured_outputs": {"regex": r"\d{3}-[a-z]{2,4}"}}, lambda t: re.fullmatch(r"\d{3}-[a-z]{2,4}", t)),
    ({"structured_outputs": {"choice": ["alpha", "beta"]}}, lambda t: t in ("alpha", "beta")),
    ({"structured_outputs": {"grammar": 'root ::= "x" ("," "x")*'}}, lambda t: re.fullmatch(r"x(,x)*", t)),
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
])
def test_every_form_of_the_constraint(client, extra, check):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=128, temperature=1.0, seed=4,
                                       extra_body=extra)
    text = r.choices[0].message.content
    assert check(text), text


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"guided_grammar": "root ::= nothing_defined"}, "guided_grammar"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),  # the second one read
    ({"response_format": {"type": "xml"}}, "response_format"),
])
def test_a_constraint_that_cannot_be_built_is_a_400_naming_the_field(cluster, body, param):
    r = httpx.post(f"http://{cluster.http.address}/v1/chat/completions",
                   json={"model": MODEL, "messages": MSGS, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# ------------------------------------------------------------------ 200 generated schemas
_LEAF = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 500)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
)
_SCHEMA = st.recursive(
    _LEAF,
    lambda inner: st.one_of(
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, inner, st.integers(0, 3)),
        st.dictionaries(st.text("pqrs", min_size=1, max_size=3), inner, min_size=1, max_size=3).map(
            lambda props: {"type": "object", "properties": props, "required": sorted(props),
                           "additionalProperties": False}),
        st.lists(inner, min_size=2, max_size=3).map(lambda alts: {"anyOf": alts}),
    ),
    max_leaves=6,
)
BATCH = 8


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(schemas=st.lists(_SCHEMA, min_size=BATCH, max_size=BATCH))
def test_generated_schemas_are_always_met(cluster, schemas):
    """25 examples x 8 schemas sent at once (decoded together): 200 schemas."""
    def one(i: int) -> None:
        body = {"model": MODEL, "prompt": f"Item {i}:", "max_tokens": 256, "temperature": 1.0, "seed": i,
                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schemas[i]}}}
        r = httpx.post(f"http://{cluster.http.address}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, (schemas[i], r.text)
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", (schemas[i], choice)
        jsonschema.validate(json.loads(choice["text"]), schemas[i])

    with cf.ThreadPoolExecutor(BATCH) as pool:
        for f in [pool.submit(one, i) for i in range(BATCH)]:
            f.result()


# ------------------------------------------------------------------ backends, and a worker stopped mid-stream
def _guided(max_tokens: int = 96) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, guided=GuidedDecoding("json", json.dumps(SCHEMA)))


@pytest.mark.parametrize("backend", ["grpc", "shm", "tcp", "torch_distributed"])
def test_every_kv_backend_equals_the_offline_engine(builtin_path, llm, backend):
    prompts = [[1, 450, 4996, 1735 + i, 1701] for i in range(3)]
    want = [o.token_ids for o in llm.generate(prompts, _guided(), use_tqdm=False)]
    kv = {"kv_backend": backend}
    with LocalCluster(builtin_engine(builtin_path), 1, 1, prefill={"kv_timeout_s": 10.0, **kv}, decode=kv,
                      router={"request_timeout_s": 60}) as c, c.client() as client:
        got = [client.complete(p, _guided()).token_ids for p in prompts]
    assert got == want
    tok = c.router.tokenizer
    for ids in got:
        jsonschema.validate(json.loads(tok.decode(ids, skip_special_tokens=True)), SCHEMA)


def test_a_decode_worker_stopped_mid_stream_resumes_valid_and_identical(builtin_path, llm):
    long = {"type": "array", "items": {"type": "integer", "minimum": 100, "maximum": 999}, "minItems": 30,
            "maxItems": 30}
    params = SamplingParams(max_tokens=200, temperature=0.0, guided=GuidedDecoding("json", json.dumps(long)))
    prompt = [1, 450, 4996, 1735, 1701]
    want = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    with LocalCluster(builtin_engine(builtin_path), 1, 2, router={"request_timeout_s": 60, "max_retries": 2}) as c, \
            c.client() as client:
        got, stopped = [], threading.Event()
        for chunk in client.stream(prompt, params):
            got += chunk.token_ids
            if len(got) >= 10 and not stopped.is_set():
                busy = next(w for w in c.decode_workers if w.stats().running)
                busy.stop()
                stopped.set()
        assert stopped.is_set() and got == want
        assert c.router.metrics.retries._value.get() >= 1
    values = json.loads(c.router.tokenizer.decode(got, skip_special_tokens=True))
    jsonschema.validate(values, long)


# ------------------------------------------------------------------ tool calls
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_calls_always_parse_against_their_schemas(client, stream):
    params = {WEATHER["function"]["name"]: WEATHER["function"]["parameters"],
              CLOCK["function"]["name"]: CLOCK["function"]["parameters"]}
    for seed, choice in enumerate(["required", {"type": "function", "function": {"name": "get_time"}}] * 3):
        kw = {"model": MODEL, "messages": MSGS, "max_tokens": 160, "temperature": 1.0, "seed": seed,
              "tools": [WEATHER, CLOCK], "tool_choice": choice}
        if not stream:
            r = client.chat.completions.create(**kw)
            calls, reason = r.choices[0].message.tool_calls, r.choices[0].finish_reason
        else:
            chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
            calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
            reason = chunks[-1].choices[0].finish_reason
            assert all(not c.choices[0].delta.content for c in chunks)
        assert reason == "tool_calls" and calls
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
        if isinstance(choice, dict):
            assert [c.function.name for c in calls] == ["get_time"]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_a_call_the_model_writes(client, stream):
    """tool_choice auto: the built-in model never writes a call by itself, so a regex makes it write
    text before one and the call; the answer is that text as content and the call in OpenAI's shape."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>'
    kw = {"model": MODEL, "messages": MSGS, "max_tokens": 120, "temperature": 0.0, "tools": [WEATHER, CLOCK],
          "tool_choice": "auto", "extra_body": {"structured_outputs": {"regex": "Let me check\\. " + re.escape(call)}}}
    if not stream:
        r = client.chat.completions.create(**kw)
        msg, reason = r.choices[0].message, r.choices[0].finish_reason
        content, calls = msg.content, msg.tool_calls
    else:
        chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
        reason = chunks[-1].choices[0].finish_reason
    assert reason == "tool_calls" and content.strip() == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2})]
    assert calls[0].id and calls[0].type == "function"


STRICT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                            "n": {"type": "integer", "minimum": -999, "maximum": 999},
                                            "tags": {"type": "array", "maxItems": 3,
                                                     "items": {"type": "string", "maxLength": 6}}},
          "required": ["name", "n", "tags"], "additionalProperties": False}
FORMS = [{"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": STRICT, "strict": True}}},
         {"structured_outputs": {"json": STRICT}}, {"guided_json": STRICT},
         {"tools": [{"type": "function", "function": {"name": "f", "parameters": STRICT}}],
          "tool_choice": {"type": "function", "function": {"name": "f"}}},
         {"response_format": {"type": "json_object"}}]


def test_every_json_form_parses_strictly_at_any_temperature_and_seed(cluster):
    """Seeds 0-9 at temperatures 0.7, 1.0 and 1.3, each JSON form in turn, through the disaggregated
    cluster: strict json.loads (no control character in a string) and the schema."""
    url = f"http://{cluster.http.address}/v1/chat/completions"
    for i, (temperature, seed) in enumerate((t, s) for t in (0.7, 1.0, 1.3) for s in range(10)):
        form = FORMS[i % len(FORMS)]
        r = httpx.post(url, timeout=120, json={"model": MODEL, "messages": MSGS, "max_tokens": 120,
                                               "temperature": temperature, "seed": seed, **form})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        msg, any_object = choice["message"], "json_object" in json.dumps(form)
        if any_object and choice["finish_reason"] == "length":
            continue  # an object of any size may run past max_tokens
        assert choice["finish_reason"] in ("stop", "tool_calls"), (form, choice)
        text = msg["tool_calls"][0]["function"]["arguments"] if "tools" in form else msg["content"]
        value = json.loads(text)
        assert isinstance(value, dict)
        if not any_object:
            jsonschema.validate(value, STRICT)
