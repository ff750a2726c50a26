"""Which tokens keep a constrained output valid UTF-8, given the bytes generated so far.

xgrammar matches text byte by byte and takes UTF-8-encoded surrogates (ED A0-BF ..) inside strings,
so a byte-fallback tokenizer (`<0xED>` tokens, Llama-2's and Mistral's) could spell bytes that no
decoder reads back: tokenizers' ByteFallback turns a whole run of such tokens into U+FFFD, closing
quotes and braces included. A constrained sequence is masked by this table as well as by its
grammar, so its bytes are always well-formed UTF-8 (Unicode's Table 3-7).

The state is what the next byte must be: a start byte (0), or a continuation in a range with so
many more to come. Each token's bytes are walked once per state, when the table is built.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# (lowest, highest) allowed next byte, continuation bytes still to come (this one included)
STATES: tuple[tuple[int, int, int], ...] = (
    (0x00, 0x7F, 0),  # 0: a new character starts (ASCII or a lead byte: see _lead)
    (0x80, 0xBF, 1), (0x80, 0xBF, 2), (0x80, 0xBF, 3),
    (0xA0, 0xBF, 2),  # after E0: no overlong form
    (0x80, 0x9F, 2),  # after ED: no surrogate
    (0x90, 0xBF, 3),  # after F0: no overlong form
    (0x80, 0x8F, 3),  # after F4: nothing above U+10FFFF
)
START = 0
_INDEX = {s: i for i, s in enumerate(STATES)}
_CONT = {n: _INDEX[(0x80, 0xBF, n)] for n in (1, 2, 3)}


def _lead(byte: int) -> int | None:
    """The state after a character's first byte (None: no character starts with it)."""
    if byte < 0x80:
        return START
    if 0xC2 <= byte <= 0xDF:
        return _CONT[1]
    if byte == 0xE0:
        return _INDEX[(0xA0, 0xBF, 2)]
    if byte == 0xED:
        return _INDEX[(0x80, 0x9F, 2)]
    if 0xE1 <= byte <= 0xEF:
        return _CONT[2]
    if byte == 0xF0:
        return _INDEX[(0x90, 0xBF, 3)]
    if 0xF1 <= byte <= 0xF3:
        return _CONT[3]
    if byte == 0xF4:
        return _INDEX[(0x80, 0x8F, 3)]
    return None


def step(state: int, data: bytes) -> int | None:
    """The state after `data` from `state` (None: the bytes are not well-formed there)."""
    for b in data:
        lo, hi, left = STATES[state]
        if left == 0:
            nxt = _lead(b)
            if nxt is None:
                return None
            state = nxt
        elif lo <= b <= hi:
            state = _CONT[left - 1] if left > 1 else START
        else:
            return None
    return state


class Utf8Table:
    """Per state, the tokens allowed (`allowed[state]`, a bool row over the vocabulary) and where
    each leads (`after`). Tokens past `token_bytes` (padding of the model's vocabulary) are left
    to the grammar: allowed, with no bytes."""

    def __init__(self, token_bytes: Sequence[bytes], vocab_size: int) -> None:
        n = len(STATES)
        self.allowed = torch.zeros(n, vocab_size, dtype=torch.bool)
        self.after: list[dict[int, int]] = [{} for _ in range(n)]  # only tokens that are not pure ASCII
        ascii_ids = [i for i, b in enumerate(token_bytes[:vocab_size]) if b.isascii()]
        self.allowed[START, ascii_ids] = True  # pure ASCII: from a start only, back to a start
        self.allowed[START, len(token_bytes):] = True
        for i, b in enumerate(token_bytes[:vocab_size]):
            if b.isascii():
                continue
            for s in range(n):
                nxt = step(s, b)
                if nxt is not None:
                    self.allowed[s, i] = True
                    self.after[s][i] = nxt

    def advance(self, state: int, token: int) -> int:
        """The state after `token` (one the table allowed; any other resets to a start)."""
        return self.after[state].get(token, START)
