"""In-transit KV compression: int8 with one float32 scale (max|x| / 127) per (K or V, block), so a
block of small values keeps its precision beside a block of large ones; the receiver dequantizes
into the cache's dtype."""

from __future__ import annotations

import torch

COMPRESSIONS = ("none", "int8")


def quantize_int8(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(2, nb, bs, kvh, hd) float -> (int8 of the same shape, float32 scales (2, nb))."""
    x = kv.float()
    scales = x.abs().amax(dim=(2, 3, 4)) / 127.0  # (2, nb)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(x / safe[:, :, None, None, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scales[:, :, None, None, None]).to(dtype)


def roundtrip(kv: torch.Tensor, compression: str) -> torch.Tensor:
    """What the receiver ends up with after sending `kv` with `compression` (for in-process paths)."""
    if compression == "none":
        return kv
    if compression == "int8":
        q, scales = quantize_int8(kv)
        return dequantize_int8(q, scales, kv.dtype)
    raise ValueError(f"unknown KV compression {compression!r}; allowed: {', '.join(COMPRESSIONS)}")
