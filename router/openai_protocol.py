"""OpenAI's request schema and errors: a request body -> a `GenerateRequest` (or an `ApiError`
naming the field), and the router's gRPC status -> the HTTP error in OpenAI's shape, naming the
field where the router's message names one. router/openai_responses.py shapes the answers.

Pure functions over plain JSON values, no I/O: `router/http_api.py` does the HTTP and the gRPC.
Fields are checked by hand (not by a pydantic model) so that every refusal is a 400 in OpenAI's
error shape with `param` set to the field, never a 422.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import GUIDED_KINDS
from proto import generate_pb2 as gen

# Accepted and ignored: they do not change what is generated.
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key",
                            "safety_identifier"})


def _zero(v: Any) -> bool:
    return v is None or (type(v) in (int, float) and v == 0)


# Accepted only at their neutral value (anything else would be silently ignored, so it is refused).
NEUTRAL_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "functions": (lambda v: v is None or v == [], "null or []"),
    "function_call": (lambda v: v is None or v == "none", "null or 'none'"),
    "modalities": (lambda v: v is None or v == ["text"], "null or ['text']"),
    "audio": (lambda v: v is None, "null"),
    "prediction": (lambda v: v is None, "null"),
    "web_search_options": (lambda v: v is None, "null"),
    "reasoning_effort": (lambda v: v is None, "null"),
    "suffix": (lambda v: v is None or v == "", "null"),
}

COMMON_FIELDS = frozenset({"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed",
                           "stop", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias",
                           # vLLM's extensions
                           "top_k", "ignore_eos", "stop_token_ids", "return_token_ids", "repetition_penalty",
                           "min_tokens", "n", "prompt_logprobs",
                           # structured output: OpenAI's, vLLM's, and vLLM's older names
                           "response_format", "structured_outputs", "guided_json", "guided_regex",
                           "guided_choice", "guided_grammar"})
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "best_of", "echo"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                               "parallel_tool_calls"}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
_U32, _U64 = 2**32 - 1, 2**64 - 1
MAX_CHOICES = 128  # router requests one HTTP request may become: prompts x max(n, best_of)


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
class Prompt:
    """One prompt: its text, or its token ids (both when a text was tokenized here; the ids are sent)."""

    text: str | None = None
    ids: list[int] | None = None

    def set_on(self, g: gen.GenerateRequest) -> None:
        if self.ids is not None:
            g.token_ids.ids[:] = self.ids
        else:
            g.text = self.text or ""


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
    prompts: list[Prompt] = field(default_factory=list)  # every prompt (grpc carries the first)
    n: int = 1  # choices returned per prompt
    best_of: int = 1  # choices generated per prompt, the n of highest cumulative logprob returned
    echo: bool = False  # completions: each choice's text starts with its prompt
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: the prompt's logprobs with this many top
    guided_field: str | None = None  # the field that set a structured-output constraint
    tools: Any = None  # chat: router.openai_tools.Tools when the request gives tools

    @property
    def prompt_token_ids(self) -> list[int] | None:
        """The first prompt's ids, when known here (None: not known)."""
        return self.prompts[0].ids if self.prompts else None

    def prompt_ids(self, index: int) -> list[int] | None:
        """The ids of answer choice `index`'s prompt, when known here."""
        return self.prompts[index // self.n].ids

    def set_prompts(self, prompts: list[Prompt]) -> None:
        """The request's prompts; the gRPC template carries the first."""
        self.prompts = prompts
        prompts[0].set_on(self.grpc)


# ---------------------------------------------------------------------------------------------- requests
Tokenize = Callable[[str], list[int]]


def parse_completion(body: Any, served_model: str, tokenize: Tokenize | None = None) -> OpenAIRequest:
    """A /v1/completions body -> the request to send. Raises ApiError (400) naming the field.
    `tokenize`: the router's tokenizer, for the prompt_token_ids of a text prompt (return_token_ids)."""
    body = _check_fields(body, COMPLETION_FIELDS)
    req = _common(body, served_model, chat=False)
    if "prompt" not in body or body["prompt"] is None:
        raise bad("prompt", "required")
    lp = body.get("logprobs")
    if lp is not None and lp is not False:  # false: some clients' way of saying "off"
        req.grpc.sampling.logprobs = _int("logprobs", lp, 0, 20)
        req.logprobs = True
    if body.get("best_of") is not None:
        req.best_of = _int("best_of", body["best_of"], 1, MAX_CHOICES)
        if req.best_of < req.n:
            raise bad("best_of", f"must be >= n ({req.n}), got {req.best_of}")
        if req.stream and req.best_of > req.n:
            raise bad("best_of", "cannot be more than n with stream: true (the best are known only at the end)")
    if body.get("echo") is not None:
        req.echo = _bool("echo", body["echo"])
    if req.echo and req.logprobs:  # the prompt's logprobs too: its tokens must be known here
        req.grpc.sampling.prompt_logprobs = max(req.grpc.sampling.logprobs, req.prompt_logprobs or 0)
    p = body["prompt"]
    batch = p if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p) else [p]
    req.set_prompts([_prompt(req, x, tokenize, f"prompt[{i}]" if len(batch) > 1 else "prompt")
                     for i, x in enumerate(batch)])
    req.best_of = max(req.best_of, req.n)
    if len(req.prompts) * req.best_of > MAX_CHOICES:
        raise bad("prompt", f"{len(req.prompts)} prompts x {req.best_of} choices each is more than "
                            f"{MAX_CHOICES} generations in one request")
    return req


def _prompt(req: OpenAIRequest, p: Any, tokenize: Tokenize | None, name: str) -> Prompt:
    if isinstance(p, str):
        return _text_prompt(req, p, tokenize)
    if isinstance(p, list) and p and all(type(t) is int and 0 <= t <= _U32 for t in p):
        return Prompt(ids=list(p))
    raise bad(name, "expected a string, a non-empty list of token ids (integers >= 0), or a list of those")


def parse_chat(body: Any, served_model: str, render: Callable[..., str],
               tokenize: Tokenize | None = None) -> OpenAIRequest:
    """A /v1/chat/completions body -> the request to send; `render(messages[, tools])` applies the
    chat template, `tokenize` as for parse_completion."""
    body = _check_fields(body, CHAT_FIELDS)
    req = _common(body, served_model, chat=True)
    if body.get("max_completion_tokens") is not None:
        req.grpc.sampling.max_tokens = _int("max_completion_tokens", body["max_completion_tokens"], 1, _U32)
        req.max_tokens_field = "max_completion_tokens"
    if "messages" not in body or body["messages"] is None:
        raise bad("messages", "required")
    from router.openai_tools import parse_tools  # it uses this module's errors

    req.tools = parse_tools(body)
    if req.tools is not None and (forced := req.tools.constraint()) is not None:
        if req.guided_field is not None:
            raise bad("tool_choice", f"a forced tool call cannot be combined with {req.guided_field}")
        req.guided_field = "tool_choice"
        req.grpc.sampling.guided.kind, req.grpc.sampling.guided.spec = forced
    msgs = chat_messages(body["messages"])
    req.set_prompts([_text_prompt(req, render(msgs, req.tools.tools) if req.tools is not None else render(msgs),
                                  tokenize)])
    req.best_of = req.n
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


def _text_prompt(req: OpenAIRequest, text: str, tokenize: Tokenize | None) -> Prompt:
    """A text prompt. With return_token_ids (or echo with prompt logprobs, which need its first token)
    and a tokenizer it is tokenized here and sent as token ids, so the ids returned are the ones
    generated from; an empty text goes on as text (the router refuses it)."""
    known = req.return_token_ids or req.grpc.sampling.HasField("prompt_logprobs")
    ids = tokenize(text) if known and tokenize is not None and text else None
    return Prompt(text=text, ids=list(ids) if ids else None)


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
    if body.get("n") is not None:
        req.n = _int("n", body["n"], 1, MAX_CHOICES)
    guided = _guided(body)
    if guided is not None:
        req.guided_field, (s.guided.kind, s.guided.spec) = guided[0], guided[1:]
    req.stream = _bool("stream", body["stream"]) if body.get("stream") is not None else False
    opts = body.get("stream_options")
    if opts is not None:
        if not req.stream:
            raise bad("stream_options", "only allowed with stream: true")
        if not isinstance(opts, dict) or any(k not in ("include_usage", "include_obfuscation") for k in opts):
            raise bad("stream_options", "expected an object with include_usage (true or false)")
        req.include_usage = _bool("stream_options.include_usage", opts.get("include_usage", False))
    if body.get("prompt_logprobs") is not None:  # vLLM's; its -1 (the whole vocabulary) is not served
        req.prompt_logprobs = s.prompt_logprobs = _int("prompt_logprobs", body["prompt_logprobs"], 0, 20)
        if req.stream:
            raise bad("prompt_logprobs", "not available with stream: true (as in vLLM)")
    return req


def chat_messages(v: Any) -> list[dict[str, str]]:
    """A chat body's messages, checked (400 naming the message and field), as the template takes them."""
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
        if m.get("function_call"):
            raise bad(f"{p}.function_call", "the deprecated function_call is not supported; use tool_calls")
        calls = m.get("tool_calls")
        if calls is not None and (role != "assistant" or not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls)):
            raise bad(f"{p}.tool_calls", "expected, on an assistant message, a list of "
                                         "{'id', 'type': 'function', 'function': {'name', 'arguments'}}")
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
        msg: dict[str, Any] = {"role": role, "content": content}
        if calls:
            msg["tool_calls"] = calls
        if role == "tool":
            tcid = m.get("tool_call_id")
            if not isinstance(tcid, str):
                raise bad(f"{p}.tool_call_id", "a tool message needs the id of the call it answers (a string)")
            msg["tool_call_id"] = tcid
        out.append(msg)
    return out


def _guided(body: dict[str, Any]) -> tuple[str, str, str] | None:
    """Structured output from response_format, structured_outputs or guided_* -> (field, kind, spec); at
    most one constraint per request. The grammar itself is checked by the router (its engine's
    message, naming the field, in a 400)."""
    found: list[tuple[str, str, str]] = []  # (field, kind, spec)
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
            raise bad("response_format", "expected {'type': 'text'}, {'type': 'json_object'} or "
                                         "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}")
        if rf["type"] == "json_object":
            found.append(("response_format", "json_object", ""))
        elif rf["type"] == "json_schema":
            js = rf.get("json_schema")
            schema = js.get("schema") if isinstance(js, dict) else None
            if not isinstance(schema, dict):
                raise bad("response_format", "json_schema needs {'name': ..., 'schema': {...}} (a JSON schema object)")
            found.append(("response_format", "json", json.dumps(schema)))
    so = body.get("structured_outputs")
    if so is not None:
        given = {k: v for k, v in so.items() if v is not None and v is not False} if isinstance(so, dict) else None
        if given is None or len(given) != 1 or next(iter(given)) not in GUIDED_KINDS:
            raise bad("structured_outputs", f"expected an object with one of {', '.join(GUIDED_KINDS)}")
        (k, v), = given.items()
        found.append((f"structured_outputs.{k}", k, _guided_spec(f"structured_outputs.{k}", k, v)))
    for k in ("json", "regex", "choice", "grammar"):
        v = body.get(f"guided_{k}")
        if v is not None:
            found.append((f"guided_{k}", k, _guided_spec(f"guided_{k}", k, v)))
    if len(found) > 1:
        raise bad(found[1][0], f"only one structured-output constraint per request (also given: {found[0][0]})")
    return found[0] if found else None


def _guided_spec(name: str, kind: str, v: Any) -> str:
    if kind == "json":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError as e:
                raise bad(name, f"not a JSON schema: {e}") from None
        if not isinstance(v, dict):
            raise bad(name, "expected a JSON schema (an object)")
        return json.dumps(v)
    if kind == "json_object":
        if v is not True:
            raise bad(name, "expected true")
        return ""
    if kind == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
            raise bad(name, "expected a non-empty list of non-empty strings")
        return json.dumps(v)
    if not isinstance(v, str) or not v:
        raise bad(name, "expected a non-empty string")
    return v


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
                   "min_tokens", "guided")


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
        if name == "guided":
            return req.guided_field if req is not None else None
        return name
    return None
