"""JSON constraints produce strict JSON (RFC 8259: no unescaped control character in a string, no lone
surrogate escape) that validates against the schema, whatever is sampled and whatever the tokenizer.

No model: an adversarial sampler walks each compiled constraint (GuidedDecoder's own), taking at every
step, when the mask allows one, a byte token or a token with a control character, a quote, a
backslash or a `\\u` escape, else any allowed token at random. A byte-level BPE (the built-in model's) and a SentencePiece
style BPE with byte fallback (`<0x0A>` tokens), as Llama-2 and Mistral ship."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import pytest

from engine.guided import GuidedDecoder, strict_json_grammar
from engine.sampling_params import GuidedDecoding, SamplingParams

STRINGS = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "n": {"type": "integer", "minimum": -50, "maximum": 50},
    "tags": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 4}, "maxItems": 3}},
    "required": ["name", "n", "tags"], "additionalProperties": False}
SCHEMAS = {
    "bounded strings": STRINGS,
    "plain string": {"type": "object", "properties": {"s": {"type": "string", "maxLength": 30}}, "required": ["s"]},
    "property names": {"type": "object", "propertyNames": {"maxLength": 3},
                       "additionalProperties": {"type": "boolean"}, "maxProperties": 3},
    "pattern": {"type": "object", "properties": {"p": {"type": "string", "pattern": "^a.{1,3}b$"}},
                "required": ["p"], "additionalProperties": False},
    "nested": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"k": {"type": "string", "minLength": 2, "maxLength": 5},
                                         "v": {"enum": ["x\ty", 1, None]}},
        "required": ["k", "v"], "additionalProperties": False}},
}
EVIL = ("\\u", "\\", '"')


def _byte_fallback_checkpoint(out) -> None:
    """A tokenizer as Llama-2's is built: Metaspace, BPE with byte fallback (a byte is `<0xNN>`, a
    normal token of the vocabulary), trained on a few JSON-ish lines."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>"]
    corpus = ['{"name": "tab\there", "n": 3, "tags": ["a\\u00e9", "x"]}', "hello world \x01\x02 café",
              '["k", "v", "x\ty", null, true, false]'] * 20
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizer
    trained.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600, special_tokens=special,
                                                            show_progress=False))
    model = json.loads(trained.to_str())["model"]
    learned = sorted((i, t) for t, i in model["vocab"].items() if t not in special)
    vocab = {t: i for i, t in enumerate([*special, *(f"<0x{b:02X}>" for b in range(256)), *(t for _, t in learned)])}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizer
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True) for t in special])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(out)


@pytest.fixture(scope="module", params=["byte-level BPE", "byte-fallback BPE"])
def decoder(request, builtin_path, tmp_path_factory):
    from engine.tokenizer import load_tokenizer

    if request.param == "byte-level BPE":
        path = builtin_path
    else:
        path = tmp_path_factory.mktemp("byte-fallback")
        _byte_fallback_checkpoint(path)
    tok = load_tokenizer(path)
    return GuidedDecoder(path, len(tok)), tok


@dataclass
class _Row:
    """What GuidedDecoder.mask reads of a sequence (engine.logits_processors.History, plus its guide)."""

    params: SamplingParams
    token_ids: list[int] = field(default_factory=lambda: [1])
    num_prompt_tokens: int = 1
    output_offset: int = 0
    eos_token_ids: frozenset[int] = frozenset()
    guide: Any = None


def _walk(decoder: GuidedDecoder, tok, guided: GuidedDecoding, rng: random.Random, limit: int = 400) -> str | None:
    """The text of one adversarial walk through GuidedDecoder.mask to the grammar's end (None: not
    there within `limit` tokens)."""
    import torch

    row = _Row(SamplingParams(guided=guided))
    vocab = decoder.vocab_size
    pieces = [tok.convert_ids_to_tokens(i) or "" for i in range(len(tok))]
    evil = [i for i, p in enumerate(pieces) if p.startswith("<0x") or any(ord(ch) < 0x20 for ch in tok.decode([i]))
            or any(e in tok.decode([i]) for e in EVIL)]
    for _ in range(limit):
        logits = decoder.mask(torch.zeros(1, vocab), [0], [row])
        allowed = set(torch.nonzero(torch.isfinite(logits[0])).flatten().tolist())
        assert allowed, f"no token allowed after {tok.decode(row.token_ids[1:])!r}"
        bad = [i for i in evil if i in allowed]
        row.token_ids.append(rng.choice(bad) if bad and rng.random() < 0.6 else rng.choice(sorted(allowed)))
        if row.token_ids[-1] == tok.eos_token_id:  # the grammar's end: only EOS was allowed
            assert allowed == {tok.eos_token_id}
            return tok.decode(row.token_ids[1:], skip_special_tokens=True)
    return None


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_adversarial_walks_of_a_json_schema_parse_strictly_and_validate(decoder, name):
    dec, tok = decoder
    schema = SCHEMAS[name]
    rng = random.Random(name)
    done = 0
    for _ in range(12):
        text = _walk(dec, tok, GuidedDecoding("json", json.dumps(schema)), rng)
        if text is None:
            continue
        done += 1
        value = json.loads(text)  # strict: a control character in a string raises
        jsonschema.validate(value, schema)
        assert "\\ud8" not in text.lower() and "\\udc" not in text.lower()
    assert done >= 8, f"only {done} of 12 walks reached the grammar's end"


def test_adversarial_walks_of_any_json_object_parse_strictly(decoder):
    dec, tok = decoder
    rng = random.Random(7)
    for _ in range(10):
        text = _walk(dec, tok, GuidedDecoding("json_object"), rng, limit=120)
        if text is not None:
            assert isinstance(json.loads(text), dict)


def test_the_grammar_text_loses_unescaped_controls_and_lone_surrogates():
    loose = ('esc ::= (([\\"\\\\/bfnrt]) | ("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))\n'
             'sub ::= (([^\\0-\\x1f\\"\\\\\\r\\n] sub))\n'
             'counted ::= (([^\\"\\\\\\r\\n]))\n'
             'digits ::= [0-9]+')
    strict = strict_json_grammar(loose).splitlines()
    assert strict[1:] == ['sub ::= (([^\\0-\\x1f\\"\\\\\\r\\n] sub))', 'counted ::= (([^\\0-\\x1f\\"\\\\\\r\\n]))',
                          'digits ::= [0-9]+']
    assert '"u" (([0-9A-Ca-cE-Fe-f] [A-Fa-f0-9]) | ([Dd] [0-7])) [A-Fa-f0-9] [A-Fa-f0-9]' in strict[0]
    assert strict_json_grammar("\n".join(strict)) == "\n".join(strict)
