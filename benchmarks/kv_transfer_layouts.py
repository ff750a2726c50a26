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


@dataclass
class Layout:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str

    def layer_shape(self, tokens: int) -> tuple[int, ...]:
        return (2, -(-tokens // BLOCK_SIZE), BLOCK_SIZE, self.kv_heads, self.head_dim)

    def nbytes(self, tokens: int) -> int:
        n = 1
        for d in self.layer_shape(tokens):
            n *= d
        return n * self.layers * getattr(torch, self.dtype).itemsize
