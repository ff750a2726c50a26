"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE, DeepSeek-V2/V3): a router picks `top_k` of
`num_experts` SwiGLU experts per token and the layer's output is their outputs weighted by the
router's probabilities (plus, for DeepSeek, always-on shared experts).

Routers (`ModelConfig.router`), each as transformers computes it:
- "softmax" (Mixtral, Qwen3-MoE): softmax over the experts, top-k, renormalised if the config says.
- "deepseek_v2": softmax in float32, top-k over all experts ("greedy") or within the `topk_group`
  groups of highest maximum ("group_limited_greedy"), times `routed_scaling_factor`.
- "deepseek_v3": sigmoid scores in float32; the choice adds a learned bias and keeps the
  `topk_group` groups whose two best biased scores sum highest; the weights are the unbiased
  scores, renormalised if the config says, times `routed_scaling_factor`.

The experts' weights are stacked, one tensor per kind (`experts.gate_up_proj` (E, 2I, H), gate
rows first, and `experts.down_proj` (E, H, I)), as transformers holds them. A step sorts its
(token, expert) pairs by expert once and runs each expert that was picked on its tokens only:
a decode step reads the weights of the experts its tokens were routed to and no others (batch 1,
top-2: two experts' bytes). The routed outputs are summed in expert order, as transformers sums
them, so float32 results agree with its `generate()` to the last bits that matter for greedy
choices. In bfloat16 on a CPU with AMX tiles, every step runs in one native call on weights
prepacked at load (engine/models/moe_packed.py). On CPU in float32, batches of a few rows per
expert (decode) run the whole layer's experts in one native call (engine/csrc/moe_experts.c: one
pass over each chosen expert's weights for all its tokens, no per-expert torch ops); larger batches
(prefill) take torch's GEMMs, one expert at a time.

With tensor parallelism (engine/tp_layout.py) every expert is sharded like a dense MLP: a rank
holds rows [r*I/N, (r+1)*I/N) of each expert's gate and up and those columns of its down; the
router is replicated, so every rank routes each token alike; one all-reduce sums the ranks'
partial outputs.

With expert parallelism (`TPLayout.expert_parallel`) rank r holds experts [r*E/N, (r+1)*E/N)
whole instead. Attention is tensor-parallel, so after its all-reduce every rank holds every token's
hidden state, and the router is replicated: the dispatch is local. Each rank runs the (token,
expert) pairs whose expert it holds, weighted, into its partial output (plus its share of the
shared experts), and the layer's one all-reduce, the same as with TP, combines them. An all-to-all
dispatch (each token's hidden state sent to its experts' ranks and back) pays off when attention
is data-parallel, each rank holding different tokens; this engine does not do that, so every rank
already has every token and nothing needs sending before the experts run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine import token_ops
from engine.config import ModelConfig
from engine.models.decode_block import moe_block
from engine.models.moe_packed import PackedExperts

if TYPE_CHECKING:
    from engine.tp_layout import TPLayout

# The native kernel (engine/csrc/moe_experts.c) while the experts' mean rows stay below this; past
# it (prefill chunks) torch's GEMMs are faster (measured on an AVX2 EPYC: break-even near 16 rows).
NATIVE_MAX_ROWS_PER_EXPERT = 12
# The softmax router computes its logits natively up to this many tokens, torch's GEMM above.
NATIVE_LOGITS_MAX_TOKENS = 64
Reduce = Callable[[torch.Tensor], torch.Tensor]  # sum over the tensor-parallel ranks, in place


class Experts(nn.Module):
    """The routed experts' weights, stacked."""

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.inter = inter
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))

        self.native: Any = None  # the native kernels (engine/native.py) where they serve this layer
        self.packed: PackedExperts | None = None  # bfloat16 experts in the tile kernel's layout

    def pack(self, lib: Any, amx: bool) -> None:
        """Move the (bfloat16) weights into the tile kernel's layout; every later step runs there."""
        self.packed = PackedExperts(self.gate_up_proj.data, self.down_proj.data, lib, amx)
        self.gate_up_proj = self.down_proj = None  # the packed copies replace them

    def run(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `expert`'s SwiGLU on the rows `x` (n, H) -> (n, H)."""
        gate, up = F.linear(x, self.gate_up_proj[expert]).split([self.inter, self.inter], dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[expert])

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_experts: int,
                held: range | None = None) -> torch.Tensor:
        """Each token's experts `ids` (T, k) of the model's `num_experts` on it, weighted by `weights`
        (T, k), summed; `held`: the experts this rank holds (expert parallelism, see `dispatch`)."""
        if self.packed is not None:
            return self.packed(x, ids if held is None else ids - held.start, weights)
        E = self.gate_up_proj.shape[0]
        if (self.native is None or x.dtype != torch.float32 or x.device.type != "cpu"
                or ids.numel() >= NATIVE_MAX_ROWS_PER_EXPERT * E):
            return dispatch(x, ids, weights, num_experts, self.run, held)
        if held is not None:  # the kernel numbers this rank's experts from 0 and skips the others'
            ids = ids - held.start
        x, ids = x.contiguous(), ids.to(torch.int64).contiguous()
        weights = weights.to(torch.float32).contiguous()
        out = torch.empty_like(x)
        H = x.shape[1]
        rc = self.native.moe_experts(x.data_ptr(), self.gate_up_proj.data_ptr(), self.down_proj.data_ptr(),
                                     ids.data_ptr(), weights.data_ptr(), out.data_ptr(), x.shape[0], ids.shape[1], E,
                                     H, self.inter, torch.get_num_threads())
        if rc != 0:
            raise MemoryError("the native experts kernel could not allocate its buffers")
        return out


def dispatch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_experts: int,
             run: Callable[[int, torch.Tensor], torch.Tensor], held: range | None = None) -> torch.Tensor:
    """Each token's experts `ids` (T, k) run on it (`run(expert, rows)`), weighted by `weights` and
    summed in expert order. The (token, choice) pairs are sorted by expert once; an expert no token
    picked is never run, so its weights are never read. `held`: the experts this rank holds (expert
    parallelism): only their pairs run, `run` gets the index within `held`, and the result is this
    rank's partial sum."""
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    rows = order // ids.shape[1]
    flat_weights = weights.flatten()[order]
    out = torch.zeros_like(x)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        if held is not None and expert not in held:  # another rank's
            start += n
            continue
        tokens = rows[start:start + n]
        y = run(expert - (held.start if held is not None else 0), x[tokens]) * flat_weights[start:start + n, None]
        out.index_add_(0, tokens, y.to(out.dtype))
        start += n
    return out


class Router(nn.Module):
    """Picks each token's experts and their weights."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.kind, self.top_k, self.norm_topk_prob = cfg.router, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.scaling, self.groups, self.topk_group = cfg.routed_scaling_factor, cfg.n_group, cfg.topk_group
        self.topk_method = cfg.topk_method
        # Qwen3-MoE hands the experts weights in the activations' dtype, the others in float32
        self.weights_in_float32 = cfg.architecture != "Qwen3MoeForCausalLM"
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        if cfg.router == "deepseek_v3":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts))
        self.token_ops: Any = None  # the native kernels (engine/native.py), set by the loader
        self._bias32: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, top_k) expert ids and (T, top_k) weights."""
        if self.token_ops is not None and x.dtype in token_ops.DTYPES and self.kind in ("softmax", "deepseek_v3"):
            return self._native(x)
        if self.kind == "softmax":
            probs = torch.softmax(F.linear(x, self.weight).float(), dim=-1)
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return ids, weights if self.weights_in_float32 else weights.to(x.dtype)
        logits = F.linear(x.float(), self.weight.float())
        if self.kind == "deepseek_v3":
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias.float()
            best = self._in_best_groups(choice, choice.view(len(x), self.groups, -1).topk(2, dim=-1)[0].sum(-1))
            ids = torch.topk(choice.masked_fill(~best, float("-inf")), self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
            if self.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            return ids, weights * self.scaling
        scores = logits.softmax(dim=-1)  # deepseek_v2
        if self.topk_method == "group_limited_greedy":
            best = self._in_best_groups(scores, scores.view(len(x), self.groups, -1).max(dim=-1).values)
            scores = scores.masked_fill(~best, 0.0)
        weights, ids = torch.topk(scores, self.top_k, dim=-1, sorted=False)
        return ids, weights * self.scaling

    def _native(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The softmax or DeepSeek-V3 router's choice in one native pass (engine/csrc/router.c); its
        logits too for a decode-sized batch, torch's GEMM above that. The weights are float32 either
        way; where transformers hands them on in bfloat16 they hold bfloat16 values, so every product
        with them rounds as the bfloat16 ones would."""
        T, E = x.shape[0], self.weight.shape[0]
        x = x.contiguous()
        ids = torch.empty(T, self.top_k, dtype=torch.int64)
        weights = torch.empty(T, self.top_k, dtype=torch.float32)
        if self.kind == "softmax":
            logits = F.linear(x, self.weight) if T > NATIVE_LOGITS_MAX_TOKENS else None
            rounded = not self.weights_in_float32 and x.dtype == torch.bfloat16
            rc = self.token_ops.pd_route_softmax(
                None if logits is None else logits.data_ptr(), x.data_ptr(), self.weight.data_ptr(), x.shape[1],
                token_ops.DTYPES[x.dtype], T, E, self.top_k, int(self.norm_topk_prob), int(rounded), ids.data_ptr(),
                weights.data_ptr())
        else:
            if self._bias32 is None:  # the loaded bias, as the float32 the choice adds
                self._bias32 = self.e_score_correction_bias.detach().float().contiguous()
            logits = F.linear(x.float(), self.weight.float()) if T > NATIVE_LOGITS_MAX_TOKENS else None
            rc = self.token_ops.pd_route_grouped(
                None if logits is None else logits.data_ptr(), x.data_ptr(), self.weight.data_ptr(),
                self._bias32.data_ptr(), x.shape[1], token_ops.DTYPES[x.dtype], T, E, self.top_k, self.groups,
                self.topk_group, int(self.norm_topk_prob), self.scaling, ids.data_ptr(), weights.data_ptr())
        if rc != 0:
            raise ValueError(f"the native router refused {E} experts, top {self.top_k} (groups {self.groups})")
        return ids, weights

    def _in_best_groups(self, scores: torch.Tensor, group_scores: torch.Tensor) -> torch.Tensor:
        """(T, E) bool: the experts in each token's `topk_group` best groups."""
        best = torch.topk(group_scores, self.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return mask.repeat_interleave(scores.shape[1] // self.groups, dim=1)


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: TPLayout | None = None, reduce: Reduce | None = None,
                 shared: nn.Module | None = None) -> None:
        """`shared`: DeepSeek's shared experts (an MLP every token goes through), added after the routed."""
        super().__init__()
        self.num_experts = cfg.num_experts
        self.reduce = reduce
        inter = layout.moe_inter if layout is not None else cfg.moe_intermediate_size
        # expert parallel: the experts this rank holds, whole (None: every expert, maybe sharded)
        self.held = layout.experts if layout is not None and layout.expert_parallel else None
        self.gate = Router(cfg)
        self.experts = Experts(len(self.held) if self.held is not None else cfg.num_experts, cfg.hidden_size, inter)
        self.shared_experts = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (out := moe_block(self, x)) is not None:  # router and experts in one native call
            return out
        ids, weights = self.gate(x)
        out = self.experts(x, ids, weights, self.num_experts, self.held)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out if self.reduce is None else self.reduce(out)
