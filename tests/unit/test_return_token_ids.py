"""vLLM's `return_token_ids` on the OpenAI API: parsing (a boolean, else a 400 naming it), where the
prompt's ids come from, and where the ids go in each response and stream shape. No servers."""

from __future__ import annotations

import pytest

from proto import generate_pb2 as gen
from router.openai_protocol import ApiError, parse_chat, parse_completion
from router.openai_responses import LogprobFormatter, Output, StreamShaper, response

MODEL = "m"
FMT = LogprobFormatter(lambda t: f"<{t}>")


def _render(messages):
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages)


def _tokenize(text: str) -> list[int]:
    return [100 + ord(c) % 50 for c in text]


def _messages() -> list[gen.GenerateResponse]:
    return [gen.GenerateResponse(token_ids=[5], text="a"),
            gen.GenerateResponse(token_ids=[6], text=""),  # e.g. half a UTF-8 character: no text yet
            gen.GenerateResponse(token_ids=[7, 8], text="bc", finish_reason="length",
                                 usage=gen.Usage(prompt_tokens=3, completion_tokens=4))]


def _total(msgs: list[gen.GenerateResponse]) -> Output:
    out = Output()
    for m in msgs:
        out.add(m)
    return out


@pytest.mark.parametrize("value", ["yes", 1, 0, [], {}])
def test_a_non_boolean_is_a_400_naming_the_field(value):
    bodies = [(parse_completion, {"prompt": "x"}), (
        lambda b, m: parse_chat(b, m, _render), {"messages": [{"role": "user", "content": "x"}]})]
    for parse, body in bodies:
        with pytest.raises(ApiError) as err:
            parse({**body, "return_token_ids": value}, MODEL)
        assert err.value.status == 400 and err.value.param == "return_token_ids"
        assert "return_token_ids" in err.value.message


def test_default_off_and_null_accepted():
    assert parse_completion({"prompt": "x"}, MODEL).return_token_ids is False
    assert parse_completion({"prompt": "x", "return_token_ids": None}, MODEL).return_token_ids is False
    body = response(parse_completion({"prompt": [1, 2]}, MODEL), _total(_messages()), FMT)
    assert "token_ids" not in body["choices"][0] and "prompt_token_ids" not in body["choices"][0]


def test_token_id_prompts_are_their_own_prompt_token_ids():
    req = parse_completion({"prompt": [1, 2, 3], "return_token_ids": True}, MODEL)
    assert req.prompt_token_ids == [1, 2, 3] and list(req.grpc.token_ids.ids) == [1, 2, 3]


def test_text_prompts_are_tokenized_here_and_sent_as_ids_when_a_tokenizer_is_given():
    req = parse_completion({"prompt": "Hello", "return_token_ids": True}, MODEL, _tokenize)
    assert req.grpc.WhichOneof("prompt") == "token_ids"
    assert list(req.grpc.token_ids.ids) == req.prompt_token_ids == _tokenize("Hello")
    chat = parse_chat({"messages": [{"role": "user", "content": "Hi"}], "return_token_ids": True}, MODEL,
                      _render, _tokenize)
    assert list(chat.grpc.token_ids.ids) == chat.prompt_token_ids == _tokenize("user: Hi\n")
    # without return_token_ids (or without a tokenizer) the router gets the text as before
    plain = parse_completion({"prompt": "Hello"}, MODEL, _tokenize)
    assert plain.grpc.text == "Hello" and plain.prompt_token_ids is None
    unknown = parse_completion({"prompt": "Hello", "return_token_ids": True}, MODEL)
    assert unknown.grpc.text == "Hello" and unknown.prompt_token_ids is None
    empty = parse_completion({"prompt": "", "return_token_ids": True}, MODEL, _tokenize)
    assert empty.grpc.WhichOneof("prompt") == "text"  # the router refuses it with its own message


def test_non_streamed_completion_and_chat_carry_the_ids_where_vllm_does():
    msgs = _messages()
    req = parse_completion({"prompt": [1, 2, 3], "return_token_ids": True}, MODEL)
    choice = response(req, _total(msgs), FMT)["choices"][0]
    assert choice["token_ids"] == [5, 6, 7, 8] and choice["prompt_token_ids"] == [1, 2, 3]
    chat = parse_chat({"messages": [{"role": "user", "content": "Hi"}], "return_token_ids": True}, MODEL,
                      _render, _tokenize)
    body = response(chat, _total(msgs), FMT)
    assert body["choices"][0]["token_ids"] == [5, 6, 7, 8]
    assert body["prompt_token_ids"] == _tokenize("user: Hi\n") and "prompt_token_ids" not in body["choices"][0]


@pytest.mark.parametrize("chat", [False, True])
def test_stream_chunks_carry_their_own_ids_and_the_first_the_prompts(chat):
    if chat:
        req = parse_chat({"messages": [{"role": "user", "content": "Hi"}], "return_token_ids": True,
                          "stream": True}, MODEL, _render, _tokenize)
    else:
        req = parse_completion({"prompt": [1, 2, 3], "return_token_ids": True, "stream": True}, MODEL)
    shaper = StreamShaper(req, FMT)
    chunks = [c for m in _messages() for c in shaper.chunks(m)]
    ids = [c["choices"][0]["token_ids"] for c in chunks]
    assert [t for x in ids for t in x] == [5, 6, 7, 8]
    assert [6] in ids  # a message with ids but no text still makes a chunk
    where = [c if chat else c["choices"][0] for c in chunks]
    assert where[0]["prompt_token_ids"] == req.prompt_token_ids is not None
    assert all("prompt_token_ids" not in w for w in where[1:])
    off = parse_completion({"prompt": [1], "stream": True}, MODEL)
    plain = [c for m in _messages() for c in StreamShaper(off, FMT).chunks(m)]
    assert all("token_ids" not in c["choices"][0] for c in plain)
    assert len(plain) == 3  # text "a", text "bc", the finish reason: as before
