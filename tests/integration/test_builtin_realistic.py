"""builtin:llama-200m is written as a bfloat16 Hugging Face checkpoint that transformers loads, and
greedy float32 output of the engine equals transformers' on it (slow: 411 MB, ~30 s)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


def test_llama_200m_loads_and_matches_transformers():
    from transformers import AutoModelForCausalLM

    from engine.builtin_model import resolve_model_path
    from pdcluster import LLM, SamplingParams

    path = resolve_model_path("builtin:llama-200m")
    hf = AutoModelForCausalLM.from_pretrained(path)
    assert hf.dtype == torch.bfloat16
    assert sum(p.numel() for p in hf.parameters()) == 205_554_688
    hf = hf.float().eval()
    llm = LLM("builtin:llama-200m", dtype="float32", num_blocks=32, max_model_len=256)
    prompts = [[5, 77, 901, 4000, 23], list(range(10, 70))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for p, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                          eos_token_id=None, pad_token_id=3)
        assert out.token_ids == ref[0, len(p):].tolist()
