from proto import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
    WORKER_ROLE_COLOCATED: _ClassVar[WorkerRole]
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
WORKER_ROLE_COLOCATED: WorkerRole

class TransferTicket(_message.Message):
    __slots__ = ("transfer_id", "kv_endpoint", "block_ids", "compat_hash", "auth_token", "num_tokens", "backend", "cached_tokens", "rank_endpoints")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    AUTH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RANK_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    kv_endpoint: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    compat_hash: str
    auth_token: str
    num_tokens: int
    backend: str
    cached_tokens: int
    rank_endpoints: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, transfer_id: _Optional[str] = ..., kv_endpoint: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., compat_hash: _Optional[str] = ..., auth_token: _Optional[str] = ..., num_tokens: _Optional[int] = ..., backend: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., rank_endpoints: _Optional[_Iterable[str]] = ...) -> None: ...

class TierSource(_message.Message):
    __slots__ = ("address", "blocks", "role")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    address: str
    blocks: int
    role: WorkerRole
    def __init__(self, address: _Optional[str] = ..., blocks: _Optional[int] = ..., role: _Optional[_Union[WorkerRole, str]] = ...) -> None: ...

class ReadTierRequest(_message.Message):
    __slots__ = ("hashes",)
    HASHES_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class TierBlock(_message.Message):
    __slots__ = ("hash", "data")
    HASH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    data: bytes
    def __init__(self, hash: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "ticket", "resume_offset", "tier_source", "ticket_follows")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    RESUME_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TIER_SOURCE_FIELD_NUMBER: _ClassVar[int]
    TICKET_FOLLOWS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generate_pb2.SamplingParams
    ticket: TransferTicket
    resume_offset: int
    tier_source: TierSource
    ticket_follows: bool
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., ticket: _Optional[_Union[TransferTicket, _Mapping]] = ..., resume_offset: _Optional[int] = ..., tier_source: _Optional[_Union[TierSource, _Mapping]] = ..., ticket_follows: _Optional[bool] = ...) -> None: ...

class AttachTicketRequest(_message.Message):
    __slots__ = ("request_id", "ticket")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    ticket: TransferTicket
    def __init__(self, request_id: _Optional[str] = ..., ticket: _Optional[_Union[TransferTicket, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token", "first_token_logprob", "num_prompt_tokens", "num_cached_tokens", "prefill_queue_ms", "prefill_compute_ms", "kv_transfer_ms", "finish_reason", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token: int
    first_token_logprob: _generate_pb2.TokenLogprob
    num_prompt_tokens: int
    num_cached_tokens: int
    prefill_queue_ms: float
    prefill_compute_ms: float
    kv_transfer_ms: float
    finish_reason: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., first_token: _Optional[int] = ..., first_token_logprob: _Optional[_Union[_generate_pb2.TokenLogprob, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., prefill_queue_ms: _Optional[float] = ..., prefill_compute_ms: _Optional[float] = ..., kv_transfer_ms: _Optional[float] = ..., finish_reason: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generate_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "num_prompt_tokens", "max_tokens", "sampling", "token_ids", "run_prefill", "transfer_id", "resume_offset", "reuse_cached_prefix")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RUN_PREFILL_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REUSE_CACHED_PREFIX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    sampling: _generate_pb2.SamplingParams
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    run_prefill: bool
    transfer_id: str
    resume_offset: int
    reuse_cached_prefix: bool
    def __init__(self, request_id: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., run_prefill: _Optional[bool] = ..., transfer_id: _Optional[str] = ..., resume_offset: _Optional[int] = ..., reuse_cached_prefix: _Optional[bool] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: TransferTicket
    def __init__(self, ticket: _Optional[_Union[TransferTicket, _Mapping]] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("request_id", "start_index", "token_ids", "logprobs", "finish_reason", "decode_queue_ms", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    START_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    DECODE_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    start_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenLogprob]
    finish_reason: str
    decode_queue_ms: float
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., start_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_generate_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., decode_queue_ms: _Optional[float] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generate_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("ok", "reason", "worker_id", "role", "model", "compat_hash")
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    reason: str
    worker_id: str
    role: WorkerRole
    model: str
    compat_hash: str
    def __init__(self, ok: _Optional[bool] = ..., reason: _Optional[str] = ..., worker_id: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., model: _Optional[str] = ..., compat_hash: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("prefix_cache_events", "prefix_cache_cursor", "tier_cursor")
    PREFIX_CACHE_EVENTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_CURSOR_FIELD_NUMBER: _ClassVar[int]
    TIER_CURSOR_FIELD_NUMBER: _ClassVar[int]
    prefix_cache_events: bool
    prefix_cache_cursor: int
    tier_cursor: int
    def __init__(self, prefix_cache_events: _Optional[bool] = ..., prefix_cache_cursor: _Optional[int] = ..., tier_cursor: _Optional[int] = ...) -> None: ...

class PrefixCacheEvents(_message.Message):
    __slots__ = ("cursor", "snapshot", "stored", "removed", "block_size", "tier_id", "tier_cursor", "tier_snapshot", "tier_stored", "tier_removed")
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TIER_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_CURSOR_FIELD_NUMBER: _ClassVar[int]
    TIER_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    TIER_STORED_FIELD_NUMBER: _ClassVar[int]
    TIER_REMOVED_FIELD_NUMBER: _ClassVar[int]
    cursor: int
    snapshot: bool
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    block_size: int
    tier_id: str
    tier_cursor: int
    tier_snapshot: bool
    tier_stored: _containers.RepeatedScalarFieldContainer[bytes]
    tier_removed: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, cursor: _Optional[int] = ..., snapshot: _Optional[bool] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ..., block_size: _Optional[int] = ..., tier_id: _Optional[str] = ..., tier_cursor: _Optional[int] = ..., tier_snapshot: _Optional[bool] = ..., tier_stored: _Optional[_Iterable[bytes]] = ..., tier_removed: _Optional[_Iterable[bytes]] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "role", "running", "queued", "kv_blocks_used", "kv_blocks_free", "queued_prefill_tokens", "kv_bytes_sent", "prefix_cache_hit_tokens", "prompt_tokens", "steps", "steps_by_batch", "prefix_cache", "kv_bytes_not_sent", "local_prefills", "tier_id", "tier_capacity_bytes", "tier_used_bytes", "tier_blocks", "tier_saves", "tier_hits", "tier_misses", "tier_evictions")
    class KvBytesSentEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STEPS_BY_BATCH_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_NOT_SENT_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    TIER_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIER_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_SAVES_FIELD_NUMBER: _ClassVar[int]
    TIER_HITS_FIELD_NUMBER: _ClassVar[int]
    TIER_MISSES_FIELD_NUMBER: _ClassVar[int]
    TIER_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: WorkerRole
    running: int
    queued: int
    kv_blocks_used: int
    kv_blocks_free: int
    queued_prefill_tokens: int
    kv_bytes_sent: _containers.ScalarMap[str, int]
    prefix_cache_hit_tokens: int
    prompt_tokens: int
    steps: _containers.RepeatedCompositeFieldContainer[StepPhaseStats]
    steps_by_batch: _containers.RepeatedCompositeFieldContainer[StepPhaseStats]
    prefix_cache: PrefixCacheEvents
    kv_bytes_not_sent: int
    local_prefills: int
    tier_id: str
    tier_capacity_bytes: int
    tier_used_bytes: int
    tier_blocks: int
    tier_saves: int
    tier_hits: int
    tier_misses: int
    tier_evictions: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., running: _Optional[int] = ..., queued: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., kv_bytes_sent: _Optional[_Mapping[str, int]] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., steps: _Optional[_Iterable[_Union[StepPhaseStats, _Mapping]]] = ..., steps_by_batch: _Optional[_Iterable[_Union[StepPhaseStats, _Mapping]]] = ..., prefix_cache: _Optional[_Union[PrefixCacheEvents, _Mapping]] = ..., kv_bytes_not_sent: _Optional[int] = ..., local_prefills: _Optional[int] = ..., tier_id: _Optional[str] = ..., tier_capacity_bytes: _Optional[int] = ..., tier_used_bytes: _Optional[int] = ..., tier_blocks: _Optional[int] = ..., tier_saves: _Optional[int] = ..., tier_hits: _Optional[int] = ..., tier_misses: _Optional[int] = ..., tier_evictions: _Optional[int] = ...) -> None: ...

class StepPhaseStats(_message.Message):
    __slots__ = ("phase", "steps", "seconds", "seqs", "tokens", "context_tokens", "batch_min")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BATCH_MIN_FIELD_NUMBER: _ClassVar[int]
    phase: str
    steps: int
    seconds: float
    seqs: int
    tokens: int
    context_tokens: int
    batch_min: int
    def __init__(self, phase: _Optional[str] = ..., steps: _Optional[int] = ..., seconds: _Optional[float] = ..., seqs: _Optional[int] = ..., tokens: _Optional[int] = ..., context_tokens: _Optional[int] = ..., batch_min: _Optional[int] = ...) -> None: ...
