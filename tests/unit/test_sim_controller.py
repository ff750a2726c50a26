"""The SLO controller in the simulator (planner/sim_controller.py): the policy the cluster runs,
applied to a simulated cluster whose traffic shifts from decode-heavy to prefill-heavy and back;
compared, in the same simulator, with static clusters and Dynamo-style load rule."""

from __future__ import annotations

import math
import random

import pytest

from planner.catalog import load_catalog
from planner.cli import main as plan_main
from planner.models import model_shape
from planner.plan import Plan, PlanContext, Pool, build_cluster
from planner.sim_controller import ControlledSimulator, load_rule
from planner.controlled_cli import static_rule
from scaling.policy import Bounds, ControllerConfig

CFG = ControllerConfig(slo_ttft_ms=1000, slo_tpot_ms=50, interval_s=10, cooldown_s=30, warmup_s=30)
PHASES = ((300, 20, 1000, 300), (300, 20, 6000, 60), (300, 20, 1000, 300))  # seconds, rate, prompt, output


@pytest.fixture(scope="module")
def spec():
    ctx = PlanContext(model_shape("Llama-3-8B"), load_catalog(None, {}), "bfloat16", None)
    return build_cluster(Plan("disaggregated", Pool("H100-SXM", 1, 1), Pool("H100-SXM", 1, 1), 8192, 256), ctx)


@pytest.fixture(scope="module")
def traffic():
    rng, t = random.Random(1), 0.0
    arrivals, prompts, outputs, phase = [], [], [], []
    for k, (seconds, rate, p, o) in enumerate(PHASES):
        end = t + seconds
        while (t := t + rng.expovariate(rate)) < end:
            arrivals.append(t)
            prompts.append(max(16, int(rng.gauss(p, p / 4))))
            outputs.append(max(2, int(rng.gauss(o, o / 4))))
            phase.append(k)
        t = end
    return arrivals, prompts, outputs, phase


def _attained(r, phase, k=None):
    ok = [a <= 1.0 and (math.isnan(b) or b <= 0.05) for a, b in zip(r.ttft, r.tpot)]
    mine = [o for o, q in zip(ok, phase) if k is None or q == k]
    return sum(mine) / len(mine)


def test_the_controller_follows_the_shift_with_few_decisions_and_fewer_worker_hours(spec, traffic):
    arrivals, prompts, outputs, phase = traffic
    bounds = Bounds(1, 11, 1, 11, 12)
    run = lambda rule, start: ControlledSimulator(spec, spec.decode[0], bounds, start, CFG, rule=rule).run(
        arrivals, prompts, outputs)
    from scaling.policy import decide

    ctl, rule = run(decide, (2, 2)), run(load_rule, (2, 2))
    static = run(static_rule, (5, 2))  # enough for the prefill-heavy phase
    assert _attained(static, phase) > 0.99
    # the controller: steady phases at the SLO, one decision (and its follow-up) per change
    assert _attained(ctl, phase, 0) > 0.95 and _attained(ctl, phase, 2) > 0.95
    assert ctl.decisions <= 2 * len(PHASES)
    grown = [i for i in ctl.intervals if i.decision != "hold" and "add" in i.decision]
    assert grown and 300 <= grown[0].t <= 340  # the prefill-heavy phase begins at 300 s
    assert ctl.worker_seconds < 0.95 * static.worker_seconds  # fewer worker-hours than the static cluster
    assert rule.decisions > ctl.decisions  # the load rule moves one worker a tick


def test_a_flip_moves_a_worker_in_place(spec):
    """Decode idle with 3 workers, prefill pressed: workers flip (1 s) instead of new ones (60 s)."""
    rng = random.Random(2)
    arrivals = sorted(rng.uniform(0, 120) for _ in range(1200))
    r = ControlledSimulator(spec, spec.decode[0], Bounds(1, 3, 1, 3, 4), (1, 3), CFG).run(
        arrivals, [6000] * len(arrivals), [4] * len(arrivals))
    flips = [i for i in r.intervals if i.decision.startswith("flip")]
    assert flips and flips[0].t < 40
    assert any(i.prefill >= 2 for i in r.intervals if i.t <= flips[0].t + 10)  # serving within the next tick


def test_the_cli_prints_the_policies_side_by_side(capsys):
    assert plan_main(["simulate", "--controller", "--model", "Llama-3-8B", "--prefill", "H100-SXM:1",
                      "--decode", "H100-SXM:1", "--phases", "azure-conv:5:120,azure-code:5:120", "--max-workers", "4",
                      "--static", "2+2"]) == 0
    out = capsys.readouterr().out
    assert "controller 1+1" in out and "load rule 1+1" in out and "static 2+2" in out and "worker-h" in out
    with pytest.raises(ValueError, match="WORKLOAD:RATE:SECONDS"):
        plan_main(["simulate", "--controller", "--model", "Llama-3-8B", "--prefill", "H100-SXM:1", "--decode",
                   "H100-SXM:1", "--phases", "azure-conv:5"])


def test_a_phase_may_ramp_its_rate():
    """`A-B`: arrivals thinned from Poisson at the top rate to a rate moving linearly from A to B."""
    import argparse

    from planner.controlled_cli import phased
    from planner.workload import load_plan_workload

    args = argparse.Namespace(phases="synthetic:10-50:200,synthetic:5:100", seed=0)
    work = phased(args, lambda name, n: load_plan_workload(name, n))
    first = [a for a, k in zip(work.arrivals, work.phase) if k == 0]
    early, late = sum(a < 50 for a in first), sum(a >= 150 for a in first)
    assert 650 < early < 850 and 2100 < late < 2400  # expected 750 (10 -> 20/s) and 2250 (40 -> 50/s)
    second = [a for a, k in zip(work.arrivals, work.phase) if k == 1]
    assert all(200 <= a < 300 for a in second) and 420 < len(second) < 580
    assert [label for label, _, _ in work.spans] == ["synthetic 10-50/s", "synthetic 5/s"]
