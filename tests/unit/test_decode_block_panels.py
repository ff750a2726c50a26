"""A layer's decode step in native calls on the panel kernel (engine/models/decode_block.py,
float32 and bfloat16 where the CPU has no AMX tiles) gives the module path's bits: the same tokens
and the same logprobs."""

from __future__ import annotations

import pytest
import torch

from engine import linear_panels
from engine.models import llama
from engine.models.decode_block import AttentionBlock
from engine.native import native_lib
from engine.packed_linear import can_pack
from pdcluster import LLM, SamplingParams

LIB = native_lib()
AMX = LIB is not None and LIB.pd_amx_ready()
DTYPES = [d for d in (torch.float32, torch.bfloat16)
          if linear_panels.served(LIB, d) and can_pack(torch.device("cpu"), d) and not (AMX and d == torch.bfloat16)]
pytestmark = pytest.mark.skipif(not DTYPES, reason="the panel decode blocks need the panel kernel for a dtype")

PROMPTS = [[5, 9, 13, 2, 7, 11, 4], [8, 3, 6], [12, 14, 5, 9, 10, 3, 8, 7, 6, 4, 2, 11, 13, 9, 5, 3, 17, 21, 8, 6]]


def _generate(llm: LLM) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, params)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ["llama-gqa", "qwen3-qknorm", "qwen2-bias", "qwen3-window-alternating"])
def test_panel_decode_blocks_give_the_module_paths_bits(checkpoint, monkeypatch, shape, dtype):
    llm = LLM(str(checkpoint(shape)), dtype=str(dtype).removeprefix("torch."), max_model_len=128, block_size=16)
    layers = llm.engine.runner.model.layers
    assert all(layer.decode_block is not None and layer.decode_block.panels for layer in layers)
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
    monkeypatch.setattr(llama, "mlp_on_panels", lambda *args: None)  # the MLP's linears one call each
    assert _generate(llm) == fused
