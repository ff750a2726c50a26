"""Structured output: a request's constraint (a JSON schema, any JSON object, a regex, a choice of
strings, an EBNF grammar) as a mask over the next token, with xgrammar (benchmarks/grammar_engines.py
measured it against llguidance on this machine; docs/structured_output.md has the numbers).

Each constrained sequence has one matcher (`Sequence.guide`). Before each of its samples the
matcher is brought up to date with the sequence's completion tokens, so the state never travels:
the prefill worker samples the first token under the mask, the decode worker's matcher then
consumes that token (and, on a resumed request, the tokens streamed before the resume, which end
its prompt) before it masks the second. At the grammar's end only EOS is allowed, and a constrained
sequence stops at EOS even with ignore_eos. JSON is generated compact (no free whitespace, which
would let a sampled completion run on in blanks). Each constraint is compiled once (an LRU).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.sampling_params import GUIDED_KINDS, GuidedDecoding

if TYPE_CHECKING:  # the router checks constraints without torch
    import torch

    from engine.logits_processors import History

log = logging.getLogger(__name__)


class GuidedError(ValueError):
    """A constraint the grammar engine cannot build (its message says why)."""


@dataclass
class _Guide:
    matcher: Any
    consumed: int = 0  # completion tokens the matcher has taken
    broken: bool = False  # a token it refused: no mask from then on (logged)


class GuidedDecoder:
    """The masks of a model's constrained sequences; the tokenizer is loaded on first use."""

    def __init__(self, model_path: str | Path, vocab_size: int) -> None:
        self.model_path, self.vocab_size = str(model_path), vocab_size
        self._compiler: Any = None
        self.compiled = functools.lru_cache(maxsize=256)(self._compile)

    @property
    def compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            from engine.tokenizer import load_tokenizer

            tok = load_tokenizer(self.model_path)
            if tok is None:
                raise GuidedError("guided: structured output needs the model's tokenizer; this checkpoint has none")
            info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def _compile(self, g: GuidedDecoding) -> Any:
        c = self.compiler
        try:
            if g.kind == "json":
                return c.compile_json_schema(g.spec, any_whitespace=False)
            if g.kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if g.kind == "regex":
                return c.compile_regex(g.spec)
            if g.kind == "choice":
                choices = (json.dumps(x, ensure_ascii=False) for x in json.loads(g.spec))  # no surrogate pairs
                return c.compile_grammar("root ::= " + " | ".join(choices))
            if g.kind == "grammar":
                return c.compile_grammar(g.spec)
        except (ValueError, TypeError, RuntimeError) as e:
            raise GuidedError(f"guided: cannot build the {g.kind} constraint: {e}") from None
        raise GuidedError(f"guided: unknown constraint kind {g.kind!r}; known: {', '.join(GUIDED_KINDS)}")

    def check(self, g: GuidedDecoding) -> None:
        """Raise GuidedError when `g` cannot be built."""
        self.compiled(g)

    def _guide(self, h: Any) -> _Guide:
        from engine.logits_processors import completion_start

        if h.guide is None:
            import xgrammar as xgr

            h.guide = _Guide(xgr.GrammarMatcher(self.compiled(h.params.guided)))
        guide: _Guide = h.guide
        start = completion_start(h) + guide.consumed  # only the tokens it has not taken (per step: one)
        for t in h.token_ids[start:]:
            if not guide.broken and not guide.matcher.accept_token(t):
                guide.broken = True
                log.warning("request %s: token %d breaks its constraint; unconstrained from here",
                            getattr(h, "request_id", "?"), t)
        guide.consumed += len(h.token_ids) - start
        return guide

    def mask(self, logits: torch.Tensor, rows: Seq[int], histories: Seq[History]) -> torch.Tensor:
        """`logits` (rows, vocab) with the tokens each constrained row may not take at -inf (a copy;
        the input is left as it was). `rows`: the constrained rows."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
        bitmask.fill_(-1)  # all allowed
        masked = []
        for i in rows:
            guide = self._guide(histories[i])
            if not guide.broken:
                guide.matcher.fill_next_token_bitmask(bitmask, i)
                masked.append(i)
        out = logits.clone()
        if masked:
            xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device), vocab_size=logits.shape[1], indices=masked)
        return out
