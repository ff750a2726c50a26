"""RMSNorm as transformers computes it (in float32, then the weight in the activations' dtype); on
CPU one native pass (engine/token_ops.py) instead of torch's chain of ops, where the loader gave
the module the kernels."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine import token_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.token_ops: Any = None  # the native kernels (engine/native.py), set by the loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.token_ops is not None and (done := token_ops.rms_norm(self.token_ops, x, self.weight, self.eps)):
            return done[0].view(x.shape)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def after_add(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + delta), x + delta): a residual add and the norm that reads its sum, in one pass."""
        if self.token_ops is not None and (done := token_ops.rms_norm(self.token_ops, x, self.weight, self.eps, delta)):
            return done
        total = x + delta
        return self.forward(total), total
