"""Load a Hugging Face safetensors checkpoint (single file or sharded) into the engine's model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.models.llama import LlamaModel
from engine.packed_linear import pack_linears
from engine.tp_layout import TPLayout

# checkpoint name suffix -> (fused parameter suffix, shard index in the fused tensor)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path} (only safetensors checkpoints are supported)")
    return files


def _target(name: str) -> tuple[str, int | None]:
    """Map a checkpoint tensor name to (engine parameter name, fused shard index or None)."""
    if name.startswith("model."):
        name = name[len("model.") :]
    for src, (dst, shard) in _FUSED.items():
        if f".{src}." in f".{name}":
            return name.replace(src, dst), shard
    return name, None


def load_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
               pack: bool = True, layout: TPLayout | None = None, reduce=None) -> LlamaModel:
    """The checkpoint's weights in `dtype` on `device`; `pack`: linear layers on oneDNN with
    prepacked weights where the device has it (engine/packed_linear.py). `layout`: one
    tensor-parallel rank's shard (each tensor read only in its slice; `reduce` sums the ranks')."""
    with torch.device("meta"):
        model = LlamaModel(cfg, max_positions, layout, reduce)
    model = model.to_empty(device=device).to(dtype)
    model.init_rope()  # after .to(dtype): the rope tables stay float32
    params = dict(model.named_parameters())
    heads, kv_heads, inter = ((layout.heads, layout.kv_heads, layout.inter) if layout is not None
                              else (cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size))
    q, kv = heads * cfg.head_dim, kv_heads * cfg.head_dim
    split = {"self_attn.qkv_proj": [q, kv, kv], "mlp.gate_up_proj": [inter] * 2}
    loaded: set[str] = set()
    for file in _weight_files(Path(cfg.path)):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if "rotary_emb" in name:
                    continue
                target, shard = _target(name)
                if target not in params:
                    raise ValueError(f"unexpected tensor {name!r} in {file.name}")
                part = layout.shard(target, shard) if layout is not None else None
                if part is None:
                    tensor = f.get_tensor(name).to(dtype)
                else:  # only this rank's slice is read
                    dim, start, length = part
                    index = [slice(None)] * len(f.get_slice(name).get_shape())
                    index[dim] = slice(start, start + length)
                    tensor = f.get_slice(name)[tuple(index)].to(dtype)
                param = params[target]
                if shard is None:
                    dst = param.data
                else:
                    kind = next(k for k in split if target.endswith(k + ".weight") or target.endswith(k + ".bias"))
                    sizes = split[kind]
                    dst = param.data.narrow(0, sum(sizes[:shard]), sizes[shard])
                if dst.shape != tensor.shape:
                    raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
                dst.copy_(tensor)
                loaded.add(f"{target}#{shard}")
    if cfg.tie_word_embeddings or "lm_head.weight#None" not in loaded:
        if not cfg.tie_word_embeddings:
            raise ValueError(f"checkpoint {cfg.path} has no lm_head.weight and does not tie embeddings")
        model.lm_head.weight = model.embed_tokens.weight
        loaded.add("lm_head.weight#None")
    expected = {
        f"{n}#{s}" if any(n.endswith(k + suffix) for k in split for suffix in (".weight", ".bias")) else f"{n}#None"
        for n in params
        for s in ([0, 1, 2] if "qkv_proj" in n else [0, 1] if "gate_up_proj" in n else [None])
    }
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint {cfg.path} is missing tensors: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if pack:
        pack_linears(model)
    return model.eval()
