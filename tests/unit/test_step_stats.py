"""Engine.step notes the shape of each batch it ran; StepTotals sums them per phase."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from engine.step_stats import StepShape, StepTotals, batch_bucket, bucket_label


def test_engine_notes_prefill_chunks_then_decode_steps(checkpoint):
    cfg = EngineConfig(model=str(checkpoint("llama-gqa")), num_blocks=64, max_model_len=256,
                       max_num_batched_tokens=32, max_num_seqs=8, enable_prefix_caching=False)
    engine = Engine(cfg, "colocated")
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(3, 43)), params)  # 40 tokens: chunks of 32 + 8
    engine.add_request("b", list(range(3, 13)), params)  # 10 tokens
    shapes = []
    while engine.has_work():
        engine.step()
        shapes.append(engine.last_step)
    # a's first chunk fills the budget; then a's last 8 tokens and all of b (18 tokens), then decodes
    assert shapes[0] == StepShape("prefill", 1, 32, 32)
    assert shapes[1] == StepShape("prefill", 2, 18, 40 + 10)
    assert shapes[2] == StepShape("decode", 2, 2, 41 + 11)
    assert shapes[3] == StepShape("decode", 2, 2, 42 + 12)
    assert len(shapes) == 4  # 3 tokens each: one from the prefill, two decode steps
    assert engine.step() == [] and engine.last_step is None


def test_step_totals_sum_per_phase_and_snapshot_is_a_copy():
    totals = StepTotals()
    totals.add(StepShape("decode", 4, 4, 400), 0.02)
    totals.add(StepShape("decode", 2, 2, 100), 0.01)
    totals.add(StepShape("prefill", 1, 64, 64), 0.05)
    totals.add(None, 1.0)  # an iteration that ran no batch counts nothing
    snap, _ = totals.snapshots()
    d = snap["decode"]
    assert (d.steps, d.seqs, d.tokens, d.context) == (2, 6, 6, 500) and abs(d.seconds - 0.03) < 1e-12
    assert (snap["prefill"].steps, snap["prefill"].tokens) == (1, 64)
    snap["decode"].steps = 99
    assert totals.snapshots()[0]["decode"].steps == 2


def test_decode_steps_are_also_summed_per_power_of_two_batch_bucket():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 7, 8, 15, 16, 300)] == [1, 2, 2, 4, 4, 8, 8, 16, 256]
    assert [bucket_label(lo) for lo in (1, 2, 4, 256)] == ["1", "2-3", "4-7", "256-511"]
    totals = StepTotals()
    totals.add(StepShape("decode", 1, 1, 50), 0.01)
    totals.add(StepShape("decode", 5, 5, 500), 0.03)
    totals.add(StepShape("decode", 7, 7, 700), 0.04)
    totals.add(StepShape("prefill", 3, 300, 300), 0.1)  # prefill: per phase only
    phases, by = totals.snapshots()
    assert list(by) == [("decode", 1), ("decode", 4)]
    four = by[("decode", 4)]
    assert (four.steps, four.seqs, four.context) == (2, 12, 1200) and abs(four.seconds - 0.07) < 1e-12
    d = phases["decode"]  # the buckets add up to the phase
    assert d.steps == sum(t.steps for t in by.values()) and d.seqs == sum(t.seqs for t in by.values())
