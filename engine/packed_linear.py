"""Linear layers on CPU: oneDNN for many rows, a native kernel for the few rows of decode.

`torch.nn.Linear` on CPU goes to MKL's sgemm. Measured faster here (an AVX2 EPYC, two threads,
float32; a 5632x1024 weight, 12 distinct copies so that none stays in cache; GB/s of weights read):

    rows          1     2     4     8    16    32    2048 (GFLOP/s)
    nn.Linear   8.2   3.4   2.6   3.2   ...              96-126
    oneDNN      8.0  10.3   7.9   7.8   3.2   4.0      112-131 (its weight as given)
    native     15.5  15.7  12.6   8.0   6.1   4.2      -

`CpuLinear` keeps the weight once, as loaded: up to `SMALL_ROWS` rows go to engine/csrc/small_gemm.c
(float32 where it was built with AVX2/FMA), more rows to oneDNN's matmul. Where the native kernel
is missing (another dtype, no compiler, no AVX2), oneDNN gets a weight reordered once into its
blocked layout instead (`_reorder_linear_weight`; ~5% faster on prefill chunks than the plain one),
which then replaces the original.

`pack_linears(model)` swaps every `nn.Linear` of a CPU model for a `CpuLinear`; where oneDNN is not
available (or the dtype is not served by it) the model is left as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.native import has_small_gemm, native_lib

SMALL_ROWS = 16  # up to this many rows: the native kernel (at 24-32 rows it and oneDNN are even)
# The batch size oneDNN is told to expect when it picks a reordered weight's layout; any batch
# works with it. 64: within a few percent of the best from 2 to 2048 rows.
LAYOUT_HINT_ROWS = 64


class CpuLinear(nn.Module):
    def __init__(self, linear: nn.Linear, small_gemm=None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self._gemm = small_gemm if small_gemm is not None and weight.dtype == torch.float32 \
            and self.in_features % 8 == 0 else None
        if self._gemm is None:
            weight = torch.ops.mkldnn._reorder_linear_weight(weight, LAYOUT_HINT_ROWS)
        else:
            weight = weight.contiguous()
        self.register_buffer("weight", weight, persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().contiguous(), requires_grad=False)

    @property
    def native(self) -> bool:
        return self._gemm is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self._gemm is not None and rows <= SMALL_ROWS and x.dim() == 2:
            x = x.contiguous()
            y = torch.empty((rows, self.out_features), dtype=torch.float32)
            bias = 0 if self.bias is None else self.bias.data_ptr()
            self._gemm.small_gemm_f32(x.data_ptr(), self.weight.data_ptr(), bias or None, y.data_ptr(), rows,
                                      self.out_features, self.in_features, torch.get_num_threads())
            return y
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{'native + oneDNN' if self.native else 'oneDNN, reordered weight'}")


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linears(model: nn.Module, native: bool = True) -> int:
    """Replace each `nn.Linear` of `model` (on CPU) by a `CpuLinear`; returns how many.
    `native`: use the native few-row kernel where it is available."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    if not targets:
        return 0
    weight = targets[0][2].weight
    if not can_pack(weight.device, weight.dtype):
        return 0
    lib = native_lib() if native and weight.dtype == torch.float32 else None
    gemm = lib if lib is not None and has_small_gemm(lib) else None
    for parent, name, child in targets:
        setattr(parent, name, CpuLinear(child, gemm))
    return len(targets)
