"""Config files: YAML read into a schema of frozen dataclasses, checked by pydantic, every mistake a
`ConfigError` whose message names the key path and what is allowed.

The schema is the dataclasses themselves. A field's annotation declares its type (`StrictInt`,
`Literal[...]`, another dataclass), its bounds once (`Field(ge=..., le=...)`; a `description` is the
hint shown after the allowed range), and, where the type does not say it, how messages word it
(`Wording`). Rules over several fields are `model_validator(mode="after")` methods that raise
`invalid(...)`; a field's own check raises `not_allowed()` or `invalid(...)`. A dataclass built or
changed in code is not checked; `validate(schema, raw)` is.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import annotated_types
import yaml
from pydantic import ConfigDict, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

FORBID_EXTRA = ConfigDict(extra="forbid")  # every section: `@with_config(FORBID_EXTRA)`
BOOL_HINT = " (YAML reads unquoted yes/no/on/off/true/false as booleans; quote the value)"


class ConfigError(ValueError):
    """A deployment file (or dict) that is not valid; the message names the key path.

    `key` is the key path (e.g. "pools[1].role") when the error is about one key, `file` the
    file it came from when it was loaded from one.
    """

    def __init__(self, message: str, *, key: str | None = None, file: str | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.file = file


@dataclasses.dataclass(frozen=True)
class Wording:
    """How messages speak of a field: "expected {expected}, got X" for a value of the wrong kind
    (default: from the type), "X is not allowed; allowed: {allowed}" for a refused value (default:
    a Literal's choices; with neither, a refused value reads as one of the wrong kind)."""

    expected: str | None = None
    allowed: str | None = None


def not_allowed() -> PydanticCustomError:
    """Raised by a field's check: the value is refused, as the field's `Wording.allowed` says."""
    return PydanticCustomError("not_allowed", "not allowed")


def invalid(message: str, key: str = "") -> PydanticCustomError:
    """Raised by a check: `message` about `key`, a path below the key being checked ("" for itself)."""
    return PydanticCustomError("invalid", "{message}", {"message": message, "key": key})


def show(v: Any) -> str:
    """A value as messages show it: YAML's null/true/false, else Python's repr."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v)


def _fmt(x: float) -> str:
    """A bound or number as messages show it: 5.0 reads 5."""
    return str(x) if isinstance(x, int) or not float(x).is_integer() else str(int(x))


def _join(path: str, key: str) -> str:
    """The key path of `key` under `path`: "router" + "http_port", "pools" + "[1].name"."""
    if not key or not path:
        return path or key
    return f"{path}{key}" if key.startswith("[") else f"{path}.{key}"


# ----------------------------------------------------------------------------- validation


@functools.cache
def _adapter(schema: Any) -> TypeAdapter:
    return TypeAdapter(schema)


def validate(schema: Any, raw: Any) -> Any:
    """`raw` (a mapping of sections, e.g. a parsed YAML file; None is an empty one) checked against
    the dataclass `schema` (or Annotated[dataclass, ...]); returns the dataclass or raises ConfigError."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        root = _strip(FieldInfo.from_annotation(schema).annotation)
        keys = ", ".join(sorted(f.name for f in dataclasses.fields(root)))
        raise ConfigError(f"(top level): expected a mapping of sections ({keys}), got {show(raw)}", key="")
    try:
        return _adapter(schema).validate_python(dict(raw))
    except ValidationError as e:
        key, message = _first(schema, e)
        raise ConfigError(f"{key or '(top level)'}: {message}", key=key) from None


def check_part(schema: Any, value: Any, key: str) -> Any:
    """Inside a field's check: `value`, the part `key` of the field, checked against `schema`;
    a mistake is raised as `invalid` with the message it has anywhere else."""
    try:
        return _adapter(schema).validate_python(value)
    except ValidationError as e:
        below, message = _first(schema, e)
        raise invalid(message, _join(key, below)) from None


def _first(schema: Any, e: ValidationError) -> tuple[str, str]:
    """(key path, message) of the mistake a reader of the file meets first."""
    return _describe(schema, min(e.errors(include_url=False), key=lambda err: _order(schema, err)))


def _strip(tp: Any) -> Any:
    """The type under Annotated[...] and `| None`."""
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return _strip(args[0])
    return tp


@dataclasses.dataclass
class _Step:
    """One part of an error's location: a list index, or a key of the dataclass `holder`, whose
    field is `info` (None: a key the dataclass does not have)."""

    part: Any
    holder: type | None
    info: FieldInfo | None


def _steps(schema: Any, err: Mapping[str, Any]) -> list[_Step]:
    steps, info = [], FieldInfo.from_annotation(schema)
    for part in err["loc"]:
        tp = _strip(info.annotation) if info is not None else None
        holder = tp if dataclasses.is_dataclass(tp) else None
        if holder is None and isinstance(part, int) and typing.get_args(tp):
            info = FieldInfo.from_annotation(typing.get_args(tp)[0])
        elif holder is not None and part in {f.name for f in dataclasses.fields(holder)}:
            info = FieldInfo.from_annotation(typing.get_type_hints(holder, include_extras=True)[part])
        else:
            info = None
        steps.append(_Step(part, holder, info))
    return steps


def _order(schema: Any, err: Mapping[str, Any]) -> list[tuple[int, int]]:
    """At each level: unknown keys first, then missing ones, then keys in the schema's order."""
    steps, order = _steps(schema, err), []
    for i, step in enumerate(steps):
        if step.holder is None:
            order.append((2, step.part if isinstance(step.part, int) else 0))
        elif step.info is None:
            order.append((0, 0))
        else:
            rank = 1 if err["type"] == "missing" and i == len(steps) - 1 else 2
            order.append((rank, [f.name for f in dataclasses.fields(step.holder)].index(step.part)))
    return order


def _describe(schema: Any, err: Mapping[str, Any]) -> tuple[str, str]:
    """(key path, message) of one pydantic error."""
    kind, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    steps = _steps(schema, err)
    key = ""
    for step in steps:
        index = step.holder is None and isinstance(step.part, int)
        key = _join(key, f"[{step.part}]" if index else str(step.part))
    if kind == "invalid":
        return _join(key, ctx["key"]), ctx["message"]
    holder, info = (steps[-1].holder, steps[-1].info) if steps else (None, FieldInfo.from_annotation(schema))
    if info is None:
        names = sorted(f.name for f in dataclasses.fields(holder)) if holder is not None else []
        return key, f"unknown key; allowed: {', '.join(names)}"
    tp = _strip(info.annotation)
    wording = next((m for m in info.metadata if isinstance(m, Wording)), Wording())
    allowed = wording.allowed
    if allowed is None and typing.get_origin(tp) is typing.Literal:
        allowed = ", ".join(typing.get_args(tp))
    if kind == "missing":
        return key, f"required; allowed: {allowed}"
    if kind == "dataclass_type":
        keys = ", ".join(sorted(f.name for f in dataclasses.fields(tp)))
        return key, f"expected a mapping with keys {keys}; got {show(value)}"
    if kind.endswith("_type") or kind in ("literal_error", "string_pattern_mismatch", "not_allowed"):
        if allowed is None:
            return key, f"expected {wording.expected or _expected(info.annotation)}, got {show(value)}"
        hint = BOOL_HINT if kind == "literal_error" and isinstance(value, bool) else ""  # an unquoted `off`
        return key, f"{show(value)} is not allowed; allowed: {allowed}{hint}"
    if kind == "finite_number":
        return key, f"{value} is not allowed; allowed: a finite number"
    if kind in ("greater_than", "greater_than_equal", "less_than_equal"):
        gt, ge, le = (next((getattr(m, name) for m in info.metadata if isinstance(m, cls)), None)
                      for name, cls in (("gt", annotated_types.Gt), ("ge", annotated_types.Ge),
                                        ("le", annotated_types.Le)))
        if ge is not None and le is not None:
            limits = f"{_fmt(ge)}..{_fmt(le)}"
        else:
            op, bound = (">", gt) if gt is not None else (">=", ge) if ge is not None else ("<=", le)
            limits = f"{op} {_fmt(bound)}"
        hint = f" ({info.description})" if info.description else ""
        return key, f"{_fmt(value)} is out of range; allowed: {limits}{hint}"
    return key, str(err["msg"])  # pragma: no cover (no field of the schemas here raises another kind)


def _expected(annotation: Any) -> str:
    """What a field of this type expects, as messages say it ("an integer or null")."""
    base = _strip(annotation)
    kinds = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    text = kinds.get(base, getattr(base, "__name__", str(base)))
    return f"{text} or null" if type(None) in typing.get_args(annotation) else text


# ----------------------------------------------------------------------------- reading


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML silently keeps the last)."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            seen: dict[tuple[str, str], int] = {}
            for key_node, _ in node.value:
                if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                    k = (key_node.tag, key_node.value)
                    if k in seen:
                        raise yaml.constructor.ConstructorError(
                            None, None,
                            f"duplicate key {key_node.value!r} (first given on line {seen[k] + 1})",
                            key_node.start_mark,
                        )
                    seen[k] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path, what: str) -> Any:
    """The parsed YAML file `path` (a `what`, e.g. "cluster config"); a ConfigError that starts with
    the file name (and, for syntax errors, the line and column) if it cannot be read or parsed."""
    name = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{name}: {what} file not found", file=name) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{name}: cannot read {what}: {e}", file=name) from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass: safe
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = e.problem or "syntax error"
        if e.context:
            problem = f"{problem} ({e.context})"
        raise ConfigError(f"{name}: {where}invalid YAML: {problem}", file=name) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{name}: invalid YAML: {e}", file=name) from None
