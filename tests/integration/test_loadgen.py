"""`pdcluster bench serve` end to end against real HTTP servers.

`FixtureServer` is a small real OpenAI-format server (FastAPI on uvicorn, in a thread) whose stream
timing is known: the first chunk after TTFT_S, then one chunk per ITL_S. It is a fixture for the
load generator's client, not a stand-in for a product component. The last test drives the real
cluster stack (router + prefill + decode workers + router/http_api.py) in this process.
"""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import threading
import time
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from common.net import free_port
from loadgen.arrivals import ArrivalConfig, arrival_offsets
from loadgen.client import EndpointConfig, fetch_model
from loadgen.metrics import SLO, summarize
from loadgen.runner import run
from loadgen.workload import WorkloadConfig, load_workload

pytestmark = pytest.mark.slow

TTFT_S = 0.20
ITL_S = 0.05
MODEL = "fixture-model"


class FixtureServer:
    """POST /{mode}/v1/completions with stream: true. Modes:
    ok     first chunk after TTFT_S, then a chunk of one token every ITL_S; finish chunk, usage, [DONE]
    multi  the same timing, two tokens per chunk, counted in `logprobs.tokens`
    fail   HTTP 500 with an OpenAI error body
    hang   nothing for an hour
    slow   ok, but one token per second"""

    def __init__(self) -> None:
        self.bodies: list[tuple[str, float, dict[str, Any]]] = []
        app = FastAPI()

        @app.get("/{mode}/v1/models")
        async def models(mode: str) -> dict[str, Any]:
            return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

        @app.post("/{mode}/v1/completions")
        async def completions(mode: str, request: Request) -> Any:
            body = await request.json()
            self.bodies.append((mode, time.monotonic(), body))
            if mode == "fail":
                return JSONResponse({"error": {"message": "fixture failure", "type": "server_error"}}, 500)
            return StreamingResponse(self._stream(mode, body), media_type="text/event-stream")

        self.app = app
        self.port = 0
        self._server: Any = None
        self._thread: threading.Thread | None = None

    async def _stream(self, mode: str, body: dict[str, Any]):
        n, per = int(body["max_tokens"]), 2 if mode == "multi" else 1
        env = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": MODEL}
        usage = (body.get("stream_options") or {}).get("include_usage")
        await asyncio.sleep(3600 if mode == "hang" else TTFT_S)
        sent = 0
        while sent < n:
            k = min(per, n - sent)
            choice: dict[str, Any] = {"index": 0, "text": " tok" * k, "logprobs": None, "finish_reason": None}
            if mode == "multi":
                choice["logprobs"] = {"tokens": [" tok"] * k, "token_logprobs": [-0.1] * k}
            yield f"data: {json.dumps({**env, 'choices': [choice], 'usage': None})}\n\n"
            sent += k
            if sent < n:
                await asyncio.sleep(1.0 if mode == "slow" else ITL_S)
        fin = {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
        yield f"data: {json.dumps({**env, 'choices': [fin], 'usage': None})}\n\n"
        if usage:
            u = {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": n,
                 "total_tokens": len(body["prompt"].split()) + n}
            yield f"data: {json.dumps({**env, 'choices': [], 'usage': u})}\n\n"
        yield "data: [DONE]\n\n"

    def start(self) -> FixtureServer:
        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False,
                                                     lifespan="off", loop="asyncio", http="h11"))
        self._thread = threading.Thread(target=lambda: asyncio.run(self._server.serve(sockets=[sock])), daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            assert time.monotonic() < deadline, "fixture server did not start"
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._server.force_exit = True
        if self._thread:
            self._thread.join(10)

    def url(self, mode: str) -> str:
        return f"http://127.0.0.1:{self.port}/{mode}"


@pytest.fixture(scope="module")
def server():
    s = FixtureServer().start()
    yield s
    s.stop()


def _synthetic(n: int, out: int):
    return load_workload(WorkloadConfig("synthetic", n, synthetic_input="fixed:16", synthetic_output=f"fixed:{out}"))


def _run(url: str, n: int = 6, out: int = 8, rate: float = 20.0, time_limit_s: float = 30.0, **ep: Any):
    w = _synthetic(n, out)
    offsets = arrival_offsets(ArrivalConfig("poisson", rate, seed=1), n).offsets
    e = EndpointConfig(url, model=MODEL, **ep)
    return run(w.requests, offsets, e, MODEL, time_limit_s)


def test_measured_ttft_and_itl_match_the_servers_delays(server):
    result = _run(server.url("ok"), ignore_eos=True)
    s = summarize(result.records, result.duration_s, SLO(ttft_ms=TTFT_S * 1e3 + 150, tpot_ms=ITL_S * 1e3 + 40))
    assert s.completed == 6 and s.failed == s.unfinished == 0, [r.error for r in result.records]
    for r in result.records:
        assert r.output_tokens == 8 and r.output_tokens_from == "usage" and r.chunks_match_usage
        assert len(r.chunk_s) == 8 and r.finish_reason == "length"
    # lower bounds are the server's sleeps; upper bounds leave room for a busy 2-core machine
    assert TTFT_S * 1e3 - 5 <= s.ttft_ms.p50 <= TTFT_S * 1e3 + 120, s.ttft_ms
    assert ITL_S * 1e3 - 5 <= s.itl_ms.p50 <= ITL_S * 1e3 + 30, s.itl_ms
    assert ITL_S * 1e3 - 5 <= s.tpot_ms.p50 <= ITL_S * 1e3 + 30, s.tpot_ms
    assert s.e2e_ms.p50 >= (TTFT_S + 7 * ITL_S) * 1e3 - 10
    assert s.itl_ms.n == 6 * 7 and s.output_tokens == 48
    assert s.slo_attainment == 1.0 and s.goodput == pytest.approx(6 / result.duration_s)
    bodies = [b for m, _, b in server.bodies if m == "ok"][-6:]
    assert all(b["stream"] and b["ignore_eos"] is True and b["temperature"] == 0 and b["max_tokens"] == 8
               and b["stream_options"] == {"include_usage": True} and b["model"] == MODEL for b in bodies)
    _run(server.url("ok"), n=1)
    assert "ignore_eos" not in server.bodies[-1][2]  # sent only with --ignore-eos


def test_multi_token_chunks_are_counted_from_logprobs(server):
    result = _run(server.url("multi"), n=3, out=8)
    for r in result.records:
        assert r.ok and r.chunk_tokens == [2, 2, 2, 2] and r.chunk_tokens_from == "logprobs"
        assert len(r.itls) == 6  # 3 gaps of ITL_S, each split over the chunk's 2 tokens
        assert all(ITL_S / 2 - 0.005 <= x <= ITL_S / 2 + 0.05 for x in r.itls), r.itls


def test_a_run_stops_at_its_time_limit(server):
    start = time.monotonic()
    result = _run(server.url("slow"), n=10, out=6, rate=4.0, time_limit_s=1.5)
    elapsed = time.monotonic() - start
    assert elapsed < 4.0, elapsed
    s = summarize(result.records, result.duration_s)
    assert result.stopped_by == "time limit" and s.completed == 0
    assert s.unfinished >= 1 and s.not_sent >= 1 and s.unfinished + s.not_sent == 10
    assert s.failures.get("unfinished") == s.unfinished and s.failures.get("not sent") == s.not_sent
    assert result.duration_s == pytest.approx(1.5, abs=0.5)


@pytest.mark.parametrize("where, kind, message", [
    ("fail", "http 500", "fixture failure"),
    ("refused", "connection", "Connect"),
    ("hang", "timeout", "request-timeout"),
])
def test_failures_are_counted_with_their_reason_and_never_hang(server, where, kind, message):
    url = f"http://127.0.0.1:{free_port()}" if where == "refused" else server.url(where)
    start = time.monotonic()
    result = _run(url, n=4, rate=50.0, time_limit_s=20.0, request_timeout_s=1.0)
    assert time.monotonic() - start < 8.0
    s = summarize(result.records, result.duration_s, SLO(ttft_ms=1000))
    assert s.completed == 0 and s.failed == 4 and s.failures == {kind: 4}
    assert all(message in (r.error or "") for r in result.records), [r.error for r in result.records]
    if where == "fail":
        assert all(r.status == 500 for r in result.records)
    assert s.slo_attainment == 0.0 and s.goodput == 0.0


def test_cli_compares_two_systems_over_a_sweep_and_writes_json_markdown_and_plots(server, tmp_path, capsys):
    from cli.main import main

    out = tmp_path / "out"
    first = len(server.bodies)
    gc.unfreeze()
    rc = main(["bench", "serve", "--endpoint", server.url("ok"), "--endpoint-label", "A",
               "--endpoint", server.url("multi"), "--endpoint-label", "B",
               "--workload", "azure-conv", "--num-requests", "4", "--max-context", "64", "--max-output", "4",
               "--rates", "8,16", "--slo-ttft-ms", "400", "--slo-tpot-ms", "100", "--ignore-eos",
               "--time-limit-s", "30", "--out", str(out), "--no-progress"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert gc.get_freeze_count() > 0  # the client's setup heap is kept out of the collector's scans
    gc.unfreeze()
    assert "Azure/AzurePublicDataset" in printed and "factor = min(1, max_context 64" in printed
    assert "prompt before" in printed and "prompt after" in printed
    # interleaved: rate 8 -> A then B, rate 16 -> B then A (each run's requests all come before the next's)
    modes = [m for m, _, _ in server.bodies[first:]]
    assert modes == ["ok"] * 4 + ["multi"] * 4 + ["multi"] * 4 + ["ok"] * 4
    result = json.loads((out / "result.json").read_text())
    assert [(r["label"], r["rate"]) for r in result["runs"]] == [("A", 8.0), ("A", 16.0), ("B", 8.0), ("B", 16.0)]
    assert all(r["summary"]["completed"] == 4 and len(r["records"]) == 4 for r in result["runs"])
    assert result["scaling"]["max_context"] == 64 and result["workload"]["source"].startswith("Azure")
    assert result["runs"][0]["records"][0]["ttft_s"] >= TTFT_S - 0.005
    assert all(r["server_counters"] is None for r in result["runs"])  # no pdcluster /metrics there
    md = (out / "summary.md").read_text()
    assert "Azure/AzurePublicDataset" in md and "| A | 8 req/s |" in md and "ttft_cdf.png" in md
    for png in ("ttft_cdf.png", "tpot_cdf.png", "goodput_vs_rate.png", "p99_tpot_vs_rate.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


def test_cli_reports_an_endpoint_that_is_down(tmp_path, capsys):
    from cli.main import main

    rc = main(["bench", "serve", "--endpoint", f"http://127.0.0.1:{free_port()}", "--workload", "synthetic",
               "--num-requests", "2", "--rate", "10", "--out", str(tmp_path), "--no-progress"])
    assert rc == 2 and "GET /v1/models failed" in capsys.readouterr().err


def test_the_real_cluster_serves_a_loadgen_run(builtin_path, tmp_path):
    from engine.config import EngineConfig
    from loadgen.cli import load_tokenizer
    from pdcluster.local_cluster import LocalCluster

    cfg = EngineConfig(model=str(builtin_path), num_blocks=128, max_model_len=256, num_threads=1)
    with LocalCluster(cfg, router={"request_timeout_s": 60, "model_name": "tiny"}, http={}) as c:
        w = load_workload(WorkloadConfig("azure-conv", 8, max_context=128, max_output=8),
                          load_tokenizer("builtin:tiny-llama"), "builtin:tiny-llama")
        offsets = arrival_offsets(ArrivalConfig("poisson", 8.0, seed=0), 8).offsets
        e = EndpointConfig(c.url, label="pdcluster", ignore_eos=True, request_timeout_s=60)
        model = asyncio.run(fetch_model(e))
        assert model == "tiny"
        result = run(w.requests, offsets, e, model, time_limit_s=120)
        s = summarize(result.records, result.duration_s)
        assert s.completed == 8, [r.error for r in result.records]
        for req, rec in zip(w.requests, result.records):
            assert rec.output_tokens == req.output_len  # ignore_eos: exactly max_tokens
            assert rec.prompt_tokens == req.prompt_tokens_measured == req.prompt_len  # exact lengths
            assert rec.ttft is not None and rec.ttft > 0


def test_phases_against_the_real_cluster_report_each_phase_with_its_worker_seconds(builtin_path, tmp_path, capsys):
    from engine.config import EngineConfig
    from loadgen.cli import main
    from pdcluster.local_cluster import LocalCluster

    cfg = EngineConfig(model=str(builtin_path), num_blocks=128, max_model_len=256, num_threads=1)
    with LocalCluster(cfg, router={"request_timeout_s": 60}, http={}) as c:
        rc = main(["--endpoint", c.url, "--endpoint-label", "pdcluster", "--phases", "96/2:3:3,8/16:3:3",
                   "--slo-ttft-ms", "5000", "--ignore-eos", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    rows = json.loads((tmp_path / "phases.json").read_text())["rows"]
    assert [r["phase"] for r in rows] == ["96/2 3/s", "8/16 3/s", "all"]
    assert rows[2]["requests"] == rows[0]["requests"] + rows[1]["requests"] == rows[2]["completed"] > 6
    for r in rows[:2]:  # one prefill and one decode worker up all along: 3 worker-seconds each per phase
        assert set(r["worker_seconds"]) == {"prefill", "decode"}
        assert all(2.0 <= v <= 3.01 for v in r["worker_seconds"].values()), r
        assert r["slo_attainment"] == 1.0
    assert "per phase" in capsys.readouterr().out and (tmp_path / "phases.md").is_file()


if __name__ == "__main__":  # a fixture server for trying `pdcluster bench serve` by hand
    srv = FixtureServer().start()
    print(f"fixture server: {srv.url('ok')} (also /multi, /fail, /hang, /slow); Ctrl-C stops it", flush=True)
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        srv.stop()
