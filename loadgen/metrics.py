"""A run's summary: latency percentiles, throughput, SLO attainment, goodput, failures by reason.

    TTFT   first content chunk - send                      (successful requests)
    TPOT   (e2e - TTFT) / (output tokens - 1)              (successful requests with >= 2 tokens)
    ITL    gaps between content chunks (a chunk of k tokens: k gaps of gap/k), all requests pooled
    e2e    end of stream - send
    send lag  actual send - scheduled arrival (the client's own delay; large values mean it fell behind)
    TTFT by turn  multi-turn workloads: TTFT of the first turns and of the turns after the first apart
    throughput   completed requests / duration; output tokens of completed requests / duration
    SLO attainment  fraction of the *sent* requests that succeeded with TTFT <= X and TPOT <= Y
                    (a one-token answer has no TPOT and meets that bound; failed or unfinished
                    requests miss); goodput = such requests / duration
Percentiles interpolate linearly between order statistics (numpy's default). Latencies in ms.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from loadgen.client import RequestRecord


def percentile(xs: list[float], q: float) -> float | None:
    """q in [0, 100]; None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class Dist:
    n: int = 0
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, xs: list[float], scale: float = 1000.0) -> Dist:
        v = [x * scale for x in xs]
        if not v:
            return cls()
        return cls(len(v), sum(v) / len(v), percentile(v, 50), percentile(v, 90), percentile(v, 99), max(v))


@dataclass
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def set(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def met(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        ttft, tpot = r.ttft, r.tpot
        if self.ttft_ms is not None and (ttft is None or ttft * 1e3 > self.ttft_ms):
            return False
        return self.tpot_ms is None or tpot is None or tpot * 1e3 <= self.tpot_ms

    def __str__(self) -> str:
        parts = [f"TTFT <= {self.ttft_ms:g} ms" if self.ttft_ms is not None else "",
                 f"TPOT <= {self.tpot_ms:g} ms" if self.tpot_ms is not None else ""]
        return " and ".join(p for p in parts if p) or "none"


@dataclass
class Summary:
    requests: int  # in the workload
    sent: int
    completed: int
    failed: int
    unfinished: int
    not_sent: int
    duration_s: float
    request_throughput: float  # completed / s
    output_throughput: float  # output tokens of completed requests / s
    output_tokens: int
    ttft_ms: Dist
    tpot_ms: Dist
    itl_ms: Dist
    e2e_ms: Dist
    send_lag_ms: Dist
    slo: SLO
    slo_attainment: float | None
    ttft_attainment: float | None
    tpot_attainment: float | None
    goodput: float | None  # requests/s meeting both bounds
    failures: dict[str, int] = field(default_factory=dict)
    tokens_per_chunk_assumed: bool = False  # some chunks counted as one token without evidence
    ttft_first_turn_ms: Dist | None = None  # multi-turn workloads only: turn 0 of each conversation
    ttft_later_turns_ms: Dist | None = None  # multi-turn workloads only: every turn after the first

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO | None = None) -> Summary:
    slo = slo or SLO()
    ok = [r for r in records if r.ok]
    sent = [r for r in records if r.outcome != "not_sent"]
    dur = max(duration_s, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    failures = Counter(r.error_kind or "unknown" for r in records if not r.ok)

    def frac(cond: SLO) -> float | None:
        return sum(cond.met(r) for r in sent) / len(sent) if slo.set and sent else None

    good = sum(slo.met(r) for r in sent) if slo.set else None
    turns = any(r.turn is not None for r in records)
    assumed = any(r.chunk_tokens_from == "assumed" and len(r.chunk_s) > 1 and r.chunks_match_usage is not True
                  for r in ok)
    return Summary(
        requests=len(records), sent=len(sent), completed=len(ok),
        failed=sum(r.outcome == "failed" for r in records),
        unfinished=sum(r.outcome == "unfinished" for r in records),
        not_sent=len(records) - len(sent), duration_s=duration_s,
        request_throughput=len(ok) / dur, output_throughput=out_tokens / dur, output_tokens=out_tokens,
        ttft_ms=Dist.of([t for r in ok if (t := r.ttft) is not None]),
        tpot_ms=Dist.of([t for r in ok if (t := r.tpot) is not None]),
        itl_ms=Dist.of([x for r in ok for x in r.itls]),
        e2e_ms=Dist.of([t for r in ok if (t := r.e2e) is not None]),
        send_lag_ms=Dist.of([r.start_s - r.scheduled_s for r in sent if r.start_s is not None]),
        slo=slo, slo_attainment=frac(slo),
        ttft_attainment=frac(SLO(ttft_ms=slo.ttft_ms)) if slo.ttft_ms is not None else None,
        tpot_attainment=frac(SLO(tpot_ms=slo.tpot_ms)) if slo.tpot_ms is not None else None,
        goodput=good / dur if good is not None else None, failures=dict(failures),
        tokens_per_chunk_assumed=assumed,
        ttft_first_turn_ms=Dist.of([t for r in ok if r.turn == 0 and (t := r.ttft) is not None]) if turns else None,
        ttft_later_turns_ms=Dist.of([t for r in ok if (r.turn or 0) > 0 and (t := r.ttft) is not None])
        if turns else None)
