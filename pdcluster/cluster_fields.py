"""The value types of cluster.yaml's fields: each declares its type, its bounds and its own check
once, and how messages word it (pdcluster/config_file.py turns pydantic's errors into them).
pdcluster/cluster_config.py lays the sections out with these types."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BeforeValidator, Field, PlainValidator, StrictFloat, StrictInt, StrictStr

from pdcluster.config_file import Wording, check_part, invalid, not_allowed, show

POOL_NAME_PATTERN = r"[a-z0-9][a-z0-9-]*"
STANDARD_RESOURCES = ("num_cpus", "num_gpus", "memory")

_HARDWARE_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]*"
_HOST = r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)"
_RAY_CLIENT_RE = re.compile(rf"ray://{_HOST}(:(?P<port>\d+))?")
_RAY_GCS_RE = re.compile(rf"{_HOST}:(?P<port>\d+)")


def none_is(default: Any) -> BeforeValidator:
    """A field whose null (e.g. every key of a section commented out) stands for `default`."""
    return BeforeValidator(lambda v: default if v is None else v)


def _not_blank(v: str) -> str:
    if not v.strip():
        raise invalid("must not be empty")
    return v


def _ray_address(v: str | None) -> str | None:
    if v is None or v == "auto":
        return v
    m = _RAY_CLIENT_RE.fullmatch(v) or _RAY_GCS_RE.fullmatch(v)
    if m is None or (m.group("port") is not None and not 1 <= int(m.group("port")) <= 65535):
        raise not_allowed()
    return v


def _power_of_two(n: int) -> int:
    if n < 1 or n & (n - 1):
        raise invalid(f"{n} is not allowed; allowed: a power of two (1, 2, 4, 8, 16, 32, ...)")
    return n


def _num_blocks(v: Any) -> int | str:
    if v is None or v == "auto":
        return "auto"
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise not_allowed()
    return v


def _kv_faults(v: str | None) -> str | None:
    if v is None:
        return None
    from kv_transfer.faults import KVFaults

    try:
        return v if KVFaults.parse(v) is not None else None
    except ValueError as e:
        raise invalid(str(e)) from None


T = TypeVar("T")
Section = Annotated[T, none_is({})]  # a section: null is an empty mapping (its defaults)
Text = Annotated[StrictStr, AfterValidator(_not_blank)]
Port = Annotated[StrictInt, Field(ge=0, le=65535, description="0: pick a free port")]
Positive = Annotated[StrictFloat, Field(gt=0, allow_inf_nan=False)]
ApiKey = Annotated[StrictStr, Field(pattern=r"\S"), Wording(expected="a non-empty string")]
ApiKeys = Annotated[tuple[ApiKey, ...], none_is(()), Wording(expected="a list of strings")]
RayAddress = Annotated[StrictStr | None, AfterValidator(_ray_address), Wording(
    allowed="null (embedded local Ray), 'auto', 'ray://HOST[:PORT]', 'HOST:PORT'")]
PoolName = Annotated[StrictStr, Field(pattern=f"^{POOL_NAME_PATTERN}$"),
                     Wording(allowed=f"a name matching {POOL_NAME_PATTERN}")]
Hardware = Annotated[StrictStr, Field(pattern=f"^{_HARDWARE_PATTERN}$"), Wording(
    allowed=f"cpu, or an accelerator type label (e.g. gpu, H100) matching {_HARDWARE_PATTERN}")]
BlockSize = Annotated[StrictInt, AfterValidator(_power_of_two)]
NumBlocks = Annotated[int | str, PlainValidator(_num_blocks), Wording(allowed="'auto' or an integer >= 1")]
KVFaultSpec = Annotated[StrictStr | None, AfterValidator(_kv_faults), Wording(
    expected="a fault spec string like 'drop=0.1,delay_ms=200,seed=1' or null")]

_AMOUNT = Annotated[StrictFloat, Field(ge=0, allow_inf_nan=False)]  # a Ray resource
_BYTES = Annotated[StrictInt, Field(ge=0, description="bytes")]


def _resources(v: Any) -> dict[str, float]:
    if v is None:
        return {"num_cpus": 1.0}
    if not isinstance(v, Mapping):
        raise invalid(f"expected a mapping of Ray resources (num_cpus, num_gpus, memory, or custom "
                      f"resource names), got {show(v)}")
    out: dict[str, float] = {}
    for k, x in v.items():
        if not isinstance(k, str) or not k:
            raise invalid("resource names must be non-empty strings", str(k))
        if k in ("CPU", "GPU"):
            raise invalid(f"use num_{k.lower()}s instead; "
                          "allowed: num_cpus, num_gpus, memory, or a custom resource", k)
        if k.startswith("num_") and k not in STANDARD_RESOURCES:
            raise invalid("unknown key; allowed: num_cpus, num_gpus, memory, or a custom resource name "
                          "(custom names must not start with num_)", k)
        out[k] = check_part(_BYTES if k == "memory" else _AMOUNT, x, k)
        if k == "num_gpus" and out[k] > 1 and not out[k].is_integer():
            raise invalid(f"{out[k]} is not allowed; allowed: a fraction below 1 or a whole number", k)
    return out


def _cpus(v: Any) -> tuple[int, ...] | None:
    if v is None:
        return None
    if hasattr(os, "sched_getaffinity"):
        usable = sorted(os.sched_getaffinity(0))
    else:
        usable = list(range(os.cpu_count() or 1))
    ids = isinstance(v, (list, tuple)) and all(isinstance(c, int) and not isinstance(c, bool) for c in v)
    if not ids or not v:
        raise invalid(f"expected a non-empty list of CPU ids, got {show(v)}; allowed: ids among {usable}")
    if len(set(v)) != len(v) or any(c < 0 for c in v):
        raise invalid(f"{show(v)} is not allowed; allowed: distinct CPU ids >= 0")
    return tuple(v)


# Ray resources per replica: num_cpus, num_gpus, memory (bytes), or custom resource names
Resources = Annotated[dict[str, float], PlainValidator(_resources)]
Cpus = Annotated[tuple[int, ...] | None, PlainValidator(_cpus)]  # CPU ids to pin a process to
