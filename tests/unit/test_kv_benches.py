"""The KV cache benchmarks run end to end on small inputs: the quality of each page format and the
bound on the yardstick model, and the capacity and decode-attention timing per format."""

from __future__ import annotations

import re

from benchmarks import kv_pages, kv_quality


def test_the_quality_benchmark_scores_every_format_and_bound(capsys):
    assert kv_quality.main(["--tokens", "400", "--window", "100", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    rows = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\s+(\S+(?: \S+)?)\s+perplexity\s+([\d.]+)", out, re.M)}
    assert set(rows) == {"auto", "int8", "fp8_e4m3", "fp8_e5m2", "bound 16+128", "bound 16+64"}
    assert all(1 < ppl < 4096 for ppl in rows.values())  # a trained model: far below its vocabulary
    assert abs(rows["int8"] / rows["auto"] - 1) < 0.02
    assert "top-1 agreement with auto 100.00%" in out  # auto against itself


def test_the_pages_benchmark_times_every_format(capsys):
    assert kv_pages.main(["--context", "64", "--batch", "1", "--repeats", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("int8") == 4 and "3.76x" in out and "bytes 0.27x" in out and "bytes 0.53x" in out
