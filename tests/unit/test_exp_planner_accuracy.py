"""benchmarks/planner_accuracy.py (scripts/exp_planner_accuracy.py): the comparison of two measurements
(--repeat) and the server-side view."""

from __future__ import annotations

import pytest

from benchmarks.planner_accuracy import main
from benchmarks.planner_accuracy_sim import plan_for, simulate_run
from benchmarks.planner_accuracy_tables import (
    METRICS,
    cell,
    error_table,
    median_rows,
    repeatability,
    within_capacity,
)


def _run(label: str, rate: float, ttfts: list[float], tpots: list[float], failed: int = 0) -> dict:
    ok = [{"outcome": "ok", "ttft_s": a, "tpot_s": b} for a, b in zip(ttfts, tpots)]
    return {"label": label, "rate": rate, "records": ok + [{"outcome": "failed"}] * failed}


def test_two_measurements_are_compared_run_by_run_as_a_simulation_is():
    first = {"runs": [_run("colocated", 2.0, [0.1, 0.2, 0.3], [0.010, 0.020, 0.030], failed=1),
                      _run("colocated", 4.0, [0.1] * 3, [0.01] * 3)]}
    second = {"runs": [_run("colocated", 2.0, [0.1, 0.22, 0.3], [0.010, 0.020, float("nan")])]}
    rows = repeatability(first, second)
    assert len(rows) == 1  # the 4 req/s run was measured once only
    r = rows[0]
    assert (r["completed"], r["sent"]) == (3, 4)
    assert r["ttft_p50"] == {"measured_ms": pytest.approx(200.0), "simulated_ms": pytest.approx(220.0),
                             "error_pct": pytest.approx(10.0)}
    assert r["tpot_p50"]["simulated_ms"] == pytest.approx(15.0)  # NaN left out: the median of 10 and 20 ms
    table = error_table(rows, "run 1 / run 2 (difference)")
    assert "run 1 / run 2 (difference)" in table[0] and "mean absolute difference" in table[-1]


def test_runs_with_fresh_prompts_share_no_prefix_cache_in_the_simulation():
    """bench serve --fresh-prompts gives each rate its own prompt texts: the simulated cluster, which
    keeps its caches from run to run, then finds none of an earlier run's prefixes (without it: all)."""
    from planner.catalog import load_catalog
    from planner.cost_model import CPU_COEFFICIENTS, load_coefficients
    from planner.models import from_checkpoint
    from planner.plan import PlanContext, build_cluster
    from planner.simulator import Simulator

    coeffs = load_coefficients(CPU_COEFFICIENTS)
    ctx = PlanContext(from_checkpoint(coeffs["model"]), load_catalog(), coefficients=coeffs)

    def run(rate: float) -> dict:
        recs = [{"index": i, "outcome": "ok", "start_s": i * 0.5, "prompt_tokens": 100, "expected_prompt_tokens": 100,
                 "expected_output_tokens": 4, "ttft_s": 0.1, "tpot_s": 0.01} for i in range(4)]
        return {"label": "colocated", "rate": rate, "records": recs, "summary": {}}

    for fresh in (False, True):
        sim = Simulator(build_cluster(plan_for("colocated", 2048, 256), ctx), keep_caches=True)
        first = simulate_run(run(2.0), sim, ctx.block_size, fresh)
        second = simulate_run(run(4.0), sim, ctx.block_size, fresh)
        assert first["server"]["simulated"]["prefix_hit_tokens"] == 0
        assert (second["server"]["simulated"]["prefix_hit_tokens"] == 0) == fresh


def test_the_median_of_repeated_measurements_is_what_the_simulation_is_compared_with():
    def row(ttft_p50: float, sim: float, label: str = "colocated", rate: float = 2.0) -> dict:
        c = cell(ttft_p50, sim)
        return {"label": label, "rate": rate, "mode": "colocated", "sent": 10, "completed": 10,
                "server": {"measured": None, "simulated": {}}, "attainment_measured": ttft_p50 / 1000,
                "attainment_simulated": 0.5, **{f"{k}_p{q}": dict(c) for _, k, q in METRICS}}

    files = [[row(100.0, 90.0), row(5.0, 5.0, rate=4.0)], [row(120.0, 92.0)], [row(80.0, 91.0)]]
    merged, spread = median_rows(files)
    assert len(merged) == 1  # the 4 req/s run was measured once only
    m = merged[0]
    assert m["ttft_p50"] == {"measured_ms": 100.0, "simulated_ms": 91.0, "error_pct": pytest.approx(-9.0)}
    assert m["attainment_measured"] == pytest.approx(0.1)
    # each against the median of the other two: 100 vs 100 (120, 80); 120 vs 90; 80 vs 110
    assert sorted(r["ttft_p90"]["error_pct"] for r in spread) == [
        pytest.approx(-100 * 30 / 110), 0.0, pytest.approx(100 * 30 / 90)]
    assert "mean absolute difference 20.2%" in error_table(spread, "others / this run (difference)")[-1]


def test_calibrate_from_fits_the_step_costs_to_other_runs_before_simulating(tmp_path, capsys):
    import json

    from planner.cost_model import CPU_COEFFICIENTS

    # the repository's fit with fixed engine step costs (a recalibration of the file leaves this test's data as is)
    engine_only = {k: v for k, v in json.loads(CPU_COEFFICIENTS.read_text()).items() if k != "live"}
    engine_only["prefill"] = {**engine_only["prefill"], "a": 0.00748, "b": 0.0002316, "c": 9.5e-8}
    engine_only["decode"] = {**engine_only["decode"], "a": 0.00711, "b": 4.31e-6, "c": 0.000385}
    engine_only["serving"] = {**engine_only["serving"], "router_in_s": 0.00699, "first_token_out_s": 0.00699,
                              "kv_latency_s": 0.00387, "kv_gbps": None, "decode_token_s": 0.001624,
                              "router_s": 0.00398, "http_s": 0.0100, "cpu_per_token_s": 0.002744}
    a, b, c = (engine_only["prefill"][k] for k in "abc")  # the engine fit the runs are read against

    def counters(rate: float) -> dict:  # colocated workers: decode 10 ms + 20 us/context token; prefill 2x engine
        steps, batch = 1000.0, 1.0 + rate / 2
        ctx = 150.0 * batch + 30.0 * rate**2
        prefill = {"steps": 40.0, "step_seqs": 40.0, "step_tokens": 4000.0, "step_context_tokens": 4000.0}
        engine = a + (b * 4000 + c * 40 * 100**2) / 40
        prefill["step_seconds"] = 40 * 2 * engine
        return {"colocated/decode": {"steps": steps, "step_seqs": batch * steps, "step_tokens": 5000.0,
                                     "step_context_tokens": ctx * steps,
                                     "step_seconds": steps * (0.010 + 20e-6 * ctx)},
                "colocated/prefill": prefill}

    calib = {"runs": [{"label": "colocated", "rate": r, "duration_s": 30.0,
                       "records": [{"outcome": "ok", "prompt_tokens": 100}] * 40, "server_counters": counters(r)}
                      for r in (1.0, 2.0, 4.0, 8.0)]}
    recs = [{"index": i, "outcome": "ok", "start_s": i * 0.5, "prompt_tokens": 100, "expected_prompt_tokens": 100,
             "expected_output_tokens": 8, "ttft_s": 0.1, "tpot_s": 0.01} for i in range(6)]
    measured = {"config": {"fresh_prompts": True},
                "runs": [{"label": "colocated", "rate": 2.0, "records": recs, "summary": {},
                          "started_at": "2026-11-30T00:00:00"}]}
    (tmp_path / "coeffs.json").write_text(json.dumps(engine_only))
    (tmp_path / "calib.json").write_text(json.dumps(calib))
    (tmp_path / "measured.json").write_text(json.dumps(measured))
    assert main([str(tmp_path / "measured.json"), "--calibrate-from", str(tmp_path / "calib.json"),
                 "--coefficients", str(tmp_path / "coeffs.json"), "--json", str(tmp_path / "rows.json")]) == 0
    out = capsys.readouterr().out
    assert f"fitted to the worker counters of bench serve runs {tmp_path / 'calib.json'}" in out
    assert "no host processor sharing on top" in out
    row = json.loads((tmp_path / "rows.json").read_text())["rows"][0]
    # 6 requests, one at a time: a decode step of one sequence is about 10 ms + 20 us x 108 tokens
    assert 11.0 < row["tpot_p50"]["simulated_ms"] < 14.0


def test_median_of_one_measurement_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "only.json"), "--median"])


def test_a_line_sums_up_the_rates_each_system_sustained():
    def row(label: str, mode: str, rate: float, err: float) -> dict:
        c = cell(100.0, 100.0 + err)
        return {"label": label, "rate": rate, "mode": mode, **{f"{k}_p{q}": dict(c) for _, k, q in METRICS}}

    rows = [row("d", "disaggregated", 2.0, 5.0), row("d", "disaggregated", 4.0, 20.0),
            row("d", "disaggregated", 8.0, 90.0), row("c", "colocated", 2.0, -8.0), row("c", "colocated", 4.0, 40.0)]
    line = within_capacity(rows, {"disaggregated": 4.0, "colocated": 2.0},
                           {"d": "disaggregated", "c": "colocated"})
    n = len(METRICS)  # the 8 req/s and colocated 4 req/s cells are past what was sustained
    assert line == (f"Up to the highest rate each system sustained as measured (colocated 2, disaggregated 4 req/s): "
                    f"{2 * n} of {3 * n} within 10%; mean absolute error 11.0%, largest 20.0%")
    modes = {"d": "disaggregated", "c": "colocated"}
    assert within_capacity(rows, {"disaggregated": None, "colocated": None}, modes) is None  # none sustained
    only = within_capacity(rows, {"disaggregated": None, "colocated": 2.0}, modes)
    assert only.startswith("Up to the highest rate each system sustained as measured (colocated 2 req/s): ")
    assert f"{n} of {n} within 10%" in only
