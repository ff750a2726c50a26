"""LangChain's `ChatOpenAI` (langchain-openai) against the cluster's OpenAI API, unchanged: invoke and
stream equal the offline engine's greedy output on the rendered chat template; with_structured_output
(json_schema and function_calling) and bind_tools return values that parse against their schemas."""

from __future__ import annotations

import jsonschema
import pytest

from pdcluster import SamplingParams
from tests.integration.openai_helpers import MODEL, base_url

langchain_openai = pytest.importorskip("langchain_openai")
pytestmark = pytest.mark.slow

CITY = {"title": "City", "description": "A city.", "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "population": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 99999}},
        "required": ["name", "population"], "additionalProperties": False}


@pytest.fixture(scope="module")
def chat(openai_cluster):
    return langchain_openai.ChatOpenAI(base_url=base_url(openai_cluster), api_key="unused", model=MODEL, temperature=0,
                                       max_tokens=12, max_retries=0, timeout=60)


def test_invoke_and_stream_equal_the_offline_engine(chat, openai_cluster, builtin_llm):
    text = openai_cluster.router.tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=False,
                                                        add_generation_prompt=True)
    ref = builtin_llm.generate([text], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].text
    assert chat.invoke("Hello there").content == ref
    assert "".join(c.content for c in chat.stream("Hello there")) == ref


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_parses(chat, method):
    structured = chat.model_copy(update={"max_tokens": 96}).with_structured_output(CITY, method=method)
    for _ in range(3):
        jsonschema.validate(structured.invoke("Name a city."), CITY)


def test_bind_tools_with_a_forced_call(chat):
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                             "parameters": CITY}}
    msg = chat.model_copy(update={"max_tokens": 96}).bind_tools([tool], tool_choice="get_weather").invoke(
        "Weather in Lima?")
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], CITY)
