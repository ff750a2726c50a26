"""A layer's per-token steps on the native kernels (engine/csrc/token_ops.c), where they serve a
tensor: RMSNorm, the residual add folded into the RMSNorm that follows it, and RoPE (after
Qwen3's per-head norms). Each returns None where the kernel does not serve the tensors (another
device or dtype, a layout it does not read); the caller then takes its torch path, whose
numerics the kernels follow op by op (engine/models/norm.py, engine/rope.py).

The loader hands the library to the modules that use it (`token_ops` attributes) on CPU, unless
the engine runs eager or PDCLUSTER_NO_NATIVE is set.
"""

from __future__ import annotations

from typing import Any

import torch

DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the kernels' dtype codes


def _served(*tensors: torch.Tensor | None) -> bool:
    """Whether the kernels read these tensors: CPU, one dtype they know, unit stride in the last dim."""
    dtype = tensors[0].dtype
    return dtype in DTYPES and all(t is None or (t.device.type == "cpu" and t.dtype == dtype and t.stride(-1) == 1)
                                   for t in tensors)


def rms_norm(lib: Any, x: torch.Tensor, weight: torch.Tensor, eps: float,
             delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(RMSNorm(s) * weight, s) over the last dim, with s = x, or x + delta (rounded to the dtype, as
    torch adds) when `delta` is given; x's rows may be strided (2-d), the outputs are contiguous."""
    if not _served(x, weight, delta):
        return None
    dim = x.shape[-1]
    if x.dim() != 2:
        if not x.is_contiguous():
            return None
        x = x.view(-1, dim)
    if delta is not None:
        delta = delta.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    total = torch.empty(x.shape, dtype=x.dtype) if delta is not None else x
    lib.pd_rms_norm(x.data_ptr(), x.stride(0), None if delta is None else delta.data_ptr(),
                    None if delta is None else total.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], dim,
                    eps, DTYPES[x.dtype], torch.get_num_threads())
    return out, total


def rope(lib: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None = None,
         k_weight: torch.Tensor | None = None, q_heads: int = 0, eps: float = 0.0,
         out: torch.Tensor | None = None) -> torch.Tensor | None:
    """engine/rope.py's apply_rope of x (T, heads, hd), its heads possibly strided views of a wider
    tensor; with q_weight / k_weight the first `q_heads` heads are RMSNorm'd with q_weight and the
    others with k_weight first (Qwen3's q_norm / k_norm). Written to `out` (a (T, heads, hd) view,
    its heads possibly inside a wider tensor), else to a new contiguous tensor, which is returned."""
    if not _served(x, cos, sin, q_weight, k_weight, out) or not (cos.is_contiguous() and sin.is_contiguous()):
        return None
    T, heads, hd = x.shape
    out = torch.empty(x.shape, dtype=x.dtype) if out is None else out
    rc = lib.pd_rope(x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(),
                     None if q_weight is None else q_weight.data_ptr(),
                     None if k_weight is None else k_weight.data_ptr(), out.data_ptr(), out.stride(0), out.stride(1),
                     T, heads, q_heads, hd, eps, DTYPES[x.dtype], torch.get_num_threads())
    return out if rc == 0 else None
