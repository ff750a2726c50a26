"""The SLO controller's decision function (scaling/policy.py) on synthetic signals: which role is
pressed and by how much, flips before new workers, sizing to the middle of the band, hysteresis,
cooldown, warm-up, urgency, bounds, and giving workers back."""

from __future__ import annotations

import dataclasses

import pytest

from scaling import HOLD, Bounds, ControllerConfig, Signals, State, decide, pressures

CFG = ControllerConfig(settle_intervals=2, cooldown_s=30.0, warmup_s=10.0)  # band 0.3..0.8, middle 0.55
ROOM = Bounds(min_prefill=1, max_prefill=4, min_decode=1, max_decode=4, max_total=5)


def sig(t: float, prefill: int = 1, decode: int = 2, p: float = 0.5, d: float = 0.4, **kw) -> Signals:
    """Prefill at `p` of its capacity (1000 tokens/s per worker), decode at `d` (100 tokens/s per worker)."""
    return Signals(now_s=t, prefill=prefill, decode=decode, prefill_tokens_per_s=1000.0 * prefill,
                   prefill_demand_tokens_s=1000.0 * prefill * p, decode_tokens_per_s=100.0 * decode,
                   arrival_rate=decode * d, mean_output_tokens=100.0, **kw)


def run(signals: list[Signals], cfg: ControllerConfig = CFG, bounds: Bounds = ROOM) -> list:
    state, out = State(), []
    for s in signals:
        d, state = decide(cfg, bounds, s, state)
        out.append(d)
    return out


def test_pressures_are_demand_over_capacity_and_late_tokens_trigger():
    assert pressures(CFG, sig(0, p=0.5, d=0.4)) == pytest.approx((0.5, 0.4))
    queued = sig(0, p=0.1, queued_prompt_tokens=60000)  # drained over backlog_drain_s (30 s): 2000 tokens/s more
    assert pressures(CFG, queued)[0] == pytest.approx(2.1)
    waiting = sig(0, d=0.1, decode_sequences=90, decode_slots=100.0)  # the sequences there now
    assert pressures(CFG, waiting)[1] == pytest.approx(0.9)
    assert pressures(CFG, sig(0, p=0.1, ttft_p90_ms=900))[0] == pytest.approx(CFG.scale_up_at)
    assert pressures(CFG, sig(0, d=0.1, tpot_p90_ms=45))[1] == pytest.approx(CFG.scale_up_at)
    assert pressures(CFG, sig(0, d=0.1, kv_used=0.81))[1] == pytest.approx(0.9)


def test_outputs_that_got_shorter_show_at_once_through_the_arrivals_max_tokens():
    def at(**kw) -> float:
        return pressures(CFG, Signals(now_s=0, prefill=1, decode=2, arrival_rate=6.0, decode_tokens_per_s=2000.0,
                                      **kw))[1]

    assert at(mean_output_tokens=256.0) == pytest.approx(6 * 256 / 2000)
    assert at(mean_output_tokens=256.0, mean_max_tokens=4.0) == pytest.approx(6 * 4 / 2000)
    # longer: the finishes still say short (the sequences running show the rest)
    assert at(mean_output_tokens=4.0, mean_max_tokens=256.0) == pytest.approx(6 * 4 / 2000)
    assert at(mean_max_tokens=100.0) == pytest.approx(6 * 100 / 2000)  # nothing finished yet


def test_late_first_tokens_press_the_side_that_keeps_them():
    # requests wait at the router for the blocks of a full decode side: decode's doing, not prefill's
    full = sig(0, p=0.02, d=0.1, ttft_p90_ms=3000, kv_used=0.88, waiting_for_decode=4)
    assert pressures(CFG, full) == pytest.approx((0.02, 0.88 / CFG.kv_high))
    starved = sig(0, p=0.02, d=0.1, ttft_p90_ms=3000, waiting_for_decode=4, decode_sequences=70, decode_slots=100.0)
    assert pressures(CFG, starved) == pytest.approx((0.02, CFG.scale_up_at))
    # waiting behind blocks that prompts queued at the prefill workers hold: prefill's doing
    backlog = sig(0, p=1.2, d=0.1, ttft_p90_ms=3000, kv_used=0.3, waiting_for_decode=4)
    assert pressures(CFG, backlog) == pytest.approx((1.2, 0.3 / CFG.kv_high))
    assert pressures(CFG, sig(0, p=0.1, d=0.3, ttft_p90_ms=3000))[0] == pytest.approx(CFG.scale_up_at)


def test_requests_waiting_for_blocks_held_for_queued_prompts_are_not_decode_load():
    """Prompts queued at a prefill worker hold their decode blocks: the requests behind them wait
    at the router with the decode side's own KV empty (a run on this machine held both roles
    pressed for 90 s that way). They are decode's load only while its own sequences fill its KV."""
    queued = sig(0, p=1.5, d=0.05, decode_sequences=150, waiting_for_decode=140, decode_slots=60.0, kv_used=0.0)
    assert pressures(CFG, queued)[1] == pytest.approx(10 / 60)
    d = run([dataclasses.replace(queued, now_s=t) for t in (0, 5)])[-1]
    assert d.action.startswith("flip 1 to prefill")
    full = dataclasses.replace(queued, kv_used=0.85)
    assert pressures(CFG, full)[1] == pytest.approx(150 / 60)


def test_a_role_pressed_only_by_its_latency_trigger_yields_to_the_others_demand():
    """A prompt burst on a shared host slows decode steps: TPOT p90 at the trigger while decode's
    demand and KV sit near zero. Both read pressed; prefill's demand wins and a decode worker
    moves (a machine run held 5 s with both pressed before this rule). A decode side that is
    busy by its own measures keeps its worker."""
    fixed = Bounds(1, 2, 1, 2, 3, min_total=3)
    burst = sig(0, prefill=1, decode=2, p=1.3, d=0.02, tpot_p90_ms=42.0)
    assert pressures(CFG, burst) == pytest.approx((1.3, CFG.scale_up_at))
    d = run([dataclasses.replace(burst, now_s=t) for t in (0, 5)], bounds=fixed)[-1]
    assert d.action == "flip 1 to prefill"
    busy = dataclasses.replace(burst, arrival_rate=2 * 0.5)  # decode's demand at 0.5: not quiet
    assert run([dataclasses.replace(busy, now_s=t) for t in (0, 5)], bounds=fixed)[-1].action == HOLD


def test_a_pressed_prefill_takes_an_idle_decode_worker_after_settling():
    d = run([sig(0, p=0.9, d=0.2), sig(5, p=0.9, d=0.2)])
    assert [x.action for x in d] == [HOLD, "flip 1 to prefill"]
    assert "settling 1/2" in d[0].reason and (d[1].prefill, d[1].decode, d[1].flips) == (2, 1, 1)


def test_the_decision_is_sized_to_the_middle_of_the_band_flips_first_then_new_workers():
    """Prefill at 1.4 with one worker needs ceil(1.4 / 0.55) = 3; decode at 0.2 with 2 workers
    needs 1, so one flips and one is new."""
    d = run([sig(t, p=1.4, d=0.2) for t in (0, 5)])[-1]
    assert (d.prefill, d.decode, d.flips, d.add_prefill, d.add_decode) == (3, 1, 1, 1, 0)
    assert d.action == "flip 1 to prefill, add 1 prefill"


def test_a_busy_decode_side_keeps_its_workers():
    """Decode at 0.5 (under the band's middle with 2, over it with 1): a new prefill worker, no flip."""
    d = run([sig(t, p=0.9, d=0.5) for t in (0, 5)])[-1]
    assert d.action == "add 1 prefill" and (d.prefill, d.decode) == (2, 2)


def test_slow_tokens_or_a_full_cache_grow_decode():
    assert run([sig(t, prefill=2, decode=1, p=0.2, d=1.0) for t in (0, 5)])[-1].flips == -1
    full = run([sig(t, prefill=2, decode=1, p=0.2, d=0.1, kv_used=0.8) for t in (0, 5)])[-1]
    assert full.action == "flip 1 to decode"


def test_hysteresis_a_proposal_that_changes_direction_starts_its_count_again():
    d = run([sig(0, p=0.9, d=0.2), sig(5, p=0.5), sig(10, p=0.9, d=0.2), sig(15, p=0.9, d=0.2)])
    assert [x.action != HOLD for x in d] == [False, False, False, True]


def test_cooldown_and_warm_up_hold_and_urgency_does_not_wait():
    d = run([sig(0, p=0.9, d=0.2), sig(5, p=0.9, d=0.2), sig(10, prefill=2, decode=1, p=0.9, d=0.4),
             sig(15, prefill=2, decode=1, p=0.9, d=0.4), sig(40, prefill=2, decode=1, p=0.9, d=0.4)])
    assert [x.action != HOLD for x in d] == [False, True, False, False, True]
    assert "cooldown" in d[3].reason
    warm = run([sig(t, p=0.9, d=0.2, youngest_worker_s=t) for t in (0, 5, 10)])
    assert [x.action != HOLD for x in warm] == [False, False, True] and "warming up" in warm[1].reason
    urgent = run([sig(0, p=3.0, d=0.2, youngest_worker_s=0.0)])[0]  # at once: no settling, no warm-up wait
    assert urgent.action != HOLD and urgent.prefill == 4


def test_workers_on_their_way_count_as_there():
    """Two prefill workers are starting: the one serving at 1.2 is at 0.4 with them, inside the band."""
    assert run([sig(t, p=1.2, d=0.4, pending_prefill=2) for t in (0, 5)])[-1].action == HOLD


def test_bounds_are_kept():
    d = run([sig(t, p=0.9, d=0.5) for t in (0, 5)], bounds=Bounds(1, 1, 1, 4, 5))
    assert d[-1].action == HOLD and "at the bounds" in d[-1].reason
    d = run([sig(t, p=3.0, d=0.2) for t in (0, 5)], bounds=Bounds(1, 4, 2, 4, 3))  # decode at its minimum
    assert d[-1].action == HOLD and "at the bounds" in d[-1].reason
    no_flips = run([sig(t, p=0.9, d=0.2) for t in (0, 5)], cfg=ControllerConfig(flips=False, settle_intervals=2))
    assert no_flips[-1].action == "add 1 prefill, remove 1 decode"


def test_idle_roles_give_workers_back_never_below_their_minimum():
    d = run([sig(t, prefill=3, decode=2, p=0.1, d=0.4) for t in (0, 5)])[-1]
    assert d.action == "remove 2 prefill" and (d.prefill, d.decode) == (1, 2)
    no_traffic = run([sig(t, prefill=1, decode=2, p=0.0, d=0.0) for t in (0, 5)])[-1]
    assert no_traffic.action == "remove 1 decode"
    assert run([sig(t, prefill=1, decode=1, p=0.0, d=0.0) for t in (0, 5)])[-1].action == HOLD


def test_no_oscillation_a_sized_decision_lands_inside_the_band():
    """After a flip to prefill the load it moved does not flip it back: demand over capacity with
    the new counts sits in the band, and nothing more is decided."""
    before = [sig(0, p=1.4, d=0.2), sig(5, p=1.4, d=0.2)]
    after = [sig(t, prefill=3, decode=1, p=1.4 / 3, d=0.4) for t in range(10, 300, 5)]
    d = run(before + after)
    assert sum(x.action != HOLD for x in d) == 1


def test_a_role_that_grew_keeps_its_workers_through_the_lull_after_a_burst():
    """A burst presses decode, new workers are asked for; the burst passes before they serve. They
    are not given back while starting, nor within shrink_after_s of the growth (a 70B simulation
    added and removed 3 decode workers three times in four minutes before this rule)."""
    burst = [sig(t, prefill=1, decode=2, d=1.2) for t in (0, 5)]
    d = run(burst)
    assert d[-1].action == "add 2 decode"  # max_decode 4
    lull = [sig(t, prefill=1, decode=2, d=0.1, pending_decode=2) for t in (40, 45, 50)]  # starting
    lull += [sig(t, prefill=1, decode=4, d=0.08) for t in range(60, 125, 5)]  # serving, idle
    after = run(burst + lull)
    assert all(x.action == HOLD for x in after[2:])
    assert "decode grew" in after[-1].reason
    later = run(burst + lull + [sig(125, prefill=1, decode=4, d=0.08)])
    assert later[-1].action == "remove 3 decode"  # shrink_after_s (120 s) after the growth
    # workers still starting are not given back whenever the role grew (a fresh state: no recent growth)
    starting = run([sig(t, prefill=1, decode=2, d=0.05, pending_decode=2) for t in (0, 5)])
    assert starting[-1].action == HOLD
    assert run([sig(t, prefill=1, decode=4, d=0.025) for t in (0, 5)])[-1].action == "remove 3 decode"
    with pytest.raises(ValueError, match="shrink_after_s"):
        ControllerConfig(shrink_after_s=-1)


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="scale_down_at < shrink_to < scale_up_at"):
        ControllerConfig(scale_down_at=0.9, scale_up_at=0.8)


def test_with_a_fixed_number_of_workers_they_only_move():
    fixed = Bounds(1, 3, 1, 3, 4, min_total=4)
    assert run([sig(t, prefill=2, decode=2, p=0.0, d=0.0) for t in (0, 5)], bounds=fixed)[-1].action == HOLD
    d = run([sig(t, prefill=1, decode=3, p=1.2, d=0.1) for t in (0, 5)], bounds=fixed)[-1]
    assert (d.flips, d.add_prefill, d.add_decode) == (2, 0, 0)
