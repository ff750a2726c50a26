"""planner.calibrate_bench: step costs fitted to the worker counters `bench serve` stored per run."""

from __future__ import annotations

import json

import pytest

from planner.calibrate_bench import add_bench, cluster_of, commit_wait, fit_bench, run_samples

ENGINE = {"a": 0.007, "b": 2e-4, "c": 1e-7}
DECODE = (0.008, 5e-6, 0.002)
SCALE, SLOPE, OVERHEAD = 1.3, 0.004, 0.011  # prefill step = (SCALE + SLOPE x decode tok/s) x engine + OVERHEAD


def _step(engine: float, tps: float) -> float:
    return (SCALE + SLOPE * tps) * engine + OVERHEAD


def _shaped_step(engine: float, tps: float) -> float:  # the form a shaped fit has: all of it stretched
    return (SCALE * engine + OVERHEAD) * (1 + SLOPE / SCALE * tps)


def _run(label: str, decode_role: str, prefill_role: str, rate: float, prompts: list[int], step_of=_step) -> dict:
    """One bench serve run with the counters a cluster of known step costs would have counted."""
    duration = len(prompts) / rate + 5.0
    batch, ctx, steps = 1.0 + rate / 2, 150.0 * (1.0 + rate / 2) + 30.0 * rate**2, 1000.0 * (1 + rate / 10)
    tokens = 60.0 * len(prompts)
    decode = {"steps": steps, "step_seqs": batch * steps, "step_tokens": tokens, "step_context_tokens": ctx * steps,
              "step_seconds": steps * (DECODE[0] + DECODE[1] * ctx + DECODE[2] * batch)}
    p_steps = len(prompts) * (1 - rate / 40)  # more prompts per step at higher rates
    engine = ENGINE["a"] + (ENGINE["b"] * sum(prompts) + ENGINE["c"] * sum(n * n for n in prompts)) / p_steps
    step = step_of(engine, tokens / duration)
    if decode_role == "decode":  # the worker counts its commits' waits for the decode worker's lock in its steps
        step += decode["step_seconds"] ** 2 / decode["steps"] / (2 * duration)
    prefill = {"steps": p_steps, "step_seqs": len(prompts), "step_tokens": sum(prompts),
               "step_context_tokens": sum(prompts), "step_seconds": p_steps * step}
    records = [{"outcome": "ok", "prompt_tokens": n} for n in prompts] + [{"outcome": "not_sent", "prompt_tokens": 9999}]
    return {"label": label, "rate": rate, "duration_s": duration, "records": records,
            "server_counters": {f"{decode_role}/decode": decode, f"{prefill_role}/prefill": prefill,
                                f"{prefill_role}/prefix": {"prompt_tokens": sum(prompts), "prefix_cache_hit_tokens": 0}}}


def _result(step_of=_step) -> dict:
    prompts = [40, 90, 300, 1000, 120, 64] * 10
    runs = []
    for rate in (1.0, 2.0, 4.0, 6.0, 8.0):
        runs.append(_run("disaggregated", "decode", "prefill", rate, prompts[: 20 + int(rate) * 5], step_of))
        runs.append(_run("colocated", "colocated", "colocated", rate, prompts[: 20 + int(rate) * 5], step_of))
    runs.append({"label": "other", "rate": 1.0, "duration_s": 10.0, "records": [], "server_counters": None})
    return {"runs": runs}


def test_each_cluster_is_told_by_its_counters():
    assert cluster_of({"colocated/decode": {"steps": 3}}) == "colocated"
    assert cluster_of({"decode/decode": {"steps": 3}, "prefill/prefill": {"steps": 1}}) == "decode"
    assert cluster_of({"decode/decode": {"steps": 0}}) is None


def test_the_fits_recover_the_step_costs_each_cluster_ran_with():
    fitted = fit_bench([_result()], ENGINE, ["r.json"])
    assert set(fitted) == {"decode", "colocated"}
    for entry in fitted.values():
        d, q = entry["decode"], entry["prefill"]
        assert entry["source"] == "bench" and entry["runs"] == 5 and entry["results"] == ["r.json"]
        assert (d["a"], d["b"], d["c"]) == pytest.approx(DECODE, rel=1e-5)
        assert q["scale"] == pytest.approx(SCALE, rel=1e-5) and q["overhead_s"] == pytest.approx(OVERHEAD, rel=1e-5)
        assert q["load_slope"] == pytest.approx(SLOPE / SCALE, rel=1e-5)
        assert q["mean_abs_pct_error"] < 1e-4


def test_with_a_closed_loop_fit_its_split_of_what_the_trace_cannot_tell_apart_is_kept():
    # a probe's fits with the right ratios (b : c for decode, scale : overhead for prefill), but
    # measured on a machine 20% slower than the trace's runs
    shapes = {"decode": {"decode": {"b": 2 * DECODE[1], "c": 2 * DECODE[2]},
                         "prefill": {"scale": SCALE / 2, "overhead_s": OVERHEAD / 2}}}
    fitted = fit_bench([_result(_shaped_step)], ENGINE, shapes=shapes)
    d, q = fitted["decode"]["decode"], fitted["decode"]["prefill"]
    assert (d["a"], d["b"], d["c"]) == pytest.approx(DECODE, rel=1e-5)
    assert d["shape_from"] == shapes["decode"]["decode"]
    assert (q["scale"], q["overhead_s"], q["load_slope"]) == pytest.approx((SCALE, OVERHEAD, SLOPE / SCALE), rel=1e-5)
    assert q["shape_from"] == shapes["decode"]["prefill"]
    assert "shape_from" not in fitted["colocated"]["decode"]  # no probe of that cluster: fitted whole


def test_decode_buckets_are_windows_of_their_own_and_separate_the_per_step_cost():
    """Runs whose decode steps were counted per batch-size bucket: every bucket with enough steps is
    a window. At one context per sequence a run's total cannot tell the per-step cost from the
    per-sequence one; the buckets' mean batches (1 to 20) can."""
    ctx_per_seq = 150.0

    def counts(batch: float, steps: float) -> dict:
        step = DECODE[0] + DECODE[1] * ctx_per_seq * batch + DECODE[2] * batch
        return {"steps": steps, "step_seqs": batch * steps, "step_tokens": batch * steps,
                "step_context_tokens": ctx_per_seq * batch * steps, "step_seconds": steps * step}

    runs = []
    for rate, shares in ((2.0, (1.0, 2.4, 5.0)), (8.0, (1.0, 2.6, 5.5, 11.0, 20.0))):
        buckets = {f"decode/decode[{lo}]": counts(b, 100.0) for lo, b in zip(("1", "2-3", "4-7", "8-15", "16-31"), shares)}
        buckets["decode/decode[32-63]"] = {**counts(40.0, 3.0), "step_seconds": 99.0}  # 3 steps: too few to count
        total = {f: sum(v[f] for v in buckets.values()) for f in buckets["decode/decode[1]"]}
        runs.append({"label": "disaggregated", "rate": rate, "duration_s": 30.0, "records": [],
                     "server_counters": {"decode/decode": total, **buckets}})
    fitted = fit_bench([{"runs": runs}], ENGINE, shapes={"decode": {"decode": {"b": DECODE[1], "c": DECODE[2]}}})
    entry = fitted["decode"]
    assert entry["runs"] == 2 and entry["decode_windows"] == 8
    assert sorted({s["batch"] for s in entry["samples"]}) == ["1", "16-31", "2-3", "4-7", "8-15"]
    d = entry["decode"]
    assert (d["a"], d["b"], d["c"]) == pytest.approx(DECODE, rel=1e-5) and d["max_abs_pct_error"] < 1e-3
    # the buckets pooled over the runs: the table the simulator interpolates
    table = d["table"]
    assert [r["steps"] for r in table] == [200.0, 200.0, 200.0, 100.0, 100.0]
    assert [r["batch"] for r in table] == pytest.approx([1.0, 2.5, 5.25, 11.0, 20.0])
    assert table[1]["seconds"] == pytest.approx(DECODE[0] + (DECODE[1] * ctx_per_seq + DECODE[2]) * 2.5)
    assert all(r["context_per_seq"] == pytest.approx(ctx_per_seq) for r in table)
    # without buckets the same runs are one window each, the total
    for run in runs:
        run["server_counters"] = {"decode/decode": run["server_counters"]["decode/decode"]}
    plain = fit_bench([{"runs": runs * 2}], ENGINE)["decode"]
    assert plain["samples"][0]["batch"] == "all" and "table" not in plain["decode"]


def test_no_counters_is_a_clear_error():
    with pytest.raises(RuntimeError, match="server_counters"):
        fit_bench([{"runs": [{"label": "x", "rate": 1.0, "duration_s": 5.0, "server_counters": None}]}], ENGINE)


def test_add_bench_replaces_the_live_fits_but_keeps_the_idle_ttft_and_the_host_share_goes():
    from planner.catalog import load_catalog
    from planner.models import model_shape
    from planner.plan import Plan, PlanContext, Pool, build_cluster

    coeffs = {"model": "builtin:tiny-llama", "model_shape": {"name": "builtin:tiny-llama"},
              "prefill": ENGINE, "decode": {"a": 0.004, "b": 1e-6, "c": 5e-3},
              "kv_capacity_tokens": 100000, "kv_bytes_per_token": 9216,
              "serving": {"decode_token_s": 1e-3, "cpu_per_token_s": 3e-3, "host_cores": 2},
              "live": {"decode": {"decode": {"a": 1, "b": DECODE[1], "c": DECODE[2]},
                                  "prefill": {"a": 0.02, "b": 4e-4, "c": 2e-7, "scale": 2 * SCALE,
                                              "overhead_s": 2 * OVERHEAD},
                                  "idle_ttft_s": {"64": 0.05, "768": 0.3}}}}
    ctx = PlanContext(model_shape("builtin:tiny-llama"), load_catalog(), coefficients=coeffs)
    disagg = Plan("disaggregated", Pool("cpu", 1), Pool("cpu", 1), 2048, 256)
    assert build_cluster(disagg, ctx).host_cpu_per_token_s == pytest.approx(2e-3)
    add_bench(coeffs, [_result(_shaped_step)])
    live = coeffs["live"]["decode"]
    assert live["idle_ttft_s"] == {"64": 0.05, "768": 0.3} and "idle_ttft_s" not in coeffs["live"]["colocated"]
    assert (live["decode"]["a"], live["decode"]["c"]) == pytest.approx((DECODE[0], DECODE[2]), rel=1e-5)
    assert live["prefill"]["shape_from"] == {"scale": 2 * SCALE, "overhead_s": 2 * OVERHEAD}
    refit = json.loads(json.dumps(coeffs))
    add_bench(refit, [_result(_shaped_step)])  # a second fit takes the same shapes (shape_from), not its own
    assert refit["live"]["decode"]["prefill"]["shape_from"] == live["prefill"]["shape_from"]
    assert refit["live"]["decode"]["prefill"]["scale"] == pytest.approx(live["prefill"]["scale"], rel=1e-9)
    cluster = build_cluster(disagg, ctx)
    assert cluster.host_cpu_per_token_s == 0.0  # the runs' step costs have the serving path's share in them
    assert cluster.decode[0].cost.decode == pytest.approx(DECODE, rel=1e-5)
    assert cluster.prefill[0].prefill_load_slope == pytest.approx(SLOPE / SCALE, rel=1e-5)
    json.dumps(coeffs)  # what the CLI writes back


def test_the_command_writes_live_into_the_coefficients_file(tmp_path, capsys):
    from planner.cli import main

    coeffs = tmp_path / "c.json"
    coeffs.write_text(json.dumps({"model": "builtin:tiny-llama", "prefill": ENGINE}))
    result = tmp_path / "result.json"
    result.write_text(json.dumps(_result()))
    assert main(["calibrate", "--from-bench", str(result), "--out", str(coeffs)]) == 0
    written = json.loads(coeffs.read_text())["live"]
    assert set(written) == {"decode", "colocated"} and written["decode"]["results"] == [str(result)]
    assert "disaggregated cluster, 5 runs" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="missing.json"):
        main(["calibrate", "--from-bench", str(tmp_path / "missing.json"), "--out", str(coeffs)])


def test_the_fixed_ttft_share_comes_from_requests_that_arrived_with_none_in_flight():
    from planner.calibrate_bench import idle_ttft

    def rec(start: float, end: float, prompt: int, ttft: float) -> dict:
        return {"outcome": "ok", "start_s": start, "end_s": end, "prompt_tokens": prompt, "ttft_s": ttft}

    run = {"rate": 1.0, "records": [
        rec(0.0, 0.5, 64, 0.05), rec(1.0, 1.5, 64, 0.07),   # alone: both count (median 0.06)
        rec(2.0, 3.0, 768, 0.30), rec(2.5, 3.2, 256, 0.90),  # the second arrived while the first ran
        rec(4.0, 4.4, 256, 0.12), {"outcome": "failed", "start_s": 5.0, "end_s": 5.1, "prompt_tokens": 32},
        rec(6.0, 6.5, 32, 0.04)]}
    assert idle_ttft(run) == ({"32": 0.04, "64": pytest.approx(0.06), "256": 0.12, "768": 0.30}, 5)
    fitted = fit_bench([_result(), {"runs": [{**_run("colocated", "colocated", "colocated", 0.5, [64] * 20),
                                              "records": run["records"]}]}], ENGINE)
    assert fitted["colocated"]["idle_ttft_s"] == idle_ttft(run)[0]  # from the lowest-rate run
    assert fitted["colocated"]["idle_ttft_from"].startswith("5 requests of the 0.5 req/s run")
    assert "idle_ttft_s" not in fitted["decode"]  # its runs' records have no times: nothing to take


def test_a_commit_waits_out_the_decode_step_in_progress_and_that_wait_leaves_the_prefill_fit():
    """The decode worker is in a step a fraction busy/window of the time, and a commit arriving then
    waits out the rest of it: E[step^2] / (2 E[step]) on average, per bucket of steps at its mean."""
    counters = {"decode/decode": {"steps": 150, "step_seconds": 2.0},
                "decode/decode[1]": {"steps": 100, "step_seconds": 1.0},  # 10 ms steps
                "decode/decode[2-3]": {"steps": 50, "step_seconds": 1.0}}  # 20 ms steps
    busy, mean_sq, mean = 2.0 / 10.0, (100 * 0.01**2 + 50 * 0.02**2) / 150, 2.0 / 150
    assert commit_wait(counters, "decode", 10.0) == pytest.approx(busy * mean_sq / (2 * mean)) == pytest.approx(0.0015)
    assert commit_wait({"decode/decode": {"steps": 100, "step_seconds": 1.0}}, "decode", 10.0) == pytest.approx(0.0005)
    run = _run("disaggregated", "decode", "prefill", 4.0, [40, 90, 300] * 10)
    counters = run["server_counters"]
    wait = commit_wait(counters, "decode", run["duration_s"])
    _, samples = run_samples(run, ENGINE)
    prefill = next(s for s in samples if s["phase"] == "prefill")
    assert prefill["commit_wait_s"] == pytest.approx(wait)
    assert prefill["step_seconds"] == pytest.approx(counters["prefill/prefill"]["step_seconds"]
                                                    - counters["prefill/prefill"]["steps"] * wait)
    # a colocated worker commits nothing: its prefill steps stay as counted
    coloc = _run("colocated", "colocated", "colocated", 4.0, [40, 90, 300] * 10)
    _, samples = run_samples(coloc, ENGINE)
    prefill = next(s for s in samples if s["phase"] == "prefill")
    assert "commit_wait_s" not in prefill
    assert prefill["step_seconds"] == coloc["server_counters"]["colocated/prefill"]["step_seconds"]
    fitted = fit_bench([_result()], ENGINE)
    assert fitted["decode"]["prefill"]["commit_wait_out"] and "commit_wait_out" not in fitted["colocated"]["prefill"]
