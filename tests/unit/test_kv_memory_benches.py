"""The KV memory serving experiments' set-up and arithmetic (the clusters themselves run in
`python -m benchmarks.kv_tier_serving` and `python -m benchmarks.kv_pages_serving`): the two systems
of each differ in the one setting compared, and the reports read the medians and ratios."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import kv_pages_serving, kv_tier_serving
from benchmarks.kv_aware_serving import analyse
from pdcluster.cluster_config import load_cluster_config


def _needs_two_cpus() -> None:
    import os

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the experiments pin their workers to two CPUs")


def test_the_tier_experiments_clusters_differ_in_the_tier_only(tmp_path: Path) -> None:
    _needs_two_cpus()
    files = kv_tier_serving.cluster_files(tmp_path, "builtin:tiny-llama", 4096, 40, 512)
    a, b = (load_cluster_config(files[n]) for n in ("no-tier", "tier"))
    assert (a.kv_cache.offload_mb, b.kv_cache.offload_mb) == (0, 512)
    assert a.kv_cache.memory_mb == b.kv_cache.memory_mb == 40 and a.router == b.router and a.pools == b.pools
    assert b.router.prefix_aware and b.mode == "disaggregated"


def test_the_pages_experiments_clusters_differ_in_the_kv_dtype_only(tmp_path: Path) -> None:
    _needs_two_cpus()
    files = kv_pages_serving.cluster_files(tmp_path, "builtin:tiny-llama", 2048, 40)
    a, b = (load_cluster_config(files[n]) for n in ("auto", "int8"))
    assert (a.kv_cache.dtype, b.kv_cache.dtype) == ("auto", "int8")
    assert a.kv_cache.memory_mb == b.kv_cache.memory_mb == 40 and a.pools == b.pools and a.engine == b.engine


def _run(label: str, rate: float, ttft: float, attainment: float, hits: float = 0.0, tier: float = 0.0) -> dict:
    return {"label": label, "rate": rate,
            "summary": {"ttft_ms": {"p50": ttft}, "tpot_ms": {"p50": 20.0}, "slo_attainment": attainment, "failed": 0},
            "server_counters": {"prefill/prefix": {"prefix_cache_hit_tokens": hits, "kv_tier_hits": tier}},
            "records": [{"prompt_tokens": 100}]}


def test_the_reports_read_medians_and_ratios() -> None:
    pages = [{"runs": [_run("auto", 0.5, 200, 0.95), _run("int8", 0.5, 150, 0.97), _run("auto", 1.0, 900, 0.6),
                       _run("int8", 1.0, 300, 0.92)]} for _ in range(3)]
    a = analyse(pages, None, 16, kv_pages_serving.SYSTEMS, kv_pages_serving.BASELINE)
    assert a["highest_rate_meeting_slo"] == {"auto": 0.5, "int8": 1.0} and a["highest_rate_ratio"]["int8"] == 2.0
    text = kv_pages_serving.report(a, {"auto": 284, "int8": 1050})
    assert "int8 / auto: 2.00x" in text and "| 1 | int8 | 300 | 20 | 92% |" in text
    tier = [{"runs": [_run("no-tier", 4.0, 400, 0.7, hits=500), _run("tier", 4.0, 200, 0.8, hits=900, tier=40)]}]
    a = analyse(tier, 1000, 16, kv_tier_serving.SYSTEMS, kv_tier_serving.BASELINE)
    text = kv_tier_serving.report(a)
    assert "| 4 | tier | 200 | 20 | 80% | 900 | 90% | 640 |" in text and "no-tier / tier: 2.00x" in text
