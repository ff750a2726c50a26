"""What the server counted during a run: a pdcluster endpoint's worker counters from its /metrics.

The router exports each worker's cumulative counters (router/metrics.py): engine steps by phase
(engine/step_stats.py: steps, wall seconds, batch sizes, tokens, tokens attended to) and the prompt
tokens it prefilled with those served from its prefix cache, the KV bytes it sent and those no
transfer had to move (blocks a decode worker held, prompts it prefilled itself). Read before and after a run, their
difference is the server's side of that run: mean step time and batch per phase, the prefix cache's
hit rate; decode steps also per batch-size bucket (phase "decode[4-7]": steps with 4 to 7
sequences). `bench serve` stores it per run (`server_counters` in result.json) when the endpoint has
such metrics; other servers have none, and nothing is stored.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

STEP_FIELDS = ("steps", "step_seconds", "step_seqs", "step_tokens", "step_context_tokens")
# per role, summed over its workers: prompt tokens prefilled and of those served from the prefix
# cache; KV bytes sent (every backend), KV bytes no transfer had to move, requests a decode worker
# prefilled; blocks written to and read back from the offload tier
PREFIX_FIELDS = ("prompt_tokens", "prefix_cache_hit_tokens", "kv_transfer_bytes", "kv_bytes_not_sent",
                 "local_prefills", "kv_tier_saves", "kv_tier_hits")
PREFIX = "prefix"  # the phase key of a role's prefix-cache counters
BY_BATCH = "_by_batch"  # suffix of the step counters per batch-size bucket (label "batch")
STATS_LAG_S = 0.7  # the router reads its workers' counters every 0.5 s
T = TypeVar("T")


def scrape_counters(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> dict[tuple[str, str], dict]:
    """{(role, phase): {step field: total}}, {(role, "phase[lo-hi]"): ...} per batch-size bucket and
    {(role, "prefix"): {prompt_tokens, prefix_cache_hit_tokens}}, summed over the workers, from the
    router's /metrics at `url`. Raises httpx.HTTPError if unreachable."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return parse_counters(httpx.get(f"{url}/metrics", headers=headers, timeout=timeout_s).raise_for_status().text)


def parse_counters(text: str) -> dict[tuple[str, str], dict]:
    """`scrape_counters` of a /metrics text. Samples without the labels they need are left out."""
    out: dict[tuple[str, str], dict] = {}
    for family in text_string_to_metric_families(text):
        name = family.name.removeprefix("pdcluster_worker_")
        bucketed = name.endswith(BY_BATCH) and name.removesuffix(BY_BATCH) in STEP_FIELDS
        name = name.removesuffix(BY_BATCH) if bucketed else name
        if family.type != "counter" or name not in (*STEP_FIELDS, *PREFIX_FIELDS):
            continue
        needs = ("role", "phase", "batch") if bucketed else ("role", "phase") if name in STEP_FIELDS else ("role",)
        for s in family.samples:
            if not s.name.endswith("_total") or not all(s.labels.get(k) for k in needs):
                continue
            phase = PREFIX if name not in STEP_FIELDS else (
                bucket_key(s.labels["phase"], s.labels["batch"]) if bucketed else s.labels["phase"])
            key = (s.labels["role"], phase)
            fields = STEP_FIELDS if name in STEP_FIELDS else PREFIX_FIELDS
            row = out.setdefault(key, dict.fromkeys(fields, 0.0))
            row[name] += s.value
    return out


def bucket_key(phase: str, batch: str) -> str:
    """The phase key of a batch-size bucket's step counters: "decode[4-7]"."""
    return f"{phase}[{batch}]"


def is_bucket(phase: str) -> bool:
    """Whether a phase key is a batch-size bucket's (`bucket_key`), not a whole phase's."""
    return phase.endswith("]")


def buckets(counters: dict[str, dict], role: str, phase: str) -> list[tuple[str, dict]]:
    """[(batch label, step counters)] of `role`'s `phase` per bucket, from an `as_json` dict."""
    prefix = f"{role}/{bucket_key(phase, '')[:-1]}"
    return [(k[len(prefix):-1], v) for k, v in counters.items() if k.startswith(prefix) and is_bucket(k)]


def delta(after: dict[tuple[str, str], dict], before: dict[tuple[str, str], dict]) -> dict[tuple[str, str], dict]:
    return {k: {f: v[f] - before.get(k, {}).get(f, 0.0) for f in v} for k, v in after.items()}


def try_scrape(url: str, api_key: str | None = None) -> dict[tuple[str, str], dict] | None:
    """`scrape_counters`, or None for an endpoint without pdcluster's worker counters."""
    try:
        counters = scrape_counters(url, api_key, timeout_s=5.0)
    except (httpx.HTTPError, ValueError):
        return None
    return counters or None


def as_json(counters: dict[tuple[str, str], dict]) -> dict[str, dict]:
    """JSON keys "role/phase" (e.g. "decode/decode", "colocated/prefill", "prefill/prefix")."""
    return {f"{role}/{phase}": v for (role, phase), v in sorted(counters.items())}


def counted(url: str, api_key: str | None, run: Callable[[], T]) -> tuple[T, dict[str, dict] | None]:
    """`run()`, and what the endpoint's workers counted meanwhile (`as_json` of the delta), or None
    for an endpoint without such counters. Each read waits out the router's polling lag, so counts
    of requests that ended just before or at the end are not misplaced."""
    if try_scrape(url, api_key) is None:
        return run(), None
    time.sleep(STATS_LAG_S)
    before = try_scrape(url, api_key)
    result = run()
    time.sleep(STATS_LAG_S)
    after = try_scrape(url, api_key)
    return result, (as_json(delta(after, before)) if before is not None and after is not None else None)
