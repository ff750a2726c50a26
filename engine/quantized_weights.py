"""Quantized checkpoints as they are published, turned into plain tensors at load.

Two formats are read (config.json `quantization_config`):

- `fp8` (DeepSeek-V3/R1): a linear weight `X.weight` is stored as float8_e4m3fn (out, in) with
  `X.weight_scale_inv` float32 (ceil(out/bo), ceil(in/bi)) for `weight_block_size` [bo, bi]; the
  weight is `fp8.float() * scale_inv`, each scale covering one bo x bi block (the last row and
  column of blocks may be partial). Tensors stored in another dtype (embeddings, norms, the router,
  lm_head, `modules_to_not_convert`) load as they are.
- `mxfp4` (gpt-oss): the experts' `gate_up_proj` and `down_proj` are stored as `X_blocks` uint8
  (E, out, in/32, 16), two e2m1 values a byte (the low nibble first), and `X_scales` uint8
  (E, out, in/32), an e8m0 exponent (2**(s - 127)) per group of 32 values along `in`. The
  dequantized (E, out, in) is transposed to the (E, in, out) layout gpt-oss's experts hold
  (engine/models/gpt_oss.py).

There is no kernel for either format in the engine, so they are dequantized to the engine's dtype
when read (`DequantizingFiles`), and the loader sees plain tensors under the parameters' names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

METHODS = ("fp8", "mxfp4")
FP8_SCALE = "_scale_inv"  # X.weight -> X.weight_scale_inv
MX_BLOCKS, MX_SCALES = "_blocks", "_scales"  # X -> X_blocks, X_scales
MX_GROUP = 32  # values per e8m0 scale
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's quantization, as far as loading needs it."""

    method: str  # one of METHODS
    weight_block_size: tuple[int, int] | None = None  # fp8: (rows, cols) a scale covers
    modules_to_not_convert: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.method == "fp8":
            return f"fp8 e4m3 with {self.weight_block_size[0]}x{self.weight_block_size[1]} block scales"
        return "mxfp4 experts"


def read_quantization(qc: dict[str, Any], path: str | Path) -> Quantization:
    """The `quantization_config` of the checkpoint at `path`; a method or option not read here is
    refused by name."""
    method = qc.get("quant_method", "?")

    def refuse(what: str) -> ValueError:
        return ValueError(f"quantized checkpoint in {path} (quantization_config, quant_method {method!r}): {what}; "
                          "loaded are fp8 (e4m3, block scales, dynamic activations) and mxfp4; "
                          "otherwise use its unquantized (bf16/fp32) weights")

    skip = tuple(qc.get("modules_to_not_convert") or ())
    if method == "mxfp4":
        return Quantization("mxfp4", modules_to_not_convert=skip)
    if method != "fp8":
        raise refuse("not supported")
    for key, allowed in (("fmt", ("e4m3",)), ("activation_scheme", ("dynamic",)), ("scale_fmt", ("float",))):
        if qc.get(key) not in (None, *allowed):
            raise refuse(f"{key} {qc[key]!r} is not supported (only {', '.join(allowed)})")
    block = qc.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise refuse(f"weight_block_size {block!r} is not two positive integers (per-tensor fp8 is not supported)")
    return Quantization("fp8", tuple(block), skip)


def plain_name(q: Quantization, name: str, stored_dtype: str) -> str | None:
    """The plain tensor the stored tensor `name` (safetensors dtype `stored_dtype`) is the quantized
    data of, or None when `name` is not (a companion scale, or a tensor stored unquantized)."""
    if q.method == "fp8":
        return name if stored_dtype == "F8_E4M3" else None
    return name.removesuffix(MX_BLOCKS) if name.endswith(MX_BLOCKS) else None


def stored_names(q: Quantization, plain: str) -> tuple[str, str]:
    """The stored (data, scale) tensors that make the plain tensor `plain`."""
    if q.method == "fp8":
        return plain, plain + FP8_SCALE
    return plain + MX_BLOCKS, plain + MX_SCALES


def companion_of(q: Quantization, name: str) -> str | None:
    """The data tensor whose scale `name` would be (None: `name` is no scale by its name)."""
    suffix = FP8_SCALE if q.method == "fp8" else MX_SCALES
    if not name.endswith(suffix):
        return None
    base = name.removesuffix(suffix)
    return base if q.method == "fp8" else base + MX_BLOCKS


def plain_shape(q: Quantization, shape: list[int]) -> list[int]:
    """The plain tensor's shape from its stored data's."""
    if q.method == "fp8":
        return list(shape)
    *experts, rows, groups, nbytes = shape
    return [*experts, groups * nbytes * 2, rows]


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                   dtype: torch.dtype) -> torch.Tensor:
    """`weight` float8_e4m3fn (..., out, in) times its block scales `scale_inv` (..., ceil(out/bo),
    ceil(in/bi)), the product in float32, then in `dtype`."""
    rows, cols = weight.shape[-2:]
    expected = (*weight.shape[:-2], -(-rows // block[0]), -(-cols // block[1]))
    if weight.dtype != torch.float8_e4m3fn or tuple(scale_inv.shape) != expected:
        raise ValueError(f"fp8 weight {weight.dtype} {tuple(weight.shape)} with scale_inv {tuple(scale_inv.shape)}: "
                         f"expected float8_e4m3fn and scales {expected} for {block[0]}x{block[1]} blocks")
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(block[1], dim=-1)[..., :cols]
    return (weight.float() * scale).to(dtype)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stacked experts `blocks` uint8 (E, out, G, 16) and `scales` uint8 (E, out, G) -> (E, G*32, out)
    in `dtype`: value 2k of a group is byte k's low nibble, 2k+1 its high one, each times 2**(s - 127)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 4 \
            or blocks.shape[:-1] != scales.shape or blocks.shape[-1] * 2 != MX_GROUP:
        raise ValueError(f"mxfp4 blocks {blocks.dtype} {tuple(blocks.shape)} with scales {scales.dtype} "
                         f"{tuple(scales.shape)}: expected uint8 (experts, out, groups, 16) and (experts, out, groups)")
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1).flatten(-2)
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2).transpose(-1, -2).contiguous().to(dtype)


def dequantize(q: Quantization, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if q.method == "fp8":
        return dequantize_fp8(data, scale, q.weight_block_size, dtype)
    return dequantize_mxfp4(data, scale, dtype)


class DequantizingFiles:
    """A quantized checkpoint's safetensors files, each seen (`view`) with its quantized tensors
    replaced by plain ones in `dtype`: the scales are hidden, `X_blocks` reads as `X`. A scale may
    sit in another shard than its data. Counts the bytes stored and dequantized for `summary`."""

    def __init__(self, q: Quantization, files: list[Path], dtype: torch.dtype) -> None:
        self.q, self.dtype = q, dtype
        self.where: dict[str, Path] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                self.where.update(dict.fromkeys(f.keys(), file))
        self.stored_bytes = self.plain_bytes = 0

    def view(self, f) -> "_PlainView":
        return _PlainView(self, f)

    def read(self, plain: str) -> torch.Tensor:
        """The plain tensor `plain`, dequantized from its stored data and scale."""
        data_name, scale_name = stored_names(self.q, plain)
        if scale_name not in self.where:
            raise ValueError(f"{self.q.method} checkpoint: tensor {data_name!r} has no {scale_name!r} "
                             f"(its scales) in {', '.join(sorted({p.name for p in self.where.values()}))}; "
                             "it cannot be dequantized")
        tensors = []
        for name in (data_name, scale_name):
            with safe_open(str(self.where[name]), framework="pt") as f:
                tensors.append(f.get_tensor(name))
        out = dequantize(self.q, *tensors, self.dtype)
        self.stored_bytes += sum(t.numel() * t.element_size() for t in tensors)
        self.plain_bytes += out.numel() * out.element_size()
        return out

    def summary(self) -> str | None:
        """One line on what dequantizing cost (None if nothing was)."""
        if not self.plain_bytes:
            return None
        what = "fp8 block-scaled weights" if self.q.method == "fp8" else "mxfp4 expert weights"
        dtype = str(self.dtype).removeprefix("torch.")
        return (f"{what} dequantized to {dtype} at load (the engine has no {self.q.method} kernel): "
                f"{_size(self.plain_bytes)} instead of {_size(self.stored_bytes)}")


class _PlainView:
    """One open safetensors file as the loader reads it (keys, get_tensor, get_slice), plain."""

    def __init__(self, files: DequantizingFiles, f) -> None:
        self.files, self.f = files, f
        self.quantized: dict[str, str] = {}  # plain name -> its stored data's name
        self.names: list[str] = []
        for name in f.keys():
            if companion_of(files.q, name) in files.where:  # a scale: read with its data
                continue
            plain = plain_name(files.q, name, f.get_slice(name).get_dtype())
            if plain is not None:
                self.quantized[plain] = name
            self.names.append(name if plain is None else plain)

    def keys(self) -> list[str]:
        return self.names

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.files.read(name) if name in self.quantized else self.f.get_tensor(name)

    def get_slice(self, name: str):
        if name not in self.quantized:
            return self.f.get_slice(name)
        return _WholeSlice(self, name)


class _WholeSlice:
    """A quantized tensor's slice: its shape from the stored header; indexing dequantizes the whole
    tensor, then narrows it (a tensor-parallel rank's part)."""

    def __init__(self, view: _PlainView, name: str) -> None:
        self.view, self.name = view, name

    def get_shape(self) -> list[int]:
        stored = self.view.f.get_slice(self.view.quantized[self.name]).get_shape()
        return plain_shape(self.view.files.q, stored)

    def __getitem__(self, index) -> torch.Tensor:
        return self.view.get_tensor(self.name)[index]


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"
