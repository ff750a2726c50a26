"""benchmarks/tensor_parallel.py runs end to end (tiny sizes): both engines, every measure, the JSON."""

from __future__ import annotations

import json

import pytest

from benchmarks.tensor_parallel import main

pytestmark = pytest.mark.slow


def test_the_step_time_benchmark_measures_both_degrees(tmp_path, capsys):
    out = tmp_path / "tp.json"
    assert main(["--model", "builtin:tiny-llama", "--repeats", "1", "--prompt-tokens", "32", "--batch", "2",
                 "--decode-steps", "2", "--out", str(out)]) == 0
    medians = json.loads(out.read_text())["medians"]
    assert set(medians) == {"1", "2"}
    assert all(medians[tp][k] > 0 for tp in medians for k in ("prefill_ms", "decode_step_ms"))
    assert "TP2/TP1" in capsys.readouterr().out
