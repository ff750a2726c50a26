"""/tokenize and /detokenize in vLLM's shape: a body -> the answer, with the served model's
tokenizer; a bad field is an ApiError (400) naming it.

    POST /tokenize    {"prompt": str, "add_special_tokens": true, "return_token_strs": false}
                      or {"messages": [...], "add_generation_prompt": true, ...}  (the chat template)
                   -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"tokens": [int, ...]} -> {"prompt": str}

A chat body's tokens are those a chat completion of the same messages generates from (the
template rendered as /v1/chat/completions renders it, then the router's encoding).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from router.openai_protocol import ApiError, bad

_COMMON = {"model", "add_special_tokens", "return_token_strs"}
_CHAT = _COMMON | {"messages", "add_generation_prompt", "continue_final_message"}


def tokenize(body: Any, tokenizer: Any, render: Callable[[Any], str], max_model_len: int | None) -> dict[str, Any]:
    """`render(messages)`: the chat template applied as for a chat completion (its errors are ApiErrors)."""
    body = _object(body, _CHAT if isinstance(body, dict) and "messages" in body else _COMMON | {"prompt"})
    _tokenizer(tokenizer)
    strs = _flag(body, "return_token_strs", False)
    if "messages" in body:
        if not _flag(body, "add_generation_prompt", True) or _flag(body, "continue_final_message", False):
            raise bad("add_generation_prompt", "only the chat completions' form (add_generation_prompt: true, "
                                               "continue_final_message: false) is supported")
        ids = tokenizer.encode(render(body["messages"]))
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad("prompt", f"expected a string, got {type(prompt).__name__}")
        ids = tokenizer.encode(prompt, add_special_tokens=_flag(body, "add_special_tokens", True))
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": tokenizer.convert_ids_to_tokens(ids) if strs else None}


def detokenize(body: Any, tokenizer: Any) -> dict[str, Any]:
    body = _object(body, {"model", "tokens"})
    _tokenizer(tokenizer)
    ids = body.get("tokens")
    vocab = len(tokenizer)
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab for t in ids):
        raise bad("tokens", f"expected a list of token ids (integers in [0, {vocab}))")
    return {"prompt": tokenizer.decode(ids)}


def _object(body: Any, known: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object, got {type(body).__name__}")
    for name in body:
        if name not in known:
            raise bad(name, "unrecognized request argument")
    return body


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"expected true or false, got {v!r}")
    return v


def _tokenizer(tokenizer: Any) -> None:
    if tokenizer is None:
        raise ApiError(404, "this API was built without the model's tokenizer", type="not_found_error")
