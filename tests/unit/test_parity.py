"""Greedy output equals transformers' own generate(), token for token, for every architecture.

Runs the offline LLM both ways: colocated (one engine; a small token budget so prompt chunks and
decode rows share steps) and disaggregated (prefill engine -> in-process KV transfer -> decode
engine). Prompts of mixed lengths are submitted together so they batch.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.builtin_model import resolve_model_path
from pdcluster import LLM, SamplingParams
from tests.checkpoints import SHAPES, VOCAB

PROMPT_LENS = (3, 17, 40, 77)
MAX_TOKENS = 24
# colocated with a budget that splits the 40- and 77-token prompts, so steps are mixed
MODE_KWARGS = {"colocated": dict(max_num_batched_tokens=32, max_num_seqs=8), "disaggregated": {}}


def _prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _reference(path, prompts, dtype=torch.float32, **load_kwargs):
    """transformers greedy tokens and per-step log-probabilities, one prompt at a time (no padding);
    `load_kwargs` go to from_pretrained."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **load_kwargs).eval()
    refs = []
    for p in prompts:
        out = hf.generate(
            torch.tensor([p]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
            eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
        )
        logprobs = torch.stack([torch.log_softmax(l[0].float(), -1) for l in out.logits])
        refs.append((out.sequences[0, len(p):].tolist(), logprobs))
    return refs


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_greedy_matches_transformers_for_every_architecture(checkpoint, shape):
    path = checkpoint(shape)
    prompts = _prompts()
    refs = _reference(path, prompts)
    for mode, kwargs in MODE_KWARGS.items():
        llm = LLM(str(path), num_blocks=128, max_model_len=256, mode=mode, **kwargs)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)
        _assert_matches(f"{shape}, {mode}", prompts, llm.generate(prompts, params), refs)


def _assert_matches(label, prompts, outs, refs):
    for prompt, out, (ref_tokens, ref_logprobs) in zip(prompts, outs, refs):
        assert out.token_ids == ref_tokens, f"{label}: prompt of {len(prompt)} tokens diverged"
        assert out.finish_reason == "length"
        ours = torch.tensor([lp.logprob for lp in out.logprobs])
        theirs = ref_logprobs.gather(1, torch.tensor(ref_tokens)[:, None]).squeeze(1)
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
        # the top-3 alternatives agree too
        for step, lp in enumerate(out.logprobs):
            top_ids = [t for t, _ in lp.top]
            assert top_ids == ref_logprobs[step].topk(3).indices.tolist()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_greedy_matches_transformers_in_half_precision(checkpoint, dtype):
    tdtype = getattr(torch, dtype)
    path = checkpoint("llama-gqa", dtype=tdtype)
    prompts = _prompts(2)
    refs = _reference(path, prompts, tdtype)
    for mode, kwargs in MODE_KWARGS.items():
        llm = LLM(str(path), dtype=dtype, num_blocks=128, max_model_len=256, mode=mode, **kwargs)
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        for out, (ref_tokens, _) in zip(outs, refs):
            assert out.token_ids == ref_tokens, mode
        assert all(e.runner.kv_caches[0].dtype == tdtype for e in llm.engines)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-moe", "tiny-mla"])
def test_builtin_model_matches_transformers(name):
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_path(f"builtin:{name}")).eval()
    llm = LLM(f"builtin:{name}", num_blocks=64, max_model_len=512)
    texts = ["Hello, world", "The quick brown fox jumps over the lazy dog because"]
    outs = llm.generate(texts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for text, out in zip(texts, outs):
        ids = llm.tokenizer(text, return_tensors="pt").input_ids
        ref = hf.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=3)
        assert out.token_ids == ref[0, ids.shape[1]:].tolist()
        assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_sharded_checkpoint_loads_and_matches(checkpoint):
    path = checkpoint("qwen2-bias", max_shard_size="200KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1
    prompts = _prompts(5)
    llm = LLM(str(path), num_blocks=128, max_model_len=256)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [ref for ref, _ in _reference(path, prompts)]
