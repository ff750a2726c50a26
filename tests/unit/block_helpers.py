"""Helpers shared by the BlockManager tests."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BS = 4


def make_seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(
        request_id=rid, token_ids=list(tokens), num_prompt_tokens=len(tokens), params=SamplingParams()
    )


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """Pretend a forward pass computed every token of `seq`, then register its full blocks."""
    seq.num_computed_tokens = len(seq.token_ids)
    bm.cache_full_blocks(seq)


def assert_accounting(bm: BlockManager, tables: list[list[int]]) -> None:
    bm.check_invariants(tables)
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    assert bm.num_used_blocks == len({b for t in tables for b in t})


def allocated(bm: BlockManager, tokens: list[int], rid: str = "r") -> Sequence:
    """A sequence of `tokens` with its blocks allocated (prefix hits included)."""
    seq = make_seq(tokens, rid)
    bm.allocate(seq)
    return seq


def computed(bm: BlockManager, tokens: list[int], rid: str = "r") -> Sequence:
    """`allocated`, then every token computed and its full blocks registered in the prefix cache."""
    seq = allocated(bm, tokens, rid)
    compute_all(bm, seq)
    return seq
