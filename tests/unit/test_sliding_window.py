"""Sliding-window attention equals transformers' generate() (float32, greedy, tokens and
log-probabilities) for every way a config windows its layers, on every attention path (prompt
spans with and without a cached prefix, chunked prefill, padded decode groups, the native decode
kernel, mixed steps, colocated and disaggregated), and the blocks outside every layer's window go
back to the block manager while a sequence runs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import ModelConfig
from engine.request_checks import resolve_max_model_len
from engine.sampling_params import SamplingParams
from pdcluster import LLM
from tests.checkpoints import VOCAB

WINDOWED = ("mistral-window", "qwen2-window-layers", "qwen3-window-alternating")
PROMPT_LENS = (9, 44, 77)  # one inside every window, two longer than any
MAX_TOKENS = 40  # the decode crosses the window's start several times
# block 4 with a small budget (prompts chunked, steps mixed), block 16 whole prompts, the torch path
ENGINES = {
    "block4-chunked": dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=8),
    "block16": dict(block_size=16),
    "block16-eager": dict(block_size=16, enforce_eager=True),
    "block4-disaggregated": dict(block_size=4, mode="disaggregated"),
}


def _prompts(lens: tuple[int, ...] = PROMPT_LENS, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module")
def references(checkpoint):
    """shape -> (path, [(tokens, log-probabilities per step)] for _prompts()), by transformers."""
    made = {}

    def get(shape: str):
        if shape not in made:
            path = checkpoint(shape)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            refs = []
            for p in _prompts():
                out = hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                  do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                                  return_dict_in_generate=True)
                refs.append((out.sequences[0, len(p):].tolist(),
                             torch.stack([torch.log_softmax(l[0].float(), -1) for l in out.logits])))
            made[shape] = (path, refs)
        return made[shape]

    return get


def _assert_matches(label: str, outs, refs) -> None:
    for out, (tokens, logprobs) in zip(outs, refs):
        assert out.token_ids == tokens, label
        ours = torch.tensor([lp.logprob for lp in out.logprobs])
        theirs = logprobs.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4, msg=label)


def test_layer_windows_are_read_as_transformers_applies_them(checkpoint):
    windows = {shape: ModelConfig.from_pretrained(checkpoint(shape)).layer_windows
               for shape in (*WINDOWED, "mistral", "llama-gqa", "qwen2-bias")}
    assert windows == {
        "mistral-window": (14, 14),  # every layer
        "qwen2-window-layers": (None, 12, 12),  # from max_window_layers on
        "qwen3-window-alternating": (18, None, 18, None),  # by layer_types
        "mistral": (None, None), "llama-gqa": (None, None), "qwen2-bias": (None, None),
    }
    cfg = ModelConfig.from_pretrained(checkpoint("mistral-window"))
    assert cfg.kv_spec.kv_window == 14
    assert ModelConfig.from_pretrained(checkpoint("qwen3-window-alternating")).kv_spec.kv_window is None
    # a window no longer caps the sequence length
    assert resolve_max_model_len(cfg, None) == cfg.max_position_embeddings == 512


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("shape", WINDOWED)
def test_windowed_greedy_matches_transformers(references, shape, engine):
    path, refs = references(shape)
    kwargs = dict(ENGINES[engine])
    llm = LLM(str(path), num_blocks=96, max_model_len=256, mode=kwargs.pop("mode", "colocated"), **kwargs)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    prompts = _prompts()
    _assert_matches(f"{shape} {engine}", llm.generate(prompts, params), refs)
    # again: the prompts' leading blocks are prefix-cache hits (some released by the first run)
    again = llm.generate(prompts, params)
    assert again[-1].num_cached_tokens >= 64
    _assert_matches(f"{shape} {engine}, prefix cached", again, refs)
    for e in llm.engines:
        assert e.block_manager.num_free_blocks == e.block_manager.num_blocks


def test_forked_choices_match_transformers_with_released_blocks(references):
    path, refs = references("mistral-window")
    llm = LLM(str(path), num_blocks=96, max_model_len=256, block_size=4, max_num_batched_tokens=16,
              max_num_seqs=8)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, n=3)
    (out,) = llm.generate(_prompts()[2:], params)
    assert [c.token_ids for c in out.outputs] == [refs[2][0]] * 3
    assert llm.engine.block_manager.num_free_blocks == 96


def _decode_free_counts(llm: LLM, prompt: list[int], max_tokens: int) -> list[int]:
    engine = llm.engine
    bm = engine.block_manager
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    seq = engine.add_request("r", prompt, params)
    free = []
    while engine.has_work():
        engine.step()
        bm.check_invariants([s.block_table for s in engine.scheduler.running])
        if not seq.is_finished:
            free.append(bm.num_free_blocks)
    assert seq.num_output_tokens == max_tokens and bm.num_free_blocks == bm.num_blocks
    return free


@pytest.mark.parametrize("caching", [True, False])
def test_blocks_outside_every_window_are_released_during_decode(references, caching):
    path, refs = references("mistral-window")  # window 14 on every layer
    llm = LLM(str(path), num_blocks=64, max_model_len=256, block_size=4, enable_prefix_caching=caching)
    prompt = _prompts()[2]  # 77 tokens: a request longer than the window, refused before
    free = _decode_free_counts(llm, prompt, 100)
    # the prompt took 20 blocks; from the next step on only the blocks of the window's 14 keys
    # and the one being written are held (a 177-token sequence would take 45)
    assert free[0] == 64 - 20
    assert min(free[1:]) >= 64 - 5
    if caching:  # the released blocks stay in the prefix cache: the same prompt hits all its full blocks
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        out = llm.generate([prompt], params)[0]
        assert out.num_cached_tokens == 76 and out.token_ids == refs[2][0]


def test_nothing_is_released_while_a_layer_attends_to_everything(references):
    path, _ = references("qwen3-window-alternating")
    llm = LLM(str(path), num_blocks=64, max_model_len=256, block_size=4)
    free = _decode_free_counts(llm, _prompts()[1], 60)
    assert free == sorted(free, reverse=True)  # only ever falls while the sequence runs
    assert free[-1] <= 64 - (44 + 60) // 4
