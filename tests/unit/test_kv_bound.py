"""The opt-in bound on a sequence's KV (EngineConfig.kv_sink_tokens / kv_recent_tokens, as
StreamingLLM): approximate against full attention by design, but exactly the attention it promises
(transformers under the same mask, whole and chunked prefill, decode), and it frees what it
promises (the blocks between the sinks and the recent window go back while the sequence runs)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.block_manager import RELEASED
from engine.builtin_model import resolve_model_path
from engine.config import EngineConfig
from engine.engine import Engine
from pdcluster import LLM, SamplingParams

MODEL = "builtin:tiny-llama"
SINKS, RECENT, BS, N = 16, 40, 16, 48
PROMPT = [1] + [(31 * j) % 8000 + 4 for j in range(90)]


def _masked_reference(seq: list[int]) -> list[int]:
    """transformers' greedy next token at every position, each query seeing the sinks and its
    recent blocks only (the bound's rule, as a 4-d mask)."""
    hf = AutoModelForCausalLM.from_pretrained(str(resolve_model_path(MODEL)), dtype=torch.float32,
                                              attn_implementation="eager").eval()
    q, k = torch.arange(len(seq))[:, None], torch.arange(len(seq))[None, :]
    recent = (q - RECENT + 1).clamp_min(0) // BS * BS
    visible = (k <= q) & ((k < SINKS) | (k >= recent))
    mask = torch.zeros(1, 1, len(seq), len(seq)).masked_fill_(~visible, torch.finfo(torch.float32).min)
    with torch.no_grad():
        return hf(torch.tensor([seq]), attention_mask=mask).logits[0].argmax(-1).tolist()


@pytest.mark.parametrize("mode, chunk", [("colocated", 2048), ("colocated", 16), ("disaggregated", 2048)])
def test_the_bound_is_exactly_the_attention_it_promises(mode: str, chunk: int) -> None:
    llm = LLM(MODEL, dtype="float32", num_blocks=64, max_model_len=256, kv_sink_tokens=SINKS,
              kv_recent_tokens=RECENT, max_num_batched_tokens=chunk, max_num_seqs=8, mode=mode)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True))[0].token_ids
    want = _masked_reference(PROMPT + out)[len(PROMPT) - 1:-1]
    assert out == want
    exact = LLM(MODEL, dtype="float32", num_blocks=64, max_model_len=256).generate(
        [PROMPT], SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True))[0].token_ids
    assert out != exact  # an approximation: on this model, another continuation


def test_the_blocks_between_the_sinks_and_the_recent_window_are_given_back() -> None:
    cfg = EngineConfig(model=MODEL, dtype="float32", num_blocks=64, max_model_len=512, kv_sink_tokens=SINKS,
                       kv_recent_tokens=RECENT)
    engine = Engine(cfg, "colocated")
    seq = engine.add_request("a", PROMPT, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    most = 0
    while engine.has_work():
        before = seq.num_computed_tokens  # what the step's release (at its start) went by
        engine.step()
        held = [b for b in seq.block_table if b != RELEASED]
        most = max(most, engine.block_manager.num_used_blocks)
        if seq.block_table and before > SINKS + RECENT + 2 * BS:
            # the sink block, the blocks the next query's recent window touches, the block being filled
            assert len(held) <= SINKS // BS + -(-RECENT // BS) + 2
            assert seq.block_table[0] != RELEASED and RELEASED in seq.block_table
    assert len(seq.token_ids) == len(PROMPT) + 200
    assert most <= SINKS // BS + -(-RECENT // BS) + 3 + 2  # plus the prefix cache's parent block
    assert engine.block_manager.num_used_blocks == 0  # all given back at the end


def test_a_bound_needs_its_recent_window_and_a_model_without_windows(checkpoint) -> None:
    with pytest.raises(ValueError, match="kv_sink_tokens bounds a sequence's KV only with kv_recent_tokens"):
        EngineConfig(kv_sink_tokens=4)
    with pytest.raises(ValueError, match="kv_recent_tokens must be an integer >= 1"):
        EngineConfig(kv_recent_tokens=0)
    with pytest.raises(ValueError, match="already attend through windows"):
        LLM(str(checkpoint("mistral-window")), kv_recent_tokens=32)
