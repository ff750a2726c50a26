"""Routed experts in bfloat16 on CPU tiles (engine/csrc/moe_experts_bf16.c): the experts' weights
prepacked once at load into the kernel's tile layout, then every step of the layer, prefill or
decode, runs its chosen experts in one native call.

A weight W (N, K) becomes (N/16, K/32, 16, 16, 2): element [nb, kb, kk, n, j] is
W[16 nb + n, 32 kb + 2 kk + j], the operand layout of Intel AMX's bfloat16 tile product, so
each 16x32 block is one contiguous 1 KiB tile. The packed copies replace the stacked weights (the
layer's memory stays the same); the torch path is not used afterwards.
"""

from __future__ import annotations

from typing import Any

import torch

TILE, DEPTH = 16, 32  # output columns of a tile; bfloat16 values of a tile's row


def packable(hidden: int, inter: int) -> bool:
    """Whether the tile layout holds experts of this shape."""
    return hidden % DEPTH == 0 and inter % DEPTH == 0


def pack(w: torch.Tensor) -> torch.Tensor:
    """Stacked weights (E, N, K) in the tile layout (E, N/16, K/32, 16, 16, 2), contiguous."""
    E, N, K = w.shape
    return w.reshape(E, N // TILE, TILE, K // DEPTH, DEPTH // 2, 2).permute(0, 1, 3, 4, 2, 5).contiguous()


class PackedExperts:
    """One layer's experts, packed, and the call that runs them."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, lib: Any, amx: bool) -> None:
        """`gate_up` (E, 2I, H) and `down` (E, H, I), bfloat16; `amx`: the tiles, else portable C."""
        self.E, self.H, self.I = gate_up.shape[0], gate_up.shape[2], down.shape[2]
        self.gate_up, self.down = pack(gate_up), pack(down)
        self.lib, self.amx = lib, amx

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (T, H) bfloat16, ids (T, k) numbered from this rank's first expert, weights (T, k)."""
        x = x.contiguous()
        ids = ids.to(torch.int64).contiguous()
        weights = weights.to(torch.float32).contiguous()
        out = torch.empty_like(x)
        rc = self.lib.moe_experts_bf16(x.data_ptr(), self.gate_up.data_ptr(), self.down.data_ptr(), ids.data_ptr(),
                                       weights.data_ptr(), out.data_ptr(), x.shape[0], ids.shape[1], self.E, self.H,
                                       self.I, torch.get_num_threads(), int(self.amx))
        if rc == -2:
            raise MemoryError("the native bfloat16 experts kernel could not allocate its buffers")
        if rc != 0:
            raise RuntimeError(f"the native bfloat16 experts kernel refused its arguments ({rc})")
        return out
