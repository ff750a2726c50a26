"""Prompt text of a target token length, built from a fixed vocabulary of common English words.

Every prompt is a sequence of *segments*; a segment is the first n words of a word stream that depends
only on (seed, key). Two prompts whose leading segments have the same keys and lengths therefore share
that text prefix exactly (Mooncake's hash ids are the keys: same id -> same block of text).

Without a tokenizer one word is taken as one token: the words are common lower-case English words,
which Llama/GPT/Qwen-style BPE vocabularies hold as a single token when preceded by a space, so the
endpoint sees about the target count (plus its BOS token, if it adds one). With a tokenizer (a Hugging
Face tokenizer or any object with `encode(text) -> ids`) the vocabulary is first narrowed to words that
are one token after a space, the special tokens `encode` adds (e.g. BOS) are counted in, and the end of
the prompt is trimmed or grown word by word until `len(encode(text))` is the target exactly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

_COMMON_WORDS = """
the of and to in is you that it he was for on are as with his they at be this have from or one had by
word but not what all were we when your can said there use an each which she do how their if will up
other about out many then them these so some her would make like him time has look two more write go see
number no way could people my than first water been call who its now find long down day did get come
made may part over new sound take only little work know place year live me back give most very after
thing our just name good sentence man think say great where help through much before line right too mean
old any same tell boy follow came want show also around form three small set put end does another well
large must big even such because turn here why ask went men read need land different home us move try
kind hand picture again change off play spell air away animal house point page letter mother answer
found study still learn should world high every near add food between own below country plant last
school father keep tree never start city earth eye light thought head under story saw left few while
along might close something seem next hard open example begin life always those both paper together got
group often run important until children side feet car mile night walk white sea began grow took river
four carry state once book hear stop without second later miss idea enough eat face watch far real
almost let above girl sometimes mountain cut young talk soon list song being leave family
"""
WORDS: tuple[str, ...] = tuple(_COMMON_WORDS.split())

_MAX_STREAMS = 20000


@dataclass
class Prompt:
    text: str
    target_tokens: int
    tokens: int | None  # measured with the tokenizer; None without one


class PromptBuilder:
    """Deterministic prompt text from (seed, segment keys); see the module docstring."""

    def __init__(self, seed: int = 0, tokenizer: Any | None = None) -> None:
        self.seed, self.tokenizer = seed, tokenizer
        self.vocab: tuple[str, ...] = WORDS
        self.specials = 0
        self._first: tuple[str, ...] = ()
        if tokenizer is not None:
            base = len(tokenizer.encode("the"))
            single = tuple(w for w in WORDS if len(tokenizer.encode("the " + w)) - base == 1)
            self.vocab = single if len(single) >= 32 else WORDS
            self.specials = len(tokenizer.encode(""))
            # a prompt's first word has no space before it, which some tokenizers split differently
            self._first = tuple(w for w in self.vocab if len(tokenizer.encode(w)) - self.specials == 1)
        self._streams: dict[str, tuple[random.Random, list[str]]] = {}

    def words(self, key: str, n: int) -> list[str]:
        """The first n words of `key`'s stream (a prefix of any longer request for the same key)."""
        if key not in self._streams:
            if len(self._streams) >= _MAX_STREAMS:  # bounded memory on long traces; streams are reproducible
                self._streams.clear()
            self._streams[key] = (random.Random(f"{self.seed}:{key}"), [])
        rng, words = self._streams[key]
        if len(words) < n:  # choices() draws one random() per word: a longer draw extends a shorter one
            words.extend(rng.choices(self.vocab, k=n - len(words)))
        return words[:n]

    def build(self, target_tokens: int, segments: list[tuple[str, int]]) -> Prompt:
        """A prompt of `target_tokens` tokens laid out as `segments` [(key, tokens), ...] whose lengths
        sum to the target. The tokenizer's special tokens come off the end; fixes happen at the end too,
        so leading segments stay identical between prompts."""
        segs = [list(s) for s in segments if s[1] > 0]
        excess = self.specials
        while excess and segs:  # BOS etc. count towards the target: take them off the last segments
            cut = min(excess, segs[-1][1] - (1 if len(segs) == 1 else 0))
            segs[-1][1] -= cut
            excess -= cut
            if segs[-1][1] == 0:
                segs.pop()
            elif cut == 0:
                break
        if not segs:
            segs = [["pad", 1]]
        head: list[str] = []
        for key, n in segs[:-1]:
            head.extend(self.words(key, n))
        last_key, tail = segs[-1]
        text = self._join(head + self.words(last_key, tail))
        if self.tokenizer is None:
            return Prompt(text, target_tokens, None)
        count = len(self.tokenizer.encode(text))
        for _ in range(64):  # each pass moves by the difference; usually none is needed
            new_tail = max(0 if head else 1, tail + target_tokens - count)
            if count == target_tokens or new_tail == tail:
                break
            tail = new_tail
            text = self._join(head + self.words(last_key, tail))
            count = len(self.tokenizer.encode(text))
        return Prompt(text, target_tokens, count)

    def _join(self, words: list[str]) -> str:
        if self._first and words and words[0] not in self._first:  # same substitute for the same word
            words = [self._first[self.vocab.index(words[0]) % len(self._first)], *words[1:]]
        return " ".join(words)
