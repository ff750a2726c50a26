"""Quantized checkpoints as published load, dequantized at load (engine/quantized_weights.py):
fp8 e4m3 with block scales (DeepSeek-V3) and mxfp4 experts (gpt-oss).

Parity with transformers (float32, greedy), each on the same files:
- mxfp4: transformers' own CPU path, `Mxfp4Config(dequantize=True)`.
- fp8 with every dim within one block or a multiple of 128: transformers' own dequantize path (it
  takes it by itself on a CPU), with its accelerate check patched out: accelerate is not installed
  here and the dequantize path does not use it.
- fp8 with partial edge blocks (dims 200 and 300): transformers 5.25 cannot read these right (its
  Fp8Dequantize takes the block size as weight dim // scale dim, 100 instead of 128 for 200 rows),
  so the reference is transformers on the plain weights this test computes block by block.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Mxfp4Config

from engine.config import ModelConfig
from engine.quantized_weights import DequantizingFiles, Quantization, dequantize_fp8
from pdcluster import LLM, SamplingParams
from tests.quantized_checkpoints import fp8_blocks, read_all, write_fp8, write_mxfp4, write_plain
from tests.unit.test_parity import MAX_TOKENS, _assert_matches, _prompts, _reference

PARTIAL = dict(hidden_size=200, intermediate_size=300)  # 128x128 blocks with partial edges
KEEP = ("model.layers.0.self_attn.o_proj",)  # left plain, named in modules_to_not_convert


@pytest.fixture(scope="module")
def fp8(checkpoint, tmp_path_factory):
    """{label: (quantized checkpoint, the plain tensors it stands for)}"""
    out = tmp_path_factory.mktemp("fp8")
    return {"aligned": write_fp8(checkpoint("deepseek-v3"), out / "aligned", keep=KEEP),
            "partial": write_fp8(checkpoint("deepseek-v3", **PARTIAL), out / "partial")}


@pytest.fixture(scope="module")
def mxfp4(checkpoint, tmp_path_factory):
    # experts' widths a multiple of mxfp4's 32-value groups
    return write_mxfp4(checkpoint("gpt-oss", intermediate_size=64), tmp_path_factory.mktemp("mxfp4") / "q")


def _generate(path, prompts):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)
    return LLM(str(path), dtype="float32", num_blocks=128, max_model_len=256).generate(prompts, params)


def test_fp8_matches_transformers_own_dequantize(fp8):
    path, _ = fp8["aligned"]
    prompts = _prompts()
    with mock.patch("transformers.quantizers.quantizer_finegrained_fp8.is_accelerate_available", return_value=True):
        refs = _reference(path, prompts)
    _assert_matches("fp8 deepseek-v3", prompts, _generate(path, prompts), refs)


def test_fp8_partial_blocks_match_transformers_on_the_plain_weights(fp8, tmp_path):
    path, plain = fp8["partial"]
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("model.layers.0.mlp.gate_proj.weight_scale_inv").get_shape() == [3, 2]  # 300x200
    prompts = _prompts(3)
    refs = _reference(write_plain(path, tmp_path / "plain", plain), prompts)
    _assert_matches("fp8 deepseek-v3, partial blocks", prompts, _generate(path, prompts), refs)


def test_mxfp4_matches_transformers_dequantize(mxfp4):
    path, _ = mxfp4
    prompts = _prompts()
    refs = _reference(path, prompts, quantization_config=Mxfp4Config(dequantize=True))
    _assert_matches("mxfp4 gpt-oss", prompts, _generate(path, prompts), refs)


@pytest.mark.parametrize("label", ["fp8 aligned", "fp8 partial", "mxfp4"])
def test_dequantized_tensors_equal_the_reference(fp8, mxfp4, label):
    path, plain = mxfp4 if label == "mxfp4" else fp8[label.split()[1]]
    cfg = ModelConfig.from_pretrained(path)
    files = DequantizingFiles(cfg.quantization, sorted(path.glob("*.safetensors")), torch.float32)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        view = files.view(f)
        assert sorted(view.keys()) == sorted(plain)  # scales hidden, X_blocks read as X
        quantized = set(view.quantized)
        assert quantized and all(torch.equal(view.get_tensor(n), plain[n]) for n in plain)
        name = sorted(quantized)[-1]
        part = view.get_slice(name)  # a tensor-parallel rank's slice: the whole, narrowed
        assert part.get_shape() == list(plain[name].shape)
        assert torch.equal(part[:, 1:3], plain[name][:, 1:3])
    if label == "fp8 aligned":
        assert "model.layers.0.self_attn.o_proj.weight" not in quantized  # modules_to_not_convert
        assert cfg.quantization == Quantization("fp8", (128, 128), KEEP)
    if label == "mxfp4":  # loaded into the experts' (E, H, 2I) and (E, I, H)
        params = dict(LLM(str(path), dtype="float32", num_blocks=16, max_model_len=64,
                          enforce_eager=True).engine.runner.model.named_parameters())
        for proj in ("gate_up_proj", "down_proj"):
            assert torch.equal(params[f"layers.1.mlp.experts.{proj}"], plain[f"model.layers.1.mlp.experts.{proj}"])


def test_fp8_dequantize_covers_partial_blocks():
    w = torch.randn(130, 260) * torch.linspace(0.1, 10, 260)  # block scales that differ
    q, scale_inv, plain = fp8_blocks(w, (128, 128))
    assert scale_inv.shape == (2, 3)
    assert torch.equal(dequantize_fp8(q, scale_inv, (128, 128), torch.float32), plain)
    assert not torch.equal(dequantize_fp8(q, scale_inv.flip(1), (128, 128), torch.float32), plain)
    assert dequantize_fp8(q, scale_inv, (128, 128), torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"scales \(2, 3\)"):
        dequantize_fp8(q, scale_inv[:, :2], (128, 128), torch.float32)


def test_load_logs_the_memory_dequantizing_costs(mxfp4, caplog):
    with caplog.at_level(logging.INFO, logger="pdcluster.engine"):
        LLM(str(mxfp4[0]), dtype="float32", num_blocks=16, max_model_len=64, enforce_eager=True)
    lines = [r.getMessage() for r in caplog.records if "dequantized" in r.getMessage()]
    # 4 layers x (gate_up 4x64x128 + down 4x64x64) float32; stored: 1 byte a value pair + a scale a 32
    assert lines == ["mxfp4 expert weights dequantized to float32 at load (the engine has no mxfp4 kernel): "
                     "0.75 MiB instead of 0.10 MiB"]


def _with_config(src: Path, dst: Path, qc: dict) -> Path:
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("qc, named", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'.*not supported"),
    ({"quant_method": "gptq"}, "'gptq'"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "activation_scheme 'static'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size None"),
])
def test_other_quantizations_are_refused_by_name(checkpoint, tmp_path, qc, named):
    path = _with_config(checkpoint("deepseek-v3"), tmp_path / "q", qc)
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_pretrained(path)


@pytest.mark.parametrize("label, drop", [
    ("fp8", "model.layers.1.self_attn.kv_b_proj.weight_scale_inv"),
    ("mxfp4", "model.layers.2.mlp.experts.down_proj_scales"),
])
def test_a_missing_scale_is_a_clear_error(fp8, mxfp4, tmp_path, label, drop):
    src = mxfp4[0] if label == "mxfp4" else fp8["aligned"][0]
    dst = _with_config(src, tmp_path / "q", json.loads((src / "config.json").read_text())["quantization_config"])
    tensors = read_all(dst)
    del tensors[drop]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    data = drop.removesuffix("_scale_inv") if label == "fp8" else drop.replace("_scales", "_blocks")
    with pytest.raises(ValueError, match=f"tensor '{data}' has no '{drop}' \\(its scales\\)"):
        LLM(str(dst), dtype="float32", num_blocks=16, max_model_len=64, enforce_eager=True)
