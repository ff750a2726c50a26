"""What a model's layers keep per token in the paged KV cache, in one small description.

Two kinds:
- "heads": a K and a V vector per KV head (Llama, Mistral, Qwen, Mixtral). A layer's cache is
  `[2, num_blocks, block_size, num_kv_heads, head_dim]` (K, then V).
- "latent" (multi-head latent attention, DeepSeek-V2/V3): one compressed latent per token, the same
  for every query head, and the RoPE part of the key beside it: `[1, num_blocks, block_size, 1,
  latent_dim + rope_dim]`. Attention reads the whole row as the key and its first `latent_dim`
  values as the value (the heads' own keys and values are folded into the queries and the output).

The block manager counts blocks, the model runner shapes the cache by `layer_shape`, the KV
transfer moves `layer_shape` tensors and refuses a pair whose `compat_key`s differ (naming what
differs: `mismatch`), and `pdcluster status` shows `describe()`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# the KV cache's formats (engine/kv_quant.py): the model's dtype, or quantized pages whose rows end
# in a float32 scale
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")
SCALE_BYTES = 4
KV_LAYOUT_VERSION = 4  # bump when the paged-KV tensor layout or the KV wire format changes (3: latent KV; 4: quantized pages)


@dataclass(frozen=True)
class KVSpec:
    num_layers: int
    num_kv_heads: int  # "heads": the model's KV heads; "latent": 1
    head_dim: int  # "heads": K's and V's width; "latent": latent_dim + rope_dim
    latent_dim: int = 0  # "latent": the latent's width (V); 0 for "heads"
    # each layer's sliding window (None: full), () when no layer has one: the block manager frees
    # what falls out of every layer's window
    windows: tuple[int | None, ...] = ()
    # "auto": rows in the model's dtype; "int8" / "fp8_e4m3" / "fp8_e5m2": quantized pages, a row's
    # head_dim bytes then its float32 scale (engine/kv_quant.py)
    cache_dtype: str = "auto"

    @property
    def quantized(self) -> bool:
        return self.cache_dtype != "auto"

    @property
    def row_width(self) -> int:
        """The last dimension of a layer's cache: head_dim values, plus a quantized row's scale bytes."""
        return self.head_dim + (SCALE_BYTES if self.quantized else 0)

    def storage_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The cache tensors' dtype for a model in `dtype`: that, or bytes for quantized pages."""
        import torch

        return torch.uint8 if self.quantized else dtype

    @property
    def kind(self) -> str:
        return "latent" if self.latent_dim else "heads"

    @property
    def planes(self) -> int:
        """Tensors per token and head: K and V (2), or the one latent row (1)."""
        return 1 if self.latent_dim else 2

    @property
    def value_dim(self) -> int:
        return self.latent_dim or self.head_dim

    def layer_shape(self, num_blocks: int, block_size: int, kv_heads: int | None = None) -> tuple[int, ...]:
        """One layer's cache (or `num_blocks` of its blocks), with `kv_heads` of the heads (default all)."""
        heads = self.num_kv_heads if kv_heads is None else kv_heads
        return (self.planes, num_blocks, block_size, heads, self.row_width)

    def bytes_per_token(self, dtype: torch.dtype, kv_heads: int | None = None) -> int:
        """Every layer's bytes for one token, with `kv_heads` of the heads (default all: a rank's share)."""
        heads = self.num_kv_heads if kv_heads is None else kv_heads
        return self.planes * self.num_layers * heads * self.row_width * self.storage_dtype(dtype).itemsize

    @property
    def kv_window(self) -> int | None:
        """How far back any layer reads: the widest window when every layer is windowed (the block
        manager frees what falls out of it), None when one attends to everything."""
        if not self.windows or None in self.windows:
            return None
        return max(self.windows)

    def describe(self) -> str:
        """A few words (logs, `pdcluster status`, refusals)."""
        if self.latent_dim:
            what = f"latent:{self.latent_dim}+{self.head_dim - self.latent_dim}x{self.num_layers}"
        else:
            what = f"heads:{self.num_kv_heads}x{self.head_dim}x{self.num_layers}"
        if self.windows:  # one window for every layer, or each layer's
            names = [str(w or "full") for w in self.windows]
            what += f",window:{names[0]}" if len(set(names)) == 1 else ",windows:" + "/".join(names)
        if self.quantized:
            what += f",{self.cache_dtype}"
        return what

    def compat_key(self, dtype: torch.dtype, block_size: int, model: list) -> str:
        """Two workers exchange KV blocks only if these are equal: readable fields (what a refusal
        names) and a hash of the rest of the model's shape."""
        digest = hashlib.sha256(json.dumps(model).encode()).hexdigest()[:12]
        dt = str(dtype).removeprefix("torch.")
        return f"kv={self.describe()};dtype={dt};block={block_size};layout={KV_LAYOUT_VERSION};model={digest}"


def mismatch(mine: str, theirs: str) -> str:
    """What differs between two compatibility keys, as "dtype float32 vs bfloat16, ..." ("" if
    nothing readable does; a key from an older worker is named whole)."""
    a, b = _fields(mine), _fields(theirs)
    if not a or not b:
        return f"{mine} vs {theirs}"
    return ", ".join(f"{k} {a.get(k, '?')} vs {b.get(k, '?')}" for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k))


def _fields(key: str) -> dict[str, str]:
    parts = [p.partition("=") for p in key.split(";")]
    return {k: v for k, sep, v in parts if sep} if all(sep for _, sep, _ in parts) else {}
