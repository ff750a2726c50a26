"""Server-sent events of an OpenAI-format stream: bytes -> `data:` payloads -> what each chunk carries."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DONE = "[DONE]"


class SSEDecoder:
    """Incremental: feed bytes as they arrive, get the complete events' data payloads.
    Multi-line `data:` fields are joined with newlines; comments (`:`) and other fields are ignored."""

    def __init__(self) -> None:
        self._buf = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes | str) -> list[str]:
        self._buf += chunk.decode("utf-8", errors="replace") if isinstance(chunk, bytes) else chunk
        out: list[str] = []
        *lines, self._buf = self._buf.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        for line in lines:
            if line == "":
                if self._data:
                    out.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                self._data.append(line[5:].removeprefix(" "))
        return out

    def close(self) -> list[str]:
        """Whatever event the stream ended in without a blank line."""
        out = self.feed("\n\n") if self._buf or self._data else []
        return out


@dataclass
class Chunk:
    done: bool = False  # `data: [DONE]`
    content: bool = False  # carries output text (or token logprobs, or token ids)
    tokens: int | None = None  # tokens in this chunk when the chunk says (logprobs, token ids); None: unknown
    tokens_from: str = "logprobs"  # logprobs | token_ids: what `tokens` counted
    text: str = ""
    token_ids: list[int] | None = None  # return_token_ids: this chunk's output token ids
    prompt_token_ids: list[int] | None = None  # return_token_ids: the prompt's (the first chunk)
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    error: str | None = None  # an error object sent in the stream


def parse_chunk(payload: str) -> Chunk:
    """One `data:` payload of /v1/completions or /v1/chat/completions."""
    if payload.strip() == DONE:
        return Chunk(done=True)
    try:
        body = json.loads(payload)
    except ValueError:
        return Chunk(error=f"malformed stream chunk: {payload[:200]!r}")
    if not isinstance(body, dict):
        return Chunk(error=f"malformed stream chunk: {payload[:200]!r}")
    if body.get("error"):
        err = body["error"]
        return Chunk(error=str(err.get("message", err) if isinstance(err, dict) else err))
    c = Chunk(usage=body.get("usage") or None)
    c.prompt_token_ids = _ids(body.get("prompt_token_ids"))  # chat: at the top level
    for choice in body.get("choices") or []:
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content")
        lp = choice.get("logprobs") or {}
        n_lp = len(lp.get("tokens") or lp.get("content") or []) if isinstance(lp, dict) else 0
        ids = _ids(choice.get("token_ids"))
        c.prompt_token_ids = _ids(choice.get("prompt_token_ids")) or c.prompt_token_ids  # completions
        if text or n_lp or ids:
            c.content = True
            c.tokens = (c.tokens or 0) + n_lp if n_lp else c.tokens
        if ids is not None:
            c.token_ids = [*(c.token_ids or []), *ids]
            if not n_lp:
                c.tokens, c.tokens_from = len(c.token_ids), "token_ids"
        c.text += text or ""
        c.finish_reason = choice.get("finish_reason") or c.finish_reason
    return c


def _ids(v: Any) -> list[int] | None:
    return [int(t) for t in v] if isinstance(v, list) and all(type(t) is int for t in v) else None
