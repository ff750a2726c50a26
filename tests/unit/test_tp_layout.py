"""Tensor-parallel sharding arithmetic (engine/tp_layout.py): each rank's heads, KV heads (split,
or replicated when there are fewer than ranks), MLP rows, the slice of each checkpoint tensor, and
the sizes refused with a message naming what must divide what."""

from __future__ import annotations

import pytest

from engine.tp_layout import TPLayout


def _layout(rank: int, size: int, heads: int = 8, kv: int = 4, inter: int = 128) -> TPLayout:
    return TPLayout(rank, size, heads, kv, 16, inter)


def test_gqa_heads_and_kv_heads_split_evenly():
    a, b = _layout(0, 2), _layout(1, 2)
    assert (a.heads, a.kv_heads, a.first_kv_head, a.inter) == (4, 2, 0, 64)
    assert (b.heads, b.kv_heads, b.first_kv_head) == (4, 2, 2)
    assert not a.kv_replicated
    assert b.shard("layers.0.self_attn.qkv_proj.weight", 0) == (0, 64, 64)  # q rows of heads 4-7
    assert b.shard("layers.0.self_attn.qkv_proj.weight", 1) == (0, 32, 32)  # k rows of KV heads 2-3
    assert b.shard("layers.0.self_attn.qkv_proj.bias", 2) == (0, 32, 32)
    assert b.shard("layers.0.self_attn.o_proj.weight", None) == (1, 64, 64)  # row-parallel: columns
    assert b.shard("layers.0.mlp.gate_up_proj.weight", 1) == (0, 64, 64)
    assert b.shard("layers.0.mlp.down_proj.weight", None) == (1, 64, 64)
    for whole in ("embed_tokens.weight", "lm_head.weight", "norm.weight", "layers.0.input_layernorm.weight",
                  "layers.0.self_attn.q_norm.weight"):
        assert b.shard(whole, None) is None


@pytest.mark.parametrize("size, owner", [(2, [0, 0]), (4, [0, 0, 1, 1])])
def test_fewer_kv_heads_than_ranks_are_replicated_to_the_ranks_whose_queries_read_them(size, owner):
    for rank in range(size):
        layout = TPLayout(rank, size, 8, size // 2, 16, 128)
        assert layout.kv_replicated and layout.kv_heads == 1
        assert layout.first_kv_head == owner[rank]
        # its query heads' group is that KV head
        group = 8 // (size // 2)
        assert {(rank * layout.heads + h) // group for h in range(layout.heads)} == {owner[rank]}


def test_mqa_every_rank_holds_the_one_kv_head():
    assert [TPLayout(r, 4, 8, 1, 16, 128).first_kv_head for r in range(4)] == [0, 0, 0, 0]


def test_one_rank_takes_everything_whole():
    assert _layout(0, 1).shard("layers.0.self_attn.qkv_proj.weight", 0) is None


@pytest.mark.parametrize("kwargs, match", [
    (dict(heads=6, kv=2), "divide the model's 6 attention heads"),
    (dict(heads=12, kv=3), "divide the model's 3 KV heads, or be a multiple"),
    (dict(inter=130), "intermediate size 130"),
])
def test_sizes_the_model_cannot_be_split_by_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _layout(0, 4, **kwargs)


def test_a_rank_outside_the_group_is_refused():
    with pytest.raises(ValueError, match="not a rank"):
        _layout(2, 2)
