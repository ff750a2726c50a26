"""Linear layers on CPU through oneDNN with weights reordered once at load ("prepacked").

`torch.nn.Linear` on CPU goes to MKL's sgemm with the row-major weight; oneDNN's matmul on a weight
reordered into its blocked layout is measured faster at every batch this engine runs, most at the
small ones of decode (an AVX2 EPYC, float32, two threads, a 5632x1024 weight; GB/s of weights
read): 1 row 10.6 vs 8.2, 2 rows 9.5 vs 3.4, 8 rows 7.2 vs 3.2; a 2048-row prefill chunk
~115-140 vs 96-126 GFLOP/s. The reordered weight replaces the original (no second copy).

`pack_linears(model)` swaps every `nn.Linear` of a CPU model for a `PackedLinear`; where oneDNN
is not available (or the dtype is not served by it) the model is left as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import cpu_has_native

# The batch size oneDNN is told to expect when it picks the weight's layout; any batch works with
# it. 64: within a few percent of the best from 2 to 2048 rows (1 row alone prefers a hint of 1).
LAYOUT_HINT_ROWS = 64


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, LAYOUT_HINT_ROWS),
                             persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, oneDNN"


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype in (torch.float32, torch.bfloat16) and cpu_has_native(dtype)


def pack_linears(model: nn.Module) -> int:
    """Replace each `nn.Linear` of `model` (on CPU) by a `PackedLinear`; returns how many."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    if not targets:
        return 0
    weight = targets[0][2].weight
    if not can_pack(weight.device, weight.dtype):
        return 0
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
