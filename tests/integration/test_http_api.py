"""The OpenAI-compatible HTTP API end to end: the official `openai` client, curl and raw HTTP against
HttpApi in front of a real router, prefill and decode worker (gRPC servers in this process, no Ray),
compared with the offline `LLM`; every error status; a client that disconnects frees the KV blocks.
One test brings a cluster up through the launcher (Ray) and asks its HTTP API for the models."""

from __future__ import annotations

import dataclasses
import json
import shutil
import socket
import subprocess
import time

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from decode_worker.server import DecodeWorkerServer
from engine.config import EngineConfig
from pdcluster import LLM, SamplingParams
from pdcluster.local_cluster import LocalCluster
from prefill_worker.server import PrefillWorkerServer
from proto import generate_pb2 as gen
from proto import generate_pb2_grpc as gen_grpc
from proto import worker_pb2 as wk
from proto import worker_pb2_grpc as wk_grpc
from proto.serving import bind_server
from router.http_api import HttpApi, router_metrics, router_readiness
from router.server import RouterServer

pytestmark = pytest.mark.slow

MODEL = "builtin:tiny-llama"
N = 12
PROMPT = "Once upon a time"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story 📖"}]


@dataclasses.dataclass
class Stack:
    prefill: PrefillWorkerServer
    decode: DecodeWorkerServer
    router: RouterServer
    api: HttpApi

    @property
    def workers(self) -> list[tuple[str, str, str]]:
        return [("prefill-0", "prefill", self.prefill.address), ("decode-0", "decode", self.decode.address)]

    @property
    def url(self) -> str:
        return f"http://{self.api.address}"


def _front(router: RouterServer, **kwargs) -> HttpApi:
    api = HttpApi(router.address, MODEL, router.tokenizer, readiness=router_readiness(router),
                  metrics=router_metrics(router), **kwargs)
    api.start()
    return api


@pytest.fixture(scope="module")
def stack(builtin_path):
    cfg = EngineConfig(model=str(builtin_path), num_blocks=128, max_model_len=512, num_threads=1)
    with LocalCluster(cfg, router={"model": MODEL, "request_timeout_s": 30}, http={}) as c:
        yield Stack(c.prefill_workers[0], c.decode_workers[0], c.router, c.http)


@pytest.fixture(scope="module")
def spare(stack):
    """A second router (1 s request deadline) whose workers each test sets: none -> 503, full -> 429."""
    router = RouterServer(MODEL, max_model_len=512, request_timeout_s=1.0)
    api = _front(router)
    yield router, f"http://{api.address}"
    api.stop()
    router.stop()


@pytest.fixture(scope="module")
def llm(builtin_path):
    return LLM(str(builtin_path), max_model_len=512, num_blocks=128)


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _reference(llm: LLM, prompt: str, n: int = N, logprobs: int | None = None):
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, logprobs=logprobs), use_tqdm=False)[0]


def _rendered(stack: Stack) -> str:
    return stack.router.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)


def _idle(stack: Stack, timeout: float = 5.0) -> float:
    """Seconds until both workers hold no KV blocks and run nothing (fails after `timeout`)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        d, p = stack.decode.stats(), stack.prefill.stats()
        if d.kv_blocks_used == p.kv_blocks_used == d.running == d.queued == 0:
            return time.monotonic() - start
        time.sleep(0.05)
    pytest.fail(f"workers still busy after {timeout}s: decode {stack.decode.stats()}, prefill {stack.prefill.stats()}")


# ------------------------------------------------------------------ generation
def test_completion_greedy_equals_the_offline_llm(client, stack, llm):
    ref = _reference(llm, PROMPT)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(ref.prompt_token_ids), N, len(ref.prompt_token_ids) + N)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == N
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)


def test_chat_greedy_equals_the_offline_llm_on_the_rendered_template(client, stack, llm):
    ref = _reference(llm, _rendered(stack))
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=N, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.usage.completion_tokens == N
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=N, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == len(ref.prompt_token_ids) + N
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_logprobs_in_openai_shape(client, stack, llm):
    ref = _reference(llm, PROMPT, logprobs=2)
    lp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, logprobs=2).choices[0].logprobs
    tok = stack.router.tokenizer
    assert lp.tokens == [tok.decode([x.token_id]) for x in ref.logprobs]
    assert lp.token_logprobs == pytest.approx([x.logprob for x in ref.logprobs], abs=1e-3)
    assert all(len(top) <= 2 and t in top for t, top in zip(lp.tokens, lp.top_logprobs))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=3).choices[0]
    content = chat.logprobs.content
    assert len(content) == 4 and "".join(c.token for c in content) == chat.message.content
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 and bytes(c.bytes).decode() == c.token for c in content)


def test_stop_string_and_seed(client, llm):
    text = _reference(llm, PROMPT).text
    stop = text.split()[2]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[: text.index(stop)]
    a, b = (client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=1.0, seed=7)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text


def test_curl_streams_server_sent_events(stack):
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True})
    out = subprocess.run([curl, "-sN", f"{stack.url}/v1/completions", "-H", "Content-Type: application/json",
                          "-d", body], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    events = out.stdout.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2]) and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_models_and_health(client, stack, spare):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(f"{stack.url}/health").json() == {"status": "ok"}
    router, url = spare
    router.set_workers([])
    r = httpx.get(f"{url}/health")
    assert r.status_code == 503 and "no healthy prefill or decode worker" in r.json()["reason"]


def _samples(url: str) -> dict[tuple[str, tuple], float]:
    r = httpx.get(f"{url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def test_metrics_parse_and_move_after_requests(client, stack):
    before = _samples(stack.url)
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0, stream=True))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=-1)
    after = _samples(stack.url)
    moved = lambda name, **labels: after.get((name, tuple(sorted(labels.items()))), 0) - before.get(  # noqa: E731
        (name, tuple(sorted(labels.items()))), 0)
    assert moved("pdcluster_time_to_first_token_seconds_count") == 2
    assert moved("pdcluster_requests_finished_total", finish_reason="length") == 2
    assert moved("pdcluster_generation_tokens_total") == 7
    assert moved("pdcluster_request_errors_total", code="INVALID_ARGUMENT") == 1
    assert any(name == "pdcluster_worker_kv_blocks_free" for name, _ in after)


# ------------------------------------------------------------------ errors
def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_bad_requests_are_400_naming_the_field(stack):
    url = f"{stack.url}/v1/completions"
    e = _error(httpx.post(url, json={"model": MODEL, "prompt": PROMPT, "temperature": -1}), 400)
    assert e["param"] == "temperature" and "temperature must be" in e["message"]
    e = _error(httpx.post(url, json={"model": MODEL, "prompt": PROMPT, "suffix": "end"}), 400)
    assert e["param"] == "suffix" and "not supported" in e["message"]
    e = _error(httpx.post(url, content=b'{"model": "x", "prompt": ', headers={"Content-Type": "application/json"}), 400)
    assert e["code"] == "invalid_json" and e["param"] is None
    e = _error(httpx.post(url, json={"model": MODEL}), 400)
    assert e["param"] == "prompt" and "required" in e["message"]
    e = _error(httpx.post(url, json={"prompt": "Once upon a time " * 200}), 400)  # tokenized by the router: too long
    assert e["param"] == "prompt" and e["code"] == "context_length_exceeded"
    e = _error(httpx.post(f"{stack.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": 1}]}), 400)
    assert e["param"] == "messages[0].content"


def test_openai_client_sees_the_errors(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, top_p=0)
    assert err.value.status_code == 400 and err.value.param == "top_p"
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt=PROMPT)
    assert err.value.code == "model_not_found" and "no-such-model" in err.value.message


def test_api_keys_401_here_and_at_the_router(stack):
    router = RouterServer(MODEL, max_model_len=512, request_timeout_s=30, api_keys=["k1"])
    router.set_workers(stack.workers)
    api = _front(router, api_keys=["k1", "k2"])  # k2 passes HTTP but not the router: the key is forwarded
    try:
        url, body = f"http://{api.address}/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
        assert _error(httpx.post(url, json=body), 401)["code"] == "invalid_api_key"
        assert _error(httpx.get(f"http://{api.address}/v1/models", headers={"x-api-key": "nope"}), 401)
        e = _error(httpx.post(url, json=body, headers={"Authorization": "Bearer k2"}), 401)
        assert "API key" in e["message"] and e["type"] == "authentication_error"
        assert httpx.post(url, json=body, headers={"Authorization": "Bearer k1"}).status_code == 200
        assert httpx.post(url, json=body, headers={"x-api-key": "k1"}).status_code == 200
        keyed = openai.OpenAI(base_url=f"http://{api.address}/v1", api_key="k1", max_retries=0)
        assert keyed.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
    finally:
        api.stop()
        router.stop()


def test_no_worker_is_503(spare):
    router, url = spare
    router.set_workers([])
    e = _error(httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}), 503)
    assert "no healthy decode worker" in e["message"]


def test_no_kv_capacity_before_the_deadline_is_429(stack, spare):
    """All the decode worker's blocks are held by reservations (as if prompts were on their way), so
    the router retries Reserve until its 1 s request deadline and answers RESOURCE_EXHAUSTED."""
    router, url = spare
    router.set_workers(stack.workers)
    _idle(stack)
    held = [f"hold-{i}" for i in range(4)]
    with grpc.insecure_channel(stack.decode.address) as ch:
        stub = wk_grpc.DecodeWorkerStub(ch)
        for rid in held:  # 4 x 32 blocks of 16 tokens = all 128
            stub.Reserve(wk.ReserveRequest(request_id=rid, token_ids=[5] * 500,
                                           sampling=gen.SamplingParams(max_tokens=1)), timeout=10)
        assert stack.decode.stats().kv_blocks_free == 0
        try:
            r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)
            e = _error(r, 429)
            assert "no KV capacity" in e["message"] and r.headers["Retry-After"] == "1"
            # every refused Reserve gave back the count the router took when it chose the worker
            assert [w.inflight for w in router.pool.workers()] == [0, 0]
        finally:
            for rid in held:
                stub.Abort(gen.AbortRequest(request_id=rid), timeout=10)
        ok = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200  # and a served request gives back both workers' counts
        assert [(w.inflight, w.inflight_tokens) for w in router.pool.workers()] == [(0, 0), (0, 0)]
        router.set_workers([])
    _idle(stack)


class _ScriptedRouter(gen_grpc.PDClusterServicer):
    """Fails on cue, by prompt: "midstream" sends one chunk then UNAVAILABLE, "deadline" fails with
    DEADLINE_EXCEEDED, "slow" outlasts the HTTP API's own 1 s deadline on the gRPC call."""

    def Generate(self, request, context):
        if request.text == "midstream":
            yield gen.GenerateResponse(request_id=request.request_id, token_ids=[5], text="a")
            context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker decode-0 ended the stream early")
        elif request.text == "deadline":
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "request exceeded 600s on a worker")
        deadline = time.monotonic() + 5
        while context.is_active() and time.monotonic() < deadline:
            time.sleep(0.05)


@pytest.fixture(scope="module")
def scripted():
    server, address = bind_server("127.0.0.1", 0, 4, "scripted router")
    gen_grpc.add_PDClusterServicer_to_server(_ScriptedRouter(), server)
    server.start()
    api = HttpApi(address, MODEL, None, request_timeout_s=1.0)
    api.start()
    yield f"http://{api.address}/v1/completions"
    api.stop()
    server.stop(0.5).wait(2)


def test_an_error_after_the_stream_started_is_an_sse_event(scripted):
    r = httpx.post(scripted, json={"prompt": "midstream", "stream": True}, timeout=30)
    assert r.status_code == 200
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
    assert json.loads(events[0])["choices"][0]["text"] == "a" and events[-1] == "[DONE]"
    error = json.loads(events[1])["error"]
    assert error["code"] == "unavailable" and "ended the stream early" in error["message"] and len(events) == 3


def test_deadlines_are_504(scripted):
    e = _error(httpx.post(scripted, json={"prompt": "deadline"}, timeout=30), 504)
    assert "exceeded 600s" in e["message"] and e["code"] == "timeout"
    start = time.monotonic()
    assert _error(httpx.post(scripted, json={"prompt": "slow"}, timeout=30), 504)["code"] == "timeout"
    assert time.monotonic() - start < 4  # the HTTP API's own deadline on the call (1 s here)


# ------------------------------------------------------------------ disconnects
@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_the_kv_blocks(stack, client, llm, stream):
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True, "temperature": 0,
                       "stream": stream}).encode()
    host, port = stack.api.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    if stream:  # wait for a few events: the request is decoding
        seen = b""
        while seen.count(b"data: ") < 3:
            seen += sock.recv(4096)
        assert seen.startswith(b"HTTP/1.1 200")
    else:
        deadline = time.monotonic() + 10
        while stack.decode.stats().running == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert stack.decode.stats().kv_blocks_used > 0
    sock.close()
    # 480 tokens take several seconds here; an aborted request frees its blocks within a fraction of that
    assert _idle(stack, timeout=5.0) < 2.0
    deadline = time.monotonic() + 5
    while stack.router._active and time.monotonic() < deadline:  # the router's call ends just after the aborts
        time.sleep(0.02)
    assert not stack.router._active
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0)
    assert r.choices[0].text == _reference(llm, PROMPT).text


def test_start_picks_a_free_port_and_stop_leaves_no_thread():
    api = HttpApi("127.0.0.1:9", MODEL, None)  # no router needed to list the model
    api.start()
    try:
        host, port = api.address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        assert httpx.get(f"http://{api.address}/v1/models", timeout=10).json()["data"][0]["id"] == MODEL
        r = httpx.get(f"http://{api.address}/health", timeout=10)
        assert r.status_code == 503 and "does not answer" in r.json()["reason"]
        busy = HttpApi("127.0.0.1:9", MODEL, None, port=int(port))
        with pytest.raises(RuntimeError, match=f"cannot bind 127.0.0.1:{port}"):
            busy.start()
    finally:
        thread = api._thread
        start = time.monotonic()
        api.stop()
        assert time.monotonic() - start < 5 and not thread.is_alive()
