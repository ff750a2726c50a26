"""benchmarks/tensor_parallel.py and benchmarks/tp_kv_paths.py run end to end (tiny sizes): every measure, the JSON."""

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
    assert set(medians) == {"tp1", "tp2"}
    assert all(medians[tp][k] > 0 for tp in medians for k in ("prefill_ms", "decode_step_ms"))
    assert "TP2/TP1" in capsys.readouterr().out


def test_the_step_time_benchmark_sets_expert_parallelism_against_tensor_parallelism(tmp_path, capsys):
    out = tmp_path / "ep.json"
    assert main(["--model", "builtin:tiny-moe", "--layouts", "tp2,ep2", "--repeats", "1", "--prompt-tokens", "32",
                 "--batch", "2", "--decode-steps", "2", "--out", str(out)]) == 0
    medians = json.loads(out.read_text())["medians"]
    assert set(medians) == {"tp2", "ep2"} and all(medians[n]["decode_step_ms"] > 0 for n in medians)
    assert "EP2/TP2" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--layouts", "tp3"])


def test_the_kv_paths_benchmark_measures_both_paths(tmp_path, capsys):
    """benchmarks/tp_kv_paths.py: the direct path's prefill rank 0 sends half the bytes of the fallback's."""
    from benchmarks.tp_kv_paths import main as kv_paths

    out = tmp_path / "tp_kv.json"
    assert kv_paths(["--model", "builtin:tiny-llama", "--repeats", "1", "--requests", "1", "--prompt-tokens", "40",
                     "--out", str(out)]) == 0
    medians = json.loads(out.read_text())["medians"]
    assert medians["direct"]["rank0_kv_mb"] * 2 == pytest.approx(medians["fallback"]["rank0_kv_mb"])
    assert all(medians[p]["ttft_ms"] > 0 for p in ("direct", "fallback"))
    assert "fallback" in capsys.readouterr().out
