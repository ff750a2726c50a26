"""Linear layers on CPU through oneDNN with weights reordered once at load ("prepacked").

`torch.nn.Linear` on CPU goes to MKL's sgemm with the row-major weight; oneDNN's matmul on a weight
reordered into its blocked layout is measured faster at every batch this engine runs, most at the
small ones of decode (an AVX2 EPYC, float32, two threads, a 5632x1024 weight; GB/s of weights
read): 1 row 10.6 vs 8.2, 2 rows 9.5 vs 3.4, 8 rows 7.2 vs 3.2; a 2048-row prefill chunk
~115-140 vs 96-126 GFLOP/s. The reordered weight replaces the original (no second copy).

`pack_linears(model)` swaps every `nn.Linear` of a CPU model for a `PackedLinear`; where oneDNN
is not available (or the dtype is not served by it) the model is left as it is.

Decode on AMX tiles: given the native kernels (`tiles`), a bfloat16 layer also keeps its weight in
the tile layout (engine/csrc/linear_bf16.c) and runs batches of up to `TILE_MAX_ROWS` rows there,
bit for bit what oneDNN computes. A decode step's weights come from memory, pushed out of the
caches by the layers before: there oneDNN's small-batch matmul reads 7-8 GB/s and the tiles 17-20
(a 1280x640 weight, 4 rows: 227 vs 91 us, 32 rows: 201 vs 132; Xeon with AMX, 2 threads). The tile copy is a second copy
of the layer's weight (the LM head, the largest, keeps oneDNN alone).

Elsewhere, given the native kernels with AVX-512 (float32; bfloat16 with AVX-512 BF16) or AVX2
(float32), a layer keeps its weight only in the panel layout of engine/csrc/linear_panels.c
(engine/linear_panels.py) and runs every batch there: at decode sizes it streams the weight from
memory near the read bandwidth where oneDNN's small-batch matmul reaches 60-75% of it (llama-200m's
linears, an AVX-512 EPYC, two threads: 1 row 1.4-1.9x, 16 rows 1.2-1.4x faster), and at prefill sizes
it runs within a few percent of oneDNN (90-100% of the GEMM peak). docs/engine_kernels.md has the
measurements (`python -m benchmarks.linear_kernels`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from engine import linear_panels
from engine.config import cpu_has_native
from engine.models.moe_packed import DEPTH, TILE, pack

log = logging.getLogger(__name__)

# The batch size oneDNN is told to expect when it picks the weight's layout; any batch works with
# it. 64: within a few percent of the best from 2 to 2048 rows (1 row alone prefers a hint of 1).
LAYOUT_HINT_ROWS = 64
# Batches up to this many rows run on the tile copy where a layer has one: faster than oneDNN there
# and the same sums in the same order (oneDNN changes its algorithm past 32 rows).
TILE_MAX_ROWS = 32


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, tiles: Any = None, panels: Any = None, gate_up: bool = False) -> None:
        """`tiles`: the native kernels, for a decode copy of a bfloat16 weight on AMX tiles; `panels`:
        the native kernels, to run every batch on the weight in the panel layout (no oneDNN copy);
        `gate_up`: the layer is a SwiGLU MLP's gate rows then up rows (`mlp_on_panels` then serves it)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.lib: Any = None
        self.tiles: torch.Tensor | None = None
        self.register_buffer("panels", None, persistent=False)
        self.paired = False  # gate/up panels: each panel's 64 columns are 32 gate and the same 32 up ones
        if tiles is None and linear_panels.served(panels, weight.dtype) \
                and (weight.dtype != torch.bfloat16 or self.in_features % 2 == 0):
            self.lib = panels
            self.paired = gate_up and self.bias is None and self.out_features % 64 == 0
            self.panels = linear_panels.pack_panels(linear_panels.pair_gate_up(weight) if self.paired else weight)
            return
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, LAYOUT_HINT_ROWS),
                             persistent=False)
        if tiles is not None and weight.dtype == torch.bfloat16 and self.in_features % DEPTH == 0 \
                and self.out_features % TILE == 0:
            self.lib, self.tiles = tiles, pack(weight[None])[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            return self._on_panels(x)
        if self.tiles is not None and x.dim() == 2 and x.shape[0] <= TILE_MAX_ROWS and x.dtype == torch.bfloat16:
            if x.stride(1) != 1:
                x = x.contiguous()
            out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
            if self.lib.pd_linear_bf16(x.data_ptr(), x.stride(0), self.tiles.data_ptr(),
                                       None if self.bias is None else self.bias.data_ptr(), out.data_ptr(), x.shape[0],
                                       self.in_features, self.out_features, torch.get_num_threads()) == 0:
                return out
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """x as the panel kernel reads it: (T, in_features) of unit stride, rows at least
        in_features apart (a slice of a wider tensor is read in place)."""
        rows = x.reshape(-1, self.in_features)
        if rows.stride(1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < self.in_features):
            rows = rows.contiguous()
        return rows

    def _on_panels(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.rows(x)
        out = linear_panels.linear(self.lib, rows, self.panels, self.bias, self.out_features)
        if out is None:  # another dtype than the weight's (a caller's mistake, kept working): torch's matmul
            weight = linear_panels.unpack_panels(self.panels, self.out_features, self.in_features)
            out = torch.nn.functional.linear(rows.to(weight.dtype), weight, self.bias)
        if self.paired:
            out = linear_panels.unpair_gate_up(out)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kernel = "native panels" if self.panels is not None else "oneDNN"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {kernel}"


def mlp_on_panels(gate_up: nn.Module, down: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """A SwiGLU MLP, down(silu(gate) * up), in one native call (engine/csrc/decode_layer.c
    pd_mlp_panels: gate/up packed paired, silu(gate) * up written from its sums, then down), or None
    where the two linears are not both on panels in x's dtype (the caller runs the module path)."""
    if not (isinstance(gate_up, PackedLinear) and gate_up.paired and isinstance(down, PackedLinear)
            and down.panels is not None and down.bias is None
            and x.dtype == gate_up.panels.dtype == down.panels.dtype):
        return None
    rows = gate_up.rows(x).contiguous()  # pd_mlp_panels reads rows back to back
    out = torch.empty(rows.shape[0], down.out_features, dtype=x.dtype)
    rc = gate_up.lib.pd_mlp_panels(rows.data_ptr(), gate_up.panels.data_ptr(), down.panels.data_ptr(), out.data_ptr(),
                                   rows.shape[0], gate_up.in_features, down.in_features,
                                   int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return out.view(*x.shape[:-1], down.out_features) if rc == 0 else None


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype in (torch.float32, torch.bfloat16) and cpu_has_native(dtype)


def pack_linears(model: nn.Module, tiles: Any = None, panels: Any = None) -> int:
    """Replace each `nn.Linear` of `model` (on CPU) by a `PackedLinear`; returns how many. `tiles`:
    the native kernels where the CPU has AMX tiles, for the decode copies (not of `lm_head`);
    `panels`: the native kernels, for the panel layout where the CPU's vector units serve it."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    if not targets:
        return 0
    weight = targets[0][2].weight
    if not can_pack(weight.device, weight.dtype):
        return 0
    copies = 0
    for parent, name, child in targets:
        packed = PackedLinear(child, tiles if name != "lm_head" else None, panels if tiles is None else None,
                              gate_up=name == "gate_up_proj" and getattr(parent, "SWIGLU", False))
        copies += packed.tiles.numel() * 2 if packed.tiles is not None else 0
        setattr(parent, name, packed)
    if copies:
        log.info("decode copies of the linear weights on AMX tiles: %.1f MiB", copies / 2**20)
    return len(targets)
