"""Tool calls on the chat API (router/openai_tools.py): tools and tool_choice read and refused with
the field named, the constraint a forced call generates under, the model's output parsed into
OpenAI's tool_calls, streamed and not. No servers."""

from __future__ import annotations

import json

import jsonschema
import pytest

from proto import generate_pb2 as gen
from router.openai_protocol import ApiError, parse_chat
from router.openai_responses import LogprobFormatter, Output, StreamShaper, response

MODEL = "builtin:tiny-llama"
FMT = LogprobFormatter(lambda i: f"t{i}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
MSGS = [{"role": "user", "content": "Weather in Paris?"}]


def _chat(rendered: list | None = None, **body):
    def render(messages, tools=None):
        if rendered is not None:
            rendered.append((messages, tools))
        return "prompt"

    return parse_chat({"messages": MSGS, **body}, MODEL, render)


def _answer(req, text: str, reason: str = "stop") -> dict:
    out = Output()
    out.add(gen.GenerateResponse(text=text, finish_reason=reason, usage=gen.Usage(prompt_tokens=1, completion_tokens=1)))
    return response(req, out, FMT)["choices"][0]


def test_tools_reach_the_template_and_auto_is_the_default():
    seen = []
    req = _chat(seen, tools=[WEATHER, TIME])
    assert req.tools.choice == "auto" and seen[0][1] == [WEATHER, TIME]
    assert not req.grpc.sampling.HasField("guided")  # auto: free text
    assert _chat(tools=[WEATHER], tool_choice="none").tools.constraint() is None


def test_auto_parses_hermes_style_calls_and_keeps_other_text_as_content():
    req = _chat(tools=[WEATHER, TIME])
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    c = _answer(req, "Let me check. " + call + '\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] == "Let me check."
    calls = c["message"]["tool_calls"]
    assert [x["function"]["name"] for x in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"} and calls[0]["id"].startswith("call_")
    plain = _answer(req, "It is sunny.")
    assert plain["message"] == {"role": "assistant", "content": "It is sunny.", "refusal": None}
    bad = _answer(req, '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>')
    assert "tool_calls" not in bad["message"] and bad["finish_reason"] == "stop"


def test_a_named_function_is_constrained_to_its_parameters():
    req = _chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    g = req.grpc.sampling.guided
    assert g.kind == "json" and json.loads(g.spec) == WEATHER["function"]["parameters"]
    c = _answer(req, '{"city": "Oslo"}')
    assert c["message"]["content"] is None and c["finish_reason"] == "tool_calls"
    assert c["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


def test_required_is_constrained_to_a_list_of_calls_of_the_tools():
    req = _chat(tools=[WEATHER, TIME], tool_choice="required")
    schema = json.loads(req.grpc.sampling.guided.spec)
    jsonschema.validate([{"name": "get_time", "arguments": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {}}], schema)  # city is required
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)
    c = _answer(req, '[{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_time", "arguments": {}}]')
    assert [x["function"]["name"] for x in c["message"]["tool_calls"]] == ["get_weather", "get_time"]


def test_parallel_tool_calls_false_gives_at_most_one_call():
    two = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
           '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert len(_answer(_chat(tools=[WEATHER, TIME], parallel_tool_calls=True), two)["message"]["tool_calls"]) == 2
    auto = _chat(tools=[WEATHER, TIME], parallel_tool_calls=False)
    c = _answer(auto, "Checking. " + two)
    assert c["message"]["content"] == "Checking." and c["finish_reason"] == "tool_calls"
    assert [x["function"]["name"] for x in c["message"]["tool_calls"]] == ["get_weather"]
    required = _chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(required.grpc.sampling.guided.spec)
    jsonschema.validate([{"name": "get_time", "arguments": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):  # the constraint itself allows one call only
        jsonschema.validate([{"name": "get_time", "arguments": {}}] * 2, schema)
    shaper = StreamShaper(_chat(tools=[WEATHER, TIME], stream=True, parallel_tool_calls=False), FMT)
    (tc,) = [c["choices"][0]["delta"]["tool_calls"] for c in shaper.chunks(gen.GenerateResponse(text=two, finish_reason="stop"))
             if "tool_calls" in c["choices"][0]["delta"]]
    assert [x["function"]["name"] for x in tc] == ["get_weather"]


def _streamed(pieces: list[str]) -> list[dict]:
    """The chunks of an auto-tools chat stream whose messages carry `pieces` (the last one finishing)."""
    shaper = StreamShaper(_chat(tools=[WEATHER], stream=True), FMT)
    return [c for i, p in enumerate(pieces) for c in shaper.chunks(
        gen.GenerateResponse(text=p, finish_reason="stop" if i == len(pieces) - 1 else ""))]


def test_streamed_auto_holds_back_a_call_and_sends_it_as_one_delta():
    chunks = _streamed(["Sure", " <tool", '_call>{"name": "get_weather", ', '"arguments": {"city": "Lima"}}</tool_call>'])
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Sure "
    (tc,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert tc[0]["index"] == 0 and tc[0]["function"]["name"] == "get_weather"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_streamed_auto_without_a_call_sends_all_the_text():
    shaper = StreamShaper(_chat(tools=[WEATHER], stream=True), FMT)
    chunks = shaper.chunks(gen.GenerateResponse(text="a <b"))
    chunks += shaper.chunks(gen.GenerateResponse(text="> c <", finish_reason="stop"))
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "a <b> c <"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("body, param", [
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0]"),
    ({"tools": [TIME, TIME]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages[0].tool_call_id"),
])
def test_bad_tools_are_400_naming_the_field(body, param):
    with pytest.raises(ApiError) as err:
        parse_chat({"messages": MSGS, **body}, MODEL, lambda m, t=None: "p")
    assert err.value.status == 400 and err.value.param == param


def test_a_tool_round_trip_history_is_accepted():
    seen = []
    history = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    parse_chat({"messages": history, "tools": [WEATHER]}, MODEL,
               lambda m, t=None: seen.append(m) or "p")
    assert seen[0][1]["tool_calls"][0]["id"] == "call_1" and seen[0][2] == {
        "role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def test_required_keeps_each_tools_own_definitions_resolvable():
    nested = {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "properties": {"guest": {"$ref": "#/$defs/Guest"}}, "required": ["guest"],
        "$defs": {"Guest": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}}}
    schema = json.loads(_chat(tools=[nested, TIME], tool_choice="required").grpc.sampling.guided.spec)
    jsonschema.validate([{"name": "book", "arguments": {"guest": {"name": "Ada"}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "book", "arguments": {"guest": {}}}], schema)


def test_a_forced_call_cut_short_keeps_its_text_as_content():
    req = _chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = _answer(req, '{"city": "Par', reason="length")
    assert c["message"]["content"] == '{"city": "Par' and "tool_calls" not in c["message"]
    assert c["finish_reason"] == "length"


def test_streamed_auto_sends_a_false_start_then_holds_the_real_call():
    chunks = _streamed(["a <to", "y> b ", '<tool_call>{"name": "get_weather", "arguments": {"city": "X"}}',
                        "</tool_call> tail"])
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert [d.get("content") for d in deltas if d.get("content")] == ["a ", "<toy> b "]
    assert [d["tool_calls"][0]["function"]["name"] for d in deltas if "tool_calls" in d] == ["get_weather"]
