"""OpenAI's request schema and errors: a request body -> a `GenerateRequest` (or an `ApiError`
naming the field), and the router's gRPC status -> the HTTP error in OpenAI's shape, naming the
field where the router's message names one. router/openai_responses.py shapes the answers.

Pure functions over plain JSON values, no I/O: `router/http_api.py` does the HTTP and the gRPC.
Fields are checked by hand (not by a pydantic model) so that every refusal is a 400 in OpenAI's
error shape with `param` set to the field, never a 422.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from proto import generate_pb2 as gen

# Accepted and ignored: they do not change what is generated.
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key",
                            "safety_identifier", "parallel_tool_calls"})


def _zero(v: Any) -> bool:
    return v is None or (type(v) in (int, float) and v == 0)


# Accepted only at their neutral value (anything else would be silently ignored, so it is refused).
NEUTRAL_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tools": (lambda v: v is None or v == [], "null or []"),
    "functions": (lambda v: v is None or v == [], "null or []"),
    "tool_choice": (lambda v: v is None or v == "none", "null or 'none'"),
    "function_call": (lambda v: v is None or v == "none", "null or 'none'"),
    "response_format": (lambda v: v is None or v == {"type": "text"}, "null or {'type': 'text'}"),
    "modalities": (lambda v: v is None or v == ["text"], "null or ['text']"),
    "audio": (lambda v: v is None, "null"),
    "prediction": (lambda v: v is None, "null"),
    "web_search_options": (lambda v: v is None, "null"),
    "reasoning_effort": (lambda v: v is None, "null"),
    "echo": (lambda v: v is None or v is False, "false"),
    "suffix": (lambda v: v is None or v == "", "null"),
    "best_of": (lambda v: v is None or (type(v) is int and v == 1), "1"),
    "n": (lambda v: v is None or (type(v) is int and v == 1), "1 (one choice per request)"),
}

COMMON_FIELDS = frozenset({"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed",
                           "stop", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias",
                           # vLLM's extensions
                           "top_k", "ignore_eos", "stop_token_ids", "return_token_ids", "repetition_penalty",
                           "min_tokens"})
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}
CHAT_ROLES = ("system", "developer", "user", "assistant")
_U32, _U64 = 2**32 - 1, 2**64 - 1


@dataclass(eq=False)
class ApiError(Exception):
    """An error in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    status: int
    message: str
    param: str | None = None
    type: str = "invalid_request_error"
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, f"{param}: {message}" if param else message, param, code=code)


@dataclass
class OpenAIRequest:
    """A parsed request: the gRPC request to send plus what shaping the answer needs."""

    chat: bool
    grpc: gen.GenerateRequest
    model: str
    id: str
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False  # return logprobs (completions: top-N dicts; chat: content entries)
    created: int = field(default_factory=lambda: int(time.time()))
    max_tokens_field: str = "max_tokens"  # which OpenAI name the user gave max_tokens under
    return_token_ids: bool = False  # the answer carries the token ids (vLLM's extension)
    prompt_token_ids: list[int] | None = None  # the prompt's ids, when known here (None: not known)


# ---------------------------------------------------------------------------------------------- requests
Tokenize = Callable[[str], list[int]]


def parse_completion(body: Any, served_model: str, tokenize: Tokenize | None = None) -> OpenAIRequest:
    """A /v1/completions body -> the request to send. Raises ApiError (400) naming the field.
    `tokenize`: the router's tokenizer, for the prompt_token_ids of a text prompt (return_token_ids)."""
    body = _check_fields(body, COMPLETION_FIELDS)
    req = _common(body, served_model, chat=False)
    if "prompt" not in body or body["prompt"] is None:
        raise bad("prompt", "required")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # one prompt in a batch of one
    if isinstance(p, str):
        _text_prompt(req, p, tokenize)
    elif isinstance(p, list) and p and all(type(t) is int and 0 <= t <= _U32 for t in p):
        req.grpc.token_ids.ids.extend(p)
        req.prompt_token_ids = list(p)
    elif isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise bad("prompt", f"a batch of {len(p)} prompts is not supported; send one prompt per request")
    else:
        raise bad("prompt", "expected a string, a list with one string, or a non-empty list of token ids "
                            "(integers >= 0)")
    lp = body.get("logprobs")
    if lp is not None and lp is not False:  # false: some clients' way of saying "off"
        req.grpc.sampling.logprobs = _int("logprobs", lp, 0, 20)
        req.logprobs = True
    return req


def parse_chat(body: Any, served_model: str, render: Callable[[list[dict[str, str]]], str],
               tokenize: Tokenize | None = None) -> OpenAIRequest:
    """A /v1/chat/completions body -> the request to send; `render` applies the chat template,
    `tokenize` as for parse_completion."""
    body = _check_fields(body, CHAT_FIELDS)
    req = _common(body, served_model, chat=True)
    if body.get("max_completion_tokens") is not None:
        req.grpc.sampling.max_tokens = _int("max_completion_tokens", body["max_completion_tokens"], 1, _U32)
        req.max_tokens_field = "max_completion_tokens"
    if "messages" not in body or body["messages"] is None:
        raise bad("messages", "required")
    _text_prompt(req, render(_messages(body["messages"])), tokenize)
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise bad("logprobs", f"expected true or false, got {lp!r}")
    if top is not None:
        if not lp:
            raise bad("top_logprobs", "needs logprobs: true")
        req.grpc.sampling.logprobs = _int("top_logprobs", top, 0, 20)
    elif lp:
        req.grpc.sampling.logprobs = 0
    req.logprobs = bool(lp)
    return req


def _text_prompt(req: OpenAIRequest, text: str, tokenize: Tokenize | None) -> None:
    """A text prompt. With return_token_ids and a tokenizer it is tokenized here and sent as token ids,
    so the prompt_token_ids returned are the ones generated from; an empty text goes on as text (the
    router refuses it)."""
    ids = tokenize(text) if req.return_token_ids and tokenize is not None and text else None
    if ids:
        req.grpc.token_ids.ids.extend(ids)
        req.prompt_token_ids = list(ids)
    else:
        req.grpc.text = text


def _check_fields(body: Any, known: frozenset[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object, got {type(body).__name__}")
    for name, value in body.items():
        if name in known or name in IGNORED_FIELDS:
            continue
        if name in NEUTRAL_FIELDS:
            ok, allowed = NEUTRAL_FIELDS[name]
            if not ok(value):
                raise bad(name, f"{value!r} is not supported by this server; allowed: {allowed}")
            continue
        raise bad(name, "unrecognized request argument")
    return body


def _common(body: dict[str, Any], served_model: str, chat: bool) -> OpenAIRequest:
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise bad("model", f"expected a model name (string), got {model!r}")
    grpc_req = gen.GenerateRequest(model=model or "")
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    grpc_req.request_id = rid
    req = OpenAIRequest(chat=chat, grpc=grpc_req, model=model or served_model, id=rid)
    s = grpc_req.sampling
    if body.get("max_tokens") is not None:
        s.max_tokens = _int("max_tokens", body["max_tokens"], 1, _U32)
    for name in ("temperature", "top_p"):
        if body.get(name) is not None:
            setattr(s, name, _float(name, body[name]))
    if body.get("top_k") is not None:
        s.top_k = max(0, _int("top_k", body["top_k"], -1, 2**31 - 1))  # -1 (vLLM) and 0: disabled
    if body.get("seed") is not None:
        s.seed = _int("seed", body["seed"], 0, _U64)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop):
            raise bad("stop", "expected a non-empty string or a list of non-empty strings")
        s.stop.extend(stop)
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(type(t) is int and 0 <= t <= _U32 for t in ids):
            raise bad("stop_token_ids", "expected a list of token ids (integers >= 0)")
        s.stop_token_ids.extend(ids)
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        if body.get(name) is not None:
            setattr(s, name, _float(name, body[name]))
    if body.get("min_tokens") is not None:
        s.min_tokens = _int("min_tokens", body["min_tokens"], 0, _U32)
    if body.get("logit_bias") is not None:
        s.logit_bias.update(_logit_bias(body["logit_bias"]))
    if body.get("ignore_eos") is not None:
        s.ignore_eos = _bool("ignore_eos", body["ignore_eos"])
    if body.get("return_token_ids") is not None:
        req.return_token_ids = _bool("return_token_ids", body["return_token_ids"])
    req.stream = _bool("stream", body["stream"]) if body.get("stream") is not None else False
    opts = body.get("stream_options")
    if opts is not None:
        if not req.stream:
            raise bad("stream_options", "only allowed with stream: true")
        if not isinstance(opts, dict) or any(k not in ("include_usage", "include_obfuscation") for k in opts):
            raise bad("stream_options", "expected an object with include_usage (true or false)")
        req.include_usage = _bool("stream_options.include_usage", opts.get("include_usage", False))
    return req


def _messages(v: Any) -> list[dict[str, str]]:
    if not isinstance(v, list) or not v:
        raise bad("messages", "expected a non-empty list of messages")
    out = []
    for i, m in enumerate(v):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(p, "expected an object with role and content")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"{p}.role", f"{role!r} is not supported; allowed: {', '.join(CHAT_ROLES)}")
        if m.get("tool_calls") or m.get("function_call"):
            raise bad(f"{p}.tool_calls", "tool calls are not supported by this server")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
                if not isinstance(text, str):
                    raise bad(f"{p}.content[{j}]", "only text parts ({'type': 'text', 'text': ...}) are "
                                                   "supported")
                parts.append(text)
            content = "".join(parts)
        elif not isinstance(content, str):
            raise bad(f"{p}.content", "expected a string or a list of text parts")
        out.append({"role": role, "content": content})
    return out


def _int(name: str, v: Any, lo: int, hi: int) -> int:
    if type(v) is float and v.is_integer():
        v = int(v)
    if type(v) is not int or not lo <= v <= hi:
        raise bad(name, f"expected an integer in [{lo}, {hi}], got {v!r}")
    return v


def _float(name: str, v: Any) -> float:
    if type(v) not in (int, float) or not math.isfinite(v) or abs(v) > 3.4e38:
        raise bad(name, f"expected a finite number, got {v!r}")
    return float(v)


def _logit_bias(v: Any) -> dict[int, float]:
    """OpenAI's logit_bias: token ids as JSON object keys (strings), biases in [-100, 100]."""
    if not isinstance(v, dict):
        raise bad("logit_bias", f"expected an object mapping token ids to biases, got {type(v).__name__}")
    out = {}
    for k, bias in v.items():
        tok = k if type(k) is int else int(k) if isinstance(k, str) and k.isascii() and k.isdigit() else None
        if tok is None or tok > _U32:
            raise bad("logit_bias", f"key {k!r} is not a token id (an integer >= 0)")
        out[tok] = _float("logit_bias", bias)
    return out


def _bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise bad(name, f"expected true or false, got {v!r}")
    return v


# ---------------------------------------------------------------------------------------------- gRPC errors
_GRPC_STATUS: dict[str, tuple[int, str, str | None]] = {
    "INVALID_ARGUMENT": (400, "invalid_request_error", None),
    "OUT_OF_RANGE": (400, "invalid_request_error", None),
    "UNAUTHENTICATED": (401, "authentication_error", "invalid_api_key"),
    "PERMISSION_DENIED": (403, "permission_error", None),
    "NOT_FOUND": (404, "invalid_request_error", "model_not_found"),
    "ALREADY_EXISTS": (409, "invalid_request_error", None),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error", "resource_exhausted"),
    "UNAVAILABLE": (503, "server_error", "unavailable"),
    "DEADLINE_EXCEEDED": (504, "server_error", "timeout"),
    # aborted on purpose (the router's Abort, by its id): not a server fault; 499 as for a client that left
    "CANCELLED": (499, "invalid_request_error", "request_cancelled"),
}
_SAMPLING_NAMES = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "stop",
                   "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                   "min_tokens")


def grpc_error(code: str, details: str, req: OpenAIRequest | None = None,
               retry_after_s: float | None = None) -> ApiError:
    """The router's gRPC status (by name, e.g. "INVALID_ARGUMENT") -> the HTTP error, keeping its
    message and naming the OpenAI field where the message names one; a 429 carries Retry-After
    (whole seconds, at least 1) from the router's hint."""
    status, kind, err_code = _GRPC_STATUS.get(code, (500, "server_error", None))
    err = ApiError(status, details or code, type=kind, code=err_code)
    if code == "NOT_FOUND":
        err.param = "model"
    elif status == 400:
        err.param = _param_of(details, req)
        if "max_model_len" in details:
            err.code = "context_length_exceeded"
    elif status == 429:
        err.headers["Retry-After"] = str(max(1, math.ceil(retry_after_s or 1.0)))
    return err


def _param_of(details: str, req: OpenAIRequest | None) -> str | None:
    chat = req is not None and req.chat
    if details.startswith("prompt"):
        return "messages" if chat else "prompt"
    if details.startswith("sampling.stop:"):
        return "stop"
    if details.startswith("sampling: "):
        rest = details[len("sampling: "):]
        name = next((n for n in _SAMPLING_NAMES if rest.startswith(n)), None)
        if name == "max_tokens" and req is not None:
            return req.max_tokens_field
        if name == "logprobs" and chat:
            return "top_logprobs"
        return name
    return None
