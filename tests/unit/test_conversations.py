"""The multi-turn workload without a server: each turn's prompt is exactly the history plus a new
message, a Mooncake trace's requests grouped into conversations by hash_ids, think times and when
each turn is due, the flags refused with a clear message, TTFT by turn in the summary and report,
and the token ids a stream chunk carries."""

from __future__ import annotations

import json
import random

import pytest

from loadgen.cli import build_parser, conversation_config, load_tokenizer
from loadgen.client import RequestRecord, StreamState
from loadgen.conversation_run import next_due, turn_records
from loadgen.conversations import (
    ConversationConfig,
    History,
    MessageMaker,
    ThinkTime,
    Turn,
    load_conversations,
    synthetic_conversations,
    trace_turns,
)
from loadgen.metrics import summarize
from loadgen.report import RunReport, markdown, result_json, text_table
from loadgen.runner import RunResult
from loadgen.sse import parse_chunk
from loadgen.workload import LengthDist, TraceRow, trace_conversations

TOKENIZER = "builtin:tiny-llama"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOKENIZER)


def _small(**kw) -> ConversationConfig:
    return ConversationConfig("multiturn", **{"conversations": 3, "turns": "fixed:3", "first_prompt": "fixed:16",
                                              "message": "fixed:8", "output": "fixed:8", **kw})


# ------------------------------------------------------------------------------------------ history
def test_each_turns_prompt_is_the_previous_prompt_plus_the_answer_plus_the_message(tok):
    w = load_conversations(_small(turns="uniform:2:5", message="uniform:1:20"), tok, TOKENIZER)
    rng = random.Random(1)
    for conv in w.conversations:
        history, prev = History(MessageMaker(0, tok)), None
        for turn in conv.turns:
            prompt = history.prompt(turn)
            assert isinstance(prompt, list)
            if prev is None:
                assert prompt == tok.encode(MessageMaker(0, tok).first(turn)[0])
                assert len(prompt) == turn.message_len  # BOS counted in
            else:
                before, answer = prev
                assert prompt[:len(before) + len(answer)] == before + answer
                assert len(prompt) == len(before) + len(answer) + turn.message_len
            answer = [rng.randrange(3, 8000) for _ in range(turn.output_len)]
            assert history.answered(prompt, answer, "ignored") == "token_ids"
            prev = (prompt, answer)


def test_the_servers_prompt_ids_are_the_history_and_text_is_encoded_when_no_ids_came(tok):
    turns = [Turn(0, 0, 10, 4, 0.0), Turn(0, 1, 5, 4, 0.0), Turn(0, 2, 5, 4, 0.0)]
    h = History(MessageMaker(0, tok))
    h.prompt(turns[0])
    h.answered([1, 2, 3], [4, 5], "")  # what the server says it generated from wins
    assert h.prompt(turns[1])[:5] == [1, 2, 3, 4, 5]
    assert h.answered(None, None, " the cat") == "text"
    encoded = tok.encode(" the cat")[1:]  # without BOS
    assert h.ids[-len(encoded):] == encoded


def test_without_a_tokenizer_prompts_are_text_and_grow_by_the_answers_text():
    turns = [Turn(0, 0, 6, 4, 0.0), Turn(0, 1, 3, 4, 0.0)]
    h = History(MessageMaker(0, None))
    first = h.prompt(turns[0])
    assert isinstance(first, str) and len(first.split()) == 6
    h.answered(None, None, " and so on")
    second = h.prompt(turns[1])
    assert second.startswith(first + " and so on ") and len(second.split()) == 6 + 3 + 3


def test_fresh_prompt_salt_changes_texts_not_lengths(tok):
    t = Turn(0, 0, 12, 4, 0.0)
    a, b = MessageMaker(0, tok).first(t)[1], MessageMaker(0, tok, salt="rate1").first(t)[1]
    assert a != b and len(a) == len(b) == 12


# ------------------------------------------------------------------------------------------ the trace
def _row(t: float, inp: int, out: int, hashes: list[int]) -> TraceRow:
    return TraceRow(t, inp, out, hashes)


def test_trace_requests_are_grouped_by_their_full_blocks():
    rows = [_row(0, 1300, 100, [0, 1, 2]),  # blocks 0, 1 full, 2 partial
            _row(1, 900, 10, [0, 7]),  # shares only the system block: a conversation of its own
            _row(5, 2048, 50, [0, 1, 2, 3]),  # starts with row 0's full blocks (0, 1): its second turn
            _row(6, 1024, 20, [0, 8]),  # full blocks 0, 8 (1024 = 2 x 512)
            _row(7, 1400, 20, [0, 1, 4]),  # row 0 is continued already (by row 2): a branch, a new one
            _row(9, 2600, 30, [0, 1, 2, 3, 6]),  # row 2's blocks (all four full): its third turn
            _row(10, 1300, 30, [0, 8, 9]),  # row 3's full blocks (0, 8): its second turn
            _row(11, 1500, 30, [0, 1, 4, 5])]  # (0, 1): the latest request holding them is row 4
    assert trace_conversations(rows) == [[0, 2, 5], [1], [3, 6], [4, 7]]


def test_trace_turns_take_lengths_and_gaps_from_the_rows():
    rows = [_row(0, 1300, 100, [0, 1, 2]), _row(5, 1500, 50, [0, 1, 3]), _row(20, 1520, 10, [0, 1, 3])]
    conv = trace_turns(rows, [0, 1, 2], ThinkTime.parse("trace:0.5"), random.Random(0), 7)
    assert [(t.message_len, t.output_len, t.think_s) for t in conv.turns] == [
        (1300, 100, 0.0), (100, 50, 2.5), (1, 10, 7.5)]  # 1500 - 1400; 1520 - 1550 -> at least 1
    assert conv.index == 7 and all(t.conversation == 7 for t in conv.turns)


# ------------------------------------------------------------------------------------------ think time
def test_think_time_forms_and_when_each_turn_is_due():
    rng = random.Random(0)
    assert ThinkTime.parse("fixed:2.5").sample(rng) == 2.5
    assert 1 <= ThinkTime.parse("uniform:1:3").sample(rng) <= 3
    assert ThinkTime.parse("exponential:0").sample(rng) == 0.0
    assert ThinkTime.parse("trace").sample(rng, 4.0) == 4.0
    with pytest.raises(ValueError, match="needs a trace"):
        ThinkTime.parse("trace").sample(rng)
    for bad in ("fixed:-1", "uniform:3:1", "normal:1", "fixed", "fixed:x", "exponential:inf"):
        with pytest.raises(ValueError, match="--think-time"):
            ThinkTime.parse(bad)
    convs = synthetic_conversations(2, LengthDist.parse("fixed:3"), LengthDist.parse("fixed:4"),
                                    LengthDist.parse("fixed:2"), LengthDist.parse("fixed:2"),
                                    ThinkTime.parse("fixed:1.5"), 0)
    assert [t.think_s for t in convs[0].turns] == [0.0, 1.5, 1.5]
    recs = turn_records(convs, [0.0, 2.0])
    assert [[(r.index, r.conversation, r.turn, r.scheduled_s) for r in rs] for rs in recs] == [
        [(0, 0, 0, 0.0), (1, 0, 1, 0.0), (2, 0, 2, 0.0)], [(3, 1, 0, 2.0), (4, 1, 1, 2.0), (5, 1, 2, 2.0)]]
    recs[0][0].end_s = 3.25
    assert next_due(recs[0][0], 1.5) == 4.75  # the next turn: the answer's end plus the think time


def test_max_context_scales_the_longest_conversation_to_fit_and_drops_what_the_floors_push_over(tok):
    w = load_conversations(_small(turns="fixed:5", max_context=60), tok, TOKENIZER)
    assert w.scaling.factor == pytest.approx(60 / 88)  # 16 + 4 x 8 messages + 5 x 8 answers
    assert all(t.prompt_len + t.output_len <= 60 for c in w.conversations for t in c.turns)
    assert [t.prompt_len for t in w.conversations[0].turns] == [10, 20, 30, 40, 50]  # 16 -> 10, 8 -> 5
    tiny = load_conversations(_small(turns="fixed:40", first_prompt="fixed:1", message="fixed:1",
                                     output="fixed:1", max_context=20))
    assert [len(c.turns) for c in tiny.conversations] == [10] * 3  # turn k needs 2k + 2 tokens
    assert any("90 turn(s) dropped" in n for n in tiny.notes) and len(tiny.requests) == 30


# ------------------------------------------------------------------------------------------ flags
def _args(*argv: str):
    return build_parser().parse_args(["--endpoint", "http://x", *argv])


@pytest.mark.parametrize("argv, message", [
    (("--turns", "fixed:3"), "--turns applies to --workload multiturn"),
    (("--workload", "multiturn:mooncake-conv", "--turns", "fixed:2"), "the trace gives the lengths"),
    (("--workload", "multiturn", "--min-turns", "3"), "--min-turns does not apply"),
    (("--workload", "multiturn", "--sample-seed", "1"), "--sample-seed does not apply"),
])
def test_flags_that_do_not_apply_are_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        conversation_config(_args(*argv))


@pytest.mark.parametrize("cfg, message", [
    (_small(conversations=0), "--conversations must be at least 1"),
    (_small(turns="fixed:0"), "--turns: bad length distribution"),
    (_small(message="lognormal:3"), "--message-len: bad length distribution"),
    (_small(think="trace"), "--think-time trace needs a trace"),
    (ConversationConfig("multiturn:azure-conv", 2), "from a Mooncake .jsonl trace"),
    (ConversationConfig("multiturn:mooncake-conv", 10**6), "the trace has only"),
])
def test_bad_values_are_refused_with_the_flag_named(cfg, message):
    with pytest.raises(ValueError, match=message):
        load_conversations(cfg)


def test_flags_make_the_config():
    cfg = conversation_config(_args("--workload", "multiturn", "--conversations", "4", "--turns", "uniform:2:4",
                                    "--first-prompt-len", "fixed:32", "--message-len", "fixed:5",
                                    "--output-len", "fixed:6", "--think-time", "exponential:2", "--max-context", "99"))
    assert (cfg.conversations, cfg.turns, cfg.first_prompt, cfg.message, cfg.output, cfg.think, cfg.max_context) == (
        4, "uniform:2:4", "fixed:32", "fixed:5", "fixed:6", "exponential:2", 99)
    assert conversation_config(_args("--workload", "azure-conv")) is None


# ------------------------------------------------------------------------------------------ report
def _turn_rec(i: int, turn: int, ttft: float) -> RequestRecord:
    r = RequestRecord(i, 0.0, start_s=1.0, conversation=i // 2, turn=turn)
    r.chunk_s, r.chunk_tokens, r.end_s, r.output_tokens, r.outcome = [1.0 + ttft], [1], 1.0 + ttft, 1, "ok"
    return r


def test_ttft_of_the_first_turns_and_the_later_ones_are_apart(tok):
    recs = [_turn_rec(0, 0, 0.4), _turn_rec(1, 1, 0.1), _turn_rec(2, 0, 0.6), _turn_rec(3, 1, 0.2)]
    s = summarize(recs, 2.0)
    assert (s.ttft_first_turn_ms.n, s.ttft_first_turn_ms.p50) == (2, pytest.approx(500.0))
    assert (s.ttft_later_turns_ms.n, s.ttft_later_turns_ms.p50) == (2, pytest.approx(150.0))
    assert summarize([_turn_rec(0, 0, 0.1)][:0] + [RequestRecord(0, 0.0)], 1.0).ttft_first_turn_ms is None
    w = load_conversations(_small(conversations=2, turns="fixed:2"), tok, TOKENIZER)
    rep = RunReport(RunResult("sys", "http://x", "m", 1.0, "poisson", recs, 2.0, "workload done"), s)
    table = text_table([rep])
    assert "TTFT turn 1 p50/p90/p99 ms" in table and "TTFT turns 2+" in table and "500.0" in table
    assert "TTFT turns 2+" in markdown({}, w, [rep], [], [])
    out = json.loads(json.dumps(result_json({}, w, [rep]), default=str))
    assert out["workload"]["conversations"] == 2 and out["workload"]["prompts"] == "token ids"
    assert [(x["conversation"], x["turn"]) for x in out["runs"][0]["records"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert out["runs"][0]["summary"]["ttft_later_turns_ms"]["n"] == 2


def test_stream_chunks_give_their_token_ids_and_the_prompts():
    rec, state = RequestRecord(0, 0.0, start_s=0.0), StreamState()
    first = {"choices": [{"index": 0, "text": "", "token_ids": [7], "prompt_token_ids": [1, 2]}]}  # no text yet
    chat = {"prompt_token_ids": [1, 2], "choices": [{"index": 0, "delta": {"content": "ab"}, "token_ids": [8, 9]}]}
    for t, body in enumerate((first, chat, {"choices": [{"index": 0, "text": "", "token_ids": [],
                                                         "finish_reason": "length"}]})):
        state.take(parse_chunk(json.dumps(body)), 0.1 * (t + 1), rec)
    state.take(parse_chunk("[DONE]"), 0.5, rec)
    state.finish(rec, 0.5)
    assert state.token_ids == [7, 8, 9] and state.prompt_token_ids == [1, 2] and state.text == "ab"
    assert rec.ok and rec.chunk_tokens == [1, 2] and rec.chunk_tokens_from == "token_ids"
    assert rec.ttft == pytest.approx(0.1)  # a token that arrived without its text yet is the first token
