"""Rotary position embedding tables, computed the way transformers computes them."""

from __future__ import annotations

from typing import Any

import torch


def rope_inv_freq(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling of the config's rope type (float32)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.config import _rope_parameters

    params = _rope_parameters(hf_config)
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        return ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    base = params["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    return inv_freq, 1.0


def rope_cos_sin(hf_config: Any, head_dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (max_positions, head_dim), float32."""
    inv_freq, scaling = rope_inv_freq(hf_config, head_dim)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling
