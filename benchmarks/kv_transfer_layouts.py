"""The KV cache layouts the transfer benchmark moves: per layout the layers, KV heads, head size and
dtype of a model, and the bytes of a prompt's KV in whole blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = {
    # name: (layers, kv heads, head dim, dtype)
    "builtin": (6, 4, 48, "float32"),
    "llama3-8b": (32, 8, 128, "bfloat16"),
}
BLOCK_SIZE = 16
BACKENDS = ("grpc", "shm", "torch_distributed", "tcp")


SCALE_BYTES = 4  # a quantized page row's float32 scale (engine/kv_quant.py)


@dataclass
class Layout:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    kv_cache_dtype: str = "auto"  # or quantized pages: a row is head_dim bytes and a 4-byte scale

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def wire_dtype(self) -> torch.dtype:
        """What a layer travels as: the model's dtype, or the pages' bytes."""
        return torch.uint8 if self.quantized else getattr(torch, self.dtype)

    def layer_shape(self, tokens: int) -> tuple[int, ...]:
        row = self.head_dim + SCALE_BYTES if self.quantized else self.head_dim
        return (2, -(-tokens // BLOCK_SIZE), BLOCK_SIZE, self.kv_heads, row)

    def nbytes(self, tokens: int) -> int:
        n = 1
        for d in self.layer_shape(tokens):
            n *= d
        return n * self.layers * self.wire_dtype.itemsize

    def bytes_per_token(self) -> int:
        """KV bytes a token moves (K and V of every layer), and what the model's dtype would move."""
        return self.nbytes(BLOCK_SIZE) // BLOCK_SIZE

    def model_dtype_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * getattr(torch, self.dtype).itemsize

    def random_layer(self, tokens: int) -> torch.Tensor:
        """A layer's KV of `tokens` (whole blocks) as it travels."""
        if self.quantized:
            return torch.randint(0, 256, self.layer_shape(tokens), dtype=torch.uint8)
        return torch.randn(self.layer_shape(tokens)).to(self.wire_dtype)
