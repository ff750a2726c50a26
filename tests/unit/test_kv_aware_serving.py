"""The KV-aware serving experiment's arithmetic: the infinite-cache bound, medians over repeats, the
ratios against routing by load (the clusters themselves run in `python -m benchmarks.kv_aware_serving`)."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.kv_aware_serving import analyse, main, part_args, prefix_bound, report


def test_the_bound_counts_leading_blocks_an_earlier_request_computed():
    a = list(range(40))  # blocks [0,16) [16,32) and 8 more tokens
    b = a[:32] + [99] * 20  # shares a's two full blocks
    c = [7] + a[1:40]  # differs in its first token: nothing
    d = a[:33]  # 33 tokens: two usable blocks, both seen
    e = a[:32]  # 32 tokens: the second block holds its last token, so one
    assert prefix_bound([a, b, c, d, e], 16) == 0 + 32 + 0 + 32 + 16
    assert prefix_bound([a], 16) == 0 and prefix_bound([], 16) == 0


def _run(label: str, rate: float, ttft: float, later: float | None, hits: float, kv: float, ok: bool = True) -> dict:
    return {"label": label, "rate": rate,
            "summary": {"ttft_ms": {"p50": ttft}, "tpot_ms": {"p50": 10.0}, "slo_attainment": 1.0 if ok else 0.5,
                        "failed": 0, "ttft_later_turns_ms": {"p50": later} if later else None},
            "server_counters": {"prefill/prefix": {"prefix_cache_hit_tokens": hits, "kv_transfer_bytes": kv},
                                "decode/prefix": {"prefix_cache_hit_tokens": 0.0, "local_prefills": 2.0}},
            "records": [{"prompt_tokens": 100, "turn": 0}, {"prompt_tokens": 150, "turn": 1}]}


def test_medians_over_repeats_and_ratios_against_routing_by_load():
    results = [{"runs": [_run("by-load", 2.0, 300.0, 200.0, 0.0, 8e6), _run("kv-aware", 2.0, 100.0, 40.0, 900.0, 1e6),
                         _run("by-load", 4.0, 900.0, 800.0, 0.0, 8e6, ok=False),
                         _run("kv-aware", 4.0, 300.0, 100.0, 900.0, 1e6)]} for _ in range(2)]
    results.append({"runs": [_run("by-load", 2.0, 330.0, 230.0, 0.0, 8e6), _run("kv-aware", 2.0, 999.0, 999.0, 0.0, 4e6),
                             _run("by-load", 4.0, 900.0, 800.0, 0.0, 8e6, ok=False),
                             _run("kv-aware", 4.0, 300.0, 100.0, 900.0, 1e6)]})
    a = analyse(results, bound=1000)
    m = a["table"]["kv-aware"][2.0]
    assert m["repeats"] == 3 and m["ttft_p50"] == 100.0 and m["hit_tokens"] == 900.0 and m["hit_of_bound"] == 0.9
    assert a["ttft_p50_ratio"]["kv-aware"] == {2.0: 3.0, 4.0: 3.0}
    assert a["ttft_later_p50_ratio"]["kv-aware"] == {2.0: 5.0, 4.0: 8.0}
    assert a["kv_bytes_ratio"]["kv-aware"][2.0] == 8.0
    # by-load moves every block: 7 + 10 per run, 8e6 bytes; its later turn (10 blocks) is 10/17 of them
    assert a["table"]["by-load"][2.0]["kv_bytes_later_turn"] == pytest.approx(8e6 * 10 / 17)
    assert a["highest_rate_meeting_slo"] == {"by-load": 2.0, "kv-aware": 4.0}
    assert a["highest_rate_ratio"]["kv-aware"] == 2.0
    text = report("mooncake", a)
    assert "| 2 | kv-aware | 100 | 40 |" in text and "90%" in text and "by-load / kv-aware: 2/s 3.00x" in text


def test_each_part_drives_its_workload_and_each_repeat_its_own_prompts():
    args = argparse.Namespace(model="builtin:tiny-llama", time_limit_s=60.0, conversations=4, turns=3, first_prompt=512,
                              message=32, output=16, think_s=0.5, chat_rates="1,2", num_requests=50, rates="1,2",
                              max_context=4000, max_output=32, mooncake_sample="conversations", sample_seed=7)
    chat = part_args("chat", args, 1)
    assert chat[:2] == ["--workload", "multiturn"] and "--seed" in chat and chat[chat.index("--seed") + 1] == "101"
    mooncake = part_args("mooncake", args, 0)
    assert mooncake[:2] == ["--workload", "mooncake-conv"] and "--sample-unit" in mooncake
    assert mooncake[mooncake.index("--sample-seed") + 1] == "7"
    azure = part_args("azure", args, 0)
    assert azure[:2] == ["--workload", "azure-conv"] and "--sample-unit" not in azure
    args.mooncake_sample = "first-rows"
    assert "--sample-unit" not in part_args("mooncake", args, 0)


def test_unknown_parts_or_systems_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--parts", "chat,nope"])
    assert "unknown ['nope']" in capsys.readouterr().err
