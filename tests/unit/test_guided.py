"""Structured output in the engine (engine/guided.py): the built-in model's output matches its
constraint (JSON schema, any JSON object, regex, choice, Lark grammar), greedy and sampled; a
resumed request (the constraint's state rebuilt from the tokens streamed before) goes on exactly
as the first attempt; a constraint the grammar engine cannot build is a ValueError naming it."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import GuidedDecoding, SamplingParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                            "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                            "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}
PROMPT = [1, 450, 4996, 1735, 1701, 6619, 2988]


@pytest.fixture(scope="module")
def engine(builtin_path):
    return Engine(EngineConfig(model=str(builtin_path), num_blocks=128, max_model_len=512, num_threads=1))


def _run(engine: Engine, params: SamplingParams, prompt: list[int] = PROMPT, offset: int = 0,
         rid: str = "r") -> tuple[list[int], str]:
    seq = engine.add_request(rid, prompt, params, output_offset=offset)
    for _ in range(4 * params.max_tokens + 8):
        engine.step()
        if seq.finish_reason is not None:
            return seq.output_token_ids, seq.finish_reason
    raise AssertionError("did not finish")


def _text(engine: Engine, ids: list[int]) -> str:
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(engine.cfg.model).decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(engine, temperature):
    params = SamplingParams(max_tokens=96, temperature=temperature, seed=5, guided=GuidedDecoding("json", json.dumps(SCHEMA)))
    ids, reason = _run(engine, params)
    assert reason == "stop"
    jsonschema.validate(json.loads(_text(engine, ids)), SCHEMA)


@pytest.mark.parametrize("guided, check", [
    (GuidedDecoding("json_object"), lambda t: isinstance(json.loads(t), dict)),
    (GuidedDecoding("regex", r"[a-c]{2,5}-\d{3}"), lambda t: re.fullmatch(r"[a-c]{2,5}-\d{3}", t)),
    (GuidedDecoding("choice", json.dumps(["yes", "no", "maybe so"])), lambda t: t in ("yes", "no", "maybe so")),
    (GuidedDecoding("grammar", 'root ::= "(" [0-9] ("+" [0-9])* ")"'),
     lambda t: re.fullmatch(r"\(\d(\+\d)*\)", t)),
])
def test_each_kind_of_constraint_holds(engine, guided, check):
    ids, reason = _run(engine, SamplingParams(max_tokens=128, temperature=1.0, seed=3, guided=guided))
    text = _text(engine, ids)
    assert reason == "stop" and check(text), text


def test_ignore_eos_still_ends_at_the_grammar_end(engine):
    ids, reason = _run(engine, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True,
                                              guided=GuidedDecoding("choice", '["yes", "no"]')))
    assert reason == "stop" and _text(engine, ids) in ("yes", "no")


@pytest.mark.parametrize("cut", [1, 4])
def test_a_resumed_request_rebuilds_the_constraint_from_the_tokens_streamed(engine, cut):
    params = SamplingParams(max_tokens=96, temperature=1.0, seed=11, guided=GuidedDecoding("json", json.dumps(SCHEMA)))
    full, _ = _run(engine, params, rid="full")
    assert len(full) > cut
    rest, reason = _run(engine, dataclasses.replace(params, max_tokens=96 - cut), PROMPT + full[:cut], cut, "resumed")
    assert full[:cut] + rest == full and reason == "stop"


@pytest.mark.parametrize("guided, words", [
    (GuidedDecoding("json", '{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}'), "json constraint"),
    (GuidedDecoding("regex", "(unclosed"), "regex constraint"),
    (GuidedDecoding("grammar", "root ::= undefined_rule"), "grammar constraint"),
])
def test_a_constraint_that_cannot_be_built_is_refused(engine, guided, words):
    with pytest.raises(ValueError, match=words):
        engine.add_request("bad", PROMPT, SamplingParams(guided=guided))


def test_guided_decoding_checks_its_fields():
    with pytest.raises(ValueError, match="kind must be one of"):
        GuidedDecoding("xml", "<a/>")
    with pytest.raises(ValueError, match="list of non-empty strings"):
        GuidedDecoding("choice", '["a", ""]')
    with pytest.raises(ValueError, match="needs its spec"):
        GuidedDecoding("regex")


def test_min_tokens_with_a_constraint_is_refused():
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        SamplingParams(min_tokens=2, guided=GuidedDecoding("json_object"))


def test_a_choice_outside_the_basic_plane_can_be_produced(engine):
    ids, reason = _run(engine, SamplingParams(max_tokens=32, temperature=0.0,
                                              guided=GuidedDecoding("choice", json.dumps(["😀 ok"]))))
    assert reason == "stop" and _text(engine, ids) == "😀 ok"
