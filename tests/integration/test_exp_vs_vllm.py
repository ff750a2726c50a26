"""benchmarks/serving_vs_vllm.py (scripts/exp_vs_vllm.py) end to end against a stand-in vLLM
server (tests/data/fake_vllm, which serves with a real colocated pdcluster): real servers, one
interleaved bench serve run, the analysis and its report. With the real vLLM venv the same script
runs the real peer."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from benchmarks import serving_vs_vllm as exp

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_serving_side_by_side_reports_every_system(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests/data/fake_vllm"), str(ROOT)]))
    rc = exp.main(["--systems", "vllm,colocated", "--rates", "4", "--num-requests", "6", "--max-context", "256",
                   "--max-output", "8", "--time-limit-s", "60",
                   "--slo-ttft-ms", "20000", "--slo-tpot-ms", "2000", "--vllm-python", sys.executable,
                   "--vllm-timeout-s", "300", "--out", str(tmp_path)])
    assert rc == 0
    summary = json.loads((tmp_path / "exp_summary.json").read_text())
    assert set(summary["table"]) == {"vllm", "colocated"} and summary["rates"] == [4.0]
    for system in ("vllm", "colocated"):
        row = summary["table"][system]["4.0"]
        assert row["failed"] == 0 and row["unfinished"] == 0 and row["ttft_p50"] > 0
    assert summary["best_ours"] == "colocated" and summary["sustained_ratio_vs_vllm"] == 1.0  # both meet it
    assert "best of ours (colocated) / vLLM" in capsys.readouterr().out
