"""A layer's decode step in native calls (engine/models/decode_block.py) gives the module path's
bits: the same tokens and the same logprobs, on every shape it serves: on AMX tiles (bfloat16), and
on the panel kernel (float32, and bfloat16 where the CPU has no AMX)."""

from __future__ import annotations

import pytest
import torch

import engine.models.moe as moe_module
from engine import linear_panels
from engine.models.decode_block import AttentionBlock
from engine.native import native_lib
from engine.packed_linear import can_pack
from pdcluster import LLM, SamplingParams

LIB = native_lib()
AMX = LIB is not None and bool(LIB.pd_amx_ready()) and can_pack(torch.device("cpu"), torch.bfloat16)
amx = pytest.mark.skipif(not AMX, reason="the native decode blocks on tiles need AMX")
PANEL_DTYPES = [d for d in (torch.float32, torch.bfloat16)
                if linear_panels.served(LIB, d) and can_pack(torch.device("cpu"), d) and not (AMX and d == torch.bfloat16)]

PROMPTS = [[5, 9, 13, 2, 7, 11, 4], [8, 3, 6], [12, 14, 5, 9, 10, 3, 8, 7, 6, 4, 2, 11, 13, 9, 5, 3, 17, 21, 8, 6]]


def _generate(llm: LLM) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, params)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


def _blocks_give_the_module_paths_bits(llm: LLM, monkeypatch) -> list[AttentionBlock]:
    """Generates with the layers' decode blocks, then without them (and without the MoE block):
    the same tokens and logprobs; decode steps took the blocks, prefill steps did not. Returns the blocks."""
    layers = llm.engine.runner.model.layers
    blocks = [layer.decode_block for layer in layers]
    assert all(b is not None for b in blocks)
    served = []
    call = AttentionBlock.__call__

    def counted(self, *args):
        out = call(self, *args)
        served.append(out is not None)
        return out

    monkeypatch.setattr(AttentionBlock, "__call__", counted)
    fused = _generate(llm)
    assert any(served) and not all(served)  # decode steps native, prefill steps not
    for layer in layers:
        layer.decode_block = None
    monkeypatch.setattr(moe_module, "moe_block", lambda moe, x: None)
    assert _generate(llm) == fused
    return blocks


@amx
@pytest.mark.parametrize("shape", ["qwen3-moe", "qwen3-qknorm", "qwen2-bias", "qwen3-window-alternating",
                                   "mixtral"])
def test_native_decode_blocks_give_the_module_paths_bits(checkpoint, monkeypatch, shape):
    llm = LLM(str(checkpoint(shape)), dtype="bfloat16", max_model_len=128, block_size=16)
    assert not any(b.panels for b in _blocks_give_the_module_paths_bits(llm, monkeypatch))


@pytest.mark.skipif(not PANEL_DTYPES, reason="the panel decode blocks need the panel kernel for a dtype")
@pytest.mark.parametrize("dtype", PANEL_DTYPES)
@pytest.mark.parametrize("shape", ["llama-gqa", "qwen3-qknorm", "qwen2-bias", "qwen3-window-alternating"])
def test_panel_decode_blocks_give_the_module_paths_bits(checkpoint, monkeypatch, shape, dtype):
    llm = LLM(str(checkpoint(shape)), dtype=str(dtype).removeprefix("torch."), max_model_len=128, block_size=16)
    assert all(b.panels for b in _blocks_give_the_module_paths_bits(llm, monkeypatch))


@amx
def test_latent_attentions_tile_projections_give_the_batched_matmuls_result(checkpoint):
    """DeepSeek's absorb and unfold (per-head W_uk, W_uv) on the tiles for decode batches: the same
    tokens as torch's batched matmul, logprobs within bfloat16's rounding."""
    path = checkpoint("deepseek-v3", qk_nope_head_dim=32, kv_lora_rank=64, v_head_dim=32)
    llm = LLM(str(path), dtype="bfloat16", max_model_len=128, block_size=16)
    attns = [layer.self_attn for layer in llm.engine.runner.model.layers]
    assert all(a.tiles is not None for a in attns)
    tiled = _generate(llm)
    for a in attns:
        a.tiles = None
    plain = _generate(llm)
    assert [t for t, _ in tiled] == [t for t, _ in plain]
    assert max(abs(x - y) for (_, a), (_, b) in zip(tiled, plain) for x, y in zip(a, b)) < 0.05
