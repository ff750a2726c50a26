"""Whether a new prompt fits in a KV cache now: the one rule of every admission that holds blocks
(a decode worker's reservations and local prefills, colocated admissions), torch-free so that the
planner's simulator applies the engine's own rule.

    blocks(prompt) + running sequences <= free blocks

One block of headroom per running sequence keeps new prompts from starving decode: each running
sequence may need one more block at its next token.
"""

from __future__ import annotations


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks of `block_size` tokens that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


def prompt_fits(num_tokens: int, block_size: int, num_running: int, num_free_blocks: float) -> bool:
    """A prompt of `num_tokens` fits in `num_free_blocks` next to `num_running` running sequences
    (the free count may be an estimate, as the simulator's is)."""
    return blocks_needed(num_tokens, block_size) + num_running <= num_free_blocks
