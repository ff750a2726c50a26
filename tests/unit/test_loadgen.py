"""loadgen without a server: trace parsing, prompts with shared prefixes, scaling, arrivals, metrics, SSE."""

from __future__ import annotations

import csv
import itertools
import json
import math
import statistics
from pathlib import Path

import pytest

from loadgen import cli as loadgen_cli
from loadgen.arrivals import ArrivalConfig, arrival_offsets, gamma_offsets, poisson_offsets
from loadgen.cli import redact, schedule
from loadgen.client import EndpointConfig, RequestRecord, StreamState
from loadgen.metrics import SLO, percentile, summarize
from loadgen.prompts import PromptBuilder
from loadgen.scaling import choose_factor, scale_lengths
from loadgen.sse import SSEDecoder, parse_chunk
from loadgen.workload import (
    NAMED,
    WORKLOADS_ENV,
    LengthDist,
    WorkloadConfig,
    load_workload,
    mooncake_segments,
    read_azure,
    read_mooncake,
    workloads_dir,
)


def _trace(name: str) -> Path:
    return (workloads_dir() / NAMED[name][0]).resolve()


# ------------------------------------------------------------------------------------------ workloads
FULL_ROWS = {"azure-conv": 19366, "azure-code": 8819, "mooncake-conv": 12031, "mooncake-synthetic": 3993}


def test_the_named_traces_ship_whole_inside_the_package(monkeypatch):
    """A clone or an install with nothing beside it has every named trace, every row of it."""
    monkeypatch.delenv(WORKLOADS_ENV, raising=False)
    root = Path(loadgen_cli.__file__).resolve().parent
    assert workloads_dir() == root / "traces"
    for name, rows in FULL_ROWS.items():
        path = _trace(name)
        assert path.parent == root / "traces"
        reader = read_azure if path.suffix == ".csv" else read_mooncake
        assert sum(1 for _ in reader(path)) == rows, name
    licences = (root / "traces" / "README.md").read_text()
    assert "CC-BY-4.0" in licences and "Apache-2.0" in licences
    assert (root / "traces" / "LICENSE-Apache-2.0").read_text().lstrip().startswith("Apache License")


def test_another_directory_of_traces_is_read_when_named(tmp_path, monkeypatch):
    (tmp_path / NAMED["azure-code"][0]).write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                                   "2023-11-16 18:15:46.6805900,374,44\n")
    monkeypatch.setenv(WORKLOADS_ENV, str(tmp_path))
    w = load_workload(WorkloadConfig("azure-code", 1))
    assert w.path == str((tmp_path / NAMED["azure-code"][0]).resolve()) and w.requests[0].prompt_len == 374


def test_azure_csv_timestamps_become_offsets_from_the_first_row(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:15:46.6805900,374,44\n"
                 "2023-11-16 18:15:50.9951690,396,109\n"
                 "2023-11-16 18:16:00.0000000,10,1\n")
    rows = list(read_azure(f))
    assert [(r.input_len, r.output_len) for r in rows] == [(374, 44), (396, 109), (10, 1)]
    assert [r.timestamp_s for r in rows] == pytest.approx([0.0, 4.314579, 13.31941])
    w = load_workload(WorkloadConfig(str(f), 2))
    assert [r.arrival_s for r in w.requests] == pytest.approx([0.0, 4.314579])
    assert [(r.prompt_len, r.output_len) for r in w.requests] == [(374, 44), (396, 109)]
    assert w.kind == "azure" and w.scaling.factor == 1.0
    with pytest.raises(ValueError, match="only 3 rows"):
        load_workload(WorkloadConfig(str(f), 4))


def test_mooncake_jsonl_parses_milliseconds_and_hash_ids(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(json.dumps(d) for d in [
        {"timestamp": 1000, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 3500, "input_length": 600, "output_length": 7, "hash_ids": [1, 4]}]) + "\n")
    rows = list(read_mooncake(f))
    assert [r.timestamp_s for r in rows] == [0.0, 2.5]
    assert rows[0].hash_ids == [1, 2, 3] and (rows[1].input_len, rows[1].output_len) == (600, 7)
    w = load_workload(WorkloadConfig(str(f), 2))
    assert w.kind == "mooncake" and w.scaling.block_tokens == 512
    assert len(w.requests[0].prompt.split()) == 1100  # one word per token without a tokenizer


def test_first_rows_of_the_real_traces():
    for name in ("azure-conv", "azure-code"):
        with open(_trace(name), newline="") as f:
            want = [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for _, r in zip(range(5), csv.DictReader(f))]
        w = load_workload(WorkloadConfig(name, 5))
        assert [(r.prompt_len, r.output_len) for r in w.requests] == want
        assert w.requests[0].arrival_s == 0.0 and all(b >= a for a, b in zip(
            [r.arrival_s for r in w.requests], [r.arrival_s for r in w.requests][1:]))
        assert "Azure/AzurePublicDataset" in w.citation and "CC-BY-4.0" in "\n".join(w.describe())
    for name in ("mooncake-conv", "mooncake-synthetic"):
        with open(_trace(name)) as f:
            want = [json.loads(next(f)) for _ in range(5)]
        w = load_workload(WorkloadConfig(name, 5))
        assert [(r.prompt_len, r.output_len, r.hash_ids) for r in w.requests] == [
            (d["input_length"], d["output_length"], d["hash_ids"]) for d in want]
        assert "kvcache-ai/Mooncake" in w.citation


def test_a_seeded_sample_is_reproducible_and_in_trace_order():
    a = load_workload(WorkloadConfig("azure-conv", 20, sample_seed=3))
    b = load_workload(WorkloadConfig("azure-conv", 20, sample_seed=3))
    c = load_workload(WorkloadConfig("azure-conv", 20, sample_seed=4))
    key = lambda w: [(r.prompt_len, r.output_len, r.arrival_s) for r in w.requests]
    assert key(a) == key(b) != key(c)
    assert a.requests[0].arrival_s == 0.0 and sorted(r.arrival_s for r in a.requests) == [r.arrival_s for r in a.requests]
    assert [r.prompt for r in a.requests] == [r.prompt for r in b.requests]


def test_sampling_conversations_keeps_each_conversations_turns(tmp_path):
    # conversations A (rows 0, 4), B (1, 5), C (2, 3, 6), by their full 512-token blocks; drawing A, B,
    # then C for 5 rows must cut C alone (to its first turn), not drop the latest rows of B and C
    chains = {"A": [[0, 1, 2], [0, 1, 2, 3]], "B": [[0, 7, 8], [0, 7, 8, 9]],
              "C": [[0, 5, 6], [0, 5, 6, 10], [0, 5, 6, 10, 11]]}
    order = ["A", "B", "C", "C", "A", "B", "C"]
    turn = {c: 0 for c in chains}
    rows = []
    for c in order:
        rows.append((c, chains[c][turn[c]]))
        turn[c] += 1
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(json.dumps({"timestamp": t * 1000, "input_length": 512 * len(h), "output_length": 4,
                                        "hash_ids": h}) for t, (_, h) in enumerate(rows)) + "\n")
    seen_cut = set()
    for seed in range(12):
        w = load_workload(WorkloadConfig(str(f), 5, sample_seed=seed, sample_unit="conversations"))
        picked = [next(j for j, (_, h) in enumerate(rows) if h == r.hash_ids) for r in w.requests]
        assert picked == sorted(picked) and len(picked) == 5  # trace order, the requested rows
        for c, turns in chains.items():
            got = [rows[j][1] for j in picked if rows[j][0] == c]
            assert got == turns[: len(got)]  # a conversation's first turns, never a later one alone
        cut = {c for c, turns in chains.items() if 0 < sum(rows[j][0] == c for j in picked) < len(turns)}
        assert len(cut) <= 1  # only the last conversation drawn is cut
        seen_cut |= cut
    assert seen_cut  # some draw did have to cut one
    with pytest.raises(ValueError, match="needs a sample seed"):
        load_workload(WorkloadConfig(str(f), 2, sample_unit="conversations"))
    with pytest.raises(ValueError, match="needs a Mooncake trace"):
        load_workload(WorkloadConfig("azure-conv", 2, sample_seed=1, sample_unit="conversations"))


def test_a_conversation_sample_of_the_mooncake_trace_repeats_more_than_its_first_rows():
    def repeated(w: object) -> float:
        seen, hit, total = set(), 0, 0
        for r in w.requests:
            hit += sum(h in seen for h in r.hash_ids)
            total += len(r.hash_ids)
            seen.update(r.hash_ids)
        return hit / total
    first = repeated(load_workload(WorkloadConfig("mooncake-conv", 200)))
    sampled = repeated(load_workload(WorkloadConfig("mooncake-conv", 200, sample_seed=0, sample_unit="conversations")))
    assert first < 0.1 and sampled > 0.25  # the whole trace: 37% of blocks repeat an earlier request's


def test_synthetic_length_distributions():
    assert LengthDist.parse("fixed:7").sample(None) == 7  # type: ignore[arg-type]
    w = load_workload(WorkloadConfig("synthetic", 400, synthetic_input="uniform:10:20",
                                     synthetic_output="lognormal:50:0.5", seed=1))
    assert {r.prompt_len for r in w.requests} <= set(range(10, 21)) and len({r.prompt_len for r in w.requests}) == 11
    assert 40 < statistics.median(r.output_len for r in w.requests) < 60
    assert all(r.arrival_s is None for r in w.requests)
    for bad in ("fixed", "uniform:5", "uniform:9:3", "normal:1:2", "lognormal:0:1"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


# ------------------------------------------------------------------------------------------ prompts
def _common_prefix(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_mooncake_hash_ids_become_shared_prompt_prefixes(tmp_path):
    f = tmp_path / "t.jsonl"
    rows = [([1, 2, 3], 1500), ([1, 2, 4], 1400), ([5, 2, 3], 1500), ([1, 2], 1024)]
    f.write_text("".join(json.dumps({"timestamp": 0, "input_length": n, "output_length": 4, "hash_ids": ids}) + "\n"
                         for ids, n in rows))
    w = load_workload(WorkloadConfig(str(f), 4, scale_lengths=1 / 16))  # blocks of 32 tokens
    assert w.scaling.block_tokens == 32
    p = [r.prompt.split() for r in w.requests]
    assert [len(x) for x in p] == [93, 87, 93, 64]
    assert _common_prefix(p[0], p[1]) >= 64 and p[0][:64] == p[1][:64]  # ids 1, 2 shared
    assert p[0][64:70] != p[1][64:70]  # 3 vs 4
    assert p[0][:32] != p[2][:32] and p[0][32:64] == p[2][32:64]  # block 2 is the same text wherever it is
    assert p[3] == p[0][:64]  # a prompt that is exactly two blocks


def test_a_prompt_salt_changes_the_texts_not_the_lengths_nor_what_they_share(tmp_path):
    """bench serve --fresh-prompts: each rate's prompts are salted; within a salt the shared prefixes
    stay shared, across salts nothing is (no prefix cached by an earlier run is reused)."""
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps({"timestamp": 0, "input_length": 1500, "output_length": 4, "hash_ids": ids}) + "\n"
                         for ids in ([1, 2, 3], [1, 2, 4])))
    plain, salted, other = (load_workload(WorkloadConfig(str(f), 2, scale_lengths=1 / 16, prompt_salt=s))
                            for s in ("", "rate1", "rate2"))
    for w in (salted, other):
        assert [len(r.prompt.split()) for r in w.requests] == [len(r.prompt.split()) for r in plain.requests]
        a, b = (r.prompt.split() for r in w.requests)
        assert a[:64] == b[:64] and a[64:70] != b[64:70]  # ids 1, 2 still shared within the run
    for x, y in itertools.combinations((plain, salted, other), 2):
        assert all(p.prompt.split()[:8] != q.prompt.split()[:8] for p, q in zip(x.requests, y.requests))
    assert loadgen_cli.prompt_salt(0) == "" and loadgen_cli.prompt_salt(1) != loadgen_cli.prompt_salt(2)


def test_real_mooncake_prefixes_are_shared_token_for_token(builtin_path):
    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer(builtin_path)
    w = load_workload(WorkloadConfig("mooncake-conv", 6, max_context=2048), tok, "builtin:tiny-llama")
    block = w.scaling.block_tokens
    assert block == math.floor(512 * w.scaling.factor)
    ids = [tok.encode(r.prompt) for r in w.requests]
    assert all(len(x) == r.prompt_len == r.prompt_tokens_measured for x, r in zip(ids, w.requests))
    for i in range(1, len(w.requests)):  # all start with hash id 0, then differ
        a, b = w.requests[0].hash_ids, w.requests[i].hash_ids
        shared = _common_prefix(a, b)
        assert shared == 1
        n = _common_prefix(ids[0], ids[i])
        assert block <= n < 2 * block + 2, (i, n, block)


def test_prompts_hit_the_token_count_exactly_with_a_tokenizer(builtin_path):
    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer(builtin_path)
    b = PromptBuilder(seed=5, tokenizer=tok)
    for n in (2, 3, 17, 100, 511, 1000):
        p = b.build(n, [(f"k{n}", n)])
        assert len(tok.encode(p.text)) == p.tokens == n
    rough = PromptBuilder(seed=5).build(300, [("x", 300)])
    assert rough.tokens is None and len(rough.text.split()) == 300
    assert 290 <= len(tok.encode(rough.text)) <= 330  # common words are about one token each


def test_mooncake_segments_fill_the_prompt_with_leading_blocks():
    assert mooncake_segments([7, 8, 9], 70, 32) == [("h7", 32), ("h8", 32), ("h9", 6)]
    assert mooncake_segments([7, 8, 9], 64, 32) == [("h7", 32), ("h8", 32)]
    assert mooncake_segments([7, 8], 70, 32) == [("h7", 32), ("h8", 38)]  # rounding left over: the last id's text
    assert mooncake_segments([], 5, 32) == [("unhashed", 5)]


# ------------------------------------------------------------------------------------------ scaling
def test_scaling_follows_bench_engines_rule_and_prints_it():
    pairs = [(300, 100), (50, 10), (1, 1)]
    factor, rule = choose_factor(pairs, max_context=100)
    assert factor == 0.25 and "max_context 100 / longest prompt+output 400" in rule
    prompts, outputs = scale_lengths(pairs, factor, max_output=20, max_context=100)
    assert prompts == [75, 12, 1] and outputs == [20, 2, 1]  # max(1, floor(x * f)), then the cap
    assert choose_factor(pairs)[0] == 1.0 and choose_factor(pairs, scale=2.0)[0] == 2.0
    assert choose_factor([(10, 10)], max_context=100)[0] == 1.0  # never scales up
    with pytest.raises(ValueError):
        choose_factor(pairs, max_context=100, scale=0.5)
    with pytest.raises(ValueError, match="too small"):
        scale_lengths([(1000, 1000), (1, 1)], 0.001, max_context=1)
    w = load_workload(WorkloadConfig("azure-conv", 10, max_context=512, max_output=32))
    text = "\n".join(w.describe())
    longest = max(r.prompt_len for r in load_workload(WorkloadConfig("azure-conv", 10)).requests)
    assert "factor = min(1, max_context 512 / longest prompt+output" in text
    assert f"= {w.scaling.factor:.4g}" in text and "output_i = min(32, max(1, floor(output_i *" in text
    assert "prompt before  min" in text and f"max {longest}" in text and "prompt after" in text
    assert all(r.prompt_len + r.output_len <= 512 and r.output_len <= 32 for r in w.requests)
    assert w.scaling.prompt_after.max == max(r.prompt_len for r in w.requests)


# ------------------------------------------------------------------------------------------ arrivals
def test_poisson_arrivals_have_the_rate():
    offs = poisson_offsets(4000, 10.0, seed=1)
    assert offs[0] == 0.0 and offs == sorted(offs) and offs == poisson_offsets(4000, 10.0, seed=1)
    assert 3999 / offs[-1] == pytest.approx(10.0, rel=0.05)
    gaps = [b - a for a, b in itertools.pairwise(offs)]
    assert statistics.variance(gaps) * 100 == pytest.approx(1.0, rel=0.1)  # exponential: var = 1/R^2
    assert poisson_offsets(3, math.inf) == [0.0, 0.0, 0.0]


def test_gamma_burstiness_sets_the_variance_not_the_mean():
    for k in (0.25, 1.0, 4.0):
        offs = gamma_offsets(8000, 5.0, k, seed=2)
        gaps = [b - a for a, b in itertools.pairwise(offs)]
        assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.06)
        assert statistics.variance(gaps) * 25 == pytest.approx(1 / k, rel=0.15)  # var = 1 / (k R^2)
    with pytest.raises(ValueError):
        gamma_offsets(3, 1.0, 0.0)


def test_trace_arrivals_keep_or_rescale_the_traces_times():
    ts = [0.0, 1.0, 3.0, 4.0]
    a = arrival_offsets(ArrivalConfig("trace"), 4, ts)
    assert a.offsets == ts and a.time_scale == 1.0
    assert arrival_offsets(ArrivalConfig("trace", time_scale=0.5), 4, ts).offsets == [0.0, 0.5, 1.5, 2.0]
    r = arrival_offsets(ArrivalConfig("trace", rate=3.0), 4, ts)
    assert r.mean_rate == pytest.approx(3.0) and "mean rate 3" in r.description
    with pytest.raises(ValueError, match="needs a trace"):
        arrival_offsets(ArrivalConfig("trace"), 2, [None, None])
    with pytest.raises(ValueError, match="needs --rate"):
        arrival_offsets(ArrivalConfig("poisson"), 2)


# ------------------------------------------------------------------------------------------ metrics
def _rec(i: int, ttft: float, gaps: list[float], ok: bool = True, kind: str | None = None) -> RequestRecord:
    r = RequestRecord(i, scheduled_s=0.0, start_s=1.0)
    t = 1.0 + ttft
    r.chunk_s = [t]
    for g in gaps:
        t += g
        r.chunk_s.append(t)
    r.chunk_tokens = [1] * len(r.chunk_s)
    r.end_s, r.output_tokens = t, len(r.chunk_s)
    r.outcome = "ok" if ok else "failed"
    if not ok:
        r.chunk_s, r.chunk_tokens, r.output_tokens, r.error_kind = [], [], 0, kind
    return r


def test_percentiles_interpolate_like_numpy():
    xs = [float(x) for x in range(1, 101)]
    assert percentile(xs, 50) == pytest.approx(50.5)
    assert percentile(xs, 90) == pytest.approx(90.1)
    assert percentile(xs, 99) == pytest.approx(99.01)
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) is None


def test_summary_slo_attainment_and_goodput_on_hand_made_records():
    recs = [_rec(0, 0.1, [0.02, 0.02, 0.02]),  # TTFT 100 ms, TPOT 20 ms: meets both
            _rec(1, 0.5, [0.02, 0.02]),  # TTFT too slow
            _rec(2, 0.1, [0.05, 0.07]),  # TPOT 60 ms: too slow
            _rec(3, 0.2, []),  # one token: no TPOT, meets
            _rec(4, 0, [], ok=False, kind="http 500"),
            RequestRecord(5, 9.0, outcome="not_sent", error_kind="not sent")]
    s = summarize(recs, duration_s=2.0, slo=SLO(ttft_ms=300, tpot_ms=50))
    assert (s.requests, s.sent, s.completed, s.failed, s.not_sent) == (6, 5, 4, 1, 1)
    assert s.failures == {"http 500": 1, "not sent": 1}
    assert s.ttft_ms.p50 == pytest.approx(150.0) and s.ttft_ms.n == 4 and s.ttft_ms.max == pytest.approx(500.0)
    assert recs[2].tpot == pytest.approx(0.06) and recs[3].tpot is None
    assert s.tpot_ms.n == 3 and s.tpot_ms.p50 == pytest.approx(20.0)
    assert s.itl_ms.n == 7 and s.itl_ms.p50 == pytest.approx(20.0) and s.itl_ms.max == pytest.approx(70.0)
    assert s.send_lag_ms.n == 5 and s.send_lag_ms.p50 == pytest.approx(1000.0)  # sent at 1.0, due at 0.0
    assert s.e2e_ms.p50 == pytest.approx(210.0)  # e2e 160, 200, 220, 540 ms
    assert s.slo_attainment == pytest.approx(2 / 5) and s.goodput == pytest.approx(1.0)
    assert s.ttft_attainment == pytest.approx(3 / 5) and s.tpot_attainment == pytest.approx(3 / 5)
    assert s.request_throughput == pytest.approx(2.0) and s.output_throughput == pytest.approx((4 + 3 + 3 + 1) / 2)
    none = summarize(recs, 2.0)
    assert none.slo_attainment is None and none.goodput is None


# ------------------------------------------------------------------------------------------ SSE
CAPTURED = (  # an OpenAI-format /v1/completions stream with include_usage (as vLLM and pdcluster send it)
    ': keep-alive comment\r\n\r\n'
    'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" Hello",'
    '"logprobs":null,"finish_reason":null}],"usage":null}\r\n\r\n'
    'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" world",'
    '"logprobs":null,"finish_reason":null}],"usage":null}\n\n'
    'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"",'
    '"logprobs":null,"finish_reason":"length"}],"usage":null}\n\n'
    'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[],'
    '"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}}\n\n'
    'data: [DONE]\n\n'
)


def test_sse_decoder_reassembles_events_split_anywhere():
    whole = SSEDecoder().feed(CAPTURED.encode())
    assert len(whole) == 5 and whole[-1] == "[DONE]"
    for step in (1, 7, 50):
        dec, got = SSEDecoder(), []
        raw = CAPTURED.encode()
        for i in range(0, len(raw), step):
            got += dec.feed(raw[i:i + step])
        assert got == whole
    assert SSEDecoder().feed("data: a\ndata: b\n\n") == ["a\nb"]
    dec = SSEDecoder()
    assert dec.feed("data: [DONE]") == [] and dec.close() == ["[DONE]"]


def test_parsed_stream_fills_a_record():
    chunks = [parse_chunk(p) for p in SSEDecoder().feed(CAPTURED)]
    assert [c.content for c in chunks] == [True, True, False, False, False]
    assert chunks[2].finish_reason == "length" and chunks[3].usage["completion_tokens"] == 3 and chunks[4].done
    rec, state = RequestRecord(0, 0.0, start_s=10.0), StreamState()
    for t, c in zip([10.2, 10.25, 10.3, 10.3, 10.3], chunks):
        if state.take(c, t, rec):
            break
    state.finish(rec, 10.4)
    assert rec.ok and rec.ttft == pytest.approx(0.2) and rec.end_s == 10.3 and rec.e2e == pytest.approx(0.3)
    assert rec.output_tokens == 3 and rec.output_tokens_from == "usage" and rec.prompt_tokens == 5
    assert rec.chunk_tokens == [1, 1] and rec.chunks_match_usage is False  # 3 tokens in 2 text chunks
    assert rec.tpot == pytest.approx(0.05) and rec.itls == [pytest.approx(0.05)]
    s = summarize([rec], 1.0)
    assert s.tokens_per_chunk_assumed  # reported: ITL assumed one token per chunk


def test_stream_errors_and_logprob_counts():
    err = parse_chunk('{"error": {"message": "boom", "type": "server_error"}}')
    assert err.error == "boom"
    rec, state = RequestRecord(0, 0.0, start_s=0.0), StreamState()
    state.take(err, 0.1, rec)
    state.finish(rec, 0.2)
    assert rec.outcome == "failed" and rec.error_kind == "stream error" and rec.error == "boom"
    rec, state = RequestRecord(0, 0.0, start_s=0.0), StreamState()
    state.finish(rec, 0.2)
    assert rec.error_kind == "incomplete stream"
    # one token whose text is an incomplete UTF-8 byte: no text chunk, usage says 1 token: an answer
    rec, state = RequestRecord(0, 0.0, start_s=0.0), StreamState()
    for t, raw in ((0.3, '{"choices":[{"index":0,"text":"","finish_reason":"length"}]}'),
                   (0.3, '{"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":1}}'), (0.3, "[DONE]")):
        state.take(parse_chunk(raw), t, rec)
    state.finish(rec, 0.4)
    assert rec.ok and rec.output_tokens == 1 and rec.ttft == pytest.approx(0.3) and rec.tpot is None
    two = parse_chunk('{"choices":[{"index":0,"text":"ab","logprobs":{"tokens":["a","b"]},"finish_reason":null}]}')
    assert two.content and two.tokens == 2
    chat = parse_chunk('{"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}')
    assert chat.content and chat.tokens is None
    assert parse_chunk("not json").error


# ------------------------------------------------------------------------------------------ cli
def test_endpoint_urls_labels_and_the_interleaved_schedule():
    e = EndpointConfig("127.0.0.1:8000/v1/")
    assert e.url == "http://127.0.0.1:8000" and e.label == "127.0.0.1:8000"
    a, b = EndpointConfig("http://a:1", "A"), EndpointConfig("http://b:1", "B")
    order = [(r, x.label) for r, x in schedule([1.0, 2.0, 4.0], [a, b])]
    assert order == [(1.0, "A"), (1.0, "B"), (2.0, "B"), (2.0, "A"), (4.0, "A"), (4.0, "B")]
    assert redact(["--api-key", "s3", "--api-key=s4", "--rate", "1"]) == ["--api-key", "***", "--api-key=***",
                                                                        "--rate", "1"]


def test_plots_are_skipped_with_a_message_without_matplotlib(tmp_path, monkeypatch):
    import sys

    from loadgen.report import RunReport, plots
    from loadgen.runner import RunResult

    recs = [_rec(0, 0.1, [0.02])]
    rep = RunReport(RunResult("A", "http://a", "m", 1.0, "Poisson", recs, 1.0, "workload done"), summarize(recs, 1.0))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    written, why = plots(tmp_path, [rep])
    assert written == [] and "matplotlib is not installed" in why and "pdcluster[plots]" in why
