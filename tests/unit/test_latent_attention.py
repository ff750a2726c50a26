"""Multi-head latent attention (engine/models/mla.py) and what a layer keeps per token
(engine/kv_spec.py): the cache holds one latent row per token and layer, transfers move exactly that,
a pair whose specs differ is refused naming the difference, and what the model cannot do yet is
refused up front."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

from engine.config import ModelConfig
from engine.kv_spec import KVSpec, mismatch
from engine.tp_ranks import layout_for
from pdcluster import LLM, SamplingParams
from tests.reference import hf_greedy


def test_a_latent_layer_keeps_one_row_per_token():
    # DeepSeek-V3: kv_lora_rank 512 + RoPE 64, 61 layers; in bfloat16 70,272 bytes a token
    spec = KVSpec(61, 1, 512 + 64, 512)
    assert spec.bytes_per_token(torch.bfloat16) == 576 * 61 * 2 == 70_272
    assert spec.layer_shape(10, 16) == (1, 10, 16, 1, 576) and spec.value_dim == 512
    heads = KVSpec(80, 8, 128)  # Llama-3-70B: 320 KiB a token
    assert heads.bytes_per_token(torch.bfloat16) == 320 * 1024 and heads.layer_shape(10, 16) == (2, 10, 16, 8, 128)


def test_a_refusal_names_what_differs(checkpoint):
    mla = ModelConfig.from_pretrained(checkpoint("deepseek-v3")).compat_hash(torch.float32, 16)
    dense = ModelConfig.from_pretrained(checkpoint("llama-gqa")).compat_hash(torch.float32, 16)
    assert mla.startswith("kv=latent:32+8x2;dtype=float32;block=16;")
    assert mismatch(mla, dense).startswith("kv latent:32+8x2 vs heads:2x16x2")
    assert mismatch(mla, mla.replace("block=16", "block=32")) == "block 16 vs 32"
    window = ModelConfig.from_pretrained(checkpoint("mistral-window")).compat_hash(torch.float32, 16)
    assert "window:14" in window


def test_the_cache_and_the_transfer_carry_the_latent_only(checkpoint):
    path = checkpoint("deepseek-v3")
    llm = LLM(str(path), num_blocks=32, max_model_len=128, mode="disaggregated")
    prompt = list(range(5, 45))
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(str(path))(prompt, 8)
    for engine in llm.engines:
        assert tuple(engine.runner.kv_caches[0].shape) == (1, 32, 16, 1, 32 + 8)
    # what a transfer carries per layer: the blocks' latent rows, nothing per head
    assert llm.prefill.engine.runner.kv_layer_shape(3) == (1, 3, 16, 1, 32 + 8)


def test_the_multi_token_prediction_layer_of_a_checkpoint_is_skipped(checkpoint, tmp_path):
    src = checkpoint("deepseek-v3")
    tensors = load_file(src / "model.safetensors")
    extra = {k.replace("layers.1.", "layers.2."): v.clone() for k, v in tensors.items() if "layers.1." in k}
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file({**tensors, **extra}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    prompt = [5, 6, 7, 8]
    got = LLM(str(tmp_path), num_blocks=16, max_model_len=64).generate(
        [prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0].token_ids
    assert got == hf_greedy(str(src))(prompt, 4)


def test_tensor_parallelism_splits_the_heads_and_keeps_the_latent_whole(checkpoint):
    cfg = ModelConfig.from_pretrained(checkpoint("deepseek-v3"))  # 4 heads, q/k 16+8, v 16, latent 32+8
    layout = layout_for(cfg, 1, 2)
    assert cfg.num_kv_heads == 1 and layout.kv_replicated and layout.kv_heads == 1
    assert layout.shard("layers.0.self_attn.q_b_proj.weight", None) == (0, 2 * 24, 2 * 24)
    assert layout.shard("layers.0.self_attn.kv_b_proj.weight", None) == (0, 2 * 32, 2 * 32)
    assert layout.shard("layers.0.self_attn.o_proj.weight", None) == (1, 2 * 16, 2 * 16)
    for whole in ("q_a_proj", "kv_a_proj_with_mqa", "kv_a_layernorm"):
        assert layout.shard(f"layers.0.self_attn.{whole}.weight", None) is None
    assert layout.shard("layers.1.mlp.shared_experts.gate_up_proj.weight", 0) == (0, 16, 16)
    assert layout.shard("layers.1.mlp.shared_experts.down_proj.weight", None) == (1, 16, 16)
