"""benchmarks/engine_kernels.py runs end to end on the tiny model and reports every section."""

from __future__ import annotations

import json

import pytest

from benchmarks import engine_kernels
from engine import linear_panels
from engine.native import native_lib


@pytest.mark.skipif(not linear_panels.served(native_lib(), __import__("torch").float32),
                    reason="the panel kernel needs AVX2 or AVX-512")
def test_kernel_bench_reports_each_section(tmp_path, capsys):
    out = tmp_path / "k.json"
    rc = engine_kernels.main(["--model", "builtin:tiny-llama", "--dtype", "float32", "--repeats", "1", "--rows", "1,7",
                              "--prefill-rows", "64", "--prompt-lens", "40", "--batches", "2", "--context", "16",
                              "--steps", "3", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())["report"]
    assert [r["rows"] for r in report["decode_linears"]] == [1, 7]
    assert all(r["panels_s"] > 0 and r["roofline_s"] > 0 for r in report["decode_linears"])
    assert report["decode_step"][0]["batch"] == 2 and report["decode_step"][0]["context"] > 16
    text = capsys.readouterr().out
    assert "of roofline" in text and "GFLOP/s" in text and "goal 60%" in text


def test_roofline_is_the_slower_of_reads_and_flops():
    # 1e9 params of 2 bytes at 100 GB/s: 20 ms; at batch 64 the flops (128 GFLOP at 1 TFLOP/s) take 128 ms
    assert engine_kernels.decode_step_roofline(10 ** 9, 2, 0.0, 1, 1.0, 100.0) == pytest.approx(0.02)
    assert engine_kernels.decode_step_roofline(10 ** 9, 2, 0.0, 64, 1.0, 100.0) == pytest.approx(0.128)
