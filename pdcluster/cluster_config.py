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

The sections are frozen dataclasses checked by pydantic (pdcluster/config_file.py): each field's
type, bounds and own check are declared once on its annotation (the value types in
pdcluster/cluster_fields.py), rules over several fields are `model_validator`s. Building or
changing a config in code (`dataclasses.replace`) checks nothing; `validate()` does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
    with_config,
)

from pdcluster.cluster_fields import (
    POOL_NAME_PATTERN,
    STANDARD_RESOURCES,
    ApiKeys,
    BlockSize,
    Cpus,
    Hardware,
    KVFaultSpec,
    NumBlocks,
    PoolName,
    Port,
    Positive,
    RayAddress,
    Resources,
    Section,
    Text,
)
from pdcluster.config_file import FORBID_EXTRA, ConfigError, Wording, invalid, read_yaml, validate
from scaling.policy import ControllerConfig

__all__ = ["API_KEYS_ENV", "DEFAULT_CLUSTER_FILE", "DTYPES", "KV_COMPRESSIONS", "KV_TRANSFER_BACKENDS",
           "MODES", "POOL_NAME_PATTERN", "ROLES", "STANDARD_RESOURCES", "ClusterConfig", "ConfigError", "ControllerSection",
           "EngineSection", "KVCacheConfig", "KVTransferConfig", "ModelSection", "PoolConfig", "RayConfig",
           "RouterConfig", "SLOConfig", "TimeoutsConfig", "load_cluster_config", "merge_env_api_keys"]

DEFAULT_CLUSTER_FILE = "cluster.yaml"
API_KEYS_ENV = "PDCLUSTER_API_KEYS"

Mode = Literal["disaggregated", "colocated"]
Role = Literal["prefill", "decode", "colocated"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
KVTransferBackend = Literal["auto", "grpc", "inproc", "torch_distributed", "shm", "tcp"]
KVCompression = Literal["none", "int8"]
KVCacheDtype = Literal["auto", "int8", "fp8_e4m3", "fp8_e5m2"]  # engine/kv_spec.py KV_CACHE_DTYPES
MODES, ROLES, DTYPES, KV_TRANSFER_BACKENDS, KV_COMPRESSIONS, KV_CACHE_DTYPES = (
    get_args(t) for t in (Mode, Role, Dtype, KVTransferBackend, KVCompression, KVCacheDtype))

_MIB = 1024 * 1024


# ----------------------------------------------------------------------------- sections


@with_config(FORBID_EXTRA)
@dataclass(frozen=True)
class RayConfig:
    # None: start an embedded local Ray; or join one: "auto" / "ray://HOST[:PORT]" / "HOST:PORT"
    address: RayAddress = None
    # times Ray restarts a worker or the router whose process died (0: never)
    max_restarts: Annotated[StrictInt, Field(ge=0, le=1000)] = 5


@with_config(FORBID_EXTRA)
@dataclass(frozen=True)
class ModelSection:
    path: Text = "builtin:stdlib-4m"  # builtin:NAME or a Hugging Face checkpoint directory
    dtype: Dtype = "auto"  # the checkpoint's dtype; or float32 / bfloat16 / float16
    # None: the model's max_position_embeddings, capped at 4096
    max_model_len: Annotated[StrictInt | None, Field(ge=2)] = 2048


@with_config(FORBID_EXTRA)
@dataclass(frozen=True)
class RouterConfig:
    host: Text = "127.0.0.1"
    grpc_port: Port = 50051  # 0: pick a free port
    http_port: Port = 8000  # 0: pick a free port
    api_keys: ApiKeys = field(default=(), repr=False)  # empty: no authentication
    # per request, after a worker or KV transfer failure (0: none)
    max_retries: Annotated[StrictInt, Field(ge=0, le=10)] = 2
    # admitted requests in flight; beyond: RESOURCE_EXHAUSTED / HTTP 429
    max_requests: Annotated[StrictInt, Field(ge=1)] = 512
    # prompt tokens of admitted requests waiting for prefill
    max_queued_prompt_tokens: Annotated[StrictInt, Field(ge=1)] = 262144
    tls_cert: Text | None = None  # PEM certificate chain: the gRPC and HTTP ports serve TLS only
    tls_key: Text | None = field(default=None, repr=False)  # its PEM private key (both or neither)
    # disaggregated: prompts up to this long may prefill on their decode worker (512: measured best,
    # docs/results/serving_vs_vllm.md)
    local_prefill_max_tokens: Annotated[StrictInt, Field(ge=0)] = 512
    # pick workers by what their prefix caches hold as well as by load (router/prefix_policy.py), and
    # a decode worker shares the blocks of a prompt it holds; false: by load only, all KV moves
    prefix_aware: StrictBool = True
    # disaggregated: a prompt whose part not cached on its decode worker is at most this long is
    # prefilled there and no KV moves (conditional disaggregation); 0: always a prefill worker
    local_prefill_uncached_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    # disaggregated: a prompt up to this long is sent to its prefill worker while its decode worker
    # reserves KV blocks (the ticket follows; the K/V computed before it came is held); 0: never
    reserve_overlap_max_tokens: Annotated[StrictInt, Field(ge=0)] = 0

    @model_validator(mode="after")
    def _pairs(self) -> RouterConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            missing = "tls_key" if self.tls_key is None else "tls_cert"
            raise invalid("required when the other TLS file is given; allowed: both tls_cert and tls_key "
                          "(PEM files), or neither (no TLS)", missing)
        if self.grpc_port and self.grpc_port == self.http_port:
            raise invalid(f"{self.http_port} is also router.grpc_port; "
                          "allowed: a different port, or 0 (pick a free port)", "http_port")
        return self


@with_config(FORBID_EXTRA)
@dataclass(frozen=True)
class PoolConfig:
    name: PoolName
    role: Role  # prefill / decode / colocated
    replicas: Annotated[StrictInt, Field(ge=0)] = 1
    # "cpu", or an accelerator type label (runs on CUDA, needs num_gpus > 0)
    hardware: Hardware = "cpu"
    # Ray, per replica (checked against `hardware` even when left out)
    resources: Annotated[Resources, Field(validate_default=True)] = field(
        default_factory=lambda: {"num_cpus": 1.0})
    # pin each replica's process to these CPU ids (Linux); None: no pinning
    cpus: Cpus = None
    # each replica's model split over this many processes on its node (engine/tp_layout.py); with
    # accelerators one device each (resources.num_gpus >= it), on CPU num_cpus shared by them
    tensor_parallel_size: Annotated[StrictInt, Field(ge=1)] = 1
    # a mixture-of-experts model's routed experts whole, E/N per rank of those N, instead of each
    # expert split N ways; attention and dense/shared MLPs stay tensor-parallel (docs/models.md)
    expert_parallel: StrictBool = False
    # the SLO controller (`controller:`) keeps this pool's workers within these (None: `replicas`)
    min_replicas: Annotated[StrictInt | None, Field(ge=0)] = None
    max_replicas: Annotated[StrictInt | None, Field(ge=0)] = None

    @property
    def device(self) -> str:
        """The torch device of this pool's engines: "cpu" for hardware cpu, else "cuda"."""
        return "cpu" if self.hardware.lower() == "cpu" else "cuda"

    @field_validator("resources")
    @classmethod
    def _accelerator_has_gpus(cls, resources: dict[str, float], info: ValidationInfo) -> dict[str, float]:
        hardware = info.data.get("hardware", "cpu")
        if hardware.lower() != "cpu" and resources.get("num_gpus", 0) <= 0:
            raise invalid(f"hardware {hardware!r} runs on an accelerator and needs num_gpus > 0 per replica; "
                          "allowed: num_gpus > 0, or hardware: cpu", "num_gpus")
        return resources

    @model_validator(mode="after")
    def _a_device_per_rank(self) -> PoolConfig:
        gpus = self.resources.get("num_gpus", 0)
        if gpus and self.tensor_parallel_size > 1 and gpus < self.tensor_parallel_size:
            raise invalid(f"{gpus:g} GPUs per replica cannot hold {self.tensor_parallel_size} tensor-parallel ranks "
                          f"(one device each); allowed: num_gpus >= {self.tensor_parallel_size}", "num_gpus")
        return self

    @model_validator(mode="after")
    def _replicas_within_bounds(self) -> PoolConfig:
        low, high = self.replica_bounds
        if not low <= self.replicas <= high:
            raise invalid(f"replicas {self.replicas} is not within min_replicas {low} and max_replicas {high}; "
                          "allowed: min_replicas <= replicas <= max_replicas", "replicas")
        return self

    @property
    def replica_bounds(self) -> tuple[int, int]:
        """(min_replicas, max_replicas), `replicas` where unset."""
        low = self.replicas if self.min_replicas is None else self.min_replicas
        return low, self.replicas if self.max_replicas is None else self.max_replicas


def _unique_names(pools: tuple[PoolConfig, ...]) -> tuple[PoolConfig, ...]:
    first: dict[str, int] = {}
    for i, pool in enumerate(pools):
        if pool.name in first:
            raise invalid(f"{pool.name!r} is already used by pools[{first[pool.name]}]; "
                          "allowed: a name unique among the pools", f"[{i}].name")
        first[pool.name] = i
    return pools


@with_config(FORBID_EXTRA)
@dataclass(frozen=True)
class KVCacheConfig:
    block_size: BlockSize = 16  # tokens per block, a power of two
    num_blocks: NumBlocks = "auto"  # "auto": from memory_mb
    # KV cache budget per worker in MiB; None: engine default (90% free GPU)
    memory_mb: Annotated[StrictInt | None, Field(ge=1)] = 512
    # "auto": the model's dtype; int8 / fp8_e4m3 / fp8_e5m2: quantized pages, a scale per token and
    # head (engine/kv_quant.py); they travel between workers as they are stored
    dtype: KVCacheDtype = "auto"
    # an opt-in, approximate bound on each sequence's KV (StreamingLLM): attend to the first
    # sink_tokens and the last recent_tokens positions only, and give back the blocks between;
    # recent_tokens null: off (exact attention over every key)
    sink_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    recent_tokens: Annotated[StrictInt | None, Field(ge=1)] = None
    # the offload tier (engine/kv_tier.py): blocks evicted from the workers' prefix caches go to a
    # pool of offload_mb MiB per node, shared by the cluster's workers there, in a directory made
    # under offload_dir (/dev/shm: host memory; a disk path: a disk pool); 0: off
    offload_mb: Annotated[StrictInt, Field(ge=0)] = 0
    offload_dir: StrictStr = "/dev/shm"


@with_config(FORBID_EXTRA)
@dataclass(frozen=True)
class EngineSection:
    max_num_batched_tokens: Annotated[StrictInt, Field(ge=1)] = 2048
    max_num_seqs: Annotated[StrictInt, Field(ge=1)] = 256
    enable_prefix_caching: StrictBool = True
    num_threads: Annotated[StrictInt | None, Field(ge=1)] = None  # torch threads on CPU; None: its default
    enforce_eager: StrictBool = False  # plain torch only (no native kernel, no prepacked oneDNN weights)

    @model_validator(mode="after")
    def _a_decode_step_fits(self) -> EngineSection:  # a decode step is one token per sequence
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise invalid(f"{self.max_num_batched_tokens} is below engine.max_num_seqs "
                          f"({self.max_num_seqs}); allowed: >= {self.max_num_seqs}", "max_num_batched_tokens")
        return self


@with_config(FORBID_EXTRA)
@dataclass(frozen=True)
class KVTransferConfig:
    backend: KVTransferBackend = "auto"
    layerwise: StrictBool = True  # send each layer's KV as soon as it is computed
    compression: KVCompression = "none"
    timeout_s: Positive = 30.0
    lease_s: Positive = 120.0  # a decode reservation whose KV has not committed by then is freed
    # fault injection spec (kv_transfer/faults.py); null: off
    faults: KVFaultSpec = None
    shm_in_place: StrictBool = True  # shm/auto on one node: prefill writes into the decode worker's cache
    shm_verify: StrictBool = False  # shm in place: an XXH3 checksum per layer, checked by the receiver


@with_config(FORBID_EXTRA)
@dataclass(frozen=True)
class TimeoutsConfig:
    startup_s: Positive = 180.0
    request_s: Positive = 600.0


@with_config(FORBID_EXTRA)
@dataclass(frozen=True)
class SLOConfig:
    ttft_ms: Positive = 1000.0
    tpot_ms: Positive = 50.0


@with_config(FORBID_EXTRA)
@dataclass(frozen=True)
class ControllerSection:
    """The SLO controller (docs/controller.md): moves workers between prefill and decode in place
    and starts or stops workers within the pools' min_replicas / max_replicas, against `slo:`."""

    enabled: StrictBool = False
    interval_s: Positive = 5.0  # how often it decides
    scale_up_at: Positive = 0.8  # a role this pressed (1.0: at its limit) grows
    scale_down_at: Positive = 0.3  # a role under this gives workers back
    shrink_to: Positive = 0.4  # a role giving workers keeps enough to stay at this
    urgent_at: Positive = 1.5  # this pressed: no waiting for the cooldown or warm-up
    settle_intervals: Annotated[StrictInt, Field(ge=1)] = 2  # a proposal must hold this many intervals
    cooldown_s: Annotated[StrictFloat, Field(ge=0)] = 30.0  # no decision within this long of the last
    warmup_s: Annotated[StrictFloat, Field(ge=0)] = 15.0  # a worker this young: its samples are ignored
    shrink_after_s: Annotated[StrictFloat, Field(ge=0)] = 120.0  # a role that grew gives back no sooner
    flips: StrictBool = True  # workers change role in place (no reload); else only start and stop
    drain_timeout_s: Positive = 120.0  # a worker leaving its role finishes its requests within this

    @model_validator(mode="after")
    def _band_in_order(self) -> ControllerSection:
        if not 0 < self.scale_down_at < self.shrink_to < self.scale_up_at <= self.urgent_at:
            raise invalid(f"need scale_down_at < shrink_to < scale_up_at <= urgent_at, got {self.scale_down_at}, "
                          f"{self.shrink_to}, {self.scale_up_at}, {self.urgent_at}", "scale_up_at")
        return self


def _default_pools() -> tuple[PoolConfig, ...]:
    return (PoolConfig(name="prefill", role="prefill"), PoolConfig(name="decode", role="decode"))


@with_config(FORBID_EXTRA)
@dataclass(frozen=True)
class ClusterConfig:
    ray: Section[RayConfig] = field(default_factory=RayConfig)
    model: Section[ModelSection] = field(default_factory=ModelSection)
    mode: Mode = "disaggregated"
    router: Section[RouterConfig] = field(default_factory=RouterConfig)
    pools: Annotated[tuple[PoolConfig, ...], AfterValidator(_unique_names), Wording(
        expected=f"a list of pools (mappings with keys {', '.join(f.name for f in fields(PoolConfig))})",
    )] = field(default_factory=_default_pools)
    kv_cache: Section[KVCacheConfig] = field(default_factory=KVCacheConfig)
    engine: Section[EngineSection] = field(default_factory=EngineSection)
    kv_transfer: Section[KVTransferConfig] = field(default_factory=KVTransferConfig)
    timeouts: Section[TimeoutsConfig] = field(default_factory=TimeoutsConfig)
    slo: Section[SLOConfig] = field(default_factory=SLOConfig)
    controller: Section[ControllerSection] = field(default_factory=ControllerSection)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> ClusterConfig:
        """Validate a parsed deployment file; missing keys take their defaults."""
        return validate(cls, d)

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts/lists/scalars in the file's layout; `from_dict(c.to_dict()) == c`."""
        return _plain(self)

    def validate(self) -> ClusterConfig:
        """Check a config built or changed in code (e.g. with dataclasses.replace); returns it normalized."""
        return ClusterConfig.from_dict(self.to_dict())

    def pools_by_role(self, role: str) -> list[PoolConfig]:
        if role not in ROLES:
            raise ValueError(f"role {role!r} is not allowed; allowed: {', '.join(ROLES)}")
        return [p for p in self.pools if p.role == role]

    def replicas_by_role(self, role: str) -> int:
        return sum(p.replicas for p in self.pools_by_role(role))

    def controller_config(self) -> ControllerConfig:
        """The SLO controller's decision settings (scaling/policy.py) from `controller:` and `slo:`."""
        c = self.controller
        return ControllerConfig(interval_s=c.interval_s, slo_ttft_ms=self.slo.ttft_ms, slo_tpot_ms=self.slo.tpot_ms,
                                scale_up_at=c.scale_up_at, scale_down_at=c.scale_down_at, shrink_to=c.shrink_to,
                                urgent_at=c.urgent_at, settle_intervals=c.settle_intervals, cooldown_s=c.cooldown_s,
                                warmup_s=c.warmup_s, shrink_after_s=c.shrink_after_s, flips=c.flips)

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
            "kv_cache_dtype": kv.dtype,
            "kv_sink_tokens": kv.sink_tokens,
            "kv_recent_tokens": kv.recent_tokens,
            "kv_offload_bytes": kv.offload_mb * _MIB,
            "max_num_batched_tokens": self.engine.max_num_batched_tokens,
            "max_num_seqs": self.engine.max_num_seqs,
            "enable_prefix_caching": self.engine.enable_prefix_caching,
            "num_threads": self.engine.num_threads,
            "enforce_eager": self.engine.enforce_eager,
        }
        if pool is not None:
            kwargs["device"] = pool.device
            kwargs["tensor_parallel_size"] = pool.tensor_parallel_size
            kwargs["expert_parallel"] = pool.expert_parallel
        return kwargs

    @model_validator(mode="after")
    def _pools_fit_mode_and_a_sequence_fits(self) -> ClusterConfig:
        roles = ("prefill", "decode") if self.mode == "disaggregated" else ("colocated",)
        for i, p in enumerate(self.pools):
            if p.role not in roles:
                raise invalid(f"{p.role!r} is not allowed in mode {self.mode}; allowed: {', '.join(roles)}",
                              f"pools[{i}].role")
        for role in roles:
            if self.replicas_by_role(role) < 1:
                names = ", ".join(p.name for p in self.pools_by_role(role)) or "none"
                raise invalid(f"mode {self.mode} needs at least one {role} replica, but the pools with role "
                              f"{role} ({names}) have 0 replicas in total; allowed: pools with roles "
                              f"{', '.join(roles)}, each role with replicas >= 1 in total", "pools")
        if self.controller.enabled and self.mode != "disaggregated":
            raise invalid("the controller moves workers between prefill and decode; allowed: false in mode "
                          f"{self.mode}", "controller.enabled")
        kv, max_len = self.kv_cache, self.model.max_model_len
        if kv.dtype != "auto" and self.kv_transfer.compression != "none":
            raise invalid(f"{self.kv_transfer.compression!r} compresses KV of the model's dtype, but kv_cache.dtype "
                          f"{kv.dtype} pages are already quantized and travel as they are stored; allowed: 'none' "
                          "with quantized pages", "kv_transfer.compression")
        if kv.sink_tokens and kv.recent_tokens is None:
            raise invalid(f"{kv.sink_tokens} sink tokens bound nothing without kv_cache.recent_tokens; allowed: "
                          "0, or recent_tokens set", "kv_cache.sink_tokens")
        if isinstance(kv.num_blocks, int) and max_len is not None and kv.num_blocks * kv.block_size < max_len:
            raise invalid(f"{kv.num_blocks} blocks x {kv.block_size} tokens cannot hold one sequence of "
                          f"model.max_model_len {max_len}; "
                          f"allowed: >= {-(-max_len // kv.block_size)}, or 'auto'", "kv_cache.num_blocks")
        return self


def _plain(obj: Any) -> Any:
    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_plain(x) for x in obj]
    if isinstance(obj, Mapping):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


# ----------------------------------------------------------------------------- loading


def load_cluster_config(path: str | Path, *, env: Mapping[str, str] | None = None) -> ClusterConfig:
    """Read, validate and return a deployment file; merges API keys from $PDCLUSTER_API_KEYS.

    `env` defaults to os.environ. Every problem is a ConfigError whose message starts with the
    file name (and, for YAML syntax errors, the line and column).
    """
    name = str(path)
    raw = read_yaml(Path(path), "cluster config")
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
