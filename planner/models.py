"""Model shapes for the planner: from a checkpoint's config.json or a named preset.

    shape = model_shape("Llama-3-8B")                  # a preset (planner/model_presets.py)
    shape = model_shape("DeepSeek-V3")                 # MoE + latent attention, FP8 weights
    shape = model_shape("builtin:tiny-llama")           # the built-in model (written on first use)
    shape = model_shape("/models/Qwen2.5-7B-Instruct")  # any supported checkpoint directory
    shape.kv_bytes_per_token(2), shape.weight_bytes(2), shape.params, shape.active_params

Parameters count every weight matrix of a Llama-family decoder: embeddings, per layer q/k/v/o
(+ q/k/v biases for Qwen2), gate/up/down, two RMSNorms, the final norm and the LM head (unless
tied); mixture-of-experts, latent attention and windowed layers are described in
planner/model_shape.py. KV bytes per token = 2 x layers x kv_heads x head_dim x dtype bytes
(latent attention: (kv_lora_rank + qk_rope_head_dim) x layers x dtype bytes).
"""

from __future__ import annotations

from pathlib import Path

from planner.model_presets import PRESETS
from planner.model_shape import Experts, LatentAttention, ModelShape

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}

__all__ = ["DTYPE_BYTES", "PRESETS", "Experts", "LatentAttention", "ModelShape", "from_checkpoint", "model_shape"]


def from_checkpoint(path: str | Path) -> ModelShape:
    """The shape of a local checkpoint (or builtin:NAME). Mixture-of-experts and latent-attention
    architectures are read by planner.model_config; dense ones by the engine's own config reader."""
    from planner.model_config import architecture, read_shape

    if not str(path).startswith("builtin:") and architecture(path) is not None:
        return read_shape(path)
    from engine.builtin_model import resolve_model_path
    from engine.config import ModelConfig

    cfg = ModelConfig.from_pretrained(resolve_model_path(str(path)))
    name = str(path) if str(path).startswith("builtin:") else Path(cfg.path).name
    return ModelShape(name, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
                      cfg.num_kv_heads, cfg.head_dim, cfg.tie_word_embeddings, cfg.attention_bias,
                      cfg.max_position_embeddings)


def model_shape(spec: str) -> ModelShape:
    """A preset name (case-insensitive), builtin:NAME, or a checkpoint directory."""
    by_lower = {k.lower(): v for k, v in PRESETS.items()}
    if spec.lower() in by_lower:
        return by_lower[spec.lower()]
    if spec.startswith("builtin:") or Path(spec).expanduser().is_dir():
        return from_checkpoint(Path(spec).expanduser() if not spec.startswith("builtin:") else spec)
    raise ValueError(f"model {spec!r}: not a preset ({', '.join(PRESETS)}), builtin:NAME or a checkpoint directory")
