"""Search: which hardware per phase, how many workers, what tensor parallelism and batch limit.

Goodput of a plan = the highest request rate at which the p-th percentile of TTFT and of TPOT
both meet the SLO (DistServe's definition), found by simulation: double the rate until the SLO
fails, then bisect (a run stops as soon as more than (1 - p/100) of its requests miss a bound).
A run at rate R lasts at least `min_span_s` of arrivals and the SLO is judged on its second half
(see Searcher), so goodput is a rate the cluster sustains.

The space is large, so it is searched as DistServe does, phase by phase, then checked whole:

  1. units: every candidate worker (hardware, tp, batch limit) is simulated alone with an ideal
     (instant, unlimited) worker for the other phase: its prefill goodput under the TTFT bound,
     its decode goodput under the TPOT bound; a colocated worker under both
  2. compose: n_p prefill and n_d decode workers serve min(n_p * g_p, n_d * g_d) (colocated n * g),
     for every pair of units and counts up to --max-workers, at cost n_p * price_p + n_d * price_d
  3. verify: the best `verify` compositions are simulated as whole clusters (their goodput
     searched again around the estimate; with a target rate: simulated at it, adding a worker to
     the phase that misses, up to 3 times)

Ranking: by goodput per dollar (then lower cost, then higher goodput), or, with a target rate, by
cost among the plans that meet the SLO at that rate (then higher goodput). A plan dominated by
another (no cheaper and no more goodput, one of them strictly) can never come first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from loadgen.metrics import SLO, percentile
from planner.parallel import allowed, layout_label
from planner.plan import Plan, PlanContext, Pool, build_cluster, fits
from planner.reuse import plan_threshold
from planner.simulator import ClusterSpec, SimResult, Simulator, WorkerSpec
from planner.workload import PlanWorkload


@dataclass(frozen=True)
class SLOTarget:
    ttft_ms: float
    tpot_ms: float
    percentile: float = 90.0
    # percentile: the p-th percentile of TTFT and of TPOT each within its bound (DistServe's);
    # attainment: at least p% of requests meet both bounds (bench serve's SLO attainment)
    criterion: str = "percentile"

    def __post_init__(self) -> None:
        if self.criterion not in ("percentile", "attainment"):
            raise ValueError(f"SLO criterion must be percentile or attainment, got {self.criterion!r}")

    @property
    def max_miss_fraction(self) -> float:
        return 1.0 - self.percentile / 100.0


@dataclass
class Evaluation:
    plan: Plan
    cost_per_hour: float
    power_w: float
    goodput: float  # req/s (0: the SLO is not met at any rate tried)
    ttft_ms: float | None = None  # the SLO's percentile, at the goodput rate (or the target rate)
    tpot_ms: float | None = None
    attainment: float | None = None  # fraction of requests meeting both bounds there
    verified: bool = False  # simulated as a whole cluster (else composed from units)
    meets_target: bool | None = None  # with a target rate
    rate: float | None = None  # the rate the latencies were measured at

    @property
    def goodput_per_dollar(self) -> float:
        """Requests served within the SLO per dollar (goodput x 3600 / cost per hour)."""
        return self.goodput * 3600.0 / self.cost_per_hour if self.cost_per_hour > 0 else 0.0


@dataclass
class SearchSpace:
    prefill_hardware: list[str]
    decode_hardware: list[str]
    modes: tuple[str, ...] = ("disaggregated", "colocated")
    tps: tuple[int, ...] = (1, 2, 4, 8)
    max_num_batched_tokens: tuple[int, ...] = (2048,)
    max_num_seqs: tuple[int, ...] = (256,)
    max_workers: int = 8
    max_devices: dict[str, int] = field(default_factory=dict)  # hardware -> devices available (a node pool's size)
    # disaggregated plans whose pools are all CPUs of this machine (the phases share its cores) are
    # also tried with local prefill of prompts up to this long (router.local_prefill_max_tokens); 0: not
    cpu_local_prefill_max_tokens: int = 512
    prefix_aware: bool = True  # every plan's router.prefix_aware
    local_prefill_uncached_tokens: int | None = 0  # each disaggregated plan's (None: auto, planner/reuse.py)

    def allows(self, plan: Plan) -> bool:
        used: dict[str, int] = {}
        for p in plan.pools:
            used[p.hardware] = used.get(p.hardware, 0) + p.count * p.tp
        return all(n <= self.max_devices.get(h, n) for h, n in used.items())


@dataclass
class SearchResult:
    ranked: list[Evaluation]  # verified, best first
    composed: list[Evaluation]  # every composition considered (estimates)
    units: dict[str, float] = field(default_factory=dict)  # unit label -> goodput
    simulations: int = 0


class _Ideal:
    """The other phase in a unit simulation: instant, unlimited."""

    tp = 1
    kv_capacity_tokens = 10**12
    instant = True  # the simulator finishes a request on an ideal decode worker at its commit

    def __init__(self, kv_bytes_per_token: int) -> None:
        self.kv_bytes_per_token = kv_bytes_per_token

    def prefill_time(self, sum_new: int, sum_attn: int, sum_prior: int = 0, n_seqs: int = 1) -> float:
        return 0.0

    def decode_time(self, batch: int, sum_context: int) -> float:
        return 0.0


def evaluate(result: SimResult, slo: SLOTarget, check_ttft: bool = True, check_tpot: bool = True,
             count_from: int = 0) -> tuple[bool, float | None, float | None, float]:
    """(meets the percentile SLO, TTFT pct ms, TPOT pct ms, attainment) over the requests from
    index `count_from` on. Unfinished requests miss."""
    ttft_s, tpot_s, e2e_s = result.ttft[count_from:], result.tpot[count_from:], result.e2e[count_from:]
    n = len(ttft_s)
    inf = math.inf
    ttft = [inf if math.isnan(x) else x * 1e3 for x in ttft_s]
    tpot = [x * 1e3 for x in tpot_s if not math.isnan(x)] + [inf] * sum(1 for x in e2e_s if math.isnan(x))
    t_p = percentile(ttft, slo.percentile)
    p_p = percentile(tpot, slo.percentile) if tpot else 0.0
    bound = SLO(slo.ttft_ms if check_ttft else None, slo.tpot_ms if check_tpot else None)
    met = sum(bound.met(RequestTimes(a, b)) for a, b in zip(ttft_s, tpot_s))
    att = met / n if n else 0.0
    ok = not result.stopped_early and result.finished == len(result.ttft)
    if slo.criterion == "attainment":
        ok = ok and att >= slo.percentile / 100.0
    else:
        ok = ok and (not check_ttft or t_p <= slo.ttft_ms) and (not check_tpot or p_p <= slo.tpot_ms)
    return ok, t_p, p_p, att


@dataclass
class RequestTimes:
    """What loadgen.metrics.SLO.met reads of a request record."""

    ttft: float | None
    tpot: float | None

    def __post_init__(self) -> None:
        self.ok = self.ttft is not None and not math.isnan(self.ttft)  # NaN: never got its first token
        self.tpot = None if self.tpot is None or math.isnan(self.tpot) else self.tpot


class Searcher:
    """Simulations at a rate R use max(min_requests, R x min_span_s) requests of the workload (at
    most all of it), so that a run lasts long enough to reach a steady state, and the SLO is judged
    on the second half of the requests by arrival: a queue that keeps growing fails there, and a
    burst that a cluster absorbs only because the run ends does not count as goodput."""

    def __init__(self, ctx: PlanContext, workload: PlanWorkload, slo: SLOTarget,
                 progress: Callable[[str], None] | None = None, min_requests: int = 1000,
                 min_span_s: float = 60.0) -> None:
        self.ctx, self.w, self.slo = ctx, workload, slo
        self.progress = progress or (lambda _label: None)
        self.simulations = 0
        self.min_requests, self.min_span_s = min(min_requests, len(workload)), min_span_s
        self.longest = max(p + o for p, o in zip(workload.prompts, workload.outputs))
        self.block_keys = workload.block_keys(ctx.block_size)  # shared prefixes (Mooncake), for prefix caching

    # ------------------------------------------------------------------ one cluster
    def requests_at(self, rate: float) -> int:
        return min(len(self.w), max(self.min_requests, math.ceil(rate * self.min_span_s)))

    def simulate(self, cluster: ClusterSpec, rate: float, check_ttft: bool = True, check_tpot: bool = True,
                 early_stop: bool = True) -> tuple[bool, float | None, float | None, float, SimResult]:
        self.simulations += 1
        w = self.w.head(self.requests_at(rate))
        n = len(w)
        judged = n - n // 2
        misses = int(self.slo.max_miss_fraction * judged) if early_stop else None
        keys = self.block_keys[:n] if self.block_keys is not None else None
        res = Simulator(cluster).run(w.arrivals(rate), w.prompts, w.outputs,
                                     self.slo.ttft_ms / 1e3 if check_ttft else None,
                                     self.slo.tpot_ms / 1e3 if check_tpot else None, misses, count_from=n // 2,
                                     block_keys=keys)
        return (*evaluate(res, self.slo, check_ttft, check_tpot, count_from=n // 2), res)

    def max_rate(self, cluster: ClusterSpec, guess: float, check_ttft: bool = True, check_tpot: bool = True,
                 rel_tol: float = 0.04) -> float:
        """The highest rate meeting the SLO (0.0 if even guess / 256 does not)."""
        feasible = lambda r: self.simulate(cluster, r, check_ttft, check_tpot)[0]
        lo, hi = 0.0, guess
        if feasible(guess):
            lo = guess
            for _ in range(12):
                hi = lo * 2
                if not feasible(hi):
                    break
                lo = hi
            else:
                return lo
        else:
            for _ in range(8):
                hi = hi / 2
                if feasible(hi):
                    lo, hi = hi, hi * 2
                    break
            else:
                return 0.0
        while hi / lo > 1 + rel_tol:
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if feasible(mid) else (lo, mid)
        return lo

    def _guess(self, pool: Pool, phase: str) -> float:
        """A starting rate: one request at a time through this worker (its service rate)."""
        cost = self.ctx.cost(pool)
        k = min(len(self.w), 200)
        total = 0.0
        for p, o in zip(self.w.prompts[:k], self.w.outputs[:k]):
            if phase in ("prefill", "colocated"):
                total += cost.prefill_time(p, p * p, 0, 1)
            if phase in ("decode", "colocated"):
                # a decode worker batches: start at 8 sequences' worth of single-sequence steps
                total += (o - 1) * cost.decode_time(1, p + o // 2) / (8 if phase == "decode" else 1)
        return max(1e-3, k / total) if total > 0 else 1.0

    # ------------------------------------------------------------------ 1. units
    def unit_goodput(self, mode: str, pool: Pool, phase: str, mnbt: int, mns: int) -> float:
        """One worker's goodput, the other phase ideal (prefill: TTFT bound only)."""
        spec = build_cluster(Plan(mode, pool if mode == "disaggregated" else None, pool, mnbt, mns), self.ctx)
        if phase == "colocated":
            return self.max_rate(replace(spec, decode=spec.decode[:1]), self._guess(pool, phase))
        me = spec.prefill[0] if phase == "prefill" else spec.decode[0]
        ideal = WorkerSpec(_Ideal(me.cost.kv_bytes_per_token), mnbt, mns, self.ctx.block_size, math.inf, "ideal")
        if phase == "prefill":
            return self.max_rate(replace(spec, prefill=[me], decode=[ideal]), self._guess(pool, phase),
                                 check_tpot=False)
        return self.max_rate(replace(spec, prefill=[ideal], decode=[me]), self._guess(pool, phase))

    # ------------------------------------------------------------------ the search
    def search(self, space: SearchSpace, target_rate: float | None = None, verify: int = 6) -> SearchResult:
        units: dict[tuple, float] = {}
        labels: dict[str, float] = {}
        jobs = list(self.unit_jobs(space))
        for mode, phase, pool, mnbt, mns in jobs:
            g = self.unit_goodput(mode, pool, phase, mnbt, mns)
            units[(mode, phase, pool, mnbt, mns)] = g
            labels[f"{phase} {pool.hardware}" + layout_label(pool.tp, pool.ep) + f" mnbt {mnbt} mns {mns}"] = g
            self.progress(f"unit {phase} {pool.hardware}{layout_label(pool.tp, pool.ep) or ' tp1'}")
        composed = self.compose(units, space, target_rate)
        ranked = self._verify(composed, target_rate, verify, space)
        return SearchResult(ranked, composed, labels, self.simulations)

    def unit_jobs(self, space: SearchSpace) -> Iterable[tuple[str, str, Pool, int, int]]:
        for mnbt in space.max_num_batched_tokens:
            for mns in space.max_num_seqs:
                if mnbt < mns:
                    continue
                for tp in space.tps:
                    if "disaggregated" in space.modes:
                        for hw in space.prefill_hardware:
                            for pool in self._pools(hw, tp):
                                yield "disaggregated", "prefill", pool, mnbt, mns
                        for hw in space.decode_hardware:
                            for pool in self._pools(hw, tp):
                                yield "disaggregated", "decode", pool, mnbt, mns
                    if "colocated" in space.modes:
                        for hw in dict.fromkeys(space.prefill_hardware + space.decode_hardware):
                            for pool in self._pools(hw, tp):
                                yield "colocated", "colocated", pool, mnbt, mns

    def _pools(self, hw: str, tp: int) -> list[Pool]:
        """One worker of `tp` devices of `hw` in each layout the rule allows (planner/parallel.py;
        a dense model: tensor parallelism within a node) that holds the weights and a longest request."""
        h, m = self.ctx.hardware(hw), self.ctx.model
        if h.is_cpu and self.ctx.coefficients and tp > 1:
            return []
        pools = [Pool(hw, 1, tp, ep=layout == "ep") for layout in allowed(m, h, tp)]
        return [p for p in pools if fits(p, self.ctx, self.longest)]

    def estimate(self, plan: Plan, g: float) -> Evaluation:
        cat = self.ctx.catalog
        return Evaluation(plan, plan.cost_per_hour(cat), plan.power_w(cat), g)

    def compose(self, units: dict[tuple, float], space: SearchSpace, target: float | None) -> list[Evaluation]:
        out: list[Evaluation] = []
        m = space.max_workers
        keys = {k[:2] + k[3:]: [] for k in units}
        for k in units:
            keys[k[:2] + k[3:]].append(k)
        for (mode, phase, mnbt, mns), ks in keys.items():
            if phase == "colocated":
                for k in ks:
                    g = units[k]
                    if g <= 0:
                        continue
                    counts = [math.ceil(target / g)] if target else range(1, m + 1)
                    for n in counts:
                        if n <= m:
                            plan = Plan(mode, None, replace(k[2], count=n), mnbt, mns,
                                        prefix_aware=space.prefix_aware)
                            if space.allows(plan):
                                out.append(self.estimate(plan, n * g))
            elif phase == "prefill":
                for kp in ks:
                    for kd in keys.get((mode, "decode", mnbt, mns), []):
                        gp, gd = units[kp], units[kd]
                        if gp <= 0 or gd <= 0:
                            continue
                        if target:
                            pairs = [(math.ceil(target / gp), math.ceil(target / gd))]
                        else:
                            pairs = [(a, b) for a in range(1, m + 1) for b in range(1, m + 1)]
                        for a, b in pairs:
                            if a <= m and b <= m:
                                plan = Plan(mode, replace(kp[2], count=a), replace(kd[2], count=b), mnbt, mns,
                                            prefix_aware=space.prefix_aware,
                                            local_prefill_uncached_tokens=plan_threshold(
                                                space.local_prefill_uncached_tokens, self.ctx, self.w, self.slo, kd[2], mnbt))
                                if space.allows(plan):
                                    out.append(self.estimate(plan, min(a * gp, b * gd)))
                                    if space.cpu_local_prefill_max_tokens and all(
                                            self.ctx.hardware(p.hardware).is_cpu for p in plan.pools):
                                        local = replace(plan, local_prefill_max_tokens=space.cpu_local_prefill_max_tokens)
                                        out.append(self.estimate(local, min(a * gp, b * gd)))
        return out

    def _verify(self, composed: list[Evaluation], target: float | None, k: int,
                space: SearchSpace | None = None) -> list[Evaluation]:
        pool = [e for e in composed if e.goodput > 0]
        pool = sorted(pool, key=(lambda e: (e.cost_per_hour, -e.goodput)) if target else rank_key)
        done: list[Evaluation] = []
        seen: set[Plan] = set()
        for e in pool:
            if len(done) >= k:
                break
            if e.plan in seen:
                continue
            seen.add(e.plan)
            done.append(self.verify_target(e, target, space) if target else self.verify_goodput(e))
            self.progress(f"verify {e.plan.label()}")
        return rank(done, target)

    def verify_goodput(self, e: Evaluation) -> Evaluation:
        cluster = build_cluster(e.plan, self.ctx)
        g = self.max_rate(cluster, e.goodput)
        ev = self.estimate(e.plan, g)
        ev.verified = True
        if g > 0:
            _, ev.ttft_ms, ev.tpot_ms, ev.attainment, _ = self.simulate(cluster, g, early_stop=False)
            ev.rate = g
        return ev

    def verify_target(self, e: Evaluation, target: float, space: SearchSpace | None = None) -> Evaluation:
        """Simulate the plan at the target rate; while it misses the SLO add a worker where the
        misses are (at most 4 times, and never past the space's worker and device limits)."""
        plan = e.plan
        for _ in range(4):
            cluster = build_cluster(plan, self.ctx)
            ok, t_p, p_p, att, _ = self.simulate(cluster, target, early_stop=False)
            if ok:
                break
            n_p = plan.prefill.count if plan.prefill else 0
            n_d = plan.decode.count
            if plan.mode == "colocated":
                n_d += 1
            elif t_p is not None and t_p > self.slo.ttft_ms:
                n_p += 1
            else:
                n_d += 1
            bigger = plan.with_counts(n_p, n_d)
            if space is not None and (max(n_p, n_d) > space.max_workers or not space.allows(bigger)):
                break  # the pools have no more devices: the plan misses the target
            plan = bigger
        ev = self.estimate(plan, e.goodput if plan == e.plan else 0.0)
        ev.verified, ev.meets_target, ev.ttft_ms, ev.tpot_ms, ev.attainment, ev.rate = True, ok, t_p, p_p, att, target
        if ok:
            ev.goodput = max(target, ev.goodput)
        return ev


def rank_key(e: Evaluation) -> tuple:
    """Goodput per dollar, then lower cost, higher goodput, and more requests meeting the SLO there."""
    return (-e.goodput_per_dollar, e.cost_per_hour, -e.goodput, -(e.attainment or 0.0))


def rank(evals: list[Evaluation], target: float | None = None) -> list[Evaluation]:
    """Best first: by goodput per dollar, or (target rate) by cost among plans meeting it."""
    if target:
        return sorted(evals, key=lambda e: (not e.meets_target, e.cost_per_hour, -e.goodput))
    return sorted(evals, key=rank_key)


def pareto(evals: list[Evaluation]) -> list[Evaluation]:
    """Plans no other plan beats on both cost (lower) and goodput (higher), by cost."""
    front: list[Evaluation] = []
    for e in sorted(evals, key=lambda e: (e.cost_per_hour, -e.goodput)):
        if e.goodput > 0 and (not front or e.goodput > front[-1].goodput):
            front.append(e)
    return front
