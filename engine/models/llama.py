"""The Llama family (Llama, Mistral, Qwen2, Qwen3; with routed experts Mixtral and Qwen3-MoE:
engine/models/moe.py; with latent attention and experts DeepSeek-V2/V3: engine/models/mla.py)
over a paged KV cache.

Numerics follow transformers' implementation step for step (RMSNorm in float32, RoPE with
rotate_half, computed in halves bit for bit alike, SiLU-gated MLP) so greedy output matches
`AutoModelForCausalLM.generate`.
q/k/v and gate/up are fused into one matmul each when the weights are loaded.
Tensors are packed: a batch is `T` tokens of several sequences, no padding.
With tensor parallelism (`layout`, engine/tp_layout.py) a rank holds its heads and its slice of
the MLP, and `reduce` (the group's all-reduce) sums the row-parallel outputs of o_proj and down_proj.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine import token_ops
from engine.attention import AttentionMetadata, paged_attention, write_kv
from engine.config import ModelConfig
from engine.models.gpt_oss import GptOssMoE
from engine.models.mla import LatentAttention
from engine.models.moe import Reduce, SparseMoE
from engine.models.norm import RMSNorm
from engine.packed_linear import mlp_on_panels
from engine.rope import apply_rope, rope_cos_sin, rotate

if TYPE_CHECKING:
    from engine.tp_layout import TPLayout


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: TPLayout | None = None, reduce: Reduce | None = None) -> None:
        super().__init__()
        self.num_heads = layout.heads if layout is not None else cfg.num_heads
        self.num_kv_heads = layout.kv_heads if layout is not None else cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.reduce = reduce
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        # gpt-oss: o_proj biased too, and one learned sink logit per head joins each softmax
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias and cfg.attention_sinks)
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if cfg.attention_sinks else None
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.head_dim**-0.5
        self.token_ops: Any = None  # the native kernels (engine/native.py), set by the loader

    def forward(
        self,
        x: torch.Tensor,  # (T, hidden)
        cos: torch.Tensor,  # (T, hd)
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(T, self.num_kv_heads, self.head_dim)
        qk_heads = qkv[:, : self.q_size + self.kv_size].view(T, -1, self.head_dim)
        if self.q_norm is None:  # q and k rotated in one pass, straight from the projection's output
            qk = rotate(self.token_ops, qk_heads, cos, sin)
        else:  # Qwen3: each head normed first (in the same native pass where the kernels serve)
            qk = None if self.token_ops is None else token_ops.rope(
                self.token_ops, qk_heads, cos, sin, self.q_norm.weight, self.k_norm.weight, self.num_heads,
                self.q_norm.eps)
            if qk is None:
                q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
                q = self.q_norm(q.reshape(T, self.num_heads, self.head_dim))
                k = self.k_norm(k.reshape(T, self.num_kv_heads, self.head_dim))
                qk = apply_rope(torch.cat([q, k], dim=1), cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        k, v = write_kv(kv_cache, k, v, meta)  # as the cache holds them: every query sees the same keys
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, self.sinks)
        out = self.o_proj(out.reshape(T, self.q_size))
        return out if self.reduce is None else self.reduce(out)


class MLP(nn.Module):
    SWIGLU = True  # gate_up_proj's rows are gate then up, and forward takes silu(gate) * up

    def __init__(self, cfg: ModelConfig, layout: TPLayout | None = None, reduce: Reduce | None = None,
                 inter: int | None = None) -> None:
        """`inter`: another width than the config's (DeepSeek's shared experts)."""
        super().__init__()
        self.inter = inter or (layout.inter if layout is not None else cfg.intermediate_size)
        self.reduce = reduce
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = nn.Linear(self.inter, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = mlp_on_panels(self.gate_up_proj, self.down_proj, x)  # one native call (engine/packed_linear.py)
        if out is None:
            gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
            out = self.down_proj(F.silu(gate) * up)
        return out if self.reduce is None else self.reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: TPLayout | None = None, reduce: Reduce | None = None,
                 index: int = 0) -> None:
        super().__init__()
        # multi-head latent attention keeps one latent per token (engine/models/mla.py)
        self.self_attn = LatentAttention(cfg, layout, reduce) if cfg.kv_lora_rank else Attention(cfg, layout, reduce)
        # a mixture-of-experts model's sparse layers route each token to a few experts
        if cfg.router == "gpt_oss":
            self.mlp = GptOssMoE(cfg, layout, reduce)
        elif index in cfg.moe_layers:
            # shared experts: tensor-parallel even when the routed ones are expert-parallel
            width = cfg.shared_intermediate_size // (layout.size if layout is not None else 1)
            shared = MLP(cfg, inter=width) if width else None  # summed with the routed experts' output
            self.mlp = SparseMoE(cfg, layout, reduce, shared)
        else:
            self.mlp = MLP(cfg, layout, reduce)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.decode_block: Any = None  # engine/models/decode_block.py's AttentionBlock, set by the loader

    def forward(self, x, cos, sin, kv_cache, meta, delta=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the residual stream, this layer's MLP output), which the caller adds: the next layer's
        norm (or the final one) does it in passing. `delta`: the previous layer's MLP output."""
        done = self.decode_block(x, delta, cos, sin, kv_cache, meta) if self.decode_block is not None else None
        if done is not None:  # a decode step's attention half in one native call (engine/models/decode_block.py)
            x, h = done
        else:
            h, x = self.input_layernorm.after_add(x, delta) if delta is not None else (self.input_layernorm(x), x)
            h, x = self.post_attention_layernorm.after_add(x, self.self_attn(h, cos, sin, kv_cache, meta))
        return x, self.mlp(h)


class LlamaModel(nn.Module):
    """Causal LM; parameter names follow the checkpoints (`model.layers.N...`, `lm_head`)."""

    def __init__(self, cfg: ModelConfig, max_positions: int, layout: TPLayout | None = None,
                 reduce: Reduce | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, layout, reduce, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.max_positions = max_positions
        # (max_positions, hd) float32 tables, filled by init_rope() once the model is on its device
        self.register_buffer("rope_cos", torch.empty(max_positions, cfg.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(max_positions, cfg.head_dim), persistent=False)

    def init_rope(self) -> None:
        cos, sin = rope_cos_sin(self.cfg.hf_config, self.cfg.head_dim, self.max_positions)
        self.rope_cos, self.rope_sin = cos.to(self.rope_cos.device), sin.to(self.rope_sin.device)

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        metas: dict[int | None, AttentionMetadata],  # by sliding window (None: full attention)
        kv_caches: list[torch.Tensor],
        layer_hook: Callable[[int], None] | None = None,
    ) -> torch.Tensor:  # (T, hidden), final norm applied
        x = self.embed_tokens(input_ids)
        cos = self.rope_cos[positions].to(x.dtype)
        sin = self.rope_sin[positions].to(x.dtype)
        delta = None
        for i, layer in enumerate(self.layers):
            x, delta = layer(x, cos, sin, kv_caches[i], metas[self.cfg.layer_windows[i]], delta)
            if layer_hook is not None:  # layer i's K/V are in the cache: it may be shipped now
                layer_hook(i)
        return self.norm.after_add(x, delta)[0] if delta is not None else self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
