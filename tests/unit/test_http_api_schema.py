"""OpenAI request bodies -> the router's GenerateRequest, or a 400 naming the field; gRPC statuses ->
HTTP errors; the router's messages -> OpenAI's response and stream shapes. No servers: the HTTP
app itself runs in-process (starlette's TestClient) for what is refused before any gRPC call."""

from __future__ import annotations

import json
import types

import pytest
from starlette.testclient import TestClient

from proto import generate_pb2 as gen
from router.http_api import HttpApi
from router.openai_choices import usage
from router.openai_protocol import ApiError, grpc_error, parse_chat, parse_completion
from router.openai_responses import LogprobFormatter, Output, StreamShaper, response, usage_chunk

MODEL = "builtin:tiny-llama"


def _render(messages):
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


def _chat(**body):
    return parse_chat({"messages": [{"role": "user", "content": "Hi"}], **body}, MODEL, _render)


def _refused(fn, body) -> ApiError:
    with pytest.raises(ApiError) as err:
        fn(body)
    assert err.value.status == 400
    return err.value


def test_completion_maps_to_the_grpc_request():
    req = parse_completion({"model": MODEL, "prompt": "Hello", "max_tokens": 7, "temperature": 0, "top_p": 0.5,
                            "seed": 3, "stop": "x", "logprobs": 2, "user": "u1", "presence_penalty": 0,
                            "stream": True, "stream_options": {"include_usage": True}}, MODEL)
    g = req.grpc
    assert g.text == "Hello" and g.model == MODEL and g.request_id == req.id and req.id.startswith("cmpl-")
    s = g.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, list(s.stop), s.logprobs) == (7, 0.0, 0.5, 3, ["x"], 2)
    assert req.stream and req.include_usage and req.logprobs and not req.chat


def test_penalties_logit_bias_and_min_tokens_map_to_the_grpc_request():
    body = {"prompt": "Hi", "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.25,
            "logit_bias": {"5": -100, "7": 2.5}, "min_tokens": 3}
    s = parse_completion(body, MODEL).grpc.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_tokens) == (0.5, -1.0, 1.25, 3)
    assert dict(s.logit_bias) == {5: -100.0, 7: 2.5}
    c = _chat(**{k: v for k, v in body.items() if k != "prompt"}).grpc.sampling
    assert dict(c.logit_bias) == {5: -100.0, 7: 2.5} and c.min_tokens == 3


def test_unset_fields_stay_unset_for_the_router_defaults():
    s = parse_completion({"prompt": "Hello", "logprobs": False, "temperature": None}, MODEL).grpc.sampling
    assert not any(s.HasField(f) for f in ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs"))


def test_vllm_style_extensions():
    s = parse_completion({"prompt": "a", "top_k": 5, "ignore_eos": True, "stop_token_ids": [2, 9]}, MODEL).grpc.sampling
    assert (s.top_k, s.ignore_eos, list(s.stop_token_ids)) == (5, True, [2, 9])
    assert parse_completion({"prompt": "a", "top_k": -1}, MODEL).grpc.sampling.top_k == 0


@pytest.mark.parametrize("prompt, text, ids", [
    (["Hello"], "Hello", []), ([5, 6, 7], None, [5, 6, 7]), ([[5, 6]], None, [5, 6]),
])
def test_prompt_forms(prompt, text, ids):
    g = parse_completion({"prompt": prompt}, MODEL).grpc
    assert g.WhichOneof("prompt") == ("text" if text else "token_ids")
    assert (g.text if text else list(g.token_ids.ids)) == (text or ids)


@pytest.mark.parametrize("body, param, words", [
    ({}, "prompt", "required"),
    ({"prompt": ["a", 5]}, "prompt", "expected a string"),
    ({"prompt": ["a", [1, -2]]}, "prompt[1]", "token ids"),
    ({"prompt": 5}, "prompt", "expected a string"),
    ({"prompt": [1, -2]}, "prompt", "token ids"),
    ({"prompt": "a", "n": 0}, "n", "integer in [1, 128]"),
    ({"prompt": "a", "n": 2, "best_of": 1}, "best_of", ">= n"),
    ({"prompt": "a", "best_of": 3, "stream": True}, "best_of", "stream"),
    ({"prompt": ["a"] * 65, "n": 2}, "prompt", "65 prompts x 2"),
    ({"prompt": "a", "echo": 1}, "echo", "true or false"),
    ({"prompt": "a", "presence_penalty": "high"}, "presence_penalty", "number"),
    ({"prompt": "a", "frequency_penalty": float("nan")}, "frequency_penalty", "number"),
    ({"prompt": "a", "logit_bias": [5, 1]}, "logit_bias", "object"),
    ({"prompt": "a", "logit_bias": {"x5": 1}}, "logit_bias", "token id"),
    ({"prompt": "a", "logit_bias": {"\u00b2": 1}}, "logit_bias", "token id"),  # a digit, not an ASCII one
    ({"prompt": "a", "logit_bias": {"5": "up"}}, "logit_bias", "number"),
    ({"prompt": "a", "min_tokens": -1}, "min_tokens", "integer"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens", "integer"),
    ({"prompt": "a", "max_tokens": "8"}, "max_tokens", "integer"),
    ({"prompt": "a", "temperature": "hot"}, "temperature", "number"),
    ({"prompt": "a", "temperature": True}, "temperature", "number"),
    ({"prompt": "a", "seed": -1}, "seed", "integer"),
    ({"prompt": "a", "stop": ["x", 3]}, "stop", "strings"),
    ({"prompt": "a", "logprobs": 21}, "logprobs", "[0, 20]"),
    ({"prompt": "a", "stream": "yes"}, "stream", "true or false"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options", "stream: true"),
    ({"prompt": "a", "model": 3}, "model", "string"),
    ({"prompt": "a", "frobnicate": 1}, "frobnicate", "unrecognized"),
])
def test_completion_refusals_name_the_field(body, param, words):
    err = _refused(lambda b: parse_completion(b, MODEL), body)
    assert err.param == param and words in err.message and err.message.startswith(param)
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_a_body_that_is_not_an_object_is_refused():
    assert _refused(lambda b: parse_completion(b, MODEL), ["prompt"]).param is None


def test_chat_renders_the_template_and_maps_its_fields():
    req = parse_chat({"messages": [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                                                {"type": "text", "text": "there"}]}],
                      "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 3}, MODEL, _render)
    assert req.chat and req.id.startswith("chatcmpl-") and req.logprobs
    assert req.grpc.text == "<|system|>\nBe brief.\n<|user|>\nHi there\n<|assistant|>\n"
    assert req.grpc.sampling.max_tokens == 5 and req.grpc.sampling.logprobs == 3
    assert req.max_tokens_field == "max_completion_tokens"
    assert _chat(logprobs=True).grpc.sampling.logprobs == 0  # the sampled token's logprob only
    assert not _chat(logprobs=False).grpc.sampling.HasField("logprobs")
    assert _chat(response_format={"type": "text"}, tools=[], tool_choice="none").grpc.text


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "prompt": "x"}, "prompt"),
    ({}, "messages"),
])
def test_chat_refusals_name_the_field(body, param):
    assert _refused(lambda b: parse_chat(b, MODEL, _render), body).param == param


@pytest.mark.parametrize("code, details, status, param", [
    ("INVALID_ARGUMENT", "sampling: temperature must be a finite number >= 0, got -1.0", 400, "temperature"),
    ("INVALID_ARGUMENT", "sampling: top_p must be in (0, 1], got 2.0", 400, "top_p"),
    ("INVALID_ARGUMENT", "sampling: max_tokens must be an integer >= 1, got 0", 400, "max_tokens"),
    ("INVALID_ARGUMENT", "prompt: prompt has 600 tokens; max_model_len is 512 (...)", 400, "prompt"),
    ("INVALID_ARGUMENT", "unknown fields in request: #9", 400, None),
    ("UNAUTHENTICATED", "missing or invalid API key", 401, None),
    ("NOT_FOUND", "model 'x' is not served here", 404, "model"),
    ("RESOURCE_EXHAUSTED", "no KV capacity before the request deadline", 429, None),
    ("UNAVAILABLE", "no healthy decode worker", 503, None),
    ("DEADLINE_EXCEEDED", "Deadline Exceeded", 504, None),
    ("CANCELLED", "request abc was aborted", 499, None),
    ("INTERNAL", "boom", 500, None),
])
def test_grpc_status_to_http(code, details, status, param):
    err = grpc_error(code, details, parse_completion({"prompt": "a"}, MODEL))
    assert (err.status, err.param, err.message) == (status, param, details)
    assert ("Retry-After" in err.headers) == (status == 429)
    if status == 400 and "max_model_len" in details:
        assert err.code == "context_length_exceeded"


def test_grpc_params_use_the_chat_names():
    req = _chat(max_completion_tokens=3)
    assert grpc_error("INVALID_ARGUMENT", "sampling: max_tokens must be ...", req).param == "max_completion_tokens"
    assert grpc_error("INVALID_ARGUMENT", "prompt: prompt is empty", req).param == "messages"
    assert grpc_error("INVALID_ARGUMENT", "sampling: logprobs must be in [0, 20]", req).param == "top_logprobs"


def _lp(token_id, logprob, top=()):
    return gen.TokenLogprob(token_id=token_id, logprob=logprob, top=[gen.Logprob(token_id=t, logprob=v) for t, v in top])


FMT = lambda: LogprobFormatter(lambda i: f"t{i}")


def test_non_streaming_shapes():
    out = Output()
    out.add(gen.GenerateResponse(text="ab", token_ids=[4, 5], logprobs=[_lp(4, -0.5, [(4, -0.5), (9, -1.0)]),
                                                                         _lp(5, float("-inf"))]))
    out.add(gen.GenerateResponse(text="c", token_ids=[6], finish_reason="length", logprobs=[_lp(6, -0.1)],
                                 usage=gen.Usage(prompt_tokens=3, completion_tokens=3)))
    body = response(parse_completion({"prompt": "a", "logprobs": 1}, MODEL), out, FMT())
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "abc"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    lps = body["choices"][0]["logprobs"]
    assert lps["tokens"] == ["t4", "t5", "t6"] and lps["text_offset"] == [0, 2, 4]
    assert lps["token_logprobs"][1] == -9999.0 and lps["top_logprobs"][0] == {"t4": -0.5, "t9": -1.0}
    json.dumps(body, allow_nan=False)
    chat = response(_chat(logprobs=True, top_logprobs=1), out, FMT())
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"] == {
        "role": "assistant", "content": "abc", "refusal": None}
    entry = chat["choices"][0]["logprobs"]["content"][0]
    assert entry["token"] == "t4" and entry["bytes"] == list(b"t4") and entry["top_logprobs"][1]["token"] == "t9"


def test_chat_stream_opens_with_the_role_and_ends_with_finish_and_usage():
    req = _chat(stream=True, stream_options={"include_usage": True})
    shaper = StreamShaper(req, FMT())
    chunks = shaper.chunks(gen.GenerateResponse(text="He", token_ids=[1]))
    chunks += shaper.chunks(gen.GenerateResponse(text="", token_ids=[2]))  # text held back: no chunk
    chunks += shaper.chunks(gen.GenerateResponse(text="llo", token_ids=[3], finish_reason="stop",
                                                 usage=gen.Usage(prompt_tokens=4, completion_tokens=3)))
    chunks.append(usage_chunk(req, usage(req, [shaper.total])))  # what the event stream ends with
    assert [c["object"] for c in chunks] == ["chat.completion.chunk"] * 5
    deltas = [c["choices"][0]["delta"] if c["choices"] else None for c in chunks]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "He"}, {"content": "llo"}, {}, None]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:4]] == [None, None, None, "stop"]
    assert chunks[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    assert all(c["usage"] is None for c in chunks[:-1]) and len({c["id"] for c in chunks}) == 1


def test_completion_stream_chunks():
    shaper = StreamShaper(parse_completion({"prompt": "a", "stream": True}, MODEL), FMT())
    chunks = shaper.chunks(gen.GenerateResponse(text="x", finish_reason="length"))
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks] == [("x", None),
                                                                                                ("", "length")]
    assert "usage" not in chunks[0]


# ------------------------------------------------------------------ the app, refusing before any gRPC call
@pytest.fixture(scope="module")
def client():
    no_template = types.SimpleNamespace(chat_template=None, bos_token=None, bos_token_id=None)
    api = HttpApi("127.0.0.1:9", MODEL, no_template, api_keys=["k1"])
    with TestClient(api.app) as c:
        yield c


def _error(r, status):
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_app_errors_are_openai_shaped(client):
    auth = {"Authorization": "Bearer k1"}
    assert _error(client.get("/v1/models"), 401)["code"] == "invalid_api_key"
    assert _error(client.get("/v1/models", headers={"Authorization": "Bearer nope"}), 401)["type"] == \
        "authentication_error"
    assert client.get("/v1/models", headers={"x-api-key": "k1"}).json()["data"][0]["id"] == MODEL
    assert client.get(f"/v1/models/{MODEL}", headers=auth).json()["id"] == MODEL
    assert _error(client.get("/v1/models/other", headers=auth), 404)["param"] == "model"
    for raw in (b"{not json", b"", b"\xff\xfe{", b"[" * 100_000):
        e = _error(client.post("/v1/completions", content=raw, headers=auth), 400)
        assert e["code"] == "invalid_json" and "not valid JSON" in e["message"]
    assert _error(client.post("/v1/completions", json={"prompt": "a", "n": 0}, headers=auth), 400)["param"] == "n"
    e = _error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                           headers=auth), 400)
    assert e["param"] == "messages" and e["code"] == "no_chat_template" and "chat template" in e["message"]
    assert _error(client.get("/v1/nothing"), 404)["type"] == "not_found_error"
    assert _error(client.get("/v1/completions"), 405)["message"]

