"""The SLO controller's decision: how many prefill and decode workers, from what the cluster shows now.

One pure function, `decide(config, bounds, signals, state)`, called every `interval_s` by the
controller in a running cluster and by the planner's simulator alike (the same code in both worlds).

Each role's pressure is its signal over its SLO, the worse of what was seen and what is coming:

    prefill  max(TTFT p90 / SLO TTFT, queued prompt tokens / the prefill workers' tokens per second
             / SLO TTFT)                          (the queue is the TTFT of the next prompts)
    decode   max(TPOT p90 / SLO TPOT, KV blocks used / kv_high)   (a full cache makes prompts wait)

A role at `scale_up_at` or more is pressed; both roles under `scale_down_at` are idle. Then:

    one role pressed, the other idle enough that it stays under `scale_up_at` x `margin` with one
        worker fewer (pressure taken as inversely proportional to the workers): a worker moves
        from it to the pressed role (a flip, when the pools allow); else the pressed role gets a
        new worker, within its bound
    both pressed: the more pressed role gets a new worker, within the bounds
    both idle: the less pressed role gives one back, if the other would stay under the same margin

A proposal becomes a decision only after `settle_intervals` intervals in a row proposed it
(hysteresis), never within `cooldown_s` of the last decision, and never while a worker younger than
`warmup_s` is serving (its first samples are a cold start: compilation, empty caches). One worker
moves per decision.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

HOLD = "hold"
ACTIONS = (HOLD, "flip_to_prefill", "flip_to_decode", "add_prefill", "add_decode", "remove_prefill",
           "remove_decode")


@dataclass(frozen=True)
class ControllerConfig:
    interval_s: float = 5.0  # how often the controller decides
    slo_ttft_ms: float = 1000.0
    slo_tpot_ms: float = 50.0
    scale_up_at: float = 0.8  # a role whose pressure (signal / SLO) reaches this is pressed
    scale_down_at: float = 0.3  # both roles under this: one worker may go
    margin: float = 0.8  # a worker leaves a role only if its pressure stays under scale_up_at x margin
    kv_high: float = 0.9  # KV blocks used at this share press decode as its SLO does
    settle_intervals: int = 2  # intervals in a row a proposal must hold (hysteresis)
    cooldown_s: float = 30.0  # no decision within this long of the last one
    warmup_s: float = 15.0  # no decision while a worker younger than this serves (cold start)
    flips: bool = True  # workers may change role in place (their pools serve both roles)

    def __post_init__(self) -> None:
        if not 0 < self.scale_down_at < self.scale_up_at:
            raise ValueError(f"need 0 < scale_down_at < scale_up_at, got {self.scale_down_at}, {self.scale_up_at}")
        if not 0 < self.margin <= 1:
            raise ValueError(f"margin must be in (0, 1], got {self.margin}")
        if self.interval_s <= 0 or self.settle_intervals < 1 or self.cooldown_s < 0 or self.warmup_s < 0:
            raise ValueError("interval_s > 0, settle_intervals >= 1, cooldown_s >= 0 and warmup_s >= 0")


@dataclass(frozen=True)
class Bounds:
    """Workers per role, and in all (the pools' min_replicas / max_replicas)."""

    min_prefill: int = 1
    max_prefill: int = 1
    min_decode: int = 1
    max_decode: int = 1
    max_total: int = 2


@dataclass(frozen=True)
class Signals:
    """What the cluster showed over the last interval. None: no sample (no request got there)."""

    now_s: float
    prefill: int  # workers serving each role now
    decode: int
    ttft_p90_ms: float | None = None  # of first tokens in the interval
    tpot_p90_ms: float | None = None  # of inter-token gaps in the interval
    queued_prompt_tokens: int = 0  # waiting at the prefill workers now
    prefill_tokens_per_s: float = 0.0  # what the prefill workers compute per second when busy (all)
    kv_used: float = 0.0  # share of the decode workers' KV blocks in use (the fullest worker)
    youngest_worker_s: float = float("inf")  # age of the newest worker in its role


@dataclass(frozen=True)
class State:
    """What `decide` remembers between calls (start with `State()`)."""

    proposal: str = HOLD
    streak: int = 0
    last_decision_s: float = float("-inf")


@dataclass(frozen=True)
class Decision:
    action: str
    prefill: int  # the target: workers per role once the action is done
    decode: int
    reason: str
    prefill_pressure: float = 0.0
    decode_pressure: float = 0.0


def pressures(cfg: ControllerConfig, s: Signals) -> tuple[float, float]:
    """(prefill, decode) pressure: each role's signal over its SLO (see the module's doc)."""
    p = (s.ttft_p90_ms or 0.0) / cfg.slo_ttft_ms
    if s.queued_prompt_tokens and s.prefill_tokens_per_s > 0:
        p = max(p, s.queued_prompt_tokens / s.prefill_tokens_per_s * 1e3 / cfg.slo_ttft_ms)
    d = max((s.tpot_p90_ms or 0.0) / cfg.slo_tpot_ms, s.kv_used / cfg.kv_high)
    return p, d


def _without_one(pressure: float, workers: int) -> float:
    return pressure * workers / (workers - 1) if workers > 1 else float("inf")


def propose(cfg: ControllerConfig, b: Bounds, s: Signals) -> tuple[str, str, float, float]:
    """(action, reason, prefill pressure, decode pressure) for this interval alone."""
    p, d = pressures(cfg, s)
    up, keep = cfg.scale_up_at, cfg.scale_up_at * cfg.margin
    total = s.prefill + s.decode
    can_add = {"prefill": s.prefill < b.max_prefill and total < b.max_total,
               "decode": s.decode < b.max_decode and total < b.max_total}
    can_give = {"prefill": s.prefill > b.min_prefill, "decode": s.decode > b.min_decode}
    count = {"prefill": s.prefill, "decode": s.decode}
    level = {"prefill": p, "decode": d}
    pressed = [r for r in ("prefill", "decode") if level[r] >= up]
    if len(pressed) == 1:
        role = pressed[0]
        other = "decode" if role == "prefill" else "prefill"
        why = f"{role} pressure {level[role]:.2f} >= {up}"
        if (cfg.flips and can_give[other] and count[role] < getattr(b, f"max_{role}")
                and _without_one(level[other], count[other]) < keep):
            return f"flip_to_{role}", f"{why}, {other} {level[other]:.2f} has room", p, d
        if can_add[role]:
            return f"add_{role}", why, p, d
        return HOLD, f"{why}, no worker to move or add", p, d
    if len(pressed) == 2:
        role = "prefill" if p >= d else "decode"
        if can_add[role]:
            return f"add_{role}", f"both pressed ({p:.2f}, {d:.2f})", p, d
        return HOLD, f"both pressed ({p:.2f}, {d:.2f}), at the bounds", p, d
    if p < cfg.scale_down_at and d < cfg.scale_down_at:
        for role in sorted(("prefill", "decode"), key=lambda r: level[r]):  # the less pressed first
            if can_give[role] and _without_one(level[role], count[role]) < keep:
                return f"remove_{role}", f"both idle ({p:.2f}, {d:.2f})", p, d
    return HOLD, f"within the band ({p:.2f}, {d:.2f})", p, d


def target(action: str, prefill: int, decode: int) -> tuple[int, int]:
    """Workers per role once `action` is done."""
    change = {"flip_to_prefill": (1, -1), "flip_to_decode": (-1, 1), "add_prefill": (1, 0), "add_decode": (0, 1),
              "remove_prefill": (-1, 0), "remove_decode": (0, -1)}.get(action, (0, 0))
    return prefill + change[0], decode + change[1]


def decide(cfg: ControllerConfig, b: Bounds, s: Signals, state: State) -> tuple[Decision, State]:
    """This interval's decision and the state to pass next time."""
    action, reason, p, d = propose(cfg, b, s)
    streak = state.streak + 1 if action == state.proposal else 1
    state = dataclasses.replace(state, proposal=action, streak=streak)

    def hold(why: str) -> tuple[Decision, State]:
        return Decision(HOLD, s.prefill, s.decode, why, p, d), state

    if action == HOLD:
        return hold(reason)
    if s.now_s - state.last_decision_s < cfg.cooldown_s:
        return hold(f"cooldown ({reason})")
    if s.youngest_worker_s < cfg.warmup_s:
        return hold(f"a worker is warming up ({reason})")
    if streak < cfg.settle_intervals:
        return hold(f"settling {streak}/{cfg.settle_intervals} ({reason})")
    prefill, decode = target(action, s.prefill, s.decode)
    return (Decision(action, prefill, decode, reason, p, d),
            State(proposal=HOLD, streak=0, last_decision_s=s.now_s))
