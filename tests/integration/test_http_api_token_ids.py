"""`return_token_ids` end to end: the OpenAI API in front of a real router, prefill and decode worker
(in this process) returns the same greedy token ids as the router's own gRPC API, streamed or not,
and the prompt's ids for a token-id prompt."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

from engine.config import EngineConfig
from pdcluster.local_cluster import LocalCluster
from proto import generate_pb2 as gen
from proto import generate_pb2_grpc as gen_grpc

pytestmark = pytest.mark.slow

MODEL = "builtin:tiny-llama"
N = 10
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def cluster(builtin_path):
    cfg = EngineConfig(model=str(builtin_path), num_blocks=128, max_model_len=512, num_threads=1)
    with LocalCluster(cfg, router={"model": MODEL, "request_timeout_s": 30}, http={}) as c:
        yield c


def _grpc_ids(cluster: LocalCluster, prompt: str | list[int]) -> list[int]:
    req = gen.GenerateRequest(sampling=gen.SamplingParams(max_tokens=N, temperature=0))
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    with grpc.insecure_channel(cluster.address) as ch:
        return [t for msg in gen_grpc.PDClusterStub(ch).Generate(req, timeout=60) for t in msg.token_ids]


def _post(cluster: LocalCluster, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{cluster.url}/v1/{path}", json={"model": MODEL, "max_tokens": N, "temperature": 0, **body},
                      timeout=60)


def _stream(cluster: LocalCluster, path: str, body: dict) -> list[dict]:
    r = _post(cluster, path, {**body, "stream": True})
    assert r.status_code == 200, r.text
    data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_completion_token_ids_equal_the_grpc_api(cluster):
    prompt_ids = cluster.router.tokenizer.encode(PROMPT)
    want = _grpc_ids(cluster, prompt_ids)
    assert len(want) == N
    r = _post(cluster, "completions", {"prompt": prompt_ids, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == want and choice["prompt_token_ids"] == prompt_ids
    assert choice["text"] == cluster.router.tokenizer.decode(want, skip_special_tokens=True)
    chunks = _stream(cluster, "completions", {"prompt": prompt_ids, "return_token_ids": True})
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == want
    assert chunks[0]["choices"][0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    # a text prompt: the same answer's ids
    text = _post(cluster, "completions", {"prompt": PROMPT, "return_token_ids": True}).json()
    assert text["choices"][0]["token_ids"] == _grpc_ids(cluster, PROMPT) == want
    assert text["choices"][0]["prompt_token_ids"] == prompt_ids  # tokenized as the router does


def test_chat_token_ids_equal_the_grpc_api(cluster):
    messages = [{"role": "user", "content": "Tell me a story"}]
    rendered = cluster.router.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    bos = cluster.router.tokenizer.bos_token
    text = rendered.removeprefix(bos) if bos else rendered
    want = _grpc_ids(cluster, text)
    r = _post(cluster, "chat/completions", {"messages": messages, "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want
    assert r.json()["prompt_token_ids"] == cluster.router.tokenizer.encode(text)
    chunks = _stream(cluster, "chat/completions", {"messages": messages, "return_token_ids": True})
    assert [t for c in chunks if c["choices"] for t in c["choices"][0]["token_ids"]] == want
    assert "prompt_token_ids" in chunks[0] and all("prompt_token_ids" not in c for c in chunks[1:])


def test_without_the_field_nothing_changes_and_a_bad_value_is_a_400(cluster):
    r = _post(cluster, "completions", {"prompt": PROMPT})
    assert r.status_code == 200 and "token_ids" not in r.json()["choices"][0]
    bad = _post(cluster, "completions", {"prompt": PROMPT, "return_token_ids": "yes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "return_token_ids"
