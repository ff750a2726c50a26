"""OpenAI's response shapes: the router's `GenerateResponse`s -> a completion or chat completion
body, or the chunks of its event stream (chat's opening role, text, logprobs, the finish reason,
the usage), with logprobs as OpenAI lays them out. No I/O; the requests they answer are read
by router/openai_protocol.py.

With return_token_ids (vLLM's extension, in vLLM's places): each choice carries `token_ids` (a
stream chunk: that chunk's), and `prompt_token_ids` is on the completion's choice or at the top
level of a chat completion (a stream: on each choice's first chunk only).

Several choices (n, best_of, a list of prompts: router/openai_choices.py): answer index i * n + k
is choice k of prompt i; echo puts a completion's prompt text before its choices' text (a stream:
as each choice's first chunk).
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
    prompt_logprobs: list[gen.TokenLogprob] = field(default_factory=list)  # echo with logprobs
    total_completion_tokens: int = 0  # the router request's every choice (on its last message)

    def add(self, msg: gen.GenerateResponse) -> None:
        self.prompt_logprobs.extend(msg.prompt_logprobs)
        self.text += msg.text
        self.token_ids.extend(msg.token_ids)
        self.logprobs.extend(msg.logprobs)
        if msg.finish_reason:
            self.finish_reason = msg.finish_reason
            self.prompt_tokens = msg.usage.prompt_tokens
            self.completion_tokens = msg.usage.completion_tokens
            self.total_completion_tokens = msg.usage.total_completion_tokens

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

    def fresh(self) -> LogprobFormatter:
        """One for another choice (its own text offsets)."""
        return LogprobFormatter(self.token_text)

    def completion(self, lps: list[gen.TokenLogprob]) -> dict[str, Any]:
        tokens = [self.token_text(lp.token_id) for lp in lps]
        offsets = []
        for t in tokens:
            offsets.append(self.offset)
            self.offset += len(t)
        return {"tokens": tokens, "token_logprobs": [_lp(lp.logprob) for lp in lps],
                "top_logprobs": [{self.token_text(t.token_id): _lp(t.logprob) for t in lp.top} for lp in lps],
                "text_offset": offsets}

    def echoed(self, first_id: int | None, prompt: list[gen.TokenLogprob], lps: list[gen.TokenLogprob],
               ) -> dict[str, Any]:
        """Completions' logprobs with echo: the prompt's tokens first (the first one has no logprob:
        null, as in vLLM and OpenAI's legacy API), then the completion's."""
        head = self.completion([gen.TokenLogprob(token_id=first_id)] if first_id is not None else [])
        if first_id is not None:
            head["token_logprobs"], head["top_logprobs"] = [None], [None]
        rest = self.completion(list(prompt) + list(lps))
        return {k: head[k] + rest[k] for k in rest}

    def prompt(self, lps: list[gen.TokenLogprob], top: int) -> list[dict[str, Any] | None]:
        """vLLM's prompt_logprobs: null for the first prompt token, then per token {token id: {logprob,
        rank, decoded_token}} for the token itself and its `top` alternatives."""
        def entry(token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
            return {"logprob": _lp(logprob), "rank": rank, "decoded_token": self.token_text(token_id)}

        out: list[dict[str, Any] | None] = [None]
        for lp in lps:
            d = {str(lp.token_id): entry(lp.token_id, lp.logprob, lp.rank if lp.HasField("rank") else None)}
            for j, t in enumerate(lp.top[:top]):
                d.setdefault(str(t.token_id), entry(t.token_id, t.logprob, j + 1))
            out.append(d)
        return out

    def chat(self, lps: list[gen.TokenLogprob]) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            s = self.token_text(token_id)
            return {"token": s, "logprob": _lp(logprob), "bytes": list(s.encode("utf-8"))}

        content = [{**entry(lp.token_id, lp.logprob),
                    "top_logprobs": [entry(t.token_id, t.logprob) for t in lp.top]} for lp in lps]
        return {"content": content, "refusal": None}


def response(req: OpenAIRequest, out: Output, fmt: LogprobFormatter) -> dict[str, Any]:
    """The non-streaming response body of one choice."""
    return response_of(req, [(0, out)], fmt, out.usage())


def response_of(req: OpenAIRequest, outs: list[tuple[int, Output]], fmt: LogprobFormatter,
                usage: dict[str, int]) -> dict[str, Any]:
    """The non-streaming response body: the choices (index, output) and the usage."""
    choices = []
    for index, out in outs:
        choice: dict[str, Any] = {"index": index, "finish_reason": out.finish_reason, "logprobs": None}
        if req.chat:
            content, calls = _tool_calls(req, out.text)
            choice["message"] = {"role": "assistant", "content": content, "refusal": None}
            if calls:
                choice["message"]["tool_calls"] = calls
                if out.finish_reason == "stop":
                    choice["finish_reason"] = "tool_calls"
            if req.logprobs:
                choice["logprobs"] = fmt.fresh().chat(out.logprobs)
        else:
            choice["text"] = _echo(req, index) + out.text
            if req.logprobs and req.echo:
                k = req.grpc.sampling.logprobs  # prompt_logprobs may have asked for more alternatives
                echoed = [gen.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top=lp.top[:k])
                          for lp in out.prompt_logprobs]
                choice["logprobs"] = fmt.fresh().echoed(_first_id(req, index), echoed, out.logprobs)
            elif req.logprobs:
                choice["logprobs"] = fmt.fresh().completion(out.logprobs)
        if req.prompt_logprobs is not None and not req.chat:
            choice["prompt_logprobs"] = fmt.prompt(out.prompt_logprobs, req.prompt_logprobs)
        choices.append(choice)
    body = {"id": req.id, "object": "chat.completion" if req.chat else "text_completion",
            "created": req.created, "model": req.model, "choices": choices, "usage": usage,
            "system_fingerprint": None}
    if req.prompt_logprobs is not None and req.chat and outs:  # vLLM puts a chat's at the top level
        body["prompt_logprobs"] = fmt.prompt(outs[0][1].prompt_logprobs, req.prompt_logprobs)
    for k, (index, out) in enumerate(outs):
        _token_ids(req, body, k, index, out.token_ids, prompt=True)
    return body


def _tools(req: OpenAIRequest) -> Any:
    """The chat request's tools when the answer may hold calls (router/openai_tools.py), else None."""
    return req.tools if req.chat and req.tools is not None and req.tools.choice != "none" else None


def _tool_calls(req: OpenAIRequest, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A chat answer's (content, tool_calls); without tools: (text, [])."""
    tools = _tools(req)
    return tools.calls(text) if tools is not None else (text, [])


def _first_id(req: OpenAIRequest, index: int) -> int | None:
    ids = req.prompt_ids(index)
    return ids[0] if ids else None


def _echo(req: OpenAIRequest, index: int) -> str:
    return (req.prompts[index // req.n].text or "") if req.echo and req.prompts else ""


def chunk(req: OpenAIRequest, out: Output, fmt: LogprobFormatter, role: bool = False,
          prompt: bool = False, index: int = 0) -> dict[str, Any]:
    """One stream chunk with `out`'s text (and logprobs, finish reason, token ids) for choice
    `index`; `role`: the chat stream's first; `prompt`: the choice's first chunk (it carries
    prompt_token_ids)."""
    choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": out.finish_reason}
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
    _token_ids(req, body, 0, index, out.token_ids, prompt)
    return body


def _token_ids(req: OpenAIRequest, body: dict[str, Any], k: int, index: int, token_ids: list[int],
               prompt: bool) -> None:
    """return_token_ids: choice k's token ids and (`prompt`) its prompt's, where vLLM puts them."""
    if not req.return_token_ids:
        return
    choice = body["choices"][k]
    choice["token_ids"] = list(token_ids)
    if prompt:
        (body if req.chat else choice)["prompt_token_ids"] = req.prompt_ids(index)


def usage_chunk(req: OpenAIRequest, usage: dict[str, int]) -> dict[str, Any]:
    """stream_options.include_usage: the last chunk, with no choices and the usage."""
    body = _chunk_envelope(req, [])
    body["usage"] = usage
    return body


class StreamShaper:
    """The router's messages for choice `index` -> the stream's chunks: the chat stream opens with
    the assistant role (echo: a completion's with the prompt), each message with text (or logprobs;
    with return_token_ids, token ids) becomes a chunk, the finish reason gets a chunk of its own
    (the usage chunk, over every choice, is router/http_stream.py's).

    With tools (router/openai_tools.py), text that is or may become a tool call is held back: all of
    it for a forced call, and from a possible `<tool_call>` on for "auto". At the end the calls come
    as one delta (`tool_calls`, each with its index, id, name and complete arguments), or the text
    held back as content when it holds none. Logprobs come only with the content sent."""

    def __init__(self, req: OpenAIRequest, fmt: LogprobFormatter, index: int = 0) -> None:
        self.req, self.fmt, self.index = req, fmt, index
        self.total = Output()
        self._first = True
        self._tools = _tools(req)
        self._sent = 0  # characters of total.text sent as content (with tools)
        self._held = False  # a `<tool_call>` began: the rest waits for the end

    def chunks(self, msg: gen.GenerateResponse) -> list[dict[str, Any]]:
        req, out = self.req, []
        if req.chat and self._first:
            out.append(self._chunk(Output(), role=True))
        if self._first and (echo := _echo(req, self.index)):
            if req.logprobs:  # the echo chunk carries the prompt's logprobs
                body = self._chunk(Output(text=echo))
                body["choices"][0]["logprobs"] = self.fmt.echoed(_first_id(req, self.index), list(msg.prompt_logprobs), [])
                out.append(body)
            else:
                out.append(self._chunk(Output(text=echo)))
        self.total.add(msg)
        text = msg.text if self._tools is None else self._releasable()
        if text or (req.logprobs and msg.logprobs and self._tools is None) or (req.return_token_ids and msg.token_ids):
            out.append(self._chunk(Output(text=text, token_ids=list(msg.token_ids),
                                          logprobs=list(msg.logprobs) if text else [])))
        if msg.finish_reason:
            reason = msg.finish_reason
            if self._tools is not None:
                _, calls = self._tools.calls(self.total.text)
                if calls:
                    out.append(self._tool_chunk(calls))
                    reason = "tool_calls" if reason == "stop" else reason
                elif rest := self.total.text[self._sent:]:
                    out.append(self._chunk(Output(text=rest)))
            out.append(self._chunk(Output(finish_reason=reason)))
        return out

    def _chunk(self, out: Output, role: bool = False) -> dict[str, Any]:
        first, self._first = self._first, False
        return chunk(self.req, out, self.fmt, role=role, prompt=first, index=self.index)

    def _releasable(self) -> str:
        """With tools: the content that can be sent now (none for a forced call; for "auto", the
        text before anything that is or may grow into `<tool_call>`)."""
        from router.openai_tools import OPEN

        if self._tools.choice != "auto" or self._held:
            return ""
        text = self.total.text
        end = text.find(OPEN, self._sent)  # the text before _sent holds no tag (nor its start)
        self._held = end >= 0
        if end < 0:  # hold back a tail that may be the start of the tag
            end = next((i for i in range(max(self._sent, len(text) - len(OPEN) + 1), len(text))
                        if OPEN.startswith(text[i:])), len(text))
        out, self._sent = text[self._sent:end], end
        return out

    def _tool_chunk(self, calls: list[dict[str, Any]]) -> dict[str, Any]:
        body = self._chunk(Output())
        body["choices"][0]["delta"] = {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}
        return body


def _chunk_envelope(req: OpenAIRequest, choices: list[dict[str, Any]]) -> dict[str, Any]:
    body = {"id": req.id, "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": req.created, "model": req.model, "choices": choices, "system_fingerprint": None}
    if req.include_usage:
        body["usage"] = None
    return body
