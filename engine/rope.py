"""Rotary position embeddings: the tables, computed the way transformers computes them, and the
rotation itself."""

from __future__ import annotations

import math
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


def attention_scale(hf_config: Any, qk_head_dim: int) -> float:
    """The softmax scale of multi-head latent attention: 1/sqrt(qk_head_dim), times YaRN's
    `mscale_all_dim` correction squared when the config scales RoPE that way (DeepSeek)."""
    from engine.config import _rope_parameters

    params = _rope_parameters(hf_config)
    scale = qk_head_dim**-0.5
    factor, mscale_all_dim = params.get("factor", 1.0), params.get("mscale_all_dim", 0)
    if params.get("rope_type", "default") != "default" and mscale_all_dim and factor > 1:
        m = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= m * m
    return scale


def rotate(lib: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """apply_rope in one native pass where `lib` (the native kernels, or None) serves x; into `out`
    (a view of x's shape) when given, which is returned."""
    from engine import token_ops

    done = token_ops.rope(lib, x, cos, sin, out=out) if lib is not None else None
    if done is not None:
        return done
    return apply_rope(x, cos, sin) if out is None else out.copy_(apply_rope(x, cos, sin))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin` as transformers computes it, bit for bit, in fewer passes.

    x: (T, heads, hd); cos/sin: (T, hd) with equal halves (RoPE tables are cat(freqs, freqs)).
    With x = [x1, x2]: the first half is x1*c + (-x2)*s = x1*c - x2*s, the second x2*c + x1*s.
    """
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.mul(x1, c, out=out[..., :half])
    out[..., :half].sub_(x2 * s)
    torch.mul(x2, c, out=out[..., half:])
    out[..., half:].add_(x1 * s)
    return out
