"""Several choices from one prefill (SamplingParams.n / best_of) in the engine: choice k equals the
request with n = 1 and seed + k (greedy: all equal n = 1), colocated and disaggregated, whatever the
prompt's length against the block size; the choices share the prompt's full blocks and copy the last
one; with no free block a choice waits and is prefilled later; aborts free every block."""

from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from pdcluster.llm import LLM

PROMPTS = {"partial": [(5 * j + 1) % 200 + 3 for j in range(21)],
           "boundary": [(3 * j + 2) % 200 + 3 for j in range(32)],
           "one": [9]}


@pytest.fixture(scope="module")
def path(checkpoint):
    return str(checkpoint("llama-gqa"))


def _llm(path: str, mode: str = "colocated", num_blocks: int = 64) -> LLM:
    return LLM(path, dtype="float32", mode=mode, max_model_len=128, num_blocks=num_blocks, max_num_seqs=8)


def _free_all(llm: LLM) -> None:
    for engine in llm.engines:
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        bm.check_invariants([])


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
@pytest.mark.parametrize("prompt", sorted(PROMPTS))
def test_choices_equal_single_requests_with_seed_plus_k(path, mode, prompt):
    llm = _llm(path, mode)
    ids = PROMPTS[prompt]
    for base in (SamplingParams(max_tokens=9, temperature=0.0),
                 SamplingParams(max_tokens=9, temperature=0.9, top_k=50, seed=11)):
        singles = [llm.generate([ids], base.choice_params(k))[0].token_ids for k in range(3)]
        (out,) = llm.generate([ids], SamplingParams(**{**base.__dict__, "n": 3}))
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert [c.token_ids for c in out.outputs] == singles
        assert all(c.finish_reason == "length" for c in out.outputs)
        _free_all(llm)


def test_choices_share_the_prompt_blocks_and_copy_the_last(path):
    llm = _llm(path)
    engine = llm.engine
    ids = PROMPTS["partial"]  # 21 tokens, block 16: one full block shared, the partial one copied
    engine.add_request("r", ids, SamplingParams(max_tokens=4, temperature=0.0, n=3))
    engine.step()  # the prompt: choice 0 samples, choices 1 and 2 fork
    seqs = sorted(engine.scheduler.running, key=lambda s: s.index)
    assert [s.index for s in seqs] == [0, 1, 2]
    parent, *children = seqs
    for child in children:
        assert child.block_table[0] == parent.block_table[0]
        assert child.block_table[1] != parent.block_table[1]
        assert child.num_computed_tokens == len(ids) - 1 and child.output_token_ids == []
    bm = engine.block_manager
    assert bm.blocks[parent.block_table[0]].ref_count == 3
    bm.check_invariants([s.block_table for s in seqs])
    engine.step()  # the children recompute the last prompt token and sample; the parent decodes
    assert [len(s.output_token_ids) for s in seqs] == [2, 1, 1]
    assert engine.abort("r") is parent  # every choice goes
    assert not engine.has_work()
    _free_all(llm)


def test_a_choice_without_a_free_block_waits_and_is_prefilled(path):
    llm = _llm(path, num_blocks=9)  # 128 tokens of max_model_len take 8 blocks
    ids = PROMPTS["boundary"]
    want = [llm.generate([ids], SamplingParams(max_tokens=3, temperature=0.0))[0].token_ids] * 4
    (out,) = llm.generate([ids], SamplingParams(max_tokens=3, temperature=0.0, n=4))
    assert [c.token_ids for c in out.outputs] == want
    _free_all(llm)


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_first_token_ends_choice_zero_the_others_still_run(path, mode):
    llm = _llm(path, mode)
    ids = PROMPTS["partial"]
    first = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids[0]
    for params in (SamplingParams(max_tokens=5, temperature=0.9, seed=3, n=3, stop_token_ids=[first]),
                   SamplingParams(max_tokens=1, temperature=0.9, seed=3, n=3)):
        singles = [llm.generate([ids], params.choice_params(k))[0].token_ids for k in range(3)]
        (out,) = llm.generate([ids], params)
        assert [c.token_ids for c in out.outputs] == singles
        _free_all(llm)


def test_abort_one_choice_keeps_the_others(path):
    llm = _llm(path)
    engine = llm.engine
    engine.add_request("r", PROMPTS["partial"], SamplingParams(max_tokens=8, temperature=0.0, n=3))
    engine.step()
    assert engine.abort("r", 1).index == 1
    assert sorted(s.index for s in engine.scheduler.running) == [0, 2]
    while engine.has_work():
        engine.step()
    _free_all(llm)


def test_best_of_returns_the_n_of_highest_cumulative_logprob(path):
    llm = _llm(path)
    ids = PROMPTS["partial"]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=4, logprobs=0)
    (every,) = llm.generate([ids], params)
    ranked = sorted(every.outputs, key=lambda c: (-c.cumulative_logprob, c.index))
    (out,) = llm.generate([ids], SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=2, best_of=4))
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ranked[:2]]
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(c.logprobs is None for c in out.outputs)  # computed to rank, not asked for
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob
    _free_all(llm)


@pytest.mark.parametrize("kwargs, match", [({"n": 0}, "n must"), ({"n": 129}, "n must"),
                                           ({"n": 3, "best_of": 2}, "best_of must"), ({"n": 2.5}, "n must")])
def test_bad_choice_counts_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
