"""gpt-oss's mixture of experts, as transformers' GptOssMLP computes it.

- The router is a linear layer with a bias; each token takes the `top_k` highest logits and the
  softmax over those chosen logits only (top-k first, then softmax) as its weights.
- Each expert has biases and a clamped SwiGLU: gate clamped above at `limit`, up clamped to
  [-limit, limit], `(up + 1) * gate * sigmoid(alpha * gate)`.
- The weights stay in the checkpoint's stacked layout: `gate_up_proj` (E, H, 2I) with gate and up
  interleaved along the last dim (gate at even columns, up at odd), `down_proj` (E, I, H), applied
  as `x @ W + b` the way transformers multiplies them, so float32 results agree bit for bit that matters.
Experts run one at a time on the tokens routed to them, summed in expert order (engine/models/moe.py).
Tensor parallelism keeps each expert's gate/up pairs together: a rank holds columns
[2 r I/N, 2 (r+1) I/N) of gate_up_proj and those rows of down_proj (engine/tp_layout.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.models.moe import Reduce, dispatch

if TYPE_CHECKING:
    from engine.tp_layout import TPLayout


class GptOssRouter(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.empty(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, top_k) expert ids and their (T, top_k) weights, in the logits' dtype."""
        logits = F.linear(x, self.weight, self.bias)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return ids, torch.softmax(top, dim=1, dtype=top.dtype)


class GptOssExperts(nn.Module):
    def __init__(self, cfg: ModelConfig, num_experts: int, inter: int) -> None:
        super().__init__()
        E, H = num_experts, cfg.hidden_size
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(E, H, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(E, inter, H))
        self.down_proj_bias = nn.Parameter(torch.empty(E, H))

    def run(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `expert` on the rows `x` (n, H) -> (n, H)."""
        gate_up = x @ self.gate_up_proj[expert] + self.gate_up_proj_bias[expert]
        gate = gate_up[..., ::2].clamp(min=None, max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return ((up + 1) * glu) @ self.down_proj[expert] + self.down_proj_bias[expert]


class GptOssMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: TPLayout | None = None, reduce: Reduce | None = None) -> None:
        """With tensor parallelism (`layout`) each expert's intermediate slice (its down bias added
        by one rank), or with expert parallelism the rank's experts whole; `reduce` sums the ranks'
        partial outputs. The router is whole on every rank."""
        super().__init__()
        self.num_experts = cfg.num_experts
        self.reduce = reduce
        self.held = layout.experts if layout is not None and layout.expert_parallel else None
        inter = layout.moe_inter if layout is not None else cfg.moe_intermediate_size
        self.router = GptOssRouter(cfg)
        self.experts = GptOssExperts(cfg, len(self.held) if self.held is not None else cfg.num_experts, inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.router(x)
        out = dispatch(x, ids, weights, self.num_experts, self.experts.run, self.held)
        return out if self.reduce is None else self.reduce(out)
