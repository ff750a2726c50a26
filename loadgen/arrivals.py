"""Open-loop arrival offsets (seconds from the start of a run). Requests are sent at these times
whether or not earlier ones have finished, so a slow server sees a growing queue, as in production.

    poisson   gaps ~ Exponential(mean 1/R)
    gamma     gaps ~ Gamma(shape = burstiness, scale = 1 / (R * burstiness)): mean 1/R,
              variance 1 / (burstiness * R^2); burstiness 1 is Poisson, < 1 burstier, > 1 smoother
    trace     the trace's own offsets times --time-scale T (T < 1 compresses), or, when a rate R is
              given, times the factor that makes the mean rate (n - 1) / span equal R

The first request is at 0. Rate `inf` sends everything at once. Seeded (numpy's PCG64).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

KINDS = ("poisson", "gamma", "trace")


@dataclass
class ArrivalConfig:
    kind: str = "poisson"
    rate: float | None = None  # requests/s
    burstiness: float = 1.0
    time_scale: float | None = None  # trace only
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Arrivals:
    offsets: list[float]
    description: str
    time_scale: float | None = None  # trace: the factor applied

    @property
    def mean_rate(self) -> float:
        span = self.offsets[-1] - self.offsets[0] if self.offsets else 0.0
        return (len(self.offsets) - 1) / span if span > 0 else math.inf


def _gaps_to_offsets(gaps: np.ndarray) -> list[float]:
    return [0.0, *np.cumsum(gaps[:-1] if len(gaps) else gaps).tolist()]


def poisson_offsets(n: int, rate: float, seed: int = 0) -> list[float]:
    if math.isinf(rate):
        return [0.0] * n
    return _gaps_to_offsets(np.random.default_rng(seed).exponential(1.0 / rate, n))[:n]


def gamma_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    return _gaps_to_offsets(np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), n))[:n]


def trace_offsets(timestamps: list[float], time_scale: float = 1.0) -> list[float]:
    t0 = timestamps[0] if timestamps else 0.0
    return [(t - t0) * time_scale for t in timestamps]


def arrival_offsets(cfg: ArrivalConfig, n: int,
                    trace_timestamps: list[float | None] | None = None) -> Arrivals:
    if cfg.kind == "trace":
        if not trace_timestamps or any(t is None for t in trace_timestamps):
            raise ValueError("--arrival trace needs a trace workload (synthetic requests have no timestamps)")
        ts = [float(t) for t in trace_timestamps[:n]]  # type: ignore[arg-type]
        if cfg.rate is not None and cfg.time_scale is not None:
            raise ValueError("--arrival trace: give a rate or --time-scale, not both")
        span = ts[-1] - ts[0]
        if cfg.rate is not None:
            scale = 0.0 if math.isinf(cfg.rate) or span <= 0 else (len(ts) - 1) / (cfg.rate * span)
            how = f"trace timestamps x {scale:.4g} (mean rate {cfg.rate:g} req/s)"
        else:
            scale = 1.0 if cfg.time_scale is None else cfg.time_scale
            how = f"trace timestamps x {scale:g} (--time-scale)"
        if scale < 0:
            raise ValueError(f"--time-scale must be >= 0, got {scale}")
        return Arrivals(trace_offsets(ts, scale), how, scale)
    if cfg.rate is None or cfg.rate <= 0:
        raise ValueError(f"--arrival {cfg.kind} needs --rate or --rates (> 0; inf: all at once)")
    if cfg.kind == "poisson":
        return Arrivals(poisson_offsets(n, cfg.rate, cfg.seed),
                        f"Poisson, {cfg.rate:g} req/s (seed {cfg.seed})")
    if cfg.kind == "gamma":
        return Arrivals(gamma_offsets(n, cfg.rate, cfg.burstiness, cfg.seed),
                        f"gamma, {cfg.rate:g} req/s, burstiness {cfg.burstiness:g} (seed {cfg.seed})")
    raise ValueError(f"unknown arrival process {cfg.kind!r}; one of {', '.join(KINDS)}")
