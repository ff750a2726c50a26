"""gpt-oss: its checkpoint names load, its attention sinks count, its layers window as configured,
and the native decode kernel (which has no sink) stays off (its mxfp4 checkpoints:
tests/unit/test_quantized_checkpoints.py)."""

from __future__ import annotations


import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from engine.checkpoint_names import Piece, expected_pieces, is_stacked, piece_of
from engine.config import ModelConfig
from engine.native import native_lib
from pdcluster import LLM, SamplingParams
from tests.unit.test_parity import MAX_TOKENS, _assert_matches, _prompts, _reference


def _names(path) -> list[str]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return list(f.keys())


def test_checkpoint_names_map_onto_the_model(checkpoint):
    path = checkpoint("gpt-oss")
    llm = LLM(str(path), num_blocks=32, max_model_len=64, enforce_eager=True)
    params = dict(llm.engine.runner.model.named_parameters())
    pieces = {piece_of(name) for name in _names(path)}
    assert Piece("layers.0.mlp.experts.gate_up_proj") in pieces  # stacked (E, H, 2I), loaded whole
    assert Piece("layers.1.self_attn.sinks") in pieces
    assert Piece("layers.0.self_attn.qkv_proj.bias", 0) in pieces  # q/k/v biases fuse like Qwen2's
    assert {p.target for p in pieces} <= set(params) | {"lm_head.weight"}
    assert not is_stacked("layers.0.mlp.experts.gate_up_proj", whole=True)
    assert tuple(params["layers.0.mlp.experts.gate_up_proj"].shape) == (4, 64, 96)
    assert pieces == expected_pieces({n: 0 for n in params}, whole=True)


def test_windows_alternate_by_layer_types(checkpoint):
    cfg = ModelConfig.from_pretrained(checkpoint("gpt-oss"))
    assert cfg.layer_windows == (10, None, 10, None)
    assert cfg.attention_sinks and cfg.router == "gpt_oss" and cfg.moe_layers == frozenset(range(4))


def _without_sinks(src, dst):
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.sinks.zero_()
    hf.save_pretrained(dst)
    return dst


def test_sinks_change_the_output_and_match_transformers_either_way(checkpoint, tmp_path):
    path = checkpoint("gpt-oss")
    zeroed = _without_sinks(path, tmp_path / "zero-sinks")
    prompts = _prompts()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)
    refs = {}
    for label, p in (("sinks", path), ("zero sinks", zeroed)):
        refs[label] = _reference(p, prompts)
        outs = LLM(str(p), num_blocks=128, max_model_len=256).generate(prompts, params)
        _assert_matches(f"gpt-oss, {label}", prompts, outs, refs[label])
    assert any(not torch.allclose(a[1], b[1]) for a, b in zip(refs["sinks"], refs["zero sinks"]))


def test_native_kernel_is_off_for_sinks(checkpoint):
    if native_lib() is None:
        pytest.skip("no native kernel built here")
    assert LLM(str(checkpoint("llama-gqa")), num_blocks=32, max_model_len=64).engine.runner.native_decode
    assert not LLM(str(checkpoint("gpt-oss")), num_blocks=32, max_model_len=64).engine.runner.native_decode

