"""Tiny quantized checkpoints for the tests, quantized here the way the published ones are stored:
fp8 e4m3 weights with block scales (DeepSeek-V3) and mxfp4 experts (gpt-oss). Each writer also
returns the plain tensors its quantized ones stand for, computed by a plain loop over the blocks
(independently of engine/quantized_weights.py)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

E4M3_MAX = 448.0
FP4_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def read_all(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


def _write(src: Path, dst: Path, tensors: dict[str, torch.Tensor], quantization_config: dict | None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.suffix == ".json" and not file.name.endswith("index.json"):
            shutil.copy(file, dst / file.name)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("quantization_config", None)
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scale_inv, the plain weight they stand for) of a float32 (out, in) `w`."""
    rows, cols = w.shape
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale_inv = torch.empty(grid, dtype=torch.float32)
    plain = torch.empty(rows, cols, dtype=torch.float32)
    for i in range(grid[0]):
        for j in range(grid[1]):
            r, c = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            s = w[r, c].abs().max().clamp(min=1e-12) / E4M3_MAX
            q[r, c] = (w[r, c] / s).to(torch.float8_e4m3fn)
            scale_inv[i, j] = s
            plain[r, c] = q[r, c].float() * s
    return q, scale_inv, plain


def write_fp8(src: Path, dst: Path, block=(128, 128), keep: tuple[str, ...] = ()) -> tuple[Path, dict]:
    """`src` (a float32 DeepSeek checkpoint) with every linear weight of its layers in fp8 block
    scales, as DeepSeek-V3 ships (embeddings, norms, routers and lm_head stay plain); the layers in
    `keep` are left plain and named in modules_to_not_convert. Returns the path and the plain
    tensors the stored ones stand for."""
    stored, plain = {}, {}
    for name, t in read_all(src).items():
        linear = name.startswith("model.layers.") and name.endswith(("proj.weight", "proj_with_mqa.weight"))
        if linear and not any(name.startswith(k + ".") for k in keep):
            stored[name], stored[name + "_scale_inv"], plain[name] = fp8_blocks(t.float(), block)
        else:
            stored[name] = plain[name] = t
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    if keep:
        qc["modules_to_not_convert"] = list(keep)
    return _write(src, dst, stored, qc), plain


def mxfp4_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(blocks, scales, the plain tensor they stand for) of a gpt-oss experts tensor `w` (E, in, out):
    stored transposed, (E, out, in/32, 16) and (E, out, in/32)."""
    experts, n_in, n_out = w.shape
    lut = torch.tensor(FP4_E2M1)
    blocks = torch.empty(experts, n_out, n_in // 32, 16, dtype=torch.uint8)
    scales = torch.empty(experts, n_out, n_in // 32, dtype=torch.uint8)
    plain = torch.empty_like(w)
    for e in range(experts):
        for o in range(n_out):
            for g in range(n_in // 32):
                group = w[e, g * 32:(g + 1) * 32, o]
                exp = int(torch.ceil(torch.log2(group.abs().max().clamp(min=2.0**-100) / 6.0)))
                codes = (group / 2.0**exp - lut[:, None]).abs().argmin(0)  # nearest e2m1 value
                blocks[e, o, g] = (codes[0::2] | codes[1::2] << 4).to(torch.uint8)  # low nibble first
                scales[e, o, g] = exp + 127
                plain[e, g * 32:(g + 1) * 32, o] = lut[codes] * 2.0**exp
    return blocks, scales, plain


def write_mxfp4(src: Path, dst: Path) -> tuple[Path, dict]:
    """`src` (a float32 gpt-oss checkpoint) with its experts' gate_up_proj and down_proj in mxfp4, as
    gpt-oss ships (attention, router, embeddings and lm_head plain). Returns the path and the plain
    tensors the stored ones stand for."""
    stored, plain = {}, {}
    for name, t in read_all(src).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            stored[name + "_blocks"], stored[name + "_scales"], plain[name] = mxfp4_blocks(t.float())
        else:
            stored[name] = plain[name] = t
    qc = {"quant_method": "mxfp4",
          "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                     "lm_head"]}
    return _write(src, dst, stored, qc), plain


def write_plain(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """`tensors` as an unquantized checkpoint of `src`'s config."""
    return _write(src, dst, tensors, None)
