"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks `top_k` of `num_experts` SwiGLU
experts per token and the layer's output is their outputs weighted by the router's probabilities.

The experts' weights are stacked, one tensor per kind (`experts.gate_up_proj` (E, 2I, H), gate
rows first, and `experts.down_proj` (E, H, I)), as transformers holds them. A step sorts its
(token, expert) pairs by expert once and runs each expert that was picked on its tokens only:
a decode step reads the weights of the experts its tokens were routed to and no others (batch 1,
top-2: two experts' bytes). The routed outputs are summed in expert order, as transformers sums
them, so float32 results agree with its `generate()` to the last bits that matter for greedy
choices.

With tensor parallelism (engine/tp_layout.py) every expert is sharded like a dense MLP: a rank
holds rows [r*I/N, (r+1)*I/N) of each expert's gate and up and those columns of its down; the
router is replicated, so every rank routes each token alike; one all-reduce sums the ranks'
partial outputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig

if TYPE_CHECKING:
    from engine.tp_layout import TPLayout

Reduce = Callable[[torch.Tensor], torch.Tensor]  # sum over the tensor-parallel ranks, in place


class Experts(nn.Module):
    """The routed experts' weights, stacked."""

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.inter = inter
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))

    def run(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `expert`'s SwiGLU on the rows `x` (n, H) -> (n, H)."""
        gate, up = F.linear(x, self.gate_up_proj[expert]).split([self.inter, self.inter], dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[expert])


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: TPLayout | None = None, reduce: Reduce | None = None) -> None:
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        # Qwen3-MoE hands the experts weights in the activations' dtype, Mixtral in float32
        self.weights_in_float32 = cfg.architecture == "MixtralForCausalLM"
        self.reduce = reduce
        inter = layout.moe_inter if layout is not None else cfg.moe_intermediate_size
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, inter)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and their weights: (T, top_k) ids and (T, top_k) weights."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights if self.weights_in_float32 else weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = order // self.top_k
        flat_weights = weights.flatten()[order]
        out = torch.zeros_like(x)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            tokens = rows[start:start + n]
            y = self.experts.run(expert, x[tokens]) * flat_weights[start:start + n, None]
            out.index_add_(0, tokens, y.to(out.dtype))
            start += n
        return out if self.reduce is None else self.reduce(out)
