"""One OpenAI request -> its router requests (one per prompt, carrying n and best_of) and their outputs
-> the answer's choices (router/openai_choices.py, router/openai_responses.py). No servers."""

from __future__ import annotations

import pytest

from proto import generate_pb2 as gen
from router.openai_choices import prompt_calls, slot, usage
from router.openai_protocol import parse_chat, parse_completion
from router.openai_responses import LogprobFormatter, Output, StreamShaper, response_of

MODEL = "builtin:tiny-llama"
FMT = LogprobFormatter(lambda i: f"t{i}")


def _out(text: str, logprobs: list[float], prompt_tokens: int = 3, total: int = 0) -> Output:
    out = Output()
    out.add(gen.GenerateResponse(text=text, token_ids=list(range(len(logprobs))), finish_reason="length",
                                 logprobs=[gen.TokenLogprob(token_id=i, logprob=x) for i, x in enumerate(logprobs)],
                                 usage=gen.Usage(prompt_tokens=prompt_tokens, completion_tokens=len(logprobs),
                                                 total_completion_tokens=total)))
    return out


def test_one_prompt_one_choice_is_the_request_itself():
    req = parse_completion({"prompt": "Hi", "seed": 7}, MODEL)
    (call,) = prompt_calls(req)
    assert call.grpc == req.grpc and call.prompt == 0


def test_a_list_of_prompts_is_one_router_request_each_carrying_n():
    req = parse_completion({"prompt": ["a", [5, 6]], "n": 2, "seed": 2**64 - 1, "max_tokens": 3}, MODEL)
    calls = prompt_calls(req)
    assert [c.prompt for c in calls] == [0, 1]
    assert [c.grpc.request_id for c in calls] == [f"{req.id}-0", f"{req.id}-1"]
    assert all(c.grpc.sampling.n == 2 and not c.grpc.sampling.HasField("best_of") for c in calls)
    assert all(c.grpc.sampling.seed == 2**64 - 1 for c in calls)  # the router adds k per choice
    assert [c.grpc.WhichOneof("prompt") for c in calls] == ["text", "token_ids"]
    assert calls[0].grpc.text == "a" and list(calls[1].grpc.token_ids.ids) == [5, 6]
    # choice k of prompt i is answer index i * n + k
    assert [slot(req, i, gen.GenerateResponse(index=k)) for i in range(2) for k in range(2)] == [0, 1, 2, 3]


def test_best_of_goes_to_the_router_and_usage_counts_every_choice_generated():
    req = parse_completion({"prompt": ["a", "b"], "n": 1, "best_of": 3}, MODEL)
    calls = prompt_calls(req)
    assert [(c.grpc.sampling.HasField("n"), c.grpc.sampling.best_of) for c in calls] == [(False, 3)] * 2
    outs = [_out("y", [-0.5], total=6), _out("q", [-2.0], total=2)]  # the router sent the best of each
    assert usage(req, outs) == {"prompt_tokens": 6, "completion_tokens": 8, "total_tokens": 14}
    body = response_of(req, list(enumerate(outs)), FMT, usage(req, outs))
    assert [c["text"] for c in body["choices"]] == ["y", "q"] and body["choices"][0]["logprobs"] is None


def test_n_choices_answer_in_order_and_echo_prefixes_each_with_its_prompt():
    req = parse_completion({"prompt": ["a", "b"], "n": 2, "echo": True, "logprobs": None}, MODEL)
    outs = [_out(t, [-1.0]) for t in "wxyz"]
    body = response_of(req, list(enumerate(outs)), FMT, usage(req, outs))
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "aw"), (1, "ax"), (2, "by"), (3, "bz")]
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 4, "total_tokens": 10}


def test_chat_n_and_each_streamed_choice_opens_with_its_role():
    req = parse_chat({"messages": [{"role": "user", "content": "Hi"}], "n": 2, "stream": True}, MODEL,
                     lambda m: "Hi")
    assert prompt_calls(req)[0].grpc.sampling.n == 2
    for index in (0, 1):
        chunks = StreamShaper(req, FMT, index).chunks(gen.GenerateResponse(text="o", finish_reason="stop"))
        assert [c["choices"][0]["index"] for c in chunks] == [index] * 3
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"


def test_a_streamed_echo_is_the_choice_first_chunk():
    req = parse_completion({"prompt": "Say", "echo": True, "stream": True}, MODEL)
    chunks = StreamShaper(req, FMT).chunks(gen.GenerateResponse(text=" hi", finish_reason="length"))
    assert [c["choices"][0]["text"] for c in chunks] == ["Say", " hi", ""]
