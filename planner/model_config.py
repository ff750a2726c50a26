"""A mixture-of-experts or latent-attention checkpoint's shape, read from its config.json.

The engine serves dense Llama-family models; these architectures the planner sizes without it, so it
reads their config.json itself, through transformers' AutoConfig (which fills each class's defaults:
gpt-oss's alternating layer_types, Qwen3-MoE's mlp_only_layers).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
    """(window, windowed layers): from layer_types where the config has them, else every layer."""
    window = getattr(hf, "sliding_window", None) or 0
    if arch == "Qwen3MoeForCausalLM" and not getattr(hf, "use_sliding_window", False):
        window = 0
    if not window:
        return 0, ()
    types = getattr(hf, "layer_types", None)
    if types:
        return window, tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return window, tuple(range(hf.num_hidden_layers))


def _quantization(hf: Any) -> str | None:
    q = getattr(hf, "quantization_config", None)
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    return str(method).lower() if method else None


def _experts(hf: Any, arch: str) -> Experts:
    layers = hf.num_hidden_layers
    k = hf.num_experts_per_tok
    if arch == "MixtralForCausalLM":
        return Experts(hf.num_local_experts, k, hf.intermediate_size)
    if arch == "GptOssForCausalLM":
        quant = MXFP4_BYTES if _quantization(hf) == "mxfp4" else None
        return Experts(hf.num_local_experts, k, hf.intermediate_size, bias=True, router_bias=True,
                       bytes_per_param=quant)
    if arch == "Qwen3MoeForCausalLM":
        only = set(getattr(hf, "mlp_only_layers", None) or ())
        step = getattr(hf, "decoder_sparse_step", 1) or 1
        dense = tuple(i for i in range(layers) if i in only or hf.num_experts <= 0 or (i + 1) % step != 0)
        return Experts(hf.num_experts, k, hf.moe_intermediate_size, dense_layers=dense)
    # DeepSeek-V2 / V3: the first first_k_dense_replace layers are dense (as transformers builds them)
    first = getattr(hf, "first_k_dense_replace", 0) or 0
    return Experts(hf.n_routed_experts, k, hf.moe_intermediate_size, shared=hf.n_shared_experts or 0,
                   dense_layers=tuple(range(min(first, layers))))


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
