"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's logprob from the 2nd on, with
the top alternatives, equal to transformers' log-softmax over the same prompt, whole or chunked,
colocated or disaggregated, with the prompt already in the prefix cache (it is computed again)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.sampling_params import SamplingParams
from pdcluster.llm import LLM

PROMPT = [(7 * j + 3) % 250 + 4 for j in range(45)]


@pytest.fixture(scope="module")
def want(checkpoint):
    path = str(checkpoint("llama-gqa"))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    return path, lp


@pytest.mark.parametrize("mode, chunk", [("colocated", 2048), ("colocated", 16), ("disaggregated", 2048)])
def test_prompt_logprobs_equal_transformers(want, mode, chunk):
    path, lp = want
    llm = LLM(path, dtype="float32", mode=mode, max_model_len=256, num_blocks=64, max_num_batched_tokens=chunk,
              max_num_seqs=8)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    for _ in range(2):  # the second time the prompt's blocks are cached: they are computed again all the same
        (out,) = llm.generate([PROMPT], params, use_tqdm=False)
        got = out.prompt_logprobs
        assert [x.token_id for x in got] == PROMPT[1:]
        ref = lp[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
        assert torch.allclose(torch.tensor([x.logprob for x in got]), ref, atol=1e-4)
        top_v, top_i = lp[:-1].topk(3, dim=-1)
        assert [[t for t, _ in x.top] for x in got] == top_i.tolist()
        assert torch.allclose(torch.tensor([[v for _, v in x.top] for x in got]), top_v, atol=1e-4)
        assert [x.rank for x in got] == ((lp[:-1] > ref[:, None]).sum(dim=-1) + 1).tolist()


def test_unset_means_none(want):
    llm = LLM(want[0], dtype="float32", max_model_len=256, num_blocks=64)
    assert llm.generate([PROMPT], SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_logprobs is None


def test_a_prompt_preempted_mid_prefill_still_gets_every_logprob(want):
    """The prompt is recomputed in other chunks after a preemption: the rows not yet taken are taken."""
    from engine.config import EngineConfig
    from engine.engine import Engine

    path, lp = want
    engine = Engine(EngineConfig(model=path, dtype="float32", num_blocks=64, max_model_len=256, num_threads=1,
                                 max_num_batched_tokens=16, max_num_seqs=8))
    seq = engine.add_request("p", PROMPT, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0))
    engine.step()  # the first 16-token chunk
    assert len(seq.prompt_logprobs) == 16
    engine.scheduler._preempt(seq)  # what the scheduler does when decode rows need its blocks
    engine.scheduler.max_num_batched_tokens = 10  # other chunk boundaries on the recompute
    while seq.finish_reason is None:
        engine.step()
    ref = lp[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
    assert torch.allclose(torch.tensor([x.logprob for x in seq.prompt_logprobs]), ref, atol=1e-4)
