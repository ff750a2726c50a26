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

JSON is strict (RFC 8259, as Python's `json.loads` and serde_json read it): xgrammar's grammar for a
string with `minLength` / `maxLength` (or `propertyNames`) lets the control characters U+0000-U+001F
through unescaped, and its `\\u` escapes include lone surrogates. `strict_json_grammar` takes both
out of the grammar's text, which is then compiled again (`GuidedDecoder._compile`). And every
constrained output is well-formed UTF-8: each row is masked by engine/utf8_mask.py as well, since
xgrammar takes UTF-8-encoded surrogates, which a byte-fallback tokenizer would decode as U+FFFD.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.sampling_params import GUIDED_KINDS, GuidedDecoding

if TYPE_CHECKING:  # the router checks constraints without torch
    import torch

    from engine.logits_processors import History

log = logging.getLogger(__name__)


_NEGATED_CLASS = re.compile(r"\[\^((?:\\.|[^\]\\])*)\]")  # [^...] in xgrammar's EBNF
_CONTROLS = r"\0-\x1f"
_HEX = "[A-Fa-f0-9]"
_ANY_ESCAPE = f'"u" {_HEX} {_HEX} {_HEX} {_HEX}'
_NO_SURROGATE = f'"u" (([0-9A-Ca-cE-Fe-f] {_HEX}) | ([Dd] [0-7])) {_HEX} {_HEX}'  # not D800-DFFF


def strict_json_grammar(ebnf: str) -> str:
    """A JSON grammar (xgrammar's EBNF text) whose strings take no unescaped control character and no
    lone surrogate escape. Every negated character class of a JSON grammar matches characters inside
    a string (outside them JSON has only fixed punctuation, digits and literals; patterns are
    `Regex(..., json_string=true)`, which escape on their own), so each one excludes U+0000-U+001F."""
    def exclude_controls(m: re.Match[str]) -> str:
        body = m.group(1)
        return m.group(0) if body.startswith(_CONTROLS) else f"[^{_CONTROLS}{body}]"

    return _NEGATED_CLASS.sub(exclude_controls, ebnf).replace(_ANY_ESCAPE, _NO_SURROGATE)


class GuidedError(ValueError):
    """A constraint the grammar engine cannot build (its message says why)."""


@dataclass
class _Guide:
    matcher: Any
    consumed: int = 0  # completion tokens the matcher has taken
    utf8: int = 0  # what the next byte must be (engine/utf8_mask.py's state)
    broken: bool = False  # a token it refused: no mask from then on (logged)


class GuidedDecoder:
    """The masks of a model's constrained sequences; the tokenizer is loaded on first use."""

    def __init__(self, model_path: str | Path, vocab_size: int) -> None:
        self.model_path, self.vocab_size = str(model_path), vocab_size
        self._compiler: Any = None
        self._utf8: Any = None  # Utf8Table over the tokenizer's bytes, built with the compiler
        self.compiled = functools.lru_cache(maxsize=256)(self._compile)

    @property
    def compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            from engine.tokenizer import load_tokenizer

            tok = load_tokenizer(self.model_path)
            if tok is None:
                raise GuidedError("guided: structured output needs the model's tokenizer; this checkpoint has none")
            from engine.utf8_mask import Utf8Table

            info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size)
            self._utf8 = Utf8Table(info.decoded_vocab, self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def _compile(self, g: GuidedDecoding) -> Any:
        c = self.compiler
        try:
            if g.kind in ("json", "json_object"):
                schema = g.spec if g.kind == "json" else '{"type": "object"}'
                loose = c.compile_json_schema(schema, any_whitespace=False)
                text = str(loose.grammar)
                strict = strict_json_grammar(text)
                return loose if strict == text else c.compile_grammar(strict)
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
            guide.utf8 = self._utf8.advance(guide.utf8, t)
        guide.consumed += len(h.token_ids) - start
        return guide

    def mask(self, logits: torch.Tensor, rows: Seq[int], histories: Seq[History]) -> torch.Tensor:
        """`logits` (rows, vocab) with the tokens each constrained row may not take at -inf (a copy;
        the input is left as it was). `rows`: the constrained rows."""
        import torch
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
            allowed = self._utf8.allowed.to(out.device)
            for i in masked:
                row = out[i].masked_fill(~allowed[histories[i].guide.utf8, :out.shape[1]], float("-inf"))
                if bool(torch.isfinite(row).any()):  # else the grammar itself asks for ill-formed bytes
                    out[i] = row
        return out
