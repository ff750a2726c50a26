"""A Llama-family layer's decode step in native calls (engine/csrc/decode_layer.c): bfloat16 on a
CPU with AMX tiles, a decode-only batch of up to `TILE_MAX_ROWS` sequences; or, where the linears
run on the panel kernel (engine/packed_linear.py), float32 or bfloat16, a decode-only batch of any
size.

`AttentionBlock` runs the attention half of a layer in one call: the previous layer's MLP output
added to the residual stream, RMSNorm, q/k/v, Qwen3's q/k norms and RoPE, the new K/V into the
paged cache, attention, o_proj, the residual add and the post-attention RMSNorm. `moe_block` runs a
softmax-routed MoE MLP (router, experts) in another. Each is the sequence of kernels the module path
calls one by one (engine/token_ops.py, engine/packed_linear.py's tile copies, the native decode
attention, the router and the packed experts), on the same values in the same order: the same
bits. A decode step's small steps run on caches the layer's weights have just streamed through, so
each Python-level call costs 50-100 us there, more than its arithmetic; two calls a layer instead
of a dozen is the gain.

The loader sets `DecoderLayer.decode_block` where a layer qualifies (engine/loader.py); a step it
does not serve (prefill or mixed rows, larger batches) takes the module path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from engine.attention import AMX_ATTENTION, AttentionMetadata
from engine.packed_linear import TILE_MAX_ROWS, PackedLinear

if TYPE_CHECKING:
    from engine.models.llama import DecoderLayer
    from engine.models.moe import SparseMoE


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class AttentionBlock:
    """One layer's attention half, for decode steps."""

    def __init__(self, layer: DecoderLayer, lib: Any) -> None:
        attn = layer.self_attn
        self.lib = lib
        self.in_w, self.post_w = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        self.eps = layer.input_layernorm.eps
        self.qkv, self.o = attn.qkv_proj, attn.o_proj
        self.q_w = attn.q_norm.weight if attn.q_norm is not None else None
        self.k_w = attn.k_norm.weight if attn.k_norm is not None else None
        self.heads, self.kv_heads, self.hd, self.scale = attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale
        self.panels = attn.qkv_proj.tiles is None  # else the AMX tile copies
        self.dtype = attn.qkv_proj.panels.dtype if self.panels else torch.bfloat16

    @staticmethod
    def serves(layer: DecoderLayer) -> bool:
        """Whether the layer's shape and weights are what the native block runs."""
        from engine.models.llama import Attention

        attn = layer.self_attn
        if not isinstance(attn, Attention):  # latent attention keeps the module path
            return False
        eps = {layer.input_layernorm.eps, layer.post_attention_layernorm.eps}
        if attn.q_norm is not None:
            eps |= {attn.q_norm.eps, attn.k_norm.eps}
        linears = (attn.qkv_proj, attn.o_proj)
        tiles = all(isinstance(m, PackedLinear) and m.tiles is not None for m in linears) \
            and layer.input_layernorm.weight.dtype == torch.bfloat16
        panels = all(isinstance(m, PackedLinear) and m.panels is not None for m in linears) \
            and layer.input_layernorm.weight.dtype == attn.qkv_proj.panels.dtype
        return attn.reduce is None and attn.sinks is None and len(eps) == 1 and (tiles or panels)

    def __call__(self, x: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 kv_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the residual stream after attention, its post-attention norm), or None for a step this
        block does not serve."""
        nd = meta.native_decode
        T = x.shape[0]
        if (nd is None or meta.spans is not None or meta.decode_groups is not None
                or (T > TILE_MAX_ROWS and not self.panels) or meta.kv_quant is not None
                or x.dtype != self.dtype or kv_cache.dtype != self.dtype or not kv_cache.is_contiguous()
                or not x.is_contiguous() or (delta is not None and not delta.is_contiguous())):
            return None
        x_out, h_out = torch.empty_like(x), torch.empty_like(x)
        bs = kv_cache.shape[2]
        args = (x.data_ptr(), _ptr(delta), self.in_w.data_ptr(),
                (self.qkv.panels if self.panels else self.qkv.tiles).data_ptr(), _ptr(self.qkv.bias),
                _ptr(self.q_w), _ptr(self.k_w), cos.data_ptr(), sin.data_ptr(), kv_cache[0].data_ptr(),
                kv_cache[1].data_ptr(), meta.slot_mapping.data_ptr(), nd.block_tables.data_ptr(),
                nd.context_lens.data_ptr(), _ptr(nd.starts), (self.o.panels if self.panels else self.o.tiles).data_ptr(),
                _ptr(self.o.bias), self.post_w.data_ptr(), x_out.data_ptr(), h_out.data_ptr(), T, x.shape[1],
                self.heads, self.kv_heads, self.hd, bs, nd.block_tables.shape[1], self.eps, self.scale)
        if self.panels:
            rc = self.lib.pd_attention_block_panels(*args, int(self.dtype == torch.bfloat16), nd.threads)
        else:
            rc = self.lib.pd_attention_block_bf16(*args, int(AMX_ATTENTION), nd.threads)
        if rc == -2:
            raise MemoryError("the native attention block could not allocate its buffers")
        if rc != 0:
            raise RuntimeError(f"the native attention block refused the layer's shapes ({rc})")
        return x_out, h_out


def moe_block(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor | None:
    """A softmax-routed MoE MLP on packed experts in one native call; None where it does not serve."""
    from engine.models.moe import NATIVE_LOGITS_MAX_TOKENS

    gate, packed = moe.gate, moe.experts.packed
    if (packed is None or gate.token_ops is None or gate.kind != "softmax" or moe.shared_experts is not None
            or moe.reduce is not None or moe.held is not None or x.dtype != torch.bfloat16
            or x.shape[0] > NATIVE_LOGITS_MAX_TOKENS):
        return None
    x = x.contiguous()
    out = torch.empty_like(x)
    rc = gate.token_ops.pd_moe_block_bf16(
        x.data_ptr(), gate.weight.data_ptr(), packed.gate_up.data_ptr(), packed.down.data_ptr(), out.data_ptr(),
        x.shape[0], x.shape[1], packed.E, gate.top_k, packed.I, int(gate.norm_topk_prob),
        int(not gate.weights_in_float32), torch.get_num_threads())
    if rc == -2:
        raise MemoryError("the native MoE block could not allocate its buffers")
    if rc != 0:
        raise RuntimeError(f"the native MoE block refused the layer's shapes ({rc})")
    return out
