"""`pdcluster plan calibrate --serving-url`: the workers' step counters reach the router's /metrics,
and the live probe fits decode and prefill step costs from them under real load."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from engine.config import EngineConfig
from pdcluster.local_cluster import LocalCluster
from planner.calibrate_serving import probe_live, scrape_steps
from planner.cli import main as plan_main
from planner.cost_model import fitted_from

pytestmark = pytest.mark.slow

MODEL = "builtin:tiny-llama"
ENGINE_PREFILL = {"a": 0.005, "b": 2e-4, "c": 1e-7}


@pytest.fixture(scope="module")
def url(builtin_path):
    cfg = EngineConfig(model=str(builtin_path), num_blocks=256, max_model_len=256, num_threads=1)
    with LocalCluster(cfg, router={"model": MODEL, "request_timeout_s": 30}, http={}) as c:
        yield c.url


def test_step_counters_move_with_requests(url):
    before = scrape_steps(url)
    for _ in range(2):
        httpx.post(f"{url}/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": "hello there", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
        }).raise_for_status()
    deadline = time.monotonic() + 10  # the router polls worker stats every 0.5 s
    while True:
        after = scrape_steps(url)
        moved = after.get(("decode", "decode"), {}).get("steps", 0) - before.get(("decode", "decode"), {}).get("steps", 0)
        if moved >= 10 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    dec = after[("decode", "decode")]
    pre = after[("prefill", "prefill")]
    assert dec["steps"] - before.get(("decode", "decode"), {}).get("steps", 0) == 2 * 5  # 6 tokens: 1 at prefill
    assert pre["step_tokens"] - before.get(("prefill", "prefill"), {}).get("step_tokens", 0) >= 2 * 2
    assert dec["step_seconds"] > 0 and dec["step_context_tokens"] > dec["step_seqs"]


def test_live_probe_fits_both_phases_and_the_planner_uses_it(url, tmp_path):
    live = probe_live(url, MODEL, MODEL, levels=(1, 4), prompt_lens=(16, 96), output_tokens=12, warmup_s=1.0,
                      seconds=2.0, engine_prefill=ENGINE_PREFILL, say=lambda _: None)
    decode = [s for s in live["samples"] if s["role"] == "decode" and s["phase"] == "decode"]
    assert len(decode) == 4
    batches = {(s["prompt"], s["concurrency"]): s["step_seqs"] / s["steps"] for s in decode}
    assert batches[(16, 1)] == pytest.approx(1.0) and batches[(16, 4)] > 1.5
    d = live["decode"]
    assert d["a"] + d["b"] * 100 + d["c"] > 0 and d["mean_abs_pct_error"] < 100
    p = live["prefill"]
    assert p["scale"] > 0 and p["b"] == pytest.approx(ENGINE_PREFILL["b"] * p["scale"])
    # one stream: the client's TTFT per prompt length, what the planner takes the serving path's fixed share from
    assert set(live["idle_ttft_s"]) == {"16", "96"} and all(0 < t < 5 for t in live["idle_ttft_s"].values())
    coeffs = {"model": MODEL, "prefill": ENGINE_PREFILL, "decode": {"a": 1.0, "b": 1.0, "c": 1.0},
              "kv_capacity_tokens": 1000, "kv_bytes_per_token": 9216, "serving": {"decode_token_s": 0.5},
              "live": {"decode": live}}
    assert fitted_from(coeffs, "decode").decode == (d["a"], d["b"], d["c"])  # no zero-load streaming cost added
    assert fitted_from(coeffs, "prefill").prefill == (p["a"], p["b"], p["c"])
    assert fitted_from(coeffs, "colocated").decode == (1.0, 1.0, 1.5)  # no live fit for colocated: the engine's


def test_cli_adds_live_to_the_coefficients_file(url, tmp_path, capsys):
    path = tmp_path / "coeffs.json"
    path.write_text(json.dumps({"model": MODEL, "prefill": ENGINE_PREFILL, "decode": {"a": 0.01, "b": 0, "c": 0}}))
    assert plan_main(["calibrate", "--serving-url", url, "--levels", "1,2", "--prompt-lens", "16,64",
                      "--output-tokens", "8", "--seconds", "1.5", "--out", str(path)]) == 0
    written = json.loads(path.read_text())
    assert set(written["live"]) == {"decode"} and written["live"]["decode"]["url"] == url
    assert "wrote `live`" in capsys.readouterr().out


def test_bench_serve_records_what_the_workers_counted_per_run(url, tmp_path):
    """bench serve reads the endpoint's worker counters around each run (loadgen.server_counters):
    steps per phase and the prefix cache's hits, as the planner's accuracy check compares them."""
    from cli.main import main

    out = tmp_path / "out"
    assert main(["bench", "serve", "--endpoint", url, "--workload", "azure-conv", "--num-requests", "6",
                 "--max-context", "128", "--max-output", "6", "--rates", "20,30", "--ignore-eos",
                 "--tokenizer", MODEL, "--time-limit-s", "60", "--out", str(out), "--no-progress"]) == 0
    runs = json.loads((out / "result.json").read_text())["runs"]
    assert len(runs) == 2
    for run in runs:
        c = run["server_counters"]
        ok = [r for r in run["records"] if r["outcome"] == "ok"]
        assert c["decode/decode"]["steps"] >= 1 and c["decode/decode"]["step_seconds"] > 0
        # the same steps per batch-size bucket ("decode[1]", "decode[2-3]", ...): they add up to the phase's
        buckets = [v for k, v in c.items() if k.startswith("decode/decode[")]
        assert buckets and sum(b["steps"] for b in buckets) == c["decode/decode"]["steps"]
        assert sum(b["step_seqs"] for b in buckets) == c["decode/decode"]["step_seqs"]
        # every prompt of the run was counted (a request of an earlier test may still finish meanwhile)
        assert c["prefill/prefix"]["prompt_tokens"] >= sum(r["prompt_tokens"] for r in ok) > 0
    # the second run sends the same prompts: the prefill worker's prefix cache serves more of them
    hits = [run["server_counters"]["prefill/prefix"]["prefix_cache_hit_tokens"] for run in runs]
    assert hits[1] > hits[0]
