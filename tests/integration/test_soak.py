"""scripts/soak.py in CI: ~30 s of mixed load (gRPC and HTTP, greedy and seeded, short and long prompts)
over TLS with an API key, KV transfer faults all along and one decode worker killed; nothing is lost,
no KV block leaks, and the report has every figure."""

from __future__ import annotations

import pytest

from benchmarks import soak

pytestmark = pytest.mark.slow


def test_a_short_soak_with_one_fault_loses_nothing_and_leaks_nothing(tmp_path):
    args = soak.parse_args(["--duration-s", "30", "--fault-every-s", "12", "--faults", "kill-decode", "--secure",
                            "--concurrency", "6", "--settle-s", "60"])
    report = soak.Soak(args).run()
    assert report["lost"] == 0, report["lost_examples"]
    assert report["kv_blocks_leaked"] == {}
    assert report["completed"] > 20 and report["sent"] == report["completed"] + report["failed_clear"]
    assert [f["fault"] for f in report["faults"]] == ["kill-decode"] * len(report["faults"]) and report["faults"]
    assert report["retried"] >= 1
    for name in ("driver", "router", "prefill-0", "prefill-1", "decode-0", "decode-1"):
        assert report["rss_mib"][name]["start"] and report["rss_mib"][name]["end"], name
