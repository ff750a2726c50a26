"""The shape of a decoder-only model, as the planner needs it: parameters, what a token reads, KV bytes.

A Llama-family decoder is the base: per layer q/k/v/o (+ q/k/v biases for Qwen2), gate/up/down and
two RMSNorms; embeddings, a final norm and the LM head (unless tied). Three optional parts describe
the models served disaggregated at scale, each with defaults that leave a dense model as it was:

- `experts` (Experts): the MLP of a MoE layer is `num` routed experts of which a token uses
  `per_token`, plus `shared` ones every token uses; `dense_layers` keep the plain MLP (DeepSeek's
  first three). Memory holds every expert (`params`); a token reads its top-k (`active_params`).
- `mla` (LatentAttention): DeepSeek's multi-head latent attention. The cache holds one latent of
  kv_lora_rank + qk_rope_head_dim values per token per layer, shared by every head, instead of
  K and V per KV head: 576 values against 2 x 128 heads x 128 for DeepSeek-V3.
- windows: `sliding_window` tokens for the layers in `sliding_layers` (gpt-oss: every other
  layer, 128 tokens); such a layer never holds more than the window of a sequence.

Quantized checkpoints store some weights in fewer bytes than the serving dtype:
`weight_bytes_per_param` covers the decoder layers' matrices (DeepSeek's FP8: 1.0) and
`Experts.bytes_per_param` the routed experts alone (gpt-oss's MXFP4: 4 bits + one 8-bit scale per
32 values = 4.25 bits). Embeddings, LM head, norms and routers stay in the serving dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts MLP (SwiGLU experts: gate, up, down)."""

    num: int  # routed experts per MoE layer
    per_token: int  # routed experts each token uses (top-k)
    intermediate_size: int  # of one routed expert
    shared: int = 0  # experts every token uses (DeepSeek: 1)
    dense_layers: tuple[int, ...] = ()  # layers whose MLP is the model's dense one
    bias: bool = False  # gpt-oss: each expert's gate_up and down carry biases
    router_bias: bool = False  # gpt-oss: the router carries a bias
    bytes_per_param: float | None = None  # routed experts stored quantized (MXFP4: 4.25 / 8)

    def expert_params(self, hidden: int) -> int:
        """One routed expert of one layer."""
        i = self.intermediate_size
        return 3 * hidden * i + ((2 * i + hidden) if self.bias else 0)

    def shared_params(self, hidden: int) -> int:
        """All shared experts of one layer (DeepSeek fuses them into one MLP of shared x size)."""
        return 3 * hidden * self.shared * self.intermediate_size

    def router_params(self, hidden: int) -> int:
        return self.num * hidden + (self.num if self.router_bias else 0)

    def distinct(self, tokens: float) -> float:
        """Expected distinct experts that `tokens` tokens touch in one layer, each choosing k of E
        (uniform routing): E (1 - (1 - k/E)^b). One token reads k; a large batch reads all E."""
        if tokens <= 0:
            return 0.0
        e, k = self.num, self.per_token
        return e * (1.0 - (1.0 - k / e) ** tokens)


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention (DeepSeek-V2/V3): q (optionally through a low-rank q_lora_rank),
    and K/V up-projected per head from one cached latent of kv_lora_rank + qk_rope_head_dim."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def params(self, hidden: int, heads: int) -> int:
        """q (direct, or q_a + norm + q_b), kv_a (+ its norm), kv_b, o; no biases (as DeepSeek's)."""
        qk, r = self.qk_head_dim, self.kv_lora_rank
        ql = self.q_lora_rank
        q = hidden * heads * qk if ql is None else hidden * ql + ql + ql * heads * qk
        kv = hidden * self.latent_dim + r + r * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * hidden


@dataclass(frozen=True)
class ModelShape:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's (dense models; MoE models' dense_layers)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases
    max_context: int = 8192
    o_bias: bool = False  # an o_proj bias too (gpt-oss)
    qk_norm: bool = False  # RMSNorm per head of q and k (Qwen3)
    attention_sinks: bool = False  # one learnt sink logit per head per layer (gpt-oss)
    sliding_window: int = 0  # tokens a windowed layer attends to (0: none)
    sliding_layers: tuple[int, ...] = ()  # the windowed layers
    experts: Experts | None = None
    mla: LatentAttention | None = None
    weight_bytes_per_param: float | None = None  # decoder layers' matrices, where the checkpoint is quantized

    @property
    def is_dense(self) -> bool:
        """No experts and no latent attention: planned as it always was (tensor parallelism only)."""
        return self.experts is None and self.mla is None

    # ------------------------------------------------------------------ attention
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_params(self) -> int:
        """One layer's attention."""
        h = self.hidden_size
        if self.mla is not None:
            return self.mla.params(h, self.num_heads)
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        bias = (self.q_dim + 2 * self.kv_dim) if self.attention_bias else 0
        extra = (h if self.o_bias else 0) + (2 * self.head_dim if self.qk_norm else 0)
        return attn + bias + extra + (self.num_heads if self.attention_sinks else 0)

    # ------------------------------------------------------------------ layers
    @property
    def layer_params(self) -> int:
        """A dense layer: attention, the dense MLP, two norms."""
        return self.attention_params + 3 * self.hidden_size * self.intermediate_size + 2 * self.hidden_size

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is the experts."""
        return 0 if self.experts is None else self.num_layers - len(self.experts.dense_layers)

    @property
    def moe_layer_params(self) -> int:
        """A MoE layer with all its experts (0 for a dense model)."""
        e, h = self.experts, self.hidden_size
        if e is None:
            return 0
        mlp = e.router_params(h) + e.num * e.expert_params(h) + e.shared_params(h)
        return self.attention_params + mlp + 2 * h

    @property
    def routed_expert_params(self) -> int:
        """Every routed expert of every layer: the part a token reads only k / E of."""
        e = self.experts
        return 0 if e is None else self.moe_layers * e.num * e.expert_params(self.hidden_size)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def params(self) -> int:
        """Total: what memory holds."""
        layers = (self.num_layers - self.moe_layers) * self.layer_params + self.moe_layers * self.moe_layer_params
        return self.embedding_params + layers + self.hidden_size + self.lm_head_params

    @property
    def matmul_params_per_token(self) -> int:
        """Weights every token multiplies (all layers, MoE layers with their top-k routed experts;
        the LM head is counted per sampled token)."""
        e = self.experts
        if e is None:
            return self.num_layers * self.layer_params
        unused = self.moe_layers * (e.num - e.per_token) * e.expert_params(self.hidden_size)
        return self.params - self.embedding_params - self.hidden_size - self.lm_head_params - unused

    @property
    def active_params(self) -> int:
        """What one token reads: its embedding row, every layer with its top-k routed and the
        shared experts, the final norm and the LM head."""
        return self.hidden_size + self.matmul_params_per_token + self.hidden_size + self.lm_head_params

    # ------------------------------------------------------------------ bytes
    @property
    def quantized(self) -> bool:
        return self.weight_bytes_per_param is not None or (
            self.experts is not None and self.experts.bytes_per_param is not None)

    def layer_bytes_per_param(self, dtype_bytes: int) -> float:
        """Bytes per parameter of the decoder layers' matrices (never more than the serving dtype)."""
        return min(self.weight_bytes_per_param or dtype_bytes, dtype_bytes)

    def expert_bytes(self, dtype_bytes: int) -> float:
        """One routed expert of one layer, in bytes."""
        e = self.experts
        if e is None:
            return 0.0
        per = min(e.bytes_per_param or self.layer_bytes_per_param(dtype_bytes), dtype_bytes)
        return e.expert_params(self.hidden_size) * per

    def routed_expert_bytes(self, dtype_bytes: int) -> float:
        e = self.experts
        return 0.0 if e is None else self.moe_layers * e.num * self.expert_bytes(dtype_bytes)

    def weight_bytes(self, dtype_bytes: int) -> float:
        """What the weights take in memory: params x dtype bytes, less where the checkpoint is quantized
        (embeddings, LM head, norms and routers stay in the serving dtype)."""
        if not self.quantized:
            return self.params * dtype_bytes
        h, e = self.hidden_size, self.experts
        small = 2 * h * self.num_layers + (self.moe_layers * e.router_params(h) if e else 0)
        plain = self.embedding_params + self.lm_head_params + h + small
        layers = self.params - plain - self.routed_expert_params
        return plain * dtype_bytes + layers * self.layer_bytes_per_param(dtype_bytes) + self.routed_expert_bytes(
            dtype_bytes)

    # ------------------------------------------------------------------ KV cache
    @property
    def windowed_layers(self) -> int:
        return len(self.sliding_layers) if self.sliding_window else 0

    def kv_layer_bytes(self, dtype_bytes: int, quantized: bool = False) -> int:
        """One token in one layer: MLA's latent (the same for every head), else K and V per KV head;
        `quantized`: the engine's quantized pages (engine/kv_quant.py), one byte a value and a
        4-byte scale a row, whatever `dtype_bytes`."""
        value, scale = (1, 4) if quantized else (dtype_bytes, 0)
        if self.mla is not None:
            return self.mla.latent_dim * value + scale
        return 2 * self.num_kv_heads * (self.head_dim * value + scale)

    def kv_split(self, dtype_bytes: int, quantized: bool = False) -> tuple[int, int]:
        """Bytes per token of (the layers without a window, the windowed layers)."""
        per_layer = self.kv_layer_bytes(dtype_bytes, quantized)
        w = self.windowed_layers
        return (self.num_layers - w) * per_layer, w * per_layer

    def kv_bytes_per_token(self, dtype_bytes: int, context: int | None = None, quantized: bool = False) -> int:
        """KV bytes per token of a sequence of `context` tokens: windowed layers hold at most the
        window, so their share per token shrinks as the sequence grows. Without a context, every
        layer holds every token (the most a token can take). `quantized`: quantized pages."""
        full, windowed = self.kv_split(dtype_bytes, quantized)
        if not windowed or context is None or context <= self.sliding_window:
            return full + windowed
        return math.ceil(full + windowed * self.sliding_window / context)
