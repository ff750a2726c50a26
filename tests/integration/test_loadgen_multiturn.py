"""`pdcluster bench serve --workload multiturn` end to end against the real cluster stack (router +
prefill + decode worker + router/http_api.py, in this process): every turn answered, each turn's
prompt exactly the previous prompt + its answer + the new message, and TTFT reported for the first
turns and the later ones apart."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest

from engine.config import EngineConfig
from loadgen.cli import main
from pdcluster.local_cluster import LocalCluster

pytestmark = pytest.mark.slow

TOKENIZER = "builtin:tiny-llama"
FIRST, MESSAGE, OUTPUT, TURNS, CONVERSATIONS = 16, 8, 6, 3, 3


def test_a_multi_turn_run_on_the_real_cluster(builtin_path, tmp_path, capsys):
    cfg = EngineConfig(model=str(builtin_path), num_blocks=128, max_model_len=256, num_threads=1)
    with LocalCluster(cfg, router={"request_timeout_s": 60, "model_name": "tiny"}, http={}) as c:
        rc = main(["--endpoint", c.url, "--workload", "multiturn", "--conversations", str(CONVERSATIONS),
                   "--turns", f"fixed:{TURNS}", "--first-prompt-len", f"fixed:{FIRST}",
                   "--message-len", f"fixed:{MESSAGE}", "--output-len", f"fixed:{OUTPUT}",
                   "--think-time", "fixed:0.2", "--rate", "5", "--tokenizer", TOKENIZER, "--ignore-eos",
                   "--time-limit-s", "120", "--request-timeout-s", "60", "--out", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    result = json.loads((tmp_path / "result.json").read_text())
    run = result["runs"][0]
    records = run["records"]
    assert len(records) == CONVERSATIONS * TURNS
    assert all(r["outcome"] == "ok" for r in records), [r["error"] for r in records]
    for conv in range(CONVERSATIONS):
        turns = sorted((r for r in records if r["conversation"] == conv), key=lambda r: r["turn"])
        assert [r["turn"] for r in turns] == list(range(TURNS))
        assert turns[0]["prompt_tokens"] == FIRST
        for prev, nxt in pairwise(turns):
            assert prev["output_tokens"] == OUTPUT  # ignore_eos: exactly max_tokens
            assert nxt["prompt_tokens"] == prev["prompt_tokens"] + prev["output_tokens"] + MESSAGE
            assert nxt["start_s"] >= prev["end_s"] + 0.2 - 1e-6  # sent after the answer and the think time
    summary = run["summary"]
    assert summary["ttft_first_turn_ms"]["n"] == CONVERSATIONS
    assert summary["ttft_later_turns_ms"]["n"] == CONVERSATIONS * (TURNS - 1)
    assert result["workload"]["conversations"] == CONVERSATIONS and result["workload"]["prompts"] == "token ids"
    assert "TTFT turn 1 p50/p90/p99 ms" in out and "TTFT turns 2+ p50/p90/p99 ms" in out
    assert "TTFT turns 2+" in (tmp_path / "summary.md").read_text()
