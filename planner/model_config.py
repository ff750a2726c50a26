"""A mixture-of-experts or latent-attention checkpoint's shape, read from its config.json.

Read through transformers' AutoConfig (which fills each class's defaults: gpt-oss's alternating
layer_types, Qwen3-MoE's mlp_only_layers), with the engine's own readers of experts and windows
(engine/config.py), so the planner sizes the layers the engine runs; not through
`ModelConfig.from_pretrained`, which refuses the quantized checkpoints (FP8, MXFP4) the planner sizes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.config import read_experts, read_layer_windows
from planner.model_presets import FP8_BYTES, MXFP4_BYTES
from planner.model_shape import Experts, LatentAttention, ModelShape

ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
                 "GptOssForCausalLM")


def architecture(path: str | Path) -> str | None:
    """The checkpoint's architecture if the planner reads it itself (None: the engine's reader)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    archs = json.loads(config.read_text()).get("architectures") or []
    return next((a for a in archs if a in ARCHITECTURES), None)


def _windows(hf: Any, arch: str) -> tuple[int, tuple[int, ...]]:
    """(window, windowed layers), as the engine windows them."""
    windows = read_layer_windows(arch, hf)
    layers = tuple(i for i, w in enumerate(windows) if w)
    return (max(windows[i] for i in layers), layers) if layers else (0, ())


def _quantization(hf: Any) -> str | None:
    q = getattr(hf, "quantization_config", None)
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    return str(method).lower() if method else None


def _experts(hf: Any, arch: str) -> Experts:
    """The routed experts as the engine builds them (which layers, widths, shared experts)."""
    e = read_experts(arch, hf)
    dense = tuple(i for i in range(hf.num_hidden_layers) if i not in e["moe_layers"])
    shared = e.get("shared_intermediate_size", 0) // e["moe_intermediate_size"]
    extra = {}
    if arch == "GptOssForCausalLM":  # biased experts and router; MXFP4 experts where quantized
        extra = dict(bias=True, router_bias=True,
                     bytes_per_param=MXFP4_BYTES if _quantization(hf) == "mxfp4" else None)
    return Experts(e["num_experts"], e["num_experts_per_tok"], e["moe_intermediate_size"], shared=shared,
                   dense_layers=dense, **extra)


def read_shape(path: str | Path) -> ModelShape:
    """The ModelShape of a checkpoint directory of one of ARCHITECTURES."""
    from transformers import AutoConfig

    path = Path(path)
    arch = architecture(path)
    if arch is None:
        raise ValueError(f"{path}: not one of {', '.join(ARCHITECTURES)}")
    hf = AutoConfig.from_pretrained(path)
    heads = hf.num_attention_heads
    window, windowed = _windows(hf, arch)
    common = dict(tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
                  max_context=hf.max_position_embeddings, sliding_window=window, sliding_layers=windowed,
                  experts=_experts(hf, arch))
    if arch.startswith("Deepseek"):
        mla = LatentAttention(hf.kv_lora_rank, hf.qk_rope_head_dim, hf.qk_nope_head_dim, hf.v_head_dim,
                              getattr(hf, "q_lora_rank", None))
        return ModelShape(path.name, hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers,
                          heads, heads, mla.qk_head_dim, mla=mla,
                          weight_bytes_per_param=FP8_BYTES if _quantization(hf) == "fp8" else None, **common)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    bias = bool(getattr(hf, "attention_bias", False))
    return ModelShape(path.name, hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers,
                      heads, getattr(hf, "num_key_value_heads", None) or heads, head_dim,
                      attention_bias=bias, o_bias=bias,  # gpt-oss and Qwen3-MoE: q/k/v/o alike
                      qk_norm=arch == "Qwen3MoeForCausalLM", attention_sinks=arch == "GptOssForCausalLM", **common)
