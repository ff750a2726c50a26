"""Logits adjustments (penalties, logit_bias, min_tokens): against transformers' logits processors
where it has them, against the formula where it does not, batched rows independent of each other."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from engine.logits_processors import adjust_logits
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams

VOCAB = 50


@dataclass
class Hist:
    token_ids: list[int]
    num_prompt_tokens: int
    output_offset: int = 0
    eos_token_ids: frozenset[int] = frozenset({2})


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_nothing_to_adjust_returns_the_same_tensor():
    logits = _logits(2)
    assert adjust_logits(logits, [SamplingParams()] * 2, [0, 0], [Hist([1], 1)] * 2) is logits


def test_repetition_penalty_equals_transformers_over_prompt_and_completion():
    logits = _logits(3)
    hists = [Hist([1, 4, 4, 9], 2), Hist([7, 8, 3], 3), Hist([5, 6, 11, 12, 5], 1)]
    params = [SamplingParams(repetition_penalty=r) for r in (1.3, 0.7, 1.0)]
    got = adjust_logits(logits, params, [2, 0, 4], hists)
    for i, (h, p) in enumerate(zip(hists, params)):
        want = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([h.token_ids]), logits[i:i + 1])
        torch.testing.assert_close(got[i], want[0])
    assert not torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])


def test_frequency_and_presence_count_only_the_completion_including_tokens_before_a_resume():
    logits = _logits(2)
    fresh = Hist([3, 3, 5, 5, 5, 8], 2)  # completion 5 5 5 8 (the 3s are prompt)
    resumed = Hist([3, 3, 5, 5, 5, 8], 5, output_offset=3)  # a retry: prompt 3 3 + resumed 5 5 5, then 8
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    got = adjust_logits(logits, [p, p], [4, 4], [fresh, resumed])
    want = logits[0].clone()
    want[5] -= 0.5 * 3 + 0.25
    want[8] -= 0.5 + 0.25
    torch.testing.assert_close(got[0], want)
    torch.testing.assert_close(got[1], logits[1] + (want - logits[0]))  # the same adjustment


def test_logit_bias_equals_transformers_sequence_bias_and_ignores_other_rows():
    logits = _logits(2)
    bias = {4: -100.0, 9: 5.5}
    got = adjust_logits(logits, [SamplingParams(logit_bias=bias), SamplingParams()], [0, 0], [Hist([1], 1)] * 2)
    proc = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
    torch.testing.assert_close(got[0], proc(torch.tensor([[1]]), logits[:1])[0])
    assert torch.equal(got[1], logits[1])


def test_min_tokens_masks_eos_and_stop_ids_until_reached_as_transformers_does():
    logits = _logits(3)
    p = SamplingParams(min_tokens=2, stop_token_ids=[7], max_tokens=8)
    got = adjust_logits(logits, [p, p, SamplingParams(min_tokens=2, ignore_eos=True)], [1, 2, 0],
                        [Hist([1, 3], 1), Hist([1, 3, 4], 1), Hist([1], 1)])
    want = MinNewTokensLengthLogitsProcessor(1, 2, [2, 7])(torch.tensor([[1, 3]]), logits[:1].clone())
    torch.testing.assert_close(got[0], want[0])
    assert got[0, 2] == got[0, 7] == float("-inf")
    assert torch.equal(got[1], logits[1])  # two completion tokens: free to stop
    assert got[2, 2] == logits[2, 2]  # ignore_eos: EOS is not a stop, so it is not masked


def test_greedy_picks_the_adjusted_argmax_and_logprobs_stay_raw():
    logits = torch.zeros(1, VOCAB)
    logits[0, 4] = 5.0
    logits[0, 6] = 4.0
    p = SamplingParams(temperature=0.0, logprobs=1, logit_bias={4: -100.0})
    tokens, lps = Sampler(torch.device("cpu"))(logits, [p], [0], [Hist([1], 1)])
    assert tokens == [6]
    assert lps[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[6]))
    assert lps[0].top[0][0] == 4  # the raw distribution's top token


@pytest.mark.parametrize("kwargs, message", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logit_bias": {3: 101.0}}, r"logit_bias\[3\]"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
])
def test_out_of_range_parameters_are_refused_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
