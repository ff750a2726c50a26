"""The SLO controller's decision: how many prefill and decode workers, from what the cluster shows now.

One pure function, `decide(config, bounds, signals, state)`, called every `interval_s` by the
controller in a running cluster and by the planner's simulator alike (the same code in both worlds).

Each role's pressure is how close it runs to its limit, 1.0 at the limit:

    prefill  (prompt tokens arriving per second + queued prompt tokens / `backlog_drain_s`) / what
             the prefill workers compute per second, and at least `scale_up_at` while the TTFT p90
             is at `scale_up_at` of its SLO or more (first tokens late: grow), unless requests
             wait at the router for decode workers' blocks while decode is the fuller side by its
             own measures (then the late first tokens press decode)
    decode   max(requests arriving per second x the mean output of those finished lately (at most
             the arrivals' mean max_tokens) / what
             the decode workers generate per second with steps at `scale_up_at` of the TPOT SLO
             (nearer it a step's time presses by itself), sequences on the decode workers or
             waiting for their blocks (while their own sequences fill the KV) / the sequences they
             run at that step time, KV blocks used /
             kv_high), and
             at least `scale_up_at` while the TPOT p90 is at `scale_up_at` of its SLO or more
             (demand from arrivals, not tokens generated: a decode side starved by a slow prefill
             side is not idle; the sequences there now: recent outputs lag when the traffic's
             output lengths change)

taken as inversely proportional to a role's workers (workers starting or flipping into it count as
there), as demand over capacity and KV use are. TTFT and TPOT themselves are not (at low load they
are one prompt's compute, one step's time), which is why they only trigger. When both roles read
pressed and one of them only by its trigger (its demand and KV measures under `shrink_to`), the
other's demand wins: on a shared host a prompt burst slows the decode steps too, and holding with
both pressed let the burst's backlog grow.

A role at `scale_up_at` or more is pressed and grows to the count that brings it to the middle of
the band [scale_down_at, scale_up_at]; the other role gives it workers in place (flips) as long as
it stays at `shrink_to` or under, and new workers make up the rest within the bounds. With neither
pressed, a role under `scale_down_at` shrinks to `shrink_to`, but not while workers are starting
into it, nor within `shrink_after_s` of its last growth (a burst that pressed it comes back; giving
the workers back and asking again churns). So one decision answers one change of the traffic,
sized to it.

A proposal becomes a decision only after `settle_intervals` intervals in a row proposed the same
direction (hysteresis; the latest sizing is taken), never within `cooldown_s` of the last decision,
and never while a worker younger than `warmup_s` serves (its first samples are a cold start:
compilation, empty caches), unless a role is at `urgent_at` or more counting the workers on their
way (the traffic changed under it: a backlog grows every second the decision waits).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import math

HOLD = "hold"


@dataclass(frozen=True)
class ControllerConfig:
    interval_s: float = 5.0  # how often the controller decides
    slo_ttft_ms: float = 1000.0
    slo_tpot_ms: float = 50.0
    scale_up_at: float = 0.8  # a role whose pressure (signal / SLO) reaches this is pressed
    scale_down_at: float = 0.3  # a role under this (the other not pressed) gives workers back
    urgent_at: float = 1.5  # a role this pressed (its pending workers counted) grows at once
    backlog_drain_s: float = 30.0  # queued prompt tokens count as demand spread over this long
    # a role giving workers away (back, or to the other role) keeps enough to stay at this: under the
    # band's middle, as a role's pressure grows faster than 1 / workers when it loses some (its steps
    # slow down, so its sequences stay longer and hold more KV)
    shrink_to: float = 0.4
    kv_high: float = 0.9  # KV blocks used at this share press decode as its SLO does
    settle_intervals: int = 2  # intervals in a row a proposal must hold (hysteresis)
    cooldown_s: float = 30.0  # no decision within this long of the last one
    warmup_s: float = 15.0  # no decision while a worker younger than this serves (cold start)
    # a role that grew gives workers back no sooner than this after (bursts come back; Kubernetes'
    # autoscaler waits 300 s by default); workers still starting are never given back
    shrink_after_s: float = 120.0
    flips: bool = True  # workers may change role in place (their pools serve both roles)

    def __post_init__(self) -> None:
        if not 0 < self.scale_down_at < self.shrink_to < self.scale_up_at <= self.urgent_at:
            raise ValueError("need 0 < scale_down_at < shrink_to < scale_up_at <= urgent_at, got "
                             f"{self.scale_down_at}, {self.shrink_to}, {self.scale_up_at}, {self.urgent_at}")
        if self.interval_s <= 0 or self.settle_intervals < 1 or min(self.cooldown_s, self.warmup_s,
                                                                     self.shrink_after_s) < 0:
            raise ValueError("interval_s > 0, settle_intervals >= 1, cooldown_s, warmup_s and shrink_after_s >= 0")


@dataclass(frozen=True)
class Bounds:
    """Workers per role, and in all (the pools' min_replicas / max_replicas)."""

    min_prefill: int = 1
    max_prefill: int = 1
    min_decode: int = 1
    max_decode: int = 1
    max_total: int = 2
    min_total: int = 0  # = max_total: no worker starts or stops, they only move (an in-process cluster)


@dataclass(frozen=True)
class Signals:
    """What the cluster showed over the last interval. None: no sample (no request got there)."""

    now_s: float
    prefill: int  # workers serving each role now
    decode: int
    ttft_p90_ms: float | None = None  # of first tokens in the interval
    tpot_p90_ms: float | None = None  # of inter-token gaps in the interval
    queued_prompt_tokens: int = 0  # waiting at the prefill workers now
    prefill_tokens_per_s: float = 0.0  # what the serving prefill workers compute per second when busy
    prefill_demand_tokens_s: float = 0.0  # prompt tokens that arrived per second in the interval
    # what the serving decode workers generate per second with steps at scale_up_at of the TPOT SLO
    decode_tokens_per_s: float = 0.0
    arrival_rate: float = 0.0  # requests that arrived per second in the interval
    mean_output_tokens: float = 0.0  # of the requests that finished lately
    mean_max_tokens: float = 0.0  # of the requests that arrived in the interval (0: none or unknown)
    decode_sequences: int = 0  # running on the decode workers or waiting for their KV blocks
    waiting_for_decode: int = 0  # of those, requests the router holds until a decode worker has blocks
    decode_slots: float = 0.0  # sequences the serving decode workers run with steps at scale_up_at of the SLO
    kv_used: float = 0.0  # share of the decode workers' KV blocks in use (the fullest worker)
    youngest_worker_s: float = float("inf")  # age of the newest worker in its role
    pending_prefill: int = 0  # workers starting, or flipping, into each role
    pending_decode: int = 0


@dataclass(frozen=True)
class State:
    """What `decide` remembers between calls (start with `State()`)."""

    proposal: str = HOLD  # the direction proposed last, e.g. "prefill+1 decode-1"
    streak: int = 0
    last_decision_s: float = float("-inf")
    grew_s: tuple[float, float] = (float("-inf"), float("-inf"))  # when prefill, decode last grew


@dataclass(frozen=True)
class Decision:
    action: str  # HOLD, or what changes: "flip 2 to prefill, add 1 prefill", "remove 1 decode"
    prefill: int  # the target: workers per role once it is done (pending ones counted)
    decode: int
    reason: str
    prefill_pressure: float = 0.0
    decode_pressure: float = 0.0
    flips: int = 0  # workers moving role in place: > 0 to prefill, < 0 to decode
    add_prefill: int = 0  # new workers (< 0: workers given back)
    add_decode: int = 0


def expected_output(s: Signals) -> float:
    """Tokens a request arriving now will generate: the mean output of those finished lately, but no
    more than the arrivals' mean max_tokens (outputs that got shorter show at once; longer ones show in
    the sequences running and their KV before they finish)."""
    if s.mean_max_tokens <= 0:
        return s.mean_output_tokens
    return min(s.mean_output_tokens, s.mean_max_tokens) if s.mean_output_tokens > 0 else s.mean_max_tokens


def pressures(cfg: ControllerConfig, s: Signals) -> tuple[float, float]:
    """(prefill, decode) pressure: how close each role runs to its limit, 1.0 at it (the module's doc)."""
    return _triggered(cfg, s, *demand(cfg, s))


def _triggered(cfg: ControllerConfig, s: Signals, p: float, d: float) -> tuple[float, float]:
    """`demand`'s pressures with the late-token triggers applied."""
    if (s.ttft_p90_ms or 0.0) >= cfg.scale_up_at * cfg.slo_ttft_ms:  # first tokens late: whose doing?
        if s.waiting_for_decode and d > p:  # requests wait for the blocks of a decode side fuller than prefill
            d = max(d, cfg.scale_up_at)
        else:
            p = max(p, cfg.scale_up_at)
    if (s.tpot_p90_ms or 0.0) >= cfg.scale_up_at * cfg.slo_tpot_ms:
        d = max(d, cfg.scale_up_at)
    return p, d


def demand(cfg: ControllerConfig, s: Signals) -> tuple[float, float]:
    """(prefill, decode) pressure from demand over capacity and occupancy alone, before the
    late-token triggers of `pressures`."""
    p = 0.0
    if s.prefill_tokens_per_s > 0:
        p = (s.prefill_demand_tokens_s + s.queued_prompt_tokens / cfg.backlog_drain_s) / s.prefill_tokens_per_s
    d = s.kv_used / cfg.kv_high
    if s.decode_tokens_per_s > 0:
        d = max(d, s.arrival_rate * expected_output(s) / s.decode_tokens_per_s)
    if s.decode_slots > 0:
        # requests waiting at the router for decode blocks are decode's load only when its own
        # sequences fill its KV; else the blocks are held for prompts queued at the prefill workers
        sequences = s.decode_sequences
        if s.kv_used < cfg.scale_up_at * cfg.kv_high:
            sequences -= s.waiting_for_decode
        d = max(d, sequences / s.decode_slots)
    return p, d


def _sized(level: float, n: int, mid: float) -> int:
    """Workers that bring a role at `level` with `n` workers to `mid` (pressure ~ 1 / workers)."""
    return math.ceil(n * level / mid - 1e-9) if n else 1


def plan(cfg: ControllerConfig, b: Bounds, s: Signals) -> tuple[Decision, str]:
    """This interval's proposal alone, and its direction (HOLD, or e.g. "prefill+ decode-")."""
    base = demand(cfg, s)
    p, d = _triggered(cfg, s, *base)
    serving = {"prefill": s.prefill, "decode": s.decode}
    have = {"prefill": s.prefill + s.pending_prefill, "decode": s.decode + s.pending_decode}

    def with_pending(pressures: tuple[float, float]) -> dict[str, float]:  # the pending workers serving too
        return {r: x * serving[r] / have[r] if have[r] else x for r, x in zip(("prefill", "decode"), pressures)}

    level = with_pending((p, d))
    lo = {"prefill": b.min_prefill, "decode": b.min_decode}
    hi = {"prefill": b.max_prefill, "decode": b.max_decode}
    mid = (cfg.scale_down_at + cfg.scale_up_at) / 2
    want = dict(have)
    pressed = [r for r in want if level[r] >= cfg.scale_up_at]
    if len(pressed) == 2:  # one pressed by its latency trigger alone yields to the other's demand
        quiet = [r for r, x in with_pending(base).items() if x < cfg.shrink_to]
        if len(quiet) == 1:
            level[quiet[0]] = with_pending(base)[quiet[0]]
            pressed.remove(quiet[0])
    for r in want:
        if r in pressed:
            want[r] = min(hi[r], max(lo[r], _sized(level[r], have[r], mid)))
        elif not pressed and level[r] < cfg.scale_down_at and have[r] == serving[r]:  # none starting
            want[r] = min(have[r], max(lo[r], _sized(level[r], have[r], cfg.shrink_to)))
    grow = [r for r in want if want[r] > have[r]]
    flips = 0  # workers moving in place into the growing role
    if len(grow) == 1:
        r = grow[0]
        o = "decode" if r == "prefill" else "prefill"
        if level[o] < cfg.shrink_to:  # the other role keeps what brings it to shrink_to; the rest may move
            want[o] = min(want[o], max(lo[o], _sized(level[o], have[o], cfg.shrink_to)))
        if cfg.flips:
            flips = min(want[r] - have[r], max(0, have[o] - want[o]))
    add = dict.fromkeys(want, 0)
    for r in want:
        moved = flips if r in grow else -flips if grow else 0
        add[r] = want[r] - have[r] - moved
    room = b.max_total - have["prefill"] - have["decode"]
    for r in sorted(want, key=lambda r: -level[r]):  # new workers within the room, the more pressed first
        if add[r] > 0:
            add[r] = min(add[r], max(0, room))
            room -= add[r]
    give = sum(have.values()) - b.min_total  # workers that may stop
    for r in sorted(want, key=lambda r: level[r]):  # the less pressed role gives back first
        if add[r] < 0:
            add[r] = max(add[r], -max(0, give))
            give += add[r]
    if grow and grow[0] == "decode":
        flips = -flips
    parts = []
    if flips:
        parts.append(f"flip {abs(flips)} to {'prefill' if flips > 0 else 'decode'}")
    for r in ("prefill", "decode"):
        if add[r]:
            parts.append(f"{'add' if add[r] > 0 else 'remove'} {abs(add[r])} {r}")
    prefill = s.prefill + s.pending_prefill + flips + add["prefill"]
    decode = s.decode + s.pending_decode - flips + add["decode"]
    if not parts:
        why = (f"{', '.join(pressed)} pressed, at the bounds" if pressed else "within the band")
        return Decision(HOLD, have["prefill"], have["decode"], f"{why} ({p:.2f}, {d:.2f})", p, d), HOLD
    direction = " ".join(f"{r}{'+' if n > have[r] else '-'}" for r, n in (("prefill", prefill), ("decode", decode))
                         if n != have[r])
    why = (f"{' and '.join(pressed)} pressed" if pressed else "idle") + f" ({p:.2f}, {d:.2f})"
    urgent = max(level.values()) >= cfg.urgent_at and (prefill > have["prefill"] or decode > have["decode"])
    return (Decision(", ".join(parts), prefill, decode, why, p, d, flips, add["prefill"], add["decode"]),
            "urgent" if urgent else direction)


def decide(cfg: ControllerConfig, b: Bounds, s: Signals, state: State) -> tuple[Decision, State]:
    """This interval's decision and the state to pass next time."""
    proposal, direction = plan(cfg, b, s)
    streak = state.streak + 1 if direction == state.proposal else 1
    state = dataclasses.replace(state, proposal=direction, streak=streak)

    have = (s.prefill + s.pending_prefill, s.decode + s.pending_decode)
    target = (proposal.prefill, proposal.decode)

    def taken() -> tuple[Decision, State]:
        grew = tuple(s.now_s if t > h else g for t, h, g in zip(target, have, state.grew_s))
        return proposal, State(proposal=HOLD, streak=0, last_decision_s=s.now_s, grew_s=grew)

    def hold(why: str) -> tuple[Decision, State]:
        return dataclasses.replace(proposal, action=HOLD, prefill=have[0], decode=have[1], reason=why, flips=0,
                                   add_prefill=0,
                                   add_decode=0), state

    if direction == HOLD:
        return hold(proposal.reason)
    if direction == "urgent":
        return taken()
    if s.now_s - state.last_decision_s < cfg.cooldown_s:
        return hold(f"cooldown: {proposal.action} ({proposal.reason})")
    if s.youngest_worker_s < cfg.warmup_s:
        return hold(f"a worker is warming up: {proposal.action} ({proposal.reason})")
    if streak < cfg.settle_intervals:
        return hold(f"settling {streak}/{cfg.settle_intervals}: {proposal.action} ({proposal.reason})")
    if all(t <= h for t, h in zip(target, have)):  # only giving back: not a role that grew lately
        for role, t, h, g in zip(("prefill", "decode"), target, have, state.grew_s):
            if t < h and s.now_s - g < cfg.shrink_after_s:
                return hold(f"{role} grew {s.now_s - g:.0f} s ago: {proposal.action} ({proposal.reason})")
    return taken()
