"""Traffic whose mix shifts (loadgen/phases.py): the phase spec, arrivals thinned to a ramp, each
phase's requests back to back with texts of their own, worker-seconds from sampled counts."""

from __future__ import annotations

import random

import pytest

from loadgen.phases import Phase, WorkerSampler, parse_phases, phase_config, phased_requests, synthetic_lengths, thinned
from loadgen.workload import WorkloadConfig, load_workload


def test_the_spec_reads_workloads_rates_ramps_and_seconds():
    assert parse_phases("azure-conv:2:60, 512/4:1-3:30") == [Phase("azure-conv", 2, 2, 60), Phase("512/4", 1, 3, 30)]
    assert parse_phases("/data/trace.csv:0.5:10")[0].workload == "/data/trace.csv"
    assert Phase("512/4", 1, 3, 30).label == "512/4 1-3/s" and Phase("x", 2, 2, 1).label == "x 2/s"


@pytest.mark.parametrize("bad", ["azure-conv:2", "azure-conv:0:10", "azure-conv:2:-1", ":2:10", "x:a-b:3", "x:inf:3"])
def test_a_phase_that_does_not_parse_is_named(bad):
    with pytest.raises(ValueError, match="--phases"):
        parse_phases(bad)


def test_synthetic_phases_have_fixed_lengths_and_texts_of_their_own():
    assert synthetic_lengths("512/4") == (512, 4) and synthetic_lengths("azure-code") is None
    with pytest.raises(ValueError, match="1 or more"):
        synthetic_lengths("0/4")
    cfg = phase_config(Phase("512/4", 2, 2, 10), 3, WorkloadConfig("azure-conv", 1, sample_seed=7))
    assert (cfg.source, cfg.synthetic_input, cfg.synthetic_output) == ("synthetic", "fixed:512", "fixed:4")
    assert cfg.prompt_salt == "phase3" and cfg.sample_seed is None and cfg.num_requests == 46


def test_a_ramp_keeps_arrivals_in_proportion_to_its_rate():
    rng, t, at_top = random.Random(1), 0.0, []
    while t < 1000:
        t += rng.expovariate(10.0)
        at_top.append(t)
    kept = [at_top[i] for i in thinned(Phase("w", 0.001, 10, 1000), at_top, "s")]
    first, last = sum(x < 500 for x in kept), sum(x >= 500 for x in kept)
    assert 2.5 < last / first < 3.5  # mean rate 2.5 vs 7.5 a second in the two halves
    assert max(kept) < 1000


def test_phases_play_back_to_back():
    work = phased_requests(parse_phases("64/4:4:5,16/32:2:5"), WorkloadConfig("synthetic", 1),
                           load_workload, seed=0)
    first = [i for i, p in enumerate(work.phase) if p == 0]
    assert work.spans == [("64/4 4/s", 0.0, 5.0), ("16/32 2/s", 5.0, 10.0)]
    assert all(work.offsets[i] < 5 for i in first) and all(5 <= o < 10 for o, p in zip(work.offsets, work.phase) if p)
    assert [r.index for r in work.requests] == list(range(len(work.requests)))
    assert {work.requests[i].output_len for i in first} == {4} and 10 < len(first) < 35


def test_worker_seconds_hold_each_sample_until_the_next():
    s = WorkerSampler("http://unused")
    s.samples = [(0.0, {"prefill": 1, "decode": 2}), (10.0, {"prefill": 2, "decode": 1})]
    assert s.worker_seconds(0, 20) == {"prefill": 30.0, "decode": 30.0}
    assert s.worker_seconds(5, 15) == {"prefill": 15.0, "decode": 15.0}
    assert WorkerSampler("http://unused").worker_seconds(0, 10) == {}
