from proto import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HandshakeRequest(_message.Message):
    __slots__ = ("compat_hash", "layout_version", "model_id", "dtype", "block_size", "sender_id", "node_id", "shm_probe", "dist_backend", "tcp", "gpu_id")
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_PROBE_FIELD_NUMBER: _ClassVar[int]
    DIST_BACKEND_FIELD_NUMBER: _ClassVar[int]
    TCP_FIELD_NUMBER: _ClassVar[int]
    GPU_ID_FIELD_NUMBER: _ClassVar[int]
    compat_hash: str
    layout_version: int
    model_id: str
    dtype: str
    block_size: int
    sender_id: str
    node_id: str
    shm_probe: str
    dist_backend: str
    tcp: bool
    gpu_id: str
    def __init__(self, compat_hash: _Optional[str] = ..., layout_version: _Optional[int] = ..., model_id: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., sender_id: _Optional[str] = ..., node_id: _Optional[str] = ..., shm_probe: _Optional[str] = ..., dist_backend: _Optional[str] = ..., tcp: _Optional[bool] = ..., gpu_id: _Optional[str] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("ok", "reason", "compat_hash", "node_id", "shm_probe_data", "dist_store", "dist_pair", "dist_backend", "tcp_port", "tcp_conn", "tcp_token", "shm_cache", "shm_cache_offset", "shm_cache_blocks", "shm_cache_layers", "first_kv_head", "kv_heads", "gpu_id")
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_PROBE_DATA_FIELD_NUMBER: _ClassVar[int]
    DIST_STORE_FIELD_NUMBER: _ClassVar[int]
    DIST_PAIR_FIELD_NUMBER: _ClassVar[int]
    DIST_BACKEND_FIELD_NUMBER: _ClassVar[int]
    TCP_PORT_FIELD_NUMBER: _ClassVar[int]
    TCP_CONN_FIELD_NUMBER: _ClassVar[int]
    TCP_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SHM_CACHE_FIELD_NUMBER: _ClassVar[int]
    SHM_CACHE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHM_CACHE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHM_CACHE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    FIRST_KV_HEAD_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    GPU_ID_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    reason: str
    compat_hash: str
    node_id: str
    shm_probe_data: bytes
    dist_store: str
    dist_pair: str
    dist_backend: str
    tcp_port: int
    tcp_conn: str
    tcp_token: bytes
    shm_cache: str
    shm_cache_offset: int
    shm_cache_blocks: int
    shm_cache_layers: int
    first_kv_head: int
    kv_heads: int
    gpu_id: str
    def __init__(self, ok: _Optional[bool] = ..., reason: _Optional[str] = ..., compat_hash: _Optional[str] = ..., node_id: _Optional[str] = ..., shm_probe_data: _Optional[bytes] = ..., dist_store: _Optional[str] = ..., dist_pair: _Optional[str] = ..., dist_backend: _Optional[str] = ..., tcp_port: _Optional[int] = ..., tcp_conn: _Optional[str] = ..., tcp_token: _Optional[bytes] = ..., shm_cache: _Optional[str] = ..., shm_cache_offset: _Optional[int] = ..., shm_cache_blocks: _Optional[int] = ..., shm_cache_layers: _Optional[int] = ..., first_kv_head: _Optional[int] = ..., kv_heads: _Optional[int] = ..., gpu_id: _Optional[str] = ...) -> None: ...

class KVLayer(_message.Message):
    __slots__ = ("transfer_id", "auth_token", "layer", "dtype", "shape", "checksum", "payload", "compression", "scales", "first_block", "shm_name", "shm_offset", "shm_nbytes", "dist_pair", "dist_tag", "tcp_conn", "tcp_tag", "shm_in_place", "shm_checksummed")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    AUTH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHM_NBYTES_FIELD_NUMBER: _ClassVar[int]
    DIST_PAIR_FIELD_NUMBER: _ClassVar[int]
    DIST_TAG_FIELD_NUMBER: _ClassVar[int]
    TCP_CONN_FIELD_NUMBER: _ClassVar[int]
    TCP_TAG_FIELD_NUMBER: _ClassVar[int]
    SHM_IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    SHM_CHECKSUMMED_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    auth_token: str
    layer: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    checksum: int
    payload: bytes
    compression: str
    scales: bytes
    first_block: int
    shm_name: str
    shm_offset: int
    shm_nbytes: int
    dist_pair: str
    dist_tag: int
    tcp_conn: str
    tcp_tag: int
    shm_in_place: bool
    shm_checksummed: bool
    def __init__(self, transfer_id: _Optional[str] = ..., auth_token: _Optional[str] = ..., layer: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., checksum: _Optional[int] = ..., payload: _Optional[bytes] = ..., compression: _Optional[str] = ..., scales: _Optional[bytes] = ..., first_block: _Optional[int] = ..., shm_name: _Optional[str] = ..., shm_offset: _Optional[int] = ..., shm_nbytes: _Optional[int] = ..., dist_pair: _Optional[str] = ..., dist_tag: _Optional[int] = ..., tcp_conn: _Optional[str] = ..., tcp_tag: _Optional[int] = ..., shm_in_place: _Optional[bool] = ..., shm_checksummed: _Optional[bool] = ...) -> None: ...

class KVCommit(_message.Message):
    __slots__ = ("transfer_id", "auth_token", "first_token", "num_layers", "first_token_logprob", "layers")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    AUTH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    auth_token: str
    first_token: int
    num_layers: int
    first_token_logprob: _generate_pb2.TokenLogprob
    layers: _containers.RepeatedCompositeFieldContainer[KVLayer]
    def __init__(self, transfer_id: _Optional[str] = ..., auth_token: _Optional[str] = ..., first_token: _Optional[int] = ..., num_layers: _Optional[int] = ..., first_token_logprob: _Optional[_Union[_generate_pb2.TokenLogprob, _Mapping]] = ..., layers: _Optional[_Iterable[_Union[KVLayer, _Mapping]]] = ...) -> None: ...

class KVAbort(_message.Message):
    __slots__ = ("transfer_id", "auth_token", "reason")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    AUTH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    auth_token: str
    reason: str
    def __init__(self, transfer_id: _Optional[str] = ..., auth_token: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class KVAck(_message.Message):
    __slots__ = ("ok", "error", "layers_received")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LAYERS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    layers_received: int
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., layers_received: _Optional[int] = ...) -> None: ...
