"""Several choices in one OpenAI request, end to end through a disaggregated cluster (router, prefill
and decode worker as gRPC servers, HTTP API, the official `openai` client): a list of prompts, n,
best_of, echo; each choice equals the request it stands for; the later choices of a prompt reuse
its KV (prefix-cache hits on both workers, fewer KV bytes moved); a client that leaves mid-stream
frees every choice's blocks."""

from __future__ import annotations

import json
import socket
import time

import openai
import pytest

from pdcluster import LLM, SamplingParams
from pdcluster.local_cluster import LocalCluster
from tests.integration.openai_helpers import MODEL, openai_client

pytestmark = pytest.mark.slow

N = 8
PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def client(openai_cluster):
    return openai_client(openai_cluster)


def _greedy(llm: LLM, prompt: str | list[int]) -> str:
    p = {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt
    return llm.generate([p], SamplingParams(temperature=0, max_tokens=N), use_tqdm=False)[0].text


def _idle(openai_cluster: LocalCluster, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        d, p = openai_cluster.decode_workers[0].stats(), openai_cluster.prefill_workers[0].stats()
        if d.kv_blocks_used == p.kv_blocks_used == d.running == d.queued == 0 and not openai_cluster.router._active:
            return
        time.sleep(0.05)
    pytest.fail(f"still busy after {timeout}s: {openai_cluster.decode_workers[0].stats()}")


def test_a_list_of_prompts_answers_each_as_alone(client, openai_cluster, builtin_llm):
    refs = [_greedy(builtin_llm, p) for p in PROMPTS]
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=N, temperature=0)
    assert [(c.index, c.text) for c in r.choices] == list(enumerate(refs))
    ids = [openai_cluster.router.tokenizer.encode(p) for p in PROMPTS]
    assert r.usage.prompt_tokens == sum(map(len, ids)) and r.usage.completion_tokens == 3 * N
    chunks = list(client.completions.create(model=MODEL, prompt=[ids[0], ids[2]], max_tokens=N, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    texts = ["", ""]
    for c in chunks[:-1]:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == [refs[0], refs[2]] and chunks[-1].usage.completion_tokens == 2 * N
    _idle(openai_cluster)


def test_n_choices_are_the_seeded_requests_they_stand_for_and_share_the_prompt_kv(client, openai_cluster):
    prompt = "In a hole in the ground there lived a hobbit. " * 4  # several full KV blocks
    alone = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=N, temperature=1.0, seed=11 + k)
             .choices[0].text for k in range(3)]
    d0, p0 = openai_cluster.decode_workers[0].stats(), openai_cluster.prefill_workers[0].stats()
    r = client.completions.create(model=MODEL, prompt=prompt + "Again:", max_tokens=N, temperature=1.0, seed=11, n=3)
    d1, p1 = openai_cluster.decode_workers[0].stats(), openai_cluster.prefill_workers[0].stats()
    assert len(r.choices) == 3 and [c.index for c in r.choices] == [0, 1, 2]
    # the 2nd and 3rd choices found the first's prompt blocks cached (the prefill worker's prefix
    # cache, the decode worker's shared blocks): the prompt's full blocks are not moved again
    new_prompt = len(openai_cluster.router.tokenizer.encode(prompt + "Again:"))
    assert p1.prefix_cache_hit_tokens - p0.prefix_cache_hit_tokens >= 2 * (new_prompt // 16 - 1) * 16
    assert d1.kv_bytes_not_sent > d0.kv_bytes_not_sent
    same = client.completions.create(model=MODEL, prompt=prompt, max_tokens=N, temperature=1.0, seed=11, n=3)
    assert [c.text for c in same.choices] == alone  # choice k samples as a request with seed 11 + k
    _idle(openai_cluster)


def test_best_of_returns_the_choices_of_highest_cumulative_logprob(client, openai_cluster):
    kw = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": N, "temperature": 1.0, "seed": 3}
    all4 = client.completions.create(**kw, n=4, logprobs=0).choices
    score = {c.text: sum(c.logprobs.token_logprobs) for c in all4}
    best = client.completions.create(**kw, n=2, best_of=4).choices
    assert [c.text for c in best] == sorted(score, key=lambda t: -score[t])[:2] and best[0].logprobs is None
    _idle(openai_cluster)


def test_echo_puts_the_prompt_before_the_text(client, openai_cluster, builtin_llm):
    ref = _greedy(builtin_llm, PROMPTS[1])
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=N, temperature=0, echo=True)
    assert r.choices[0].text == PROMPTS[1] + ref
    ids = openai_cluster.router.tokenizer.encode(PROMPTS[1])
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=N, temperature=0, echo=True,
                                            stream=True))
    assert chunks[0].choices[0].text == openai_cluster.router.tokenizer.decode(ids)
    assert "".join(c.choices[0].text for c in chunks[1:]) == ref


def test_chat_n_streams_each_choice_with_its_index(client, openai_cluster, builtin_llm):
    msgs = [{"role": "user", "content": "Tell me a story"}]
    text = openai_cluster.router.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ref = _greedy(builtin_llm, text)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=N, temperature=0, n=2)
    assert [c.message.content for c in r.choices] == [ref, ref]
    contents = {0: "", 1: ""}
    roles = set()
    for c in client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=N, temperature=0, n=2,
                                            stream=True):
        choice = c.choices[0]
        if choice.delta.role == "assistant":
            roles.add(choice.index)
        contents[choice.index] += choice.delta.content or ""
    assert contents == {0: ref, 1: ref} and roles == {0, 1}


def test_a_client_leaving_mid_stream_frees_every_choice(openai_cluster):
    body = json.dumps({"model": MODEL, "prompt": PROMPTS, "n": 2, "max_tokens": 400, "ignore_eos": True,
                       "temperature": 0, "stream": True}).encode()
    host, port = openai_cluster.http.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    seen = b""
    while seen.count(b"data: ") < 20:
        seen += sock.recv(4096)
    assert openai_cluster.decode_workers[0].stats().running >= 2
    sock.close()
    _idle(openai_cluster, timeout=10.0)


def test_echo_with_logprobs_gives_the_prompt_tokens_logprobs_first(client, openai_cluster, builtin_llm):
    ids = openai_cluster.router.tokenizer.encode(PROMPTS[2])
    ref = builtin_llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=N, logprobs=2, prompt_logprobs=2),
                       use_tqdm=False)[0]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=N, temperature=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    tok = openai_cluster.router.tokenizer
    assert lp.tokens == [tok.decode([t]) for t in ids + ref.token_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [x.logprob for x in ref.prompt_logprobs] + [x.logprob for x in ref.logprobs]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-3)
    assert r.choices[0].text == PROMPTS[2] + ref.text and lp.text_offset == sorted(lp.text_offset)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=N, temperature=0, echo=True,
                                            logprobs=2, stream=True))
    head = chunks[0].choices[0]
    assert head.text == PROMPTS[2] and head.logprobs.token_logprobs[1:] == pytest.approx(want[:len(ids) - 1], abs=1e-3)


def test_vllm_prompt_logprobs_field_on_every_choice_and_on_chat(client, openai_cluster, builtin_llm):
    ids = openai_cluster.router.tokenizer.encode(PROMPTS[1])
    want = builtin_llm.generate([ids], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2),
                        use_tqdm=False)[0].prompt_logprobs
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=2, temperature=0, n=2,
                                  extra_body={"prompt_logprobs": 2})
    for choice in r.choices:
        got = choice.model_extra["prompt_logprobs"]
        assert got[0] is None and len(got) == len(ids)
        for entry, w in zip(got[1:], want):
            mine = entry[str(w.token_id)]
            assert mine["rank"] == w.rank and mine["logprob"] == pytest.approx(w.logprob, abs=1e-4)
            assert set(entry) == {str(w.token_id)} | {str(t) for t, _ in w.top}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    got = chat.model_extra["prompt_logprobs"]
    assert got[0] is None and all(len(e) == 1 for e in got[1:])
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, stream=True, extra_body={"prompt_logprobs": 1})
    _idle(openai_cluster)
