"""Tool calls for /v1/chat/completions: `tools` and `tool_choice` read and checked, the constraint a
forced call generates under, and the model's output turned into OpenAI's `tool_calls`.

- `tool_choice: "none"` (the default without tools): plain text; the tools still reach the chat template.
- `"auto"` (the default with tools): the model decides. A call is written as the Hermes / Qwen format
  does, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (several may follow each other);
  text before the first is the message's content. Output without a well-formed call is content.
- `"required"`: the output is constrained (structured output, engine/guided.py) to a JSON array of
  one or more `{"name": <a tool>, "arguments": <its parameters' schema>}`; it always parses.
- a named function: the output is constrained to that function's parameters' schema: the arguments.
- `parallel_tool_calls: false`: at most one call. `required` is constrained to an array of exactly one;
  under `auto` only the first call the model writes is returned (what follows it is dropped).

The tools are passed to the chat template (`tools=`), which renders them if it knows how.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from router.openai_protocol import bad

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


@dataclass
class Tools:
    tools: list[dict[str, Any]] = field(default_factory=list)  # the request's, as given (for the template)
    params: dict[str, dict[str, Any]] = field(default_factory=dict)  # function name -> parameters schema
    choice: str = "none"  # none | auto | required | named
    named: str | None = None  # the function of a named tool_choice
    parallel: bool = True  # parallel_tool_calls: false -> at most one call

    def constraint(self) -> tuple[str, str] | None:
        """(kind, spec) of the structured output a forced call generates under; None: free text."""
        if self.choice == "named":
            return "json", json.dumps(self.params[self.named])
        if self.choice == "required":
            defs: dict[str, Any] = {}
            calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": _hoist(n, p, defs)},
                      "required": ["name", "arguments"], "additionalProperties": False}
                     for n, p in self.params.items()]
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **({} if self.parallel else {"maxItems": 1})}
            return "json", json.dumps({**schema, "$defs": defs} if defs else schema)
        return None

    def calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The output -> (content, tool_calls in OpenAI's shape); no calls: (text, [])."""
        if self.choice == "named":  # unparsed (cut by max_tokens): the text stays the content
            args = _json(text)
            return (None, [_call(self.named, args)]) if args is not None else (text, [])
        if self.choice == "required":
            found = _json(text)
            calls = [_call(c["name"], c.get("arguments", {})) for c in found
                     if isinstance(c, dict) and c.get("name") in self.params] if isinstance(found, list) else []
            return (None, calls[:1] if not self.parallel else calls) if calls else (text, [])
        if self.choice != "auto" or OPEN not in text:
            return text, []
        found = []
        for m in _CALL.finditer(text):
            c = _json(m.group(1))
            if not isinstance(c, dict) or c.get("name") not in self.params:
                return text, []  # not a well-formed call of a known tool: all of it is content
            found.append(_call(c["name"], c.get("arguments", c.get("parameters", {}))))
            if not self.parallel:
                break
        if not found:
            return text, []
        content = text[:text.index(OPEN)].strip()
        return content or None, found


def _hoist(tool: str, schema: dict[str, Any], defs: dict[str, Any]) -> Any:
    """A tool's parameters schema nested in the `required` schema: its own `$defs` (pydantic's nested
    models) move to the root under `<tool>.<name>`, and its references follow them."""
    own = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    if not own:
        return schema
    renamed = {f"#/$defs/{k}": f"#/$defs/{tool}.{k}" for k in own} | {
        f"#/definitions/{k}": f"#/$defs/{tool}.{k}" for k in own}

    def walk(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: (renamed.get(x, x) if k == "$ref" and isinstance(x, str) else walk(x)) for k, x in v.items()
                    if k not in ("$defs", "definitions")}
        return [walk(x) for x in v] if isinstance(v, list) else v

    for name, d in own.items():
        defs[f"{tool}.{name}"] = walk(d)
    return walk(schema)


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _call(name: str, arguments: Any) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def parse_tools(body: dict[str, Any]) -> Tools | None:
    """`tools` and `tool_choice` of a chat body -> Tools (None: no tools given). 400s name the field."""
    raw, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", "expected true or false")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise bad("tool_choice", f"{choice!r} needs tools")
        return None
    if not isinstance(raw, list):
        raise bad("tools", "expected a list of {'type': 'function', 'function': {...}}")
    out = Tools(tools=raw, parallel=parallel is not False)
    for i, t in enumerate(raw):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        name = f.get("name") if isinstance(f, dict) else None
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad(f"tools[{i}]", "expected {'type': 'function', 'function': {'name': <letters, digits, _ or "
                                     "-, at most 64>, 'parameters': {...}}}")
        if name in out.params:
            raise bad(f"tools[{i}].function.name", f"{name!r} is given twice")
        params = f.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        elif not isinstance(params, dict):
            raise bad(f"tools[{i}].function.parameters", "expected a JSON schema (an object)")
        out.params[name] = params
    if choice is None or choice in ("none", "auto", "required"):
        out.choice = choice or "auto"
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in out.params:
            raise bad("tool_choice", f"function {name!r} is not among the tools")
        out.choice, out.named = "named", name
    else:
        raise bad("tool_choice", "expected 'none', 'auto', 'required' or {'type': 'function', 'function': "
                                 "{'name': ...}}")
    return out
