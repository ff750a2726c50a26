"""Load a Hugging Face safetensors checkpoint (single file or sharded) into the engine's model."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn
from safetensors import safe_open

from engine.checkpoint_names import Piece, beyond, expected_pieces, fused_shards, is_stacked, piece_of
from engine.config import ModelConfig
from engine.models.decode_block import AttentionBlock
from engine.models.llama import LlamaModel
from engine.models.moe import Experts
from engine.models.moe_packed import packable
from engine.native import native_lib
from engine.packed_linear import pack_linears
from engine.quantized_weights import DequantizingFiles
from engine.tp_layout import TPLayout

log = logging.getLogger("pdcluster.engine")

def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path} (only safetensors checkpoints are supported)")
    return files


def _read(f, name: str, piece: Piece, layout: TPLayout | None, dtype: torch.dtype, whole: bool = False):
    """(piece, tensor in `dtype`) for the checkpoint tensor `name`: with tensor parallelism only
    the rank's slice (engine/tp_layout.py) is read. A stacked experts tensor (E, ...) is handed on
    one expert (and gate/up shard) at a time; with expert parallelism only the rank's experts (its
    rows of dim 0) are read."""
    if is_stacked(piece.target, whole) and piece.expert is None:  # transformers' stacked form
        held = _held(layout)
        if held is None:
            stacked, first = f.get_tensor(name).to(dtype), 0
        else:
            stacked, first = f.get_slice(name)[held.start:held.stop].to(dtype), held.start
        shards = fused_shards(piece.target)
        for expert, rows in enumerate(stacked, first):
            for shard, part in zip(shards, rows.chunk(len(shards), dim=0)):
                sub = Piece(piece.target, shard, expert)
                cut = layout.shard(sub.target, shard) if layout is not None else None
                yield sub, part if cut is None else part.narrow(*cut)
        return
    cut = layout.shard(piece.target, piece.shard) if layout is not None else None
    if cut is None:
        yield piece, f.get_tensor(name).to(dtype)
        return
    dim, start, length = cut  # only this rank's slice is read
    index = [slice(None)] * len(f.get_slice(name).get_shape())
    index[dim] = slice(start, start + length)
    yield piece, f.get_slice(name)[tuple(index)].to(dtype)


def _held(layout: TPLayout | None) -> range | None:
    """The routed experts an expert-parallel rank holds; None: every expert."""
    return layout.experts if layout is not None and layout.expert_parallel else None


def load_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
               pack: bool = True, layout: TPLayout | None = None, reduce=None) -> LlamaModel:
    """The checkpoint's weights in `dtype` on `device`; `pack`: linear layers on oneDNN with
    prepacked weights where the device has it (engine/packed_linear.py). `layout`: one
    tensor-parallel rank's shard (each tensor read only in its slice; `reduce` sums the ranks'); with
    expert parallelism only the rank's experts are read (another rank's `experts.N.*` is skipped)."""
    with torch.device("meta"):
        model = LlamaModel(cfg, max_positions, layout, reduce)
    model = model.to_empty(device=device).to(dtype)
    model.init_rope()  # after .to(dtype): the rope tables stay float32
    params = dict(model.named_parameters())
    heads, kv_heads = (layout.heads, layout.kv_heads) if layout is not None else (cfg.num_heads, cfg.num_kv_heads)
    q, kv = heads * cfg.head_dim, kv_heads * cfg.head_dim
    whole = cfg.router == "gpt_oss"  # experts kept in the checkpoint's layout (engine/models/gpt_oss.py)
    held = _held(layout)
    loaded: set[Piece] = set()
    skipped = 0
    files = _weight_files(Path(cfg.path))
    quantized = DequantizingFiles(cfg.quantization, files, dtype) if cfg.quantization is not None else None
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            if quantized is not None:  # quantized tensors read as plain ones, their scales hidden
                f = quantized.view(f)
            for name in f.keys():
                if "rotary_emb" in name:
                    continue
                plain = name.removeprefix("model.")  # a parameter of that name (latent attention's q_proj) as it is
                piece = Piece(plain) if plain in params else piece_of(name)
                if piece.target not in params:
                    if beyond(name, cfg.num_layers):
                        skipped += 1
                        continue
                    raise ValueError(f"unexpected tensor {name!r} in {file.name}")
                if held is not None and piece.expert is not None and piece.expert not in held:
                    continue  # another expert-parallel rank's expert: not read
                for part, tensor in _read(f, name, piece, layout, dtype, whole):
                    if layout is not None and layout.zeroed(part.target):  # another rank adds it
                        tensor = torch.zeros_like(tensor)
                    dst = params[part.target].data
                    if part.expert is not None:  # the rank's own index (expert parallel: from held.start)
                        dst = dst[part.expert - (held.start if held is not None else 0)]
                    if part.shard is not None:  # q/k/v, or the halves of gate/up
                        sizes = [q, kv, kv] if ".qkv_proj." in part.target else [dst.shape[0] // 2] * 2
                        dst = dst.narrow(0, sum(sizes[:part.shard]), sizes[part.shard])
                    if dst.shape != tensor.shape:
                        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
                    dst.copy_(tensor)
                    loaded.add(part)
    if quantized is not None and (cost := quantized.summary()):
        log.info(cost)
    if skipped:
        log.info("skipped %d tensors of layers past the model's %d (multi-token prediction)", skipped, cfg.num_layers)
    if cfg.tie_word_embeddings or Piece("lm_head.weight") not in loaded:
        if not cfg.tie_word_embeddings:
            raise ValueError(f"checkpoint {cfg.path} has no lm_head.weight and does not tie embeddings")
        model.lm_head.weight = model.embed_tokens.weight
        loaded.add(Piece("lm_head.weight"))
    stacked = {n: (held if held is not None else p.shape[0]) if is_stacked(n, whole) else 0
               for n, p in params.items()}
    missing = sorted(expected_pieces(stacked, whole) - loaded, key=str)
    if missing:
        names = [f"{m.target}{'' if m.expert is None else f'[{m.expert}]'}" for m in missing[:5]]
        raise ValueError(f"checkpoint {cfg.path} is missing tensors: {names}{' ...' if len(missing) > 5 else ''}")
    for module in model.modules():  # layouts a module keeps for its steps (engine/models/mla.py)
        if hasattr(module, "finish_load"):
            module.finish_load()
    if pack:
        lib = native_lib() if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) else None
        tiles = lib if lib is not None and dtype == torch.bfloat16 and lib.pd_amx_ready() else None  # AMX
        pack_linears(model, tiles, lib)
        if lib is not None:
            _native_experts(model, lib, dtype)
            _native_token_ops(model, lib)
            _native_decode_blocks(model, lib, tiles is not None)  # AMX tiles or panels: AttentionBlock.serves says
    return model.eval()


def _native_token_ops(model: nn.Module, lib: Any) -> None:
    """Norms, RoPE and routers in one native pass each (engine/token_ops.py): every module that takes them."""
    for module in model.modules():
        if hasattr(module, "token_ops"):
            module.token_ops = lib


def _native_decode_blocks(model: nn.Module, lib: Any, amx: bool) -> None:
    """Each layer whose attention half the native decode block runs gets one (engine/models/decode_block.py)."""
    for layer in model.layers:
        if AttentionBlock.serves(layer):
            layer.decode_block = AttentionBlock(layer, lib)
        elif amx and hasattr(layer.self_attn, "pack_heads"):  # latent attention: its per-head projections on tiles
            layer.self_attn.pack_heads(lib)


def _native_experts(model: nn.Module, lib: Any, dtype: torch.dtype) -> None:
    """Routed experts in one native call per layer: float32 (small batches), or bfloat16 on AMX
    tiles (every batch; the weights repacked for them)."""
    amx = dtype == torch.bfloat16 and bool(lib.pd_amx_ready())
    for module in model.modules():
        if not isinstance(module, Experts):
            continue
        if dtype == torch.float32:
            module.native = lib
        elif amx and packable(module.gate_up_proj.shape[2], module.inter):
            module.pack(lib, amx=True)
