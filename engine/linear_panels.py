"""A linear layer's weight in the panel layout of the native kernel (engine/csrc/linear_panels.c)
and the call that runs it.

W (N, K) becomes panels of 64 output columns, the last one narrower (N rounded up to 16, the pad
columns zero): float32 panels are [K][width], bfloat16 ones [K/2][width][2] (two k values of a
column side by side). Panel p starts at 64 p K values. The packed copy replaces the weight.

A SwiGLU MLP's fused gate/up weight (gate rows, then up rows) can be packed paired
(`pair_gate_up`): each panel 32 gate rows then the same 32 up rows, so the kernel writes
silu(gate) * up straight from its sums (`linear(..., swiglu=True)`), and the (T, 2 inter) output
and torch's two passes over it are never made.
"""

from __future__ import annotations

from typing import Any

import torch

PANEL = 64
DTYPE_BITS = {torch.float32: 1, torch.bfloat16: 2}


def served(lib: Any, dtype: torch.dtype) -> bool:
    """Whether the kernel library was built with the vector instructions `dtype` needs here."""
    return lib is not None and bool(lib.pd_linear_panels_dtypes() & DTYPE_BITS.get(dtype, 0))


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (N, K) in the panel layout, one flat contiguous tensor of the same dtype."""
    n, k = weight.shape
    if weight.dtype == torch.bfloat16 and k % 2:
        raise ValueError(f"a bfloat16 weight needs an even in_features, not {k}")
    n16 = -(-n // 16) * 16
    w = torch.zeros(n16, k, dtype=weight.dtype)
    w[:n] = weight
    parts = []
    for start in range(0, n16, PANEL):
        cols = w[start:start + PANEL]
        if weight.dtype == torch.bfloat16:
            parts.append(cols.view(cols.shape[0], k // 2, 2).permute(1, 0, 2).reshape(-1))
        else:
            parts.append(cols.t().reshape(-1))
    return torch.cat(parts).contiguous()


def pair_gate_up(weight: torch.Tensor) -> torch.Tensor:
    """(2 I, K) gate rows then up rows -> rows in 32-row blocks gate, up, gate, up, ... (I % 32 == 0)."""
    two_i, k = weight.shape
    inter = two_i // 2
    return weight.view(2, inter // 32, 32, k).transpose(0, 1).reshape(two_i, k)


def unpair_gate_up(out: torch.Tensor) -> torch.Tensor:
    """A paired layer's plain output (..., 2 I) back in gate-then-up column order."""
    lead, two_i = out.shape[:-1], out.shape[-1]
    return out.reshape(-1, two_i // 64, 2, 32).transpose(1, 2).reshape(*lead, two_i)


def unpack_panels(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The (n, k) weight back from its panels (for state dicts and checks)."""
    n16 = -(-n // 16) * 16
    rows, offset = [], 0
    for start in range(0, n16, PANEL):
        width = min(PANEL, n16 - start)
        part = packed[offset:offset + width * k]
        offset += width * k
        if packed.dtype == torch.bfloat16:
            rows.append(part.view(k // 2, width, 2).permute(1, 0, 2).reshape(width, k))
        else:
            rows.append(part.view(k, width).t())
    return torch.cat(rows)[:n].contiguous()


def linear(lib: Any, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int,
           swiglu: bool = False) -> torch.Tensor | None:
    """x (T, K) . W^T (+ bias) on the kernel, or None where it does not serve this call. `swiglu`:
    W packed paired (`pair_gate_up`), the result silu(gate) * up, (T, n / 2)."""
    if x.dim() != 2 or x.dtype != packed.dtype or x.stride(1) != 1:
        return None
    t, k = x.shape
    out = torch.empty(t, n // 2 if swiglu else n, dtype=x.dtype)
    rc = lib.pd_linear_panels(x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                              out.data_ptr(), t, k, n, int(x.dtype == torch.bfloat16), int(swiglu),
                              torch.get_num_threads())
    return out if rc == 0 else None
