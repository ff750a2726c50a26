"""A trained checkpoint packed small enough to ship inside the repository, and its expansion.

`pack` keeps a Hugging Face checkpoint's config and tokenizer files and stores its weights in
PACKED_WEIGHTS: every matrix as int8 with one float32 scale per row (max |row| / 127), every other
tensor (norms) in bfloat16: about half a bfloat16 checkpoint's bytes. `expand` writes the
checkpoint back, weights in bfloat16 (q x scale, rounded once), into a directory that transformers
and the engine load like any other. The expanded weights are the model: what was measured of the
shipped model was measured on them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PACKED_WEIGHTS = "weights.int8.safetensors"
SCALE_SUFFIX = ".row_scale"


def pack(src: Path, out: Path) -> None:
    """The checkpoint in `src` (config, tokenizer, model.safetensors) packed into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copyfile(f, out / f.name)
    packed: dict[str, torch.Tensor] = {}
    for name, w in load_file(src / "model.safetensors").items():
        if w.dim() != 2:
            packed[name] = w.to(torch.bfloat16)
            continue
        wf = w.float()
        scale = (wf.abs().amax(dim=1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        packed[name] = (wf / scale).round().clamp(-127, 127).to(torch.int8)
        packed[name + SCALE_SUFFIX] = scale
    save_file(packed, out / PACKED_WEIGHTS)


def expand(src: Path, out: Path) -> None:
    """The packed checkpoint in `src` as a loadable one in `out` (bfloat16 model.safetensors)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != PACKED_WEIGHTS:
            shutil.copyfile(f, out / f.name)
    packed = load_file(src / PACKED_WEIGHTS)
    weights = {name: (t.float() * packed[name + SCALE_SUFFIX]).to(torch.bfloat16) if t.dtype == torch.int8 else t
               for name, t in packed.items() if not name.endswith(SCALE_SUFFIX)}
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
