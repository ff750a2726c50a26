"""scripts/exp_planner_accuracy.py's comparison of two measurements (--repeat) and its server-side view."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def acc():
    spec = importlib.util.spec_from_file_location("exp_planner_accuracy", REPO / "scripts" / "exp_planner_accuracy.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _run(label: str, rate: float, ttfts: list[float], tpots: list[float], failed: int = 0) -> dict:
    ok = [{"outcome": "ok", "ttft_s": a, "tpot_s": b} for a, b in zip(ttfts, tpots)]
    return {"label": label, "rate": rate, "records": ok + [{"outcome": "failed"}] * failed}


def test_two_measurements_are_compared_run_by_run_as_a_simulation_is(acc):
    first = {"runs": [_run("colocated", 2.0, [0.1, 0.2, 0.3], [0.010, 0.020, 0.030], failed=1),
                      _run("colocated", 4.0, [0.1] * 3, [0.01] * 3)]}
    second = {"runs": [_run("colocated", 2.0, [0.1, 0.22, 0.3], [0.010, 0.020, float("nan")])]}
    rows = acc.repeatability(first, second)
    assert len(rows) == 1  # the 4 req/s run was measured once only
    r = rows[0]
    assert (r["completed"], r["sent"]) == (3, 4)
    assert r["ttft_p50"] == {"measured_ms": pytest.approx(200.0), "simulated_ms": pytest.approx(220.0),
                             "error_pct": pytest.approx(10.0)}
    assert r["tpot_p50"]["simulated_ms"] == pytest.approx(15.0)  # NaN left out: the median of 10 and 20 ms
    table = acc.error_table(rows, "run 1 / run 2 (difference)")
    assert "run 1 / run 2 (difference)" in table[0] and "mean absolute difference" in table[-1]
