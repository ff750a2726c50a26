"""OpenAI's response shapes: the router's `GenerateResponse`s -> a completion or chat completion
body, or the chunks of its event stream (chat's opening role, text, logprobs, the finish reason,
the usage), with logprobs as OpenAI lays them out. No I/O; the requests they answer are read
by router/openai_protocol.py.

With return_token_ids (vLLM's extension, in vLLM's places): each choice carries `token_ids` (a
stream chunk: that chunk's), and `prompt_token_ids` is on the completion's choice or at the top
level of a chat completion (a stream: on its first chunk only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from proto import generate_pb2 as gen
from router.openai_protocol import OpenAIRequest


@dataclass
class Output:
    """What the router sent back, accumulated (non-streaming) or for one chunk (streaming)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[gen.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, msg: gen.GenerateResponse) -> None:
        self.text += msg.text
        self.token_ids.extend(msg.token_ids)
        self.logprobs.extend(msg.logprobs)
        if msg.finish_reason:
            self.finish_reason = msg.finish_reason
            self.prompt_tokens = msg.usage.prompt_tokens
            self.completion_tokens = msg.usage.completion_tokens

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def _lp(x: float) -> float:
    return max(x, -9999.0)  # JSON has no -inf


class LogprobFormatter:
    """Token logprobs in OpenAI's shapes; token strings come from `token_text(id)`."""

    def __init__(self, token_text: Callable[[int], str]) -> None:
        self.token_text = token_text
        self.offset = 0  # completions' text_offset runs on across stream chunks

    def completion(self, lps: list[gen.TokenLogprob]) -> dict[str, Any]:
        tokens = [self.token_text(lp.token_id) for lp in lps]
        offsets = []
        for t in tokens:
            offsets.append(self.offset)
            self.offset += len(t)
        return {"tokens": tokens, "token_logprobs": [_lp(lp.logprob) for lp in lps],
                "top_logprobs": [{self.token_text(t.token_id): _lp(t.logprob) for t in lp.top} for lp in lps],
                "text_offset": offsets}

    def chat(self, lps: list[gen.TokenLogprob]) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            s = self.token_text(token_id)
            return {"token": s, "logprob": _lp(logprob), "bytes": list(s.encode("utf-8"))}

        content = [{**entry(lp.token_id, lp.logprob),
                    "top_logprobs": [entry(t.token_id, t.logprob) for t in lp.top]} for lp in lps]
        return {"content": content, "refusal": None}


def response(req: OpenAIRequest, out: Output, fmt: LogprobFormatter) -> dict[str, Any]:
    """The non-streaming response body."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": out.finish_reason, "logprobs": None}
    if req.chat:
        choice["message"] = {"role": "assistant", "content": out.text, "refusal": None}
        if req.logprobs:
            choice["logprobs"] = fmt.chat(out.logprobs)
    else:
        choice["text"] = out.text
        if req.logprobs:
            choice["logprobs"] = fmt.completion(out.logprobs)
    body = {"id": req.id, "object": "chat.completion" if req.chat else "text_completion",
            "created": req.created, "model": req.model, "choices": [choice], "usage": out.usage(),
            "system_fingerprint": None}
    _token_ids(req, body, out.token_ids, prompt=True)
    return body


def chunk(req: OpenAIRequest, out: Output, fmt: LogprobFormatter, role: bool = False,
          prompt: bool = False) -> dict[str, Any]:
    """One stream chunk with `out`'s text (and logprobs, finish reason, token ids); `role`: the chat
    stream's first; `prompt`: the stream's first chunk (it carries prompt_token_ids)."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": out.finish_reason}
    if req.chat:
        choice["delta"] = {"role": "assistant", "content": out.text} if role else (
            {"content": out.text} if out.text or not out.finish_reason else {})
        if req.logprobs and out.logprobs:
            choice["logprobs"] = fmt.chat(out.logprobs)
    else:
        choice["text"] = out.text
        if req.logprobs and out.logprobs:
            choice["logprobs"] = fmt.completion(out.logprobs)
    body = _chunk_envelope(req, [choice])
    _token_ids(req, body, out.token_ids, prompt)
    return body


def _token_ids(req: OpenAIRequest, body: dict[str, Any], token_ids: list[int], prompt: bool) -> None:
    """return_token_ids: the choice's token ids and (`prompt`) the prompt's, where vLLM puts them."""
    if not req.return_token_ids:
        return
    choice = body["choices"][0]
    choice["token_ids"] = list(token_ids)
    if prompt:
        (body if req.chat else choice)["prompt_token_ids"] = req.prompt_token_ids


def usage_chunk(req: OpenAIRequest, out: Output) -> dict[str, Any]:
    """stream_options.include_usage: the last chunk, with no choices and the usage."""
    body = _chunk_envelope(req, [])
    body["usage"] = out.usage()
    return body


class StreamShaper:
    """The router's messages -> the stream's chunks: the chat stream opens with the assistant role,
    each message with text (or logprobs; with return_token_ids, token ids) becomes a chunk, the finish
    reason gets a chunk of its own, then (stream_options.include_usage) the usage chunk."""

    def __init__(self, req: OpenAIRequest, fmt: LogprobFormatter) -> None:
        self.req, self.fmt = req, fmt
        self.total = Output()
        self._first = True

    def chunks(self, msg: gen.GenerateResponse) -> list[dict[str, Any]]:
        req, out = self.req, []
        if req.chat and self._first:
            out.append(self._chunk(Output(), role=True))
        self.total.add(msg)
        if msg.text or (req.logprobs and msg.logprobs) or (req.return_token_ids and msg.token_ids):
            out.append(self._chunk(Output(text=msg.text, token_ids=list(msg.token_ids),
                                          logprobs=list(msg.logprobs))))
        if msg.finish_reason:
            out.append(self._chunk(Output(finish_reason=msg.finish_reason)))
            if req.include_usage:
                out.append(usage_chunk(req, self.total))
        return out

    def _chunk(self, out: Output, role: bool = False) -> dict[str, Any]:
        first, self._first = self._first, False
        return chunk(self.req, out, self.fmt, role=role, prompt=first)


def _chunk_envelope(req: OpenAIRequest, choices: list[dict[str, Any]]) -> dict[str, Any]:
    body = {"id": req.id, "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": req.created, "model": req.model, "choices": choices, "system_fingerprint": None}
    if req.include_usage:
        body["usage"] = None
    return body
