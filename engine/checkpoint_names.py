"""Which engine parameter each checkpoint tensor loads into.

The engine fuses q/k/v into one `qkv_proj` and gate/up into one `gate_up_proj`, and stacks a
mixture-of-experts layer's experts into `mlp.experts.gate_up_proj` (E, 2I, H) and
`mlp.experts.down_proj` (E, H, I). Checkpoints name them one by one: Mixtral as
`block_sparse_moe.experts.N.w1/w3/w2` (gate, up, down), Qwen3-MoE as `mlp.experts.N.gate_proj/
up_proj/down_proj`; transformers' own stacked names load as they are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# checkpoint name suffix -> (fused parameter suffix, shard index in the fused tensor)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "shared_experts.gate_proj": ("shared_experts.gate_up_proj", 0),  # DeepSeek's shared experts
    "shared_experts.up_proj": ("shared_experts.gate_up_proj", 1),
}
_EXPERT = re.compile(r"^(.*)\.mlp\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
# an expert's tensor -> (stacked parameter, shard)
_EXPERT_PART = {"w1": ("gate_up_proj", 0), "gate_proj": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1),
                "up_proj": ("gate_up_proj", 1), "w2": ("down_proj", None), "down_proj": ("down_proj", None)}
STACKED = (".experts.gate_up_proj", ".experts.down_proj")


@dataclass(frozen=True)
class Piece:
    """Where one tensor goes: `target` (the engine's parameter name), its row `expert` of a stacked
    experts parameter, and its `shard` of a fused one (0/1/2: q/k/v; 0/1: gate/up); None: whole."""

    target: str
    shard: int | None = None
    expert: int | None = None


def piece_of(name: str) -> Piece:
    """The engine's place for the checkpoint tensor `name`."""
    name = name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
    m = _EXPERT.match(name)
    if m is not None:
        kind, shard = _EXPERT_PART[m.group(3)]
        return Piece(f"{m.group(1)}.mlp.experts.{kind}", shard, int(m.group(2)))
    for src, (dst, shard) in _FUSED.items():
        if f".{src}." in f".{name}":
            return Piece(name.replace(src, dst), shard)
    return Piece(name)


def beyond(name: str, num_layers: int) -> bool:
    """Whether `name` belongs to a layer past the model's last (DeepSeek-V3's multi-token
    prediction layer: checkpoints carry it, generation does not use it)."""
    m = re.match(r"^(?:model\.)?layers\.(\d+)\.", name)
    return m is not None and int(m.group(1)) >= num_layers


def is_stacked(target: str, whole: bool = False) -> bool:
    """Whether `target` is a stacked experts parameter loaded one expert and gate/up half at a time;
    `whole`: the model keeps the checkpoint's stacked layout as it is (gpt-oss: (E, H, 2I) with
    gate and up interleaved), so its experts tensors load whole."""
    return not whole and target.endswith(STACKED)


def fused_shards(target: str, whole: bool = False) -> list[int | None]:
    """The shards a parameter is loaded in (each a `Piece`): [None] for one loaded whole (`whole`:
    as for `is_stacked`)."""
    if ".qkv_proj." in target:
        return [0, 1, 2]
    if ".gate_up_proj." in target or is_stacked(target, whole) and target.endswith(".experts.gate_up_proj"):
        return [0, 1]
    return [None]


def expected_pieces(params: dict[str, int | range], whole: bool = False) -> set[Piece]:
    """Every piece a complete checkpoint fills, for parameters `name -> experts` (0: not stacked; a
    count: experts 0.., a range: those experts, the ones an expert-parallel rank holds)."""
    return {Piece(name, shard, expert) for name, experts in params.items()
            for expert in ((range(experts) if isinstance(experts, int) else experts) if experts else [None])
            for shard in fused_shards(name, whole)}
