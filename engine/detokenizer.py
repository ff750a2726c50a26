"""Incremental detokenization and stop strings (used by the offline LLM and by the router).

Text is emitted only once it is final: a byte-level token may end in the middle of a multi-byte
character (decoded as U+FFFD), so such a tail is held back until the next token completes it.
Decoding a short window (`prefix_offset`..) keeps each step O(1) in the output length.
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], stop: list[str] | None = None,
                 min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-6:])  # a little context so word boundaries decode right
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop = stop or []
        self._held = max((len(s) for s in self.stop), default=1) - 1  # chars a stop string could still claim
        self._emitted = 0
        self.stopped = False
        # stop strings are matched only in the text of completion tokens after the first min_tokens
        self.min_tokens = min_tokens
        self._added = 0
        self._stop_floor = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Add one token; return the newly final text (may be empty). Sets `stopped` on a stop string."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        self._added += 1
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._release(final=False)

    def _release(self, final: bool) -> str:
        if self._added <= self.min_tokens:  # no stop yet, and none later in the text so far
            self._stop_floor, hits = len(self.text), []
        else:
            search_from = max(self._stop_floor, self._emitted - self._held)
            hits = [at for at in (self.text.find(s, search_from) for s in self.stop) if at != -1]
        if hits:  # the earliest stop string wins; it and everything after it are dropped
            self.text = self.text[: min(hits)]
            self.stopped = True
            final = True
        end = len(self.text) if final else max(self._emitted, len(self.text) - self._held)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def flush(self) -> str:
        """At the end of the request: release the text held back for stop-string matching."""
        return self._release(final=True)
