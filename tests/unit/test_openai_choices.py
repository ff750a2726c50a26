"""One OpenAI request -> its router requests (a list of prompts, n, best_of, echo) and their outputs
-> the answer's choices (router/openai_choices.py, router/openai_responses.py). No servers."""

from __future__ import annotations

import pytest

from proto import generate_pb2 as gen
from router.openai_choices import answer_choices, choice_calls, cumulative_logprob, usage
from router.openai_protocol import parse_chat, parse_completion
from router.openai_responses import LogprobFormatter, Output, StreamShaper, response_of

MODEL = "builtin:tiny-llama"
FMT = LogprobFormatter(lambda i: f"t{i}")


def _out(text: str, logprobs: list[float], prompt_tokens: int = 3) -> Output:
    out = Output()
    out.add(gen.GenerateResponse(text=text, token_ids=list(range(len(logprobs))), finish_reason="length",
                                 logprobs=[gen.TokenLogprob(token_id=i, logprob=x) for i, x in enumerate(logprobs)],
                                 usage=gen.Usage(prompt_tokens=prompt_tokens, completion_tokens=len(logprobs))))
    return out


def test_one_prompt_one_choice_is_the_request_itself():
    req = parse_completion({"prompt": "Hi", "seed": 7}, MODEL)
    (call,) = choice_calls(req)
    assert call.grpc == req.grpc and call.leader and call.slot == 0


def test_a_list_of_prompts_times_n_numbers_choices_prompt_major_with_distinct_ids_and_seeds():
    req = parse_completion({"prompt": ["a", [5, 6]], "n": 2, "seed": 2**64 - 1, "max_tokens": 3}, MODEL)
    calls = choice_calls(req)
    assert [(c.slot, c.prompt, c.leader) for c in calls] == [(0, 0, True), (1, 0, False), (2, 1, True),
                                                            (3, 1, False)]
    assert [c.grpc.request_id for c in calls] == [f"{req.id}-{i}-{k}" for i in range(2) for k in range(2)]
    assert [c.grpc.sampling.seed for c in calls] == [2**64 - 1, 0] * 2  # seed + k, wrapped
    assert [c.grpc.WhichOneof("prompt") for c in calls] == ["text", "text", "token_ids", "token_ids"]
    assert calls[0].grpc.text == "a" and list(calls[3].grpc.token_ids.ids) == [5, 6]
    assert all(c.grpc.sampling.max_tokens == 3 and not c.grpc.sampling.HasField("logprobs") for c in calls)


def test_best_of_asks_for_the_sampled_logprobs_and_keeps_the_n_best_per_prompt():
    req = parse_completion({"prompt": ["a", "b"], "n": 1, "best_of": 3}, MODEL)
    calls = choice_calls(req)
    assert len(calls) == 6 and all(c.grpc.sampling.logprobs == 0 for c in calls)
    outs = [_out("x", [-1.0, -1.0]), _out("y", [-0.5]), _out("z", [-0.5, -0.1]),
            _out("p", [-3.0]), _out("q", [-2.0]), _out("r", [-2.0])]
    assert cumulative_logprob(outs[2]) == pytest.approx(-0.6)
    assert [(i, o.text) for i, o in answer_choices(req, outs)] == [(0, "y"), (1, "q")]  # ties: the first
    assert usage(req, outs) == {"prompt_tokens": 6, "completion_tokens": 8, "total_tokens": 14}
    body = response_of(req, answer_choices(req, outs), FMT, usage(req, outs))
    assert [c["text"] for c in body["choices"]] == ["y", "q"] and body["choices"][0]["logprobs"] is None


def test_n_choices_answer_in_order_and_echo_prefixes_each_with_its_prompt():
    req = parse_completion({"prompt": ["a", "b"], "n": 2, "echo": True, "logprobs": None}, MODEL)
    outs = [_out(t, [-1.0]) for t in "wxyz"]
    body = response_of(req, answer_choices(req, outs), FMT, usage(req, outs))
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "aw"), (1, "ax"), (2, "by"), (3, "bz")]
    assert body["usage"]["prompt_tokens"] == 6


def test_chat_n_and_each_streamed_choice_opens_with_its_role():
    req = parse_chat({"messages": [{"role": "user", "content": "Hi"}], "n": 2, "stream": True}, MODEL,
                     lambda m: "Hi")
    assert len(choice_calls(req)) == 2
    for index in (0, 1):
        chunks = StreamShaper(req, FMT, index).chunks(gen.GenerateResponse(text="o", finish_reason="stop"))
        assert [c["choices"][0]["index"] for c in chunks] == [index] * 3
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"


def test_a_streamed_echo_is_the_choice_first_chunk():
    req = parse_completion({"prompt": "Say", "echo": True, "stream": True}, MODEL)
    chunks = StreamShaper(req, FMT).chunks(gen.GenerateResponse(text=" hi", finish_reason="length"))
    assert [c["choices"][0]["text"] for c in chunks] == ["Say", " hi", ""]
