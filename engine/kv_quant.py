"""Quantized KV pages: each cached row (one token's K or V of one head, or one latent row) stored as
one byte per value plus its own float32 scale, in the same row.

`kv_cache.dtype` (EngineConfig.kv_cache_dtype): "auto" keeps the model's dtype; "int8",
"fp8_e4m3" and "fp8_e5m2" store a row x of `d` values as the bytes

    [ q_0 ... q_{d-1} | s (float32, 4 bytes) ],   x ~= q * s,   s = max|x| / QMAX

(int8: q = round(x / s) in [-127, 127]; fp8: q = x / s in the format, s mapping the row's largest
magnitude to the format's largest finite value). Scales are per token and head, computed as the
row is written: a row never changes once written, so nothing is rescaled when a block fills up (a
per-block scale would be, or would waste range on the block's first rows), and the 4 bytes cost
4 / d of the row (3% at d = 128, 6% at 64).

Keeping the scale inside the row keeps a layer's cache one tensor of rows (uint8, last dimension
d + 4): everything that moves whole blocks (prefix-cache forks, preemption, the KV transfer's
bytes, tensor-parallel head slices) moves the quantized bytes and their scales together, unchanged;
only the attention reads and the writes of new rows know the format. Attention dequantizes the
rows it gathers (a step's blocks), never a whole cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv_spec import KV_CACHE_DTYPES, SCALE_BYTES


@dataclass(frozen=True)
class KVQuant:
    """One quantized page format."""

    name: str  # "int8", "fp8_e4m3", "fp8_e5m2"

    @property
    def value_dtype(self) -> torch.dtype:
        return {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[self.name]

    @property
    def qmax(self) -> float:
        """The largest magnitude a row's largest value is scaled to."""
        return 127.0 if self.name == "int8" else float(torch.finfo(self.value_dtype).max)

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """Rows x (..., d) of any float dtype -> (..., d + 4) uint8: the values, then the scale."""
        d = x.shape[-1]
        if d % SCALE_BYTES:
            raise ValueError(f"quantized KV pages need rows of a multiple of 4 values, not {d}")
        xf = x.float()
        scale = xf.abs().amax(dim=-1, keepdim=True) / self.qmax
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: q = 0, s = 1
        q = xf / scale
        if self.name == "int8":
            q = q.round_().clamp_(-127, 127)
        out = torch.empty((*x.shape[:-1], d + SCALE_BYTES), dtype=torch.uint8, device=x.device)
        out[..., :d].view(self.value_dtype).copy_(q)
        out[..., d:].view(torch.float32).copy_(scale)
        return out

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored rows (..., d + 4) uint8 -> their values (..., d) in `dtype` (q * s in float32, rounded once)."""
        rows = rows.contiguous()
        d = rows.shape[-1] - SCALE_BYTES
        values = rows[..., :d].view(self.value_dtype).float()
        return (values * rows[..., d:].view(torch.float32)).to(dtype)


def parse_kv_cache_dtype(name: str) -> KVQuant | None:
    """The format `name` names (None for "auto": the model's dtype); a clear error for anything else."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return None if name == "auto" else KVQuant(name)
