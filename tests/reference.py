"""Greedy outputs of transformers' `generate()`: what every serving path must equal token for token."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM


def hf_greedy(path: str, pad_token_id: int = 0, dtype: torch.dtype = torch.float32,
              device: str = "cpu") -> Callable[..., list[int]]:
    """`ref(ids, n, **generate_kwargs)`: the n tokens transformers generates greedily after `ids`
    (no EOS stop) in `dtype` on `device`; the kwargs go to `generate()` (repetition_penalty,
    sequence_bias, ...)."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()

    def ref(ids: list[int], n: int, **generate_kwargs: object) -> list[int]:
        out = hf.generate(torch.tensor([ids], device=device), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, eos_token_id=None, pad_token_id=pad_token_id, **generate_kwargs)
        return out[0, len(ids):].tolist()

    return ref
