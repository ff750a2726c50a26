"""/tokenize and /detokenize (vLLM's shape) on the HTTP app in-process: they need only the
tokenizer, no router. Chat bodies tokenize as a chat completion of the same messages generates."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from engine.tokenizer import load_tokenizer
from router.http_api import HttpApi

MODEL = "builtin:tiny-llama"


@pytest.fixture(scope="module")
def api(builtin_path):
    api = HttpApi("127.0.0.1:9", MODEL, load_tokenizer(builtin_path), max_model_len=512)
    with TestClient(api.app) as c:
        yield api, c


def test_tokenize_a_prompt_and_back(api):
    api, c = api
    tok = api.tokenizer
    r = c.post("/tokenize", json={"model": MODEL, "prompt": "Hello world", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    bare = c.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
    assert bare["tokens"] == tok.encode("Hello world", add_special_tokens=False) and bare["token_strs"] is None
    assert c.post("/detokenize", json={"tokens": bare["tokens"]}).json() == {"prompt": "Hello world"}


def test_tokenize_chat_messages_as_a_chat_completion_renders_them(api):
    api, c = api
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    r = c.post("/tokenize", json={"messages": msgs}).json()
    assert r["tokens"] == api.tokenizer.encode(api._render([{"role": "user", "content": "Hi"}]))


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "bogus": 1}, "bogus"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False},
     "add_generation_prompt"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
])
def test_bad_bodies_are_400_naming_the_field(api, path, body, param):
    r = api[1].post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
