"""Traffic whose mix shifts: `pdcluster bench serve --phases` (and `pdcluster plan simulate
--controller --phases`, which reads the same spec).

    --phases azure-conv:2:120,azure-code:1-3:120,512/4:2:60

Each phase is WORKLOAD:RATE:SECONDS: Poisson arrivals at RATE requests/s for SECONDS, the lengths
of WORKLOAD (a workload `--workload` takes, or PROMPT/OUTPUT: synthetic, every request that many
tokens); RATE may be A-B, moving linearly from A to B over the phase (Poisson arrivals at the top
rate, each kept with probability rate(t) / top). The phases play back to back as one run; each
phase's prompts have texts of their own (a later phase of the same workload hits no prefix cache).

Per phase the report gives SLO attainment and latency percentiles (of the requests arriving in it)
and, against a pdcluster endpoint, the worker-seconds of each role: its router's /metrics
(`pdcluster_worker_up{worker, role}`) read every second while the run goes (`WorkerSampler`).
"""

from __future__ import annotations

import dataclasses
import math
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadgen.workload import Request, WorkloadConfig


@dataclass(frozen=True)
class Phase:
    workload: str  # a workload name or path, or PROMPT/OUTPUT (synthetic)
    rate_from: float
    rate_to: float
    seconds: float

    @property
    def label(self) -> str:
        rate = f"{self.rate_from:g}" if self.rate_from == self.rate_to else f"{self.rate_from:g}-{self.rate_to:g}"
        return f"{self.workload} {rate}/s"

    def rate_at(self, t: float) -> float:
        return self.rate_from + (self.rate_to - self.rate_from) * t / self.seconds


def parse_phases(text: str, flag: str = "--phases") -> list[Phase]:
    """`WORKLOAD:RATE:SECONDS,...` -> phases; ValueError naming the item that does not parse."""
    phases = []
    for item in (x.strip() for x in text.split(",")):
        try:
            name, rate, seconds = item.rsplit(":", 2)
            first, _, last = rate.partition("-")
            a, b, s = float(first), float(last or first), float(seconds)
        except ValueError:
            raise ValueError(f"{flag}: {item!r} is not WORKLOAD:RATE:SECONDS (RATE: R or A-B)") from None
        if not name or min(a, b) <= 0 or s <= 0 or not all(math.isfinite(x) for x in (a, b, s)):
            raise ValueError(f"{flag}: {item!r} needs a workload, and rates and seconds above 0")
        phases.append(Phase(name, a, b, s))
    if not phases:
        raise ValueError(f"{flag}: no phase given")
    return phases


def synthetic_lengths(workload: str) -> tuple[int, int] | None:
    """(prompt, output) tokens of a PROMPT/OUTPUT phase; None for a named workload."""
    prompt, sep, output = workload.partition("/")
    if not sep or not prompt.isdigit() or not output.isdigit():
        return None
    if int(prompt) < 1 or int(output) < 1:
        raise ValueError(f"--phases: {workload!r} needs prompt and output lengths of 1 or more")
    return int(prompt), int(output)


def thinned(phase: Phase, arrivals_at_top: list[float], seed: str) -> list[int]:
    """Indexes of the arrivals (Poisson at the phase's top rate, in order) kept inside the phase."""
    keep, top = random.Random(seed), max(phase.rate_from, phase.rate_to)
    out = []
    for i, t in enumerate(arrivals_at_top):
        if t >= phase.seconds:
            break
        if keep.random() * top <= phase.rate_at(t):
            out.append(i)
    return out


def phase_config(phase: Phase, k: int, base: WorkloadConfig) -> WorkloadConfig:
    """The workload of phase k: enough requests for its top rate, texts of its own."""
    n = max(1, math.ceil(max(phase.rate_from, phase.rate_to) * phase.seconds * 1.3) + 20)
    lengths = synthetic_lengths(phase.workload)
    source = "synthetic" if lengths else phase.workload
    cfg = dataclasses.replace(base, source=source, num_requests=n, sample_seed=None, prompt_salt=f"phase{k}")
    if lengths:
        cfg = dataclasses.replace(cfg, synthetic_input=f"fixed:{lengths[0]}", synthetic_output=f"fixed:{lengths[1]}")
    return cfg


@dataclass
class PhasedRequests:
    requests: list[Request]
    offsets: list[float]  # each request's arrival, seconds from the start
    phase: list[int]  # each request's phase
    spans: list[tuple[str, float, float]]  # (label, start, end) per phase


def phased_requests(phases: list[Phase], base: WorkloadConfig, load: Callable[[WorkloadConfig], Any],
                    seed: int = 0) -> PhasedRequests:
    """The phases' requests back to back; `load(config)` reads a workload (loadgen.workload.load_workload)."""
    out = PhasedRequests([], [], [], [])
    t0 = 0.0
    for k, phase in enumerate(phases):
        requests = load(phase_config(phase, k, base)).requests
        rng, t, at_top = random.Random(f"{seed}:arrivals:{k}"), 0.0, []
        for _ in requests:
            t += rng.expovariate(max(phase.rate_from, phase.rate_to))
            at_top.append(t)
        for i in thinned(phase, at_top, f"{seed}:{k}"):
            out.requests.append(dataclasses.replace(requests[i], index=len(out.requests), arrival_s=None))
            out.offsets.append(t0 + at_top[i])
            out.phase.append(k)
        out.spans.append((phase.label, t0, t0 + phase.seconds))
        t0 += phase.seconds
    return out


class WorkerSampler:
    """Counts a pdcluster router's workers per role every `every_s` while a run goes:
    `with WorkerSampler(url) as s: ...; s.worker_seconds(t0, t1)`. Against an endpoint without
    `pdcluster_worker_up`, `samples` stays empty."""

    def __init__(self, url: str, api_key: str | None = None, every_s: float = 1.0) -> None:
        self.url, self.every_s = url, every_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.samples: list[tuple[float, dict[str, int]]] = []  # (seconds since start, workers per role)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="worker-sampler", daemon=True)
        self.t0 = time.perf_counter()

    def _count(self) -> dict[str, int] | None:
        try:
            text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=5.0).raise_for_status().text
        except httpx.HTTPError:
            return None
        roles: dict[str, int] = {}
        for family in text_string_to_metric_families(text):
            if family.name == "pdcluster_worker_up":
                for s in family.samples:
                    if s.value == 1 and s.labels.get("role"):
                        roles[s.labels["role"]] = roles.get(s.labels["role"], 0) + 1
        return roles or None

    def _loop(self) -> None:
        while True:
            roles = self._count()
            if roles is not None:
                self.samples.append((time.perf_counter() - self.t0, roles))
            if self._stop.wait(self.every_s):
                return

    def __enter__(self) -> WorkerSampler:
        self.t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def worker_seconds(self, start: float, end: float) -> dict[str, float]:
        """Worker-seconds per role over [start, end) (seconds since the sampler started), each sample
        held until the next; {} without samples."""
        out: dict[str, float] = {}
        for i, (t, roles) in enumerate(self.samples):
            nxt = self.samples[i + 1][0] if i + 1 < len(self.samples) else max(t, end)
            a, b = max(t, start), min(nxt, end)
            if b > a:
                for role, n in roles.items():
                    out[role] = out.get(role, 0.0) + n * (b - a)
        return out
