"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of latents.

Each token's keys and values are made from one compressed latent `c` (kv_lora_rank wide, after
its RMSNorm) and one RoPE key part `k_pe` shared by every head. The cache keeps exactly those:
one row `[c, k_pe]` per token and layer (engine/kv_spec.py, kind "latent"), which is what a
prefill worker ships to a decode worker.

Decode runs on the latents themselves ("absorbed"): head h's key is `W_uk[h] c` and its value
`W_uv[h] c`, so `q_h . k = (W_uk[h]^T q_nope_h) . c + q_pe_h . k_pe`: each query is folded into
the latent space once, attends over the cached rows as one shared key/value head (MQA, key width
kv_lora_rank + rope, value width kv_lora_rank), and its output is unfolded by `W_uv[h]`; no
per-head key or value is expanded, so a step reads each cached row once. A prefill step (no decode
rows) expands instead, as transformers computes: each span's latents, new or cached, become
per-head keys `[W_uk c, k_pe]` and values `W_uv c`, and attention is ordinary multi-head attention
of width qk_nope + rope: a prompt's queries are many, and scores over 576-wide latents cost
(kv_lora_rank + rope) / (qk_nope + rope) = 3x the flops of DeepSeek's 192-wide heads.
Both equal transformers' computation up to float rounding.

RoPE: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... of q_pe and k_pe; gathering the
even then the odd dims turns that into the half-split rotation the other models use, and a dot
product does not care which layout both sides share. The gather is done once, at load, on the rows
of the projections that make q_pe and k_pe (`finish_load`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, paged_attention
from engine.config import ModelConfig
from engine.models.moe import Reduce
from engine.models.moe_packed import DEPTH, TILE, pack
from engine.models.norm import RMSNorm
from engine.packed_linear import TILE_MAX_ROWS
from engine.rope import attention_scale, rotate

if TYPE_CHECKING:
    from engine.tp_layout import TPLayout

# transformers builds these two norms with RMSNorm's default epsilon, not the config's
LATENT_NORM_EPS = 1e-6


class Weight(nn.Module):
    """A projection kept as its plain weight (never prepacked): attention splits it per head."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: TPLayout | None = None, reduce: Reduce | None = None) -> None:
        """With tensor parallelism (`layout`) a rank holds its query heads' projections and the whole
        latent (its projection, norm and cache: every head reads it); `reduce` sums o_proj's partial outputs."""
        super().__init__()
        self.num_heads = layout.heads if layout is not None else cfg.num_heads
        self.reduce = reduce
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.latent = cfg.kv_lora_rank
        self.interleaved = cfg.rope_interleave
        qk = self.nope + self.rope
        h = cfg.hidden_size
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.num_heads * qk, bias=False)
        else:
            self.q_proj = nn.Linear(h, self.num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.latent + self.rope, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.latent, LATENT_NORM_EPS)
        self.kv_b_proj: Weight | None = Weight(self.num_heads * (self.nope + self.v_dim), self.latent)
        # kv_b_proj split by finish_load: (H, nope, latent) and (H, v_dim, latent)
        self.w_uk = self.w_uv = torch.empty(0)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, h, bias=cfg.attention_bias)
        self.scale = attention_scale(cfg.hf_config, qk)
        self.q_lora = bool(cfg.q_lora_rank)
        self.token_ops: Any = None  # the native kernels (engine/native.py), set by the loader
        self.lib: Any = None
        self.tiles: tuple[torch.Tensor, torch.Tensor] | None = None  # W_uk, W_uv packed (pack_heads)

    def finish_load(self) -> None:
        """Split kv_b_proj into contiguous per-head stacks W_uk (H, nope, latent) and W_uv (H, v_dim,
        latent), which a step reads in place (a strided slice of the fused weight was copied by
        every decode step's absorb and unfold); and with interleaved RoPE, order the rows that make
        q_pe and k_pe evens first, then odds, so the projections give the half-split layout RoPE
        rotates (the same values; no gather per step)."""
        assert self.kv_b_proj is not None, "finish_load runs once, after the weights are loaded"
        w = self.kv_b_proj.weight.data.view(self.num_heads, self.nope + self.v_dim, self.latent)
        self.w_uk, self.w_uv = w[:, :self.nope].contiguous(), w[:, self.nope:].contiguous()
        self.kv_b_proj = None
        if self.interleaved:
            order = torch.cat([torch.arange(0, self.rope, 2), torch.arange(1, self.rope, 2)])
            qk = self.nope + self.rope
            q_rows = torch.arange(self.num_heads * qk).view(self.num_heads, qk)
            q_rows[:, self.nope:] = q_rows[:, self.nope:][:, order]
            self._permute_rows(self.q_b_proj if self.q_lora else self.q_proj, q_rows.flatten())
            kv_rows = torch.arange(self.latent + self.rope)
            kv_rows[self.latent:] = self.latent + order
            self._permute_rows(self.kv_a_proj_with_mqa, kv_rows)

    @staticmethod
    def _permute_rows(linear: nn.Linear, rows: torch.Tensor) -> None:
        linear.weight.data = linear.weight.data[rows].contiguous()
        if linear.bias is not None:
            linear.bias.data = linear.bias.data[rows].contiguous()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        T, H = x.shape[0], self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(T, H, self.nope + self.rope)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.latent, self.rope], dim=-1)
        k_pe = rotate(self.token_ops, k_pe.view(T, 1, self.rope), cos, sin)[:, 0]
        row = torch.cat([self.kv_a_layernorm(c), k_pe], dim=-1)
        row = row.view(T, 1, self.latent + self.rope)
        cache = kv_cache[0]  # (blocks, block_size, 1, latent + rope [+ a quantized row's scale])
        stored = meta.stored(row)
        cache.view(-1, 1, cache.shape[-1]).index_copy_(0, meta.slot_mapping, stored)
        if meta.spans is not None:  # as the cache holds it: a prefill attends to what decode reads
            row = meta.values(stored, row.dtype)
        if meta.spans is not None and meta.decode_groups is None and meta.native_decode is None:
            out = self._expanded(q, row[:, 0], cache.view(-1, cache.shape[-1]), meta, cos, sin)
            return self._finish(out, T)
        tiles = self.tiles is not None and T <= TILE_MAX_ROWS and q.dtype == torch.bfloat16
        if tiles:  # absorbed on AMX tiles, straight into the query rows
            q_full = q.new_empty((T, H, self.latent + self.rope))
            self._heads(q, self.nope, self.tiles[0], q_full, self.latent)
            rotate(self.token_ops, q[..., self.nope:], cos, sin, out=q_full[..., self.latent:])
        else:
            q_latent = torch.bmm(q[..., :self.nope].transpose(0, 1), self.w_uk).transpose(0, 1)  # (T, H, latent)
            q_full = torch.cat([q_latent, rotate(self.token_ops, q[..., self.nope:], cos, sin)], dim=-1)
        values = (cache, cache[..., :self.latent])  # the key row, and its latent part as the value
        out = paged_attention(q_full, row, row[..., :self.latent], values, meta, self.scale)  # (T, H, latent)
        if tiles:  # the kernel reads the heads in place
            heads_out = out.new_empty((T, H, self.v_dim))
            self._heads(out, self.latent, self.tiles[1], heads_out, self.v_dim)
            return self._finish(heads_out, T)
        return self._finish(torch.bmm(out.transpose(0, 1), self.w_uv.transpose(1, 2)).transpose(0, 1), T)

    def pack_heads(self, lib: Any) -> None:
        """Keep W_uk and W_uv also in the tile layout (engine/csrc/linear_bf16.c), for the absorb and
        unfold of decode batches (bfloat16 on AMX), where a batched matmul on weights the previous
        layers pushed out of the caches reads them at a fraction of the bandwidth."""
        if self.w_uk.dtype != torch.bfloat16 or self.nope % DEPTH or self.latent % DEPTH or self.v_dim % TILE:
            return
        self.lib = lib
        self.tiles = (pack(self.w_uk.transpose(1, 2)), pack(self.w_uv))  # (H, latent, nope), (H, v_dim, latent)

    def _heads(self, x: torch.Tensor, K: int, w: torch.Tensor, out: torch.Tensor, N: int) -> None:
        """out[t, h, :N] = x[t, h, :K] . W_h^T for each head, W_h packed in `w`; x and out (T, H, *)."""
        rc = self.lib.pd_linear_heads_bf16(x.data_ptr(), x.stride(0), x.stride(1), w.data_ptr(), out.data_ptr(),
                                           out.stride(0), out.stride(1), x.shape[0], K, N, self.num_heads,
                                           torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"the per-head tile projection refused its shapes ({rc})")

    def _finish(self, out: torch.Tensor, T: int) -> torch.Tensor:
        """(T, H, v_dim) heads' outputs -> the layer's output."""
        out = self.o_proj(out.reshape(T, self.num_heads * self.v_dim))
        return out if self.reduce is None else self.reduce(out)

    def _expanded(self, q: torch.Tensor, new_rows: torch.Tensor, flat: torch.Tensor, meta: AttentionMetadata,
                  cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Prefill spans as multi-head attention over keys and values expanded from their latents
        (the span's new rows, or its cached ones); (T, H, v_dim)."""
        H, nope, qk = self.num_heads, self.nope, self.nope + self.rope
        q = torch.cat([q[..., :nope], rotate(self.token_ops, q[..., nope:], cos, sin)], dim=-1)
        w_uk, w_uv = self.w_uk.view(-1, self.latent), self.w_uv.view(-1, self.latent)
        outs = []
        for span in meta.spans:
            rows = new_rows[span.q_start:span.q_end] if span.kv_index is None else meta.values(flat[span.kv_index],
                                                                                                 q.dtype)
            n, c = rows.shape[0], rows[:, :self.latent]
            k = torch.cat([F.linear(c, w_uk).view(n, H, nope), rows[:, None, self.latent:].expand(n, H, self.rope)],
                          dim=-1)
            v = F.linear(c, w_uv).view(n, H, self.v_dim)
            # CPU's fused attention wants one head width: the values padded with zeros to the keys'
            v = F.pad(v, (0, qk - self.v_dim)) if self.v_dim < qk else v
            qs = q[span.q_start:span.q_end].transpose(0, 1)[None]  # (1, H, n, qk): 4-d, the fused kernel's
            o = F.scaled_dot_product_attention(
                qs, k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=span.mask, scale=self.scale,
                is_causal=span.kv_index is None and span.mask is None and qs.shape[2] > 1)
            outs.append(o[0].transpose(0, 1)[..., :self.v_dim])
        return torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]
