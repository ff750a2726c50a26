"""planner.calibrate_serving.fit_live: the live step-cost fits from a probe's samples."""

from __future__ import annotations

import pytest

from planner.calibrate_serving import fit_live

ENGINE = {"a": 0.007, "b": 2e-4, "c": 1e-7}


def _samples(scale: float, slope: float, overhead: float) -> list[dict]:
    """Windows of a probe: decode steps (a + b*context + c*batch) and prefill steps of P-token prompts
    costing (scale + slope x decode tokens/s) x the engine's fit + overhead."""
    out = []
    for p in (64, 256, 768):
        for b in (1, 2, 4, 8, 16):
            steps, batch, window = 100, float(b), 10.0
            tps = 300.0 * b / (b + 3) + p / 100  # decode tokens per second in this window
            out.append({"prompt": p, "concurrency": b, "role": "decode", "phase": "decode", "window_s": window,
                        "steps": steps, "step_seqs": batch * steps, "step_tokens": tps * window,
                        "step_context_tokens": batch * (p + 30) * steps,
                        "step_seconds": steps * (0.008 + 5e-6 * batch * (p + 30) + 0.001 * batch)})
            tokens = p * min(b, 3)  # prompts per prefill step
            engine = ENGINE["a"] + (ENGINE["b"] + ENGINE["c"] * p) * tokens
            out.append({"prompt": p, "concurrency": b, "role": "prefill", "phase": "prefill", "window_s": window,
                        "steps": 10, "step_seqs": 10 * min(b, 3), "step_tokens": 10 * tokens,
                        "step_context_tokens": 10 * tokens,
                        "step_seconds": 10 * ((scale + slope * tps) * engine + overhead)})
    return out


def test_the_prefill_fit_recovers_scale_overhead_and_load_slope():
    live = fit_live(_samples(1.1, 0.003, 0.012), "decode", ENGINE)
    d, q = live["decode"], live["prefill"]
    assert (d["a"], d["b"], d["c"]) == pytest.approx((0.008, 5e-6, 0.001), rel=1e-6)
    assert q["scale"] == pytest.approx(1.1, rel=1e-6) and q["overhead_s"] == pytest.approx(0.012, rel=1e-6)
    assert q["load_slope"] == pytest.approx(0.003 / 1.1, rel=1e-6)  # relative to the scaled step
    assert (q["a"], q["b"], q["c"]) == pytest.approx((1.1 * 0.007 + 0.012, 1.1 * 2e-4, 1.1 * 1e-7), rel=1e-6)
    assert q["mean_abs_pct_error"] < 1e-6


def test_without_prefill_samples_or_an_engine_fit_only_decode_is_fitted():
    samples = _samples(1.0, 0.0, 0.0)
    assert "prefill" not in fit_live(samples, "decode", None)
    assert "prefill" not in fit_live([s for s in samples if s["phase"] == "decode"], "decode", ENGINE)
    with pytest.raises(RuntimeError, match="too few decode samples"):
        fit_live([s for s in samples if s["phase"] == "prefill"], "decode", ENGINE)


def test_prompt_pool_never_runs_dry_and_never_repeats():
    """The probe's prompts: topped up ahead of a level, refilled on the spot when the streams outrun
    that (a fixed pool once ran dry before a fast machine's second level), all distinct."""
    from loadgen.cli import load_tokenizer
    from planner.calibrate_serving import _PromptPool

    pool = _PromptPool(16, 4, load_tokenizer("builtin:tiny-llama"), "builtin:tiny-llama")
    pool.top_up(10)
    assert len(pool.pool) >= 10
    got = [next(pool) for _ in range(300)]  # past every top-up
    assert pool.taken == 300 and len(set(got)) == 300
