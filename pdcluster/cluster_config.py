"""The deployment file (`cluster.yaml`): schema, defaults, validation and loading.

    cfg = load_cluster_config("cluster.yaml")        # ConfigError (a ValueError) on any mistake
    cfg.pools_by_role("prefill")                     # -> [PoolConfig, ...]
    EngineConfig(**cfg.engine_kwargs(pool))          # one worker's engine settings

Every section has defaults equal to the repository's `cluster.yaml`, so an empty file (or `{}`)
is the default deployment: embedded local Ray, the built-in model, one prefill and one decode
worker on CPU, the router on 127.0.0.1. Error messages name the key path and what is allowed,
e.g. `pools[1].role: 'decoder' is not allowed; allowed: prefill, decode, colocated`.

API keys of the router may also come from the environment variable PDCLUSTER_API_KEYS (comma
separated); `load_cluster_config` appends them to `router.api_keys`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Callable

import yaml

DEFAULT_CLUSTER_FILE = "cluster.yaml"
API_KEYS_ENV = "PDCLUSTER_API_KEYS"

MODES = ("disaggregated", "colocated")
ROLES = ("prefill", "decode", "colocated")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_TRANSFER_BACKENDS = ("auto", "grpc", "inproc", "torch_distributed", "shm", "tcp")
KV_COMPRESSIONS = ("none", "int8")
POOL_NAME_PATTERN = r"[a-z0-9][a-z0-9-]*"
STANDARD_RESOURCES = ("num_cpus", "num_gpus", "memory")

_POOL_NAME_RE = re.compile(POOL_NAME_PATTERN)
_HARDWARE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_HOST = r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)"
_RAY_CLIENT_RE = re.compile(rf"ray://{_HOST}(:(?P<port>\d+))?")
_RAY_GCS_RE = re.compile(rf"{_HOST}:(?P<port>\d+)")
_MIB = 1024 * 1024


class ConfigError(ValueError):
    """A deployment file (or dict) that is not valid; the message names the key path.

    `key` is the key path (e.g. "pools[1].role") when the error is about one key, `file` the
    file it came from when it was loaded from one.
    """

    def __init__(self, message: str, *, key: str | None = None, file: str | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.file = file


# ----------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class RayConfig:
    # None: start an embedded local Ray; or join one: "auto" / "ray://HOST[:PORT]" / "HOST:PORT"
    address: str | None = None
    max_restarts: int = 5  # times Ray restarts a worker or the router whose process died (0: never)


@dataclass(frozen=True)
class ModelSection:
    path: str = "builtin:tiny-llama"  # builtin:NAME or a Hugging Face checkpoint directory
    dtype: str = "auto"  # the checkpoint's dtype; or float32 / bfloat16 / float16
    max_model_len: int | None = 2048  # None: the model's max_position_embeddings, capped at 4096


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    grpc_port: int = 50051  # 0: pick a free port
    http_port: int = 8000  # 0: pick a free port
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # empty: no authentication
    max_retries: int = 2  # per request, after a worker or KV transfer failure (0: none)
    max_requests: int = 512  # admitted requests in flight; beyond: RESOURCE_EXHAUSTED / HTTP 429
    max_queued_prompt_tokens: int = 262144  # prompt tokens of admitted requests waiting for prefill
    tls_cert: str | None = None  # PEM certificate chain: the gRPC and HTTP ports serve TLS only
    tls_key: str | None = field(default=None, repr=False)  # its PEM private key (both or neither)
    local_prefill_max_tokens: int = 0  # disaggregated: prompts up to this long may prefill on their decode worker


@dataclass(frozen=True)
class PoolConfig:
    name: str
    role: str  # prefill / decode / colocated
    replicas: int = 1
    hardware: str = "cpu"  # "cpu", or an accelerator type label (runs on CUDA, needs num_gpus > 0)
    resources: dict[str, float] = field(default_factory=lambda: {"num_cpus": 1.0})  # Ray, per replica
    cpus: tuple[int, ...] | None = None  # pin each replica's process to these CPU ids (Linux); None: no pinning

    @property
    def device(self) -> str:
        """The torch device of this pool's engines: "cpu" for hardware cpu, else "cuda"."""
        return "cpu" if self.hardware.lower() == "cpu" else "cuda"


@dataclass(frozen=True)
class KVCacheConfig:
    block_size: int = 16  # tokens per block, a power of two
    num_blocks: int | str = "auto"  # "auto": from memory_mb
    memory_mb: int | None = 512  # KV cache budget per worker in MiB; None: engine default (90% free GPU)


@dataclass(frozen=True)
class EngineSection:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads on CPU; None: torch's default
    enforce_eager: bool = False  # plain torch only (no native kernel, no prepacked oneDNN weights)


@dataclass(frozen=True)
class KVTransferConfig:
    backend: str = "auto"
    layerwise: bool = True  # send each layer's KV as soon as it is computed
    compression: str = "none"
    timeout_s: float = 30.0
    lease_s: float = 120.0  # a decode reservation whose KV has not committed by then is freed
    faults: str | None = None  # fault injection spec (kv_transfer/faults.py); null: off
    shm_in_place: bool = True  # shm/auto on one node: prefill writes into the decode worker's cache
    shm_verify: bool = False  # shm in place: an XXH3 checksum per layer, checked by the receiver


@dataclass(frozen=True)
class TimeoutsConfig:
    startup_s: float = 180.0
    request_s: float = 600.0


@dataclass(frozen=True)
class SLOConfig:
    ttft_ms: float = 1000.0
    tpot_ms: float = 50.0


def _default_pools() -> tuple[PoolConfig, ...]:
    return (PoolConfig(name="prefill", role="prefill"), PoolConfig(name="decode", role="decode"))


@dataclass(frozen=True)
class ClusterConfig:
    ray: RayConfig = field(default_factory=RayConfig)
    model: ModelSection = field(default_factory=ModelSection)
    mode: str = "disaggregated"
    router: RouterConfig = field(default_factory=RouterConfig)
    pools: tuple[PoolConfig, ...] = field(default_factory=_default_pools)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    engine: EngineSection = field(default_factory=EngineSection)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    slo: SLOConfig = field(default_factory=SLOConfig)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "ClusterConfig":
        """Validate a parsed deployment file; missing keys take their defaults."""
        return _parse_cluster(d)

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts/lists/scalars in the file's layout; `from_dict(c.to_dict()) == c`."""
        return _plain(self)

    def validate(self) -> "ClusterConfig":
        """Check a config built or changed in code (e.g. with dataclasses.replace); returns it normalized."""
        return ClusterConfig.from_dict(self.to_dict())

    def pools_by_role(self, role: str) -> list[PoolConfig]:
        if role not in ROLES:
            raise ValueError(f"role {role!r} is not allowed; allowed: {', '.join(ROLES)}")
        return [p for p in self.pools if p.role == role]

    def replicas_by_role(self, role: str) -> int:
        return sum(p.replicas for p in self.pools_by_role(role))

    def engine_kwargs(self, pool: PoolConfig | None = None) -> dict[str, Any]:
        """Keyword arguments of engine.config.EngineConfig; with a pool, also its device."""
        kv = self.kv_cache
        kwargs: dict[str, Any] = {
            "model": self.model.path,
            "dtype": self.model.dtype,
            "max_model_len": self.model.max_model_len,
            "block_size": kv.block_size,
            "num_blocks": None if kv.num_blocks == "auto" else kv.num_blocks,
            "kv_cache_memory_bytes": None if kv.memory_mb is None else kv.memory_mb * _MIB,
            "max_num_batched_tokens": self.engine.max_num_batched_tokens,
            "max_num_seqs": self.engine.max_num_seqs,
            "enable_prefix_caching": self.engine.enable_prefix_caching,
            "num_threads": self.engine.num_threads,
            "enforce_eager": self.engine.enforce_eager,
        }
        if pool is not None:
            kwargs["device"] = pool.device
        return kwargs


# ----------------------------------------------------------------------------- loading


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


def load_cluster_config(path: str | Path, *, env: Mapping[str, str] | None = None) -> ClusterConfig:
    """Read, validate and return a deployment file; merges API keys from $PDCLUSTER_API_KEYS.

    `env` defaults to os.environ. Every problem is a ConfigError whose message starts with the
    file name (and, for YAML syntax errors, the line and column).
    """
    path = Path(path)
    name = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{name}: cluster config file not found", file=name) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{name}: cannot read cluster config: {e}", file=name) from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = e.problem or "syntax error"
        if e.context:
            what = f"{what} ({e.context})"
        raise ConfigError(f"{name}: {where}invalid YAML: {what}", file=name) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{name}: invalid YAML: {e}", file=name) from None
    try:
        cfg = ClusterConfig.from_dict(raw)
    except ConfigError as e:
        raise ConfigError(f"{name}: {e}", key=e.key, file=name) from None
    return merge_env_api_keys(cfg, os.environ if env is None else env)


def merge_env_api_keys(cfg: ClusterConfig, env: Mapping[str, str]) -> ClusterConfig:
    """Append the comma-separated keys of $PDCLUSTER_API_KEYS to router.api_keys (no duplicates)."""
    extra = [k.strip() for k in env.get(API_KEYS_ENV, "").split(",") if k.strip()]
    if not extra:
        return cfg
    keys = tuple(dict.fromkeys([*cfg.router.api_keys, *extra]))
    router = replace(cfg.router, api_keys=keys)
    return replace(cfg, router=router)


def _plain(obj: Any) -> Any:
    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_plain(x) for x in obj]
    if isinstance(obj, Mapping):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


# ----------------------------------------------------------------------------- validation

def _err(path: str, message: str) -> ConfigError:
    return ConfigError(f"{path}: {message}", key=path)


def _show(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v)


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _section(path: str, v: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    """A mapping with only `allowed` keys; null (all keys commented out) is an empty mapping."""
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise _err(path, f"expected a mapping with keys {', '.join(sorted(allowed))}; got {_show(v)}")
    for k in v:
        if k not in allowed:
            raise _err(_join(path, k), f"unknown key; allowed: {', '.join(sorted(allowed))}")
    return dict(v)


def _keys_of(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def _get(d: Mapping[str, Any], path: str, cls: type, key: str, parse: Callable[[str, Any], Any]) -> Any:
    if key in d:
        return parse(_join(path, key), d[key])
    for f in fields(cls):
        if f.name == key:
            return f.default if f.default_factory is MISSING else f.default_factory()
    raise KeyError(key)  # pragma: no cover


def _int(path: str, v: Any, *, lo: int | None = None, hi: int | None = None, none: bool = False,
         hint: str = "") -> int | None:
    if v is None and none:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _err(path, f"expected an integer{' or null' if none else ''}, got {_show(v)}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        if hi is None:
            rng = f">= {lo}"
        elif lo is None:
            rng = f"<= {hi}"
        else:
            rng = f"{lo}..{hi}"
        raise _err(path, f"{v} is out of range; allowed: {rng}{hint}")
    return v


def _num(path: str, v: Any, *, ge: float | None = None, gt: float | None = None) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _err(path, f"expected a number, got {_show(v)}")
    v = float(v)
    if not math.isfinite(v):
        raise _err(path, f"{v} is not allowed; allowed: a finite number")
    if gt is not None and not v > gt:
        raise _err(path, f"{_fmt(v)} is out of range; allowed: > {_fmt(gt)}")
    if ge is not None and not v >= ge:
        raise _err(path, f"{_fmt(v)} is out of range; allowed: >= {_fmt(ge)}")
    return v


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _bool(path: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise _err(path, f"expected true or false, got {_show(v)}")
    return v


def _str(path: str, v: Any, *, none: bool = False) -> str | None:
    if v is None and none:
        return None
    if not isinstance(v, str):
        raise _err(path, f"expected a string{' or null' if none else ''}, got {_show(v)}")
    if not v.strip():
        raise _err(path, "must not be empty")
    return v


def _choice(choices: tuple[str, ...]) -> Callable[[str, Any], str]:
    def parse(path: str, v: Any) -> str:
        if not isinstance(v, str) or v not in choices:
            hint = ""
            if isinstance(v, bool):
                hint = " (YAML reads unquoted yes/no/on/off/true/false as booleans; quote the value)"
            raise _err(path, f"{_show(v)} is not allowed; allowed: {', '.join(choices)}{hint}")
        return v

    return parse


def _port(path: str, v: Any) -> int:
    return _int(path, v, lo=0, hi=65535, hint=" (0: pick a free port)")  # type: ignore[return-value]


def _positive(path: str, v: Any) -> float:
    return _num(path, v, gt=0)


# --- sections


def _parse_ray(path: str, v: Any) -> RayConfig:
    d = _section(path, v, _keys_of(RayConfig))
    return RayConfig(address=_get(d, path, RayConfig, "address", _ray_address),
                     max_restarts=_get(d, path, RayConfig, "max_restarts", lambda p, x: _int(p, x, lo=0, hi=1000)))


def _ray_address(path: str, v: Any) -> str | None:
    allowed = "null (embedded local Ray), 'auto', 'ray://HOST[:PORT]', 'HOST:PORT'"
    if v is None:
        return None
    if not isinstance(v, str):
        raise _err(path, f"{_show(v)} is not allowed; allowed: {allowed}")
    if v == "auto":
        return v
    m = _RAY_CLIENT_RE.fullmatch(v) or _RAY_GCS_RE.fullmatch(v)
    if m is None or (m.group("port") is not None and not 1 <= int(m.group("port")) <= 65535):
        raise _err(path, f"{_show(v)} is not allowed; allowed: {allowed}")
    return v


def _parse_model(path: str, v: Any) -> ModelSection:
    d = _section(path, v, _keys_of(ModelSection))
    return ModelSection(
        path=_get(d, path, ModelSection, "path", _str),
        dtype=_get(d, path, ModelSection, "dtype", _choice(DTYPES)),
        max_model_len=_get(d, path, ModelSection, "max_model_len",
                           lambda p, x: _int(p, x, lo=2, none=True)),
    )


def _parse_router(path: str, v: Any) -> RouterConfig:
    d = _section(path, v, _keys_of(RouterConfig))
    r = RouterConfig(
        host=_get(d, path, RouterConfig, "host", _str),
        grpc_port=_get(d, path, RouterConfig, "grpc_port", _port),
        http_port=_get(d, path, RouterConfig, "http_port", _port),
        api_keys=_get(d, path, RouterConfig, "api_keys", _api_keys),
        max_retries=_get(d, path, RouterConfig, "max_retries", lambda p, x: _int(p, x, lo=0, hi=10)),
        max_requests=_get(d, path, RouterConfig, "max_requests", lambda p, x: _int(p, x, lo=1)),
        max_queued_prompt_tokens=_get(d, path, RouterConfig, "max_queued_prompt_tokens", lambda p, x: _int(p, x, lo=1)),
        tls_cert=_get(d, path, RouterConfig, "tls_cert", lambda p, x: _str(p, x, none=True)),
        tls_key=_get(d, path, RouterConfig, "tls_key", lambda p, x: _str(p, x, none=True)),
        local_prefill_max_tokens=_get(d, path, RouterConfig, "local_prefill_max_tokens",
                                      lambda p, x: _int(p, x, lo=0)),
    )
    if (r.tls_cert is None) != (r.tls_key is None):
        missing = "tls_key" if r.tls_key is None else "tls_cert"
        raise _err(_join(path, missing), "required when the other TLS file is given; allowed: both tls_cert "
                                         "and tls_key (PEM files), or neither (no TLS)")
    if r.grpc_port and r.grpc_port == r.http_port:
        raise _err(_join(path, "http_port"), f"{r.http_port} is also router.grpc_port; "
                                             "allowed: a different port, or 0 (pick a free port)")
    return r


def _api_keys(path: str, v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    if not isinstance(v, (list, tuple)):
        raise _err(path, f"expected a list of strings, got {_show(v)}")
    keys = []
    for i, k in enumerate(v):
        if not isinstance(k, str) or not k.strip():
            raise _err(f"{path}[{i}]", f"expected a non-empty string, got {_show(k)}")
        keys.append(k)
    return tuple(keys)


def _parse_pools(path: str, v: Any) -> tuple[PoolConfig, ...]:
    if not isinstance(v, (list, tuple)):
        raise _err(path, f"expected a list of pools (mappings with keys "
                         f"{', '.join(_keys_of(PoolConfig))}), got {_show(v)}")
    pools = []
    first: dict[str, int] = {}
    for i, item in enumerate(v):
        pool = _parse_pool(f"{path}[{i}]", item)
        if pool.name in first:
            raise _err(f"{path}[{i}].name", f"{pool.name!r} is already used by {path}[{first[pool.name]}]; "
                                            "allowed: a name unique among the pools")
        first[pool.name] = i
        pools.append(pool)
    return tuple(pools)


def _parse_pool(path: str, v: Any) -> PoolConfig:
    if not isinstance(v, Mapping):
        keys = ", ".join(sorted(_keys_of(PoolConfig)))
        raise _err(path, f"expected a mapping with keys {keys}; got {_show(v)}")
    d = _section(path, v, _keys_of(PoolConfig))
    if "name" not in d:
        raise _err(_join(path, "name"), f"required; allowed: a name matching {POOL_NAME_PATTERN}")
    if "role" not in d:
        raise _err(_join(path, "role"), f"required; allowed: {', '.join(ROLES)}")
    name = _pool_name(_join(path, "name"), d["name"])
    role = _choice(ROLES)(_join(path, "role"), d["role"])
    replicas = _get(d, path, PoolConfig, "replicas", lambda p, x: _int(p, x, lo=0))
    hardware = _get(d, path, PoolConfig, "hardware", _hardware)
    resources = _get(d, path, PoolConfig, "resources", _resources)
    if hardware.lower() != "cpu" and resources.get("num_gpus", 0) <= 0:
        raise _err(_join(path, "resources.num_gpus"),
                   f"hardware {hardware!r} runs on an accelerator and needs num_gpus > 0 per replica; "
                   "allowed: num_gpus > 0, or hardware: cpu")
    cpus = _get(d, path, PoolConfig, "cpus", _cpus)
    return PoolConfig(name=name, role=role, replicas=replicas, hardware=hardware, resources=resources, cpus=cpus)


def _cpus(path: str, v: Any) -> tuple[int, ...] | None:
    if v is None:
        return None
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if not isinstance(v, (list, tuple)) or not v or any(isinstance(c, bool) or not isinstance(c, int) for c in v):
        raise _err(path, f"expected a non-empty list of CPU ids, got {_show(v)}; allowed: ids among {usable}")
    if len(set(v)) != len(v) or any(c < 0 for c in v):
        raise _err(path, f"{_show(v)} is not allowed; allowed: distinct CPU ids >= 0")
    return tuple(v)


def _pool_name(path: str, v: Any) -> str:
    if not isinstance(v, str) or not _POOL_NAME_RE.fullmatch(v):
        raise _err(path, f"{_show(v)} is not allowed; allowed: a name matching {POOL_NAME_PATTERN}")
    return v


def _hardware(path: str, v: Any) -> str:
    if not isinstance(v, str) or not _HARDWARE_RE.fullmatch(v):
        raise _err(path, f"{_show(v)} is not allowed; allowed: cpu, or an accelerator type label "
                         f"(e.g. gpu, H100) matching {_HARDWARE_RE.pattern}")
    return v


def _resources(path: str, v: Any) -> dict[str, float]:
    if v is None:
        return {"num_cpus": 1.0}
    if not isinstance(v, Mapping):
        raise _err(path, f"expected a mapping of Ray resources (num_cpus, num_gpus, memory, or custom "
                         f"resource names), got {_show(v)}")
    out: dict[str, float] = {}
    for k, x in v.items():
        p = _join(path, k)
        if not isinstance(k, str) or not k:
            raise _err(p, "resource names must be non-empty strings")
        if k in ("CPU", "GPU"):
            raise _err(p, f"use num_{k.lower()}s instead; "
                          "allowed: num_cpus, num_gpus, memory, or a custom resource")
        if k.startswith("num_") and k not in STANDARD_RESOURCES:
            raise _err(p, "unknown key; allowed: num_cpus, num_gpus, memory, or a custom resource name "
                          "(custom names must not start with num_)")
        if k == "memory":
            out[k] = _int(p, x, lo=0, hint=" (bytes)")  # type: ignore[assignment]
            continue
        q = _num(p, x, ge=0)
        if k == "num_gpus" and q > 1 and not q.is_integer():
            raise _err(p, f"{_fmt(q)} is not allowed; allowed: a fraction below 1 or a whole number")
        out[k] = q
    return out


def _parse_kv_cache(path: str, v: Any) -> KVCacheConfig:
    d = _section(path, v, _keys_of(KVCacheConfig))
    return KVCacheConfig(
        block_size=_get(d, path, KVCacheConfig, "block_size", _block_size),
        num_blocks=_get(d, path, KVCacheConfig, "num_blocks", _num_blocks),
        memory_mb=_get(d, path, KVCacheConfig, "memory_mb", lambda p, x: _int(p, x, lo=1, none=True)),
    )


def _block_size(path: str, v: Any) -> int:
    n = _int(path, v)
    assert n is not None
    if n < 1 or n & (n - 1):
        raise _err(path, f"{n} is not allowed; allowed: a power of two (1, 2, 4, 8, 16, 32, ...)")
    return n


def _num_blocks(path: str, v: Any) -> int | str:
    if v is None or v == "auto":
        return "auto"
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise _err(path, f"{_show(v)} is not allowed; allowed: 'auto' or an integer >= 1")
    return v


def _parse_engine(path: str, v: Any) -> EngineSection:
    d = _section(path, v, _keys_of(EngineSection))
    e = EngineSection(
        max_num_batched_tokens=_get(d, path, EngineSection, "max_num_batched_tokens",
                                    lambda p, x: _int(p, x, lo=1)),
        max_num_seqs=_get(d, path, EngineSection, "max_num_seqs", lambda p, x: _int(p, x, lo=1)),
        enable_prefix_caching=_get(d, path, EngineSection, "enable_prefix_caching", _bool),
        num_threads=_get(d, path, EngineSection, "num_threads", lambda p, x: _int(p, x, lo=1, none=True)),
        enforce_eager=_get(d, path, EngineSection, "enforce_eager", _bool),
    )
    if e.max_num_batched_tokens < e.max_num_seqs:  # a decode step is one token per sequence
        raise _err(_join(path, "max_num_batched_tokens"),
                   f"{e.max_num_batched_tokens} is below engine.max_num_seqs ({e.max_num_seqs}); "
                   f"allowed: >= {e.max_num_seqs}")
    return e


def _parse_kv_transfer(path: str, v: Any) -> KVTransferConfig:
    d = _section(path, v, _keys_of(KVTransferConfig))
    return KVTransferConfig(
        backend=_get(d, path, KVTransferConfig, "backend", _choice(KV_TRANSFER_BACKENDS)),
        layerwise=_get(d, path, KVTransferConfig, "layerwise", _bool),
        compression=_get(d, path, KVTransferConfig, "compression", _choice(KV_COMPRESSIONS)),
        timeout_s=_get(d, path, KVTransferConfig, "timeout_s", _positive),
        lease_s=_get(d, path, KVTransferConfig, "lease_s", _positive),
        faults=_get(d, path, KVTransferConfig, "faults", _kv_faults),
        shm_in_place=_get(d, path, KVTransferConfig, "shm_in_place", _bool),
        shm_verify=_get(d, path, KVTransferConfig, "shm_verify", _bool),
    )


def _kv_faults(path: str, v: Any) -> str | None:
    from kv_transfer.faults import KVFaults

    if v is None:
        return None
    if not isinstance(v, str):
        raise _err(path, f"expected a fault spec string like 'drop=0.1,delay_ms=200,seed=1' or null, got {_show(v)}")
    try:
        return v if KVFaults.parse(v) is not None else None
    except ValueError as e:
        raise _err(path, str(e)) from None


def _parse_timeouts(path: str, v: Any) -> TimeoutsConfig:
    d = _section(path, v, _keys_of(TimeoutsConfig))
    return TimeoutsConfig(
        startup_s=_get(d, path, TimeoutsConfig, "startup_s", _positive),
        request_s=_get(d, path, TimeoutsConfig, "request_s", _positive),
    )


def _parse_slo(path: str, v: Any) -> SLOConfig:
    d = _section(path, v, _keys_of(SLOConfig))
    return SLOConfig(
        ttft_ms=_get(d, path, SLOConfig, "ttft_ms", _positive),
        tpot_ms=_get(d, path, SLOConfig, "tpot_ms", _positive),
    )


def _parse_cluster(raw: Any) -> ClusterConfig:
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"(top level): expected a mapping of sections "
                          f"({', '.join(sorted(_keys_of(ClusterConfig)))}), got {_show(raw)}", key="")
    d = _section("", raw, _keys_of(ClusterConfig))
    cfg = ClusterConfig(
        ray=_parse_ray("ray", d.get("ray")),
        model=_parse_model("model", d.get("model")),
        mode=_choice(MODES)("mode", d["mode"]) if "mode" in d else ClusterConfig.mode,
        router=_parse_router("router", d.get("router")),
        pools=_parse_pools("pools", d["pools"]) if "pools" in d else _default_pools(),
        kv_cache=_parse_kv_cache("kv_cache", d.get("kv_cache")),
        engine=_parse_engine("engine", d.get("engine")),
        kv_transfer=_parse_kv_transfer("kv_transfer", d.get("kv_transfer")),
        timeouts=_parse_timeouts("timeouts", d.get("timeouts")),
        slo=_parse_slo("slo", d.get("slo")),
    )
    _check_mode(cfg)
    kv, max_len = cfg.kv_cache, cfg.model.max_model_len
    if isinstance(kv.num_blocks, int) and max_len is not None and kv.num_blocks * kv.block_size < max_len:
        raise _err("kv_cache.num_blocks",
                   f"{kv.num_blocks} blocks x {kv.block_size} tokens cannot hold one sequence of "
                   f"model.max_model_len {max_len}; allowed: >= {-(-max_len // kv.block_size)}, or 'auto'")
    return cfg


def _check_mode(cfg: ClusterConfig) -> None:
    if cfg.mode == "disaggregated":
        need, allowed_roles = ("prefill", "decode"), ("prefill", "decode")
    else:
        need, allowed_roles = ("colocated",), ("colocated",)
    for i, p in enumerate(cfg.pools):
        if p.role not in allowed_roles:
            raise _err(f"pools[{i}].role", f"{p.role!r} is not allowed in mode {cfg.mode}; "
                                           f"allowed: {', '.join(allowed_roles)}")
    for role in need:
        if cfg.replicas_by_role(role) < 1:
            names = ", ".join(p.name for p in cfg.pools_by_role(role)) or "none"
            raise _err("pools", f"mode {cfg.mode} needs at least one {role} replica, "
                                f"but the pools with role {role} ({names}) have 0 replicas in total; "
                                f"allowed: pools with roles {', '.join(allowed_roles)}, "
                                f"each role with replicas >= 1 in total")
