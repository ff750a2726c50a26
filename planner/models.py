"""Model shapes for the planner: from a checkpoint's config.json or a named preset.

    shape = model_shape("Llama-3-8B")                  # a preset
    shape = model_shape("builtin:tiny-llama")           # the built-in model (written on first use)
    shape = model_shape("/models/Qwen2.5-7B-Instruct")  # any supported checkpoint directory
    shape.kv_bytes_per_token(2), shape.weight_bytes(2), shape.params

Parameters count every weight matrix of a Llama-family decoder: embeddings, per layer q/k/v/o
(+ q/k/v biases for Qwen2), gate/up/down, two RMSNorms, the final norm and the LM head (unless
tied). KV bytes per token = 2 x layers x kv_heads x head_dim x dtype bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}


@dataclass(frozen=True)
class ModelShape:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_context: int = 8192

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        h = self.hidden_size
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        bias = (self.q_dim + 2 * self.kv_dim) if self.attention_bias else 0
        return attn + bias + 3 * h * self.intermediate_size + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def params(self) -> int:
        return self.embedding_params + self.num_layers * self.layer_params + self.hidden_size + self.lm_head_params

    @property
    def matmul_params_per_token(self) -> int:
        """Weights every token multiplies (all layers; the LM head is counted per sampled token)."""
        return self.num_layers * self.layer_params

    def weight_bytes(self, dtype_bytes: int) -> int:
        return self.params * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def _preset(name: str, vocab: int, hidden: int, inter: int, layers: int, heads: int, kv: int,
            head_dim: int | None = None, tie: bool = False, bias: bool = False, ctx: int = 8192) -> ModelShape:
    return ModelShape(name, vocab, hidden, inter, layers, heads, kv, head_dim or hidden // heads, tie, bias, ctx)


# From each model's config.json on the Hugging Face Hub.
PRESETS: dict[str, ModelShape] = {m.name: m for m in (
    _preset("Llama-3-8B", 128256, 4096, 14336, 32, 32, 8),
    _preset("Llama-3-70B", 128256, 8192, 28672, 80, 64, 8),
    _preset("Llama-2-7B", 32000, 4096, 11008, 32, 32, 32, ctx=4096),
    _preset("Llama-2-13B", 32000, 5120, 13824, 40, 40, 40, ctx=4096),
    _preset("Llama-2-70B", 32000, 8192, 28672, 80, 64, 8, ctx=4096),
    _preset("Qwen2.5-7B", 152064, 3584, 18944, 28, 28, 4, bias=True, ctx=32768),
    _preset("Qwen2.5-72B", 152064, 8192, 29568, 80, 64, 8, bias=True, ctx=32768),
)}


def from_checkpoint(path: str | Path) -> ModelShape:
    """The shape of a local checkpoint (or builtin:NAME), read by the engine's own config reader."""
    from engine.builtin_model import resolve_model_path
    from engine.config import ModelConfig

    cfg = ModelConfig.from_pretrained(resolve_model_path(str(path)))
    name = str(path) if str(path).startswith("builtin:") else Path(cfg.path).name
    return ModelShape(name, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
                      cfg.num_kv_heads, cfg.head_dim, cfg.tie_word_embeddings, cfg.attention_bias,
                      cfg.max_position_embeddings)


def model_shape(spec: str) -> ModelShape:
    """A preset name (case-insensitive), builtin:NAME, or a checkpoint directory."""
    by_lower = {k.lower(): v for k, v in PRESETS.items()}
    if spec.lower() in by_lower:
        return by_lower[spec.lower()]
    if spec.startswith("builtin:") or Path(spec).expanduser().is_dir():
        return from_checkpoint(Path(spec).expanduser() if not spec.startswith("builtin:") else spec)
    raise ValueError(f"model {spec!r}: not a preset ({', '.join(PRESETS)}), builtin:NAME or a checkpoint directory")
