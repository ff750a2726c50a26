"""benchmarks/serving_vs_vllm.py (scripts/exp_vs_vllm.py) without servers: its flags' errors, the
analysis of a bench serve result and the report (the end-to-end run is
tests/integration/test_exp_vs_vllm.py)."""

from __future__ import annotations

import pytest

from benchmarks import serving_vs_vllm as exp


def test_unknown_system_and_missing_vllm_are_clear_errors(tmp_path, capsys):
    with pytest.raises(SystemExit):
        exp.main(["--systems", "sglang", "--out", str(tmp_path)])
    assert "--systems takes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        exp.main(["--vllm-python", str(tmp_path / "nope"), "--out", str(tmp_path)])
    assert "install_vllm_cpu.sh" in capsys.readouterr().err


def test_analysis_finds_each_systems_highest_rate_and_the_ratios():
    def run(label, rate, attainment, tpot_p99):
        return {"label": label, "rate": rate, "summary": {
            "slo_attainment": attainment, "goodput": rate * attainment, "failed": 0, "unfinished": 0,
            "ttft_ms": {"p50": 100.0 / rate, "p90": 200.0, "p99": 300.0},
            "tpot_ms": {"p50": 10.0 * rate, "p99": tpot_p99}}}

    runs = [run("vllm", 4, 0.99, 30), run("vllm", 8, 0.5, 90),
            run("colocated", 4, 0.98, 40), run("colocated", 8, 0.95, 60),
            run("disaggregated", 4, 1.0, 20), run("disaggregated", 8, 0.7, 24)]
    a = exp.analyse({"runs": runs})
    assert a["max_rate_meeting_slo"] == {"vllm": 4, "colocated": 8, "disaggregated": 4}
    assert a["best_ours"] == "colocated" and a["sustained_ratio_vs_vllm"] == 2.0
    assert a["disagg_over_colocated_tpot_p99"] == {"rate": 8, "ratio": 0.4}
    assert a["lowest_rate"]["vllm"] == {"ttft_p50": 25.0, "tpot_p50": 40.0}
    text = exp.report(a, "TTFT <= 1000 ms and TPOT <= 50 ms")
    assert "**2.00x**" in text and "| 8 | colocated | 95% |" in text


def test_repeats_combine_into_medians_and_the_median_ratio(tmp_path):
    import json

    def run(label, rate, attainment):
        return {"label": label, "rate": rate, "summary": {
            "slo_attainment": attainment, "goodput": rate * attainment, "failed": 0, "unfinished": 0,
            "ttft_ms": {"p50": 50.0, "p90": 90.0, "p99": 99.0}, "tpot_ms": {"p50": 10.0, "p99": 30.0}}}

    dirs = []
    for i, (v8, e8) in enumerate([(0.95, 0.95), (0.80, 0.95), (0.95, 0.70)]):
        a = exp.analyse({"runs": [run("vllm", 4, 1.0), run("vllm", 8, v8),
                                  run("elastic", 4, 1.0), run("elastic", 8, e8)]})
        d = tmp_path / f"r{i}"
        d.mkdir()
        (d / "exp_summary.json").write_text(json.dumps(a))
        dirs.append(str(d))
    assert exp.main(["--combine", *dirs, "--out", str(tmp_path / "all")]) == 0
    text = (tmp_path / "all" / "combined.md").read_text()
    assert "| 8 | vllm | 95% (80%-95%) |" in text and "| 8 | elastic | 95% (70%-95%) |" in text
    assert "1.00x (elastic)" in text and "2.00x (elastic)" in text and "0.50x (elastic)" in text
    assert "**1.00x**" in text  # the median of 1.0, 2.0 and 0.5
