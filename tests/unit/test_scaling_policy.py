"""The SLO controller's decision function (scaling/policy.py) on synthetic signals: which role is
pressed, flips against new workers, hysteresis, cooldown, warm-up, bounds, and scaling down."""

from __future__ import annotations

import pytest

from scaling import HOLD, Bounds, ControllerConfig, Signals, State, decide

CFG = ControllerConfig(settle_intervals=2, cooldown_s=30.0, warmup_s=10.0)
ROOM = Bounds(min_prefill=1, max_prefill=3, min_decode=1, max_decode=3, max_total=4)


def sig(t: float, prefill: int = 1, decode: int = 2, ttft: float | None = 200.0, tpot: float | None = 10.0,
        **kw) -> Signals:
    return Signals(now_s=t, prefill=prefill, decode=decode, ttft_p90_ms=ttft, tpot_p90_ms=tpot, **kw)


def run(signals: list[Signals], cfg: ControllerConfig = CFG, bounds: Bounds = ROOM) -> list:
    state, out = State(), []
    for s in signals:
        d, state = decide(cfg, bounds, s, state)
        out.append(d)
    return out


def test_slow_first_tokens_move_an_idle_decode_worker_to_prefill_after_settling():
    d = run([sig(0, ttft=900), sig(5, ttft=900)])
    assert [x.action for x in d] == [HOLD, "flip_to_prefill"]
    assert "settling 1/2" in d[0].reason and (d[1].prefill, d[1].decode) == (2, 1)
    assert d[1].prefill_pressure == pytest.approx(0.9)


def test_queued_prompt_tokens_press_prefill_before_any_first_token_is_late():
    """4000 tokens queued at 2000 tokens/s: the next first tokens come 2 s late, over a 1 s SLO."""
    d = run([sig(t, ttft=100, queued_prompt_tokens=4000, prefill_tokens_per_s=2000) for t in (0, 5)])
    assert d[-1].action == "flip_to_prefill" and d[-1].prefill_pressure == pytest.approx(2.0)


def test_a_busy_decode_side_gets_a_new_worker_not_a_flip():
    """Decode at 0.5 of its SLO with 2 workers would be at 1.0 with one: no flip, a new prefill worker."""
    d = run([sig(t, ttft=900, tpot=25) for t in (0, 5)])
    assert d[-1].action == "add_prefill" and (d[-1].prefill, d[-1].decode) == (2, 2)


def test_slow_tokens_or_a_full_cache_move_a_worker_to_decode():
    assert run([sig(t, prefill=2, decode=1, tpot=45) for t in (0, 5)])[-1].action == "flip_to_decode"
    full = run([sig(t, prefill=2, decode=1, tpot=5, kv_used=0.85) for t in (0, 5)])
    assert full[-1].action == "flip_to_decode" and full[-1].decode_pressure == pytest.approx(0.85 / 0.9)


def test_hysteresis_a_proposal_that_changes_starts_its_count_again():
    d = run([sig(0, ttft=900), sig(5, ttft=500), sig(10, ttft=900), sig(15, ttft=900)])
    assert [x.action for x in d] == [HOLD, HOLD, HOLD, "flip_to_prefill"]


def test_cooldown_and_warm_up_hold_decisions():
    d = run([sig(0, ttft=900), sig(5, ttft=900), sig(10, prefill=2, decode=1, ttft=2000),
             sig(15, prefill=2, decode=1, ttft=2000), sig(40, prefill=2, decode=1, ttft=2000)])
    assert [x.action for x in d] == [HOLD, "flip_to_prefill", HOLD, HOLD, "add_prefill"]
    assert "cooldown" in d[3].reason
    warm = run([sig(t, ttft=900, youngest_worker_s=t) for t in (0, 5, 10)])
    assert [x.action for x in warm] == [HOLD, HOLD, "flip_to_prefill"] and "warming up" in warm[1].reason


def test_bounds_are_kept():
    at_max = Bounds(min_prefill=1, max_prefill=1, min_decode=1, max_decode=3, max_total=4)
    d = run([sig(t, ttft=900) for t in (0, 5)], bounds=at_max)
    assert d[-1].action == HOLD and "no worker to move or add" in d[-1].reason
    full = Bounds(min_prefill=1, max_prefill=3, min_decode=2, max_decode=3, max_total=3)
    d = run([sig(t, ttft=900) for t in (0, 5)], bounds=full)  # decode at its minimum, no room for a third
    assert d[-1].action == HOLD
    no_flips = run([sig(t, ttft=900) for t in (0, 5)], cfg=ControllerConfig(flips=False, settle_intervals=2))
    assert no_flips[-1].action == "add_prefill"


def test_both_pressed_adds_to_the_more_pressed_role():
    assert run([sig(t, ttft=900, tpot=48) for t in (0, 5)])[-1].action == "add_decode"
    assert run([sig(t, prefill=2, decode=2, ttft=900, tpot=48) for t in (0, 5)], bounds=Bounds(
        1, 2, 1, 2, 4))[-1].action == HOLD


def test_idle_gives_back_the_least_pressed_role_and_never_below_the_minimum():
    d = run([sig(t, prefill=2, decode=2, ttft=100, tpot=5) for t in (0, 5)])
    assert d[-1].action == "remove_prefill" and (d[-1].prefill, d[-1].decode) == (1, 2)
    no_traffic = run([sig(t, prefill=1, decode=2, ttft=None, tpot=None) for t in (0, 5)])
    assert no_traffic[-1].action == "remove_decode"
    assert run([sig(t, prefill=1, decode=1, ttft=None, tpot=None) for t in (0, 5)])[-1].action == HOLD


def test_no_oscillation_a_flip_is_not_undone_by_the_load_it_moved():
    """After a flip to prefill, decode carries the same tokens on one worker fewer: its pressure
    doubles, but the flip was allowed only if that stays under the band, so nothing flips back."""
    before = sig(0, ttft=900, tpot=12)
    after_tpot = 12 * 2  # one decode worker of two left
    d = run([before, sig(5, ttft=900, tpot=12), *(sig(t, prefill=2, decode=1, ttft=300, tpot=after_tpot)
                                                   for t in range(10, 120, 5))])
    assert [x.action for x in d].count(HOLD) == len(d) - 1


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="scale_down_at < scale_up_at"):
        ControllerConfig(scale_down_at=0.9, scale_up_at=0.8)
