"""`pdcluster bench transfer` runs end to end (tiny sizes): every backend moves the bytes, the limits are measured."""

from __future__ import annotations

import json

import pytest

from benchmarks import kv_transfer as bench

pytestmark = pytest.mark.slow


def test_bench_transfer_small_case_writes_every_backend_and_limit(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--tokens", "64", "--layouts", "builtin", "--repeats", "1", "--overlap-tokens", "0",
                       "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["tokens"] == 64 and row["bytes"] == 2 * 6 * 4 * 16 * 4 * 48 * 4  # 2 x layers x blocks x 16 x kvh x hd x 4
    for key in ("socket_s", "memcpy_s", "grpc_raw_s", "grpc_s", "shm_s", "torch_distributed_s", "tcp_s"):
        assert row[key] is not None and row[key] > 0, key
    out = capsys.readouterr().out
    assert "grpc/sock" in out and "tcp/sock" in out


def test_quantized_pages_move_at_most_half_the_bytes_a_token_of_the_model_dtype(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--tokens", "64", "--layouts", "builtin,llama3-8b", "--repeats", "1", "--overlap-tokens", "0",
                       "--kv-cache-dtype", "int8", "--backends", "grpc,shm", "--out", str(out)]) == 0
    rows = {r["layout"]: r for r in json.loads(out.read_text())["rows"]}
    builtin, llama = rows["builtin"], rows["llama3-8b"]
    # builtin: float32, 6 layers x 4 KV heads x 48: a row of 48 bytes and a 4-byte scale instead of 192 bytes
    assert builtin["bytes_per_token"] == 2 * 6 * 4 * (48 + 4) and builtin["model_dtype_bytes_per_token"] == 9216
    assert builtin["bytes"] == 64 * builtin["bytes_per_token"] and builtin["grpc_s"] > 0 and builtin["shm_s"] > 0
    # llama3-8b: bfloat16 rows of 128 -> 132 bytes: 0.52x, "halve or better" within the scale's 3%
    assert llama["bytes_per_token"] / llama["model_dtype_bytes_per_token"] == pytest.approx(132 / 256)
    assert "KV bytes per token, builtin: 2496 as int8 pages, 9216 in the model's dtype (0.27x)" in capsys.readouterr().out


def test_overlap_takes_the_backend():
    ov = bench.overlap(64, 1, "tcp")
    assert ov["backend"] == "tcp" and set(ov["ttft_s"]) == {"normal", "sync", "compute"}
    assert all(t > 0 for t in ov["ttft_s"].values())
    t, paired = ov["ttft_all_s"], ov["hidden_fraction_paired"]
    b_c = t["sync"][0] - t["compute"][0]
    if b_c > 0:  # one round: the paired estimate is that round's
        assert paired == pytest.approx(1 - (t["normal"][0] - t["compute"][0]) / b_c)
    else:
        assert paired is None


@pytest.mark.parametrize("args, message", [
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--overlap-repeats", "0"], "--overlap-tokens 0 skips"),
])
def test_bad_counts_are_refused_before_any_work(args, message, capsys):
    from benchmarks.kv_transfer import main

    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2 and message in capsys.readouterr().err
