from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CachePriority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_PRIORITY_UNSPECIFIED: _ClassVar[CachePriority]
    CACHE_PRIORITY_LOW: _ClassVar[CachePriority]

class AllocationPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ALLOCATION_POLICY_UNSPECIFIED: _ClassVar[AllocationPolicy]
    ALLOCATION_POLICY_PAGED: _ClassVar[AllocationPolicy]
    ALLOCATION_POLICY_RESERVE: _ClassVar[AllocationPolicy]

class AllocationStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ALLOCATION_STATUS_UNSPECIFIED: _ClassVar[AllocationStatus]
    ALLOCATION_STATUS_OK: _ClassVar[AllocationStatus]
    ALLOCATION_STATUS_NO_ROOM: _ClassVar[AllocationStatus]
CACHE_PRIORITY_UNSPECIFIED: CachePriority
CACHE_PRIORITY_LOW: CachePriority
ALLOCATION_POLICY_UNSPECIFIED: AllocationPolicy
ALLOCATION_POLICY_PAGED: AllocationPolicy
ALLOCATION_POLICY_RESERVE: AllocationPolicy
ALLOCATION_STATUS_UNSPECIFIED: AllocationStatus
ALLOCATION_STATUS_OK: AllocationStatus
ALLOCATION_STATUS_NO_ROOM: AllocationStatus

class RegisterPoolRequest(_message.Message):
    __slots__ = ("pool_id", "num_blocks", "block_size", "model_fingerprint", "enable_prefix_caching", "allocation_policy", "max_model_len", "executor_instance_id", "medium", "kv_store", "kv_store_namespace", "kv_store_capacity_blocks")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_POLICY_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    num_blocks: int
    block_size: int
    model_fingerprint: str
    enable_prefix_caching: bool
    allocation_policy: AllocationPolicy
    max_model_len: int
    executor_instance_id: str
    medium: str
    kv_store: str
    kv_store_namespace: str
    kv_store_capacity_blocks: int
    def __init__(self, pool_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., enable_prefix_caching: _Optional[bool] = ..., allocation_policy: _Optional[_Union[AllocationPolicy, str]] = ..., max_model_len: _Optional[int] = ..., executor_instance_id: _Optional[str] = ..., medium: _Optional[str] = ..., kv_store: _Optional[str] = ..., kv_store_namespace: _Optional[str] = ..., kv_store_capacity_blocks: _Optional[int] = ...) -> None: ...

class RegisterPoolResponse(_message.Message):
    __slots__ = ("created",)
    CREATED_FIELD_NUMBER: _ClassVar[int]
    created: bool
    def __init__(self, created: _Optional[bool] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("pool_id", "ttl_ms", "client_name")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    ttl_ms: int
    client_name: str
    def __init__(self, pool_id: _Optional[str] = ..., ttl_ms: _Optional[int] = ..., client_name: _Optional[str] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "ttl_ms", "allocate_socket", "instance_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATE_SOCKET_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    ttl_ms: int
    allocate_socket: str
    instance_id: str
    def __init__(self, session_id: _Optional[str] = ..., ttl_ms: _Optional[int] = ..., allocate_socket: _Optional[str] = ..., instance_id: _Optional[str] = ...) -> None: ...

class RenewSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class RenewSessionResponse(_message.Message):
    __slots__ = ("expires_in_ms",)
    EXPIRES_IN_MS_FIELD_NUMBER: _ClassVar[int]
    expires_in_ms: int
    def __init__(self, expires_in_ms: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("num_sequences_freed",)
    NUM_SEQUENCES_FREED_FIELD_NUMBER: _ClassVar[int]
    num_sequences_freed: int
    def __init__(self, num_sequences_freed: _Optional[int] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("pool_id", "session_id", "free_seq_ids", "sequences", "written_seq_ids", "written_num_tokens", "store_report")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FREE_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STORE_REPORT_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    session_id: str
    free_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceAllocation]
    written_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    written_num_tokens: _containers.RepeatedScalarFieldContainer[int]
    store_report: StoreReport
    def __init__(self, pool_id: _Optional[str] = ..., session_id: _Optional[str] = ..., free_seq_ids: _Optional[_Iterable[int]] = ..., sequences: _Optional[_Iterable[_Union[SequenceAllocation, _Mapping]]] = ..., written_seq_ids: _Optional[_Iterable[int]] = ..., written_num_tokens: _Optional[_Iterable[int]] = ..., store_report: _Optional[_Union[StoreReport, _Mapping]] = ...) -> None: ...

class StoreReport(_message.Message):
    __slots__ = ("saved_hashes", "failed_hashes", "missing_hashes")
    SAVED_HASHES_FIELD_NUMBER: _ClassVar[int]
    FAILED_HASHES_FIELD_NUMBER: _ClassVar[int]
    MISSING_HASHES_FIELD_NUMBER: _ClassVar[int]
    saved_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    failed_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    missing_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, saved_hashes: _Optional[_Iterable[bytes]] = ..., failed_hashes: _Optional[_Iterable[bytes]] = ..., missing_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class StoreOrders(_message.Message):
    __slots__ = ("save_block_ids", "save_hashes", "save_keys", "delete_hashes")
    SAVE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SAVE_HASHES_FIELD_NUMBER: _ClassVar[int]
    SAVE_KEYS_FIELD_NUMBER: _ClassVar[int]
    DELETE_HASHES_FIELD_NUMBER: _ClassVar[int]
    save_block_ids: _containers.RepeatedScalarFieldContainer[int]
    save_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    save_keys: _containers.RepeatedScalarFieldContainer[bytes]
    delete_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, save_block_ids: _Optional[_Iterable[int]] = ..., save_hashes: _Optional[_Iterable[bytes]] = ..., save_keys: _Optional[_Iterable[bytes]] = ..., delete_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SequenceAllocation(_message.Message):
    __slots__ = ("seq_id", "token_ids", "num_new_tokens", "enable_prefix_caching", "cache_salt", "adapter_id", "num_lookahead_slots", "tenant", "num_shared_tokens", "cache_ttl_ms", "cache_priority", "num_precomputed_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKAHEAD_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    CACHE_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    NUM_PRECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_new_tokens: int
    enable_prefix_caching: bool
    cache_salt: str
    adapter_id: str
    num_lookahead_slots: int
    tenant: str
    num_shared_tokens: int
    cache_ttl_ms: int
    cache_priority: CachePriority
    num_precomputed_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_new_tokens: _Optional[int] = ..., enable_prefix_caching: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., adapter_id: _Optional[str] = ..., num_lookahead_slots: _Optional[int] = ..., tenant: _Optional[str] = ..., num_shared_tokens: _Optional[int] = ..., cache_ttl_ms: _Optional[int] = ..., cache_priority: _Optional[_Union[CachePriority, str]] = ..., num_precomputed_tokens: _Optional[int] = ...) -> None: ...

class SequenceAllocationResult(_message.Message):
    __slots__ = ("seq_id", "status", "num_cached_tokens", "start_position", "num_tokens", "block_table_offset", "block_table", "copy_src", "copy_dst", "num_store_tokens", "store_load_block_ids", "store_load_hashes")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    COPY_SRC_FIELD_NUMBER: _ClassVar[int]
    COPY_DST_FIELD_NUMBER: _ClassVar[int]
    NUM_STORE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STORE_LOAD_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    STORE_LOAD_HASHES_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    status: AllocationStatus
    num_cached_tokens: int
    start_position: int
    num_tokens: int
    block_table_offset: int
    block_table: _containers.RepeatedScalarFieldContainer[int]
    copy_src: _containers.RepeatedScalarFieldContainer[int]
    copy_dst: _containers.RepeatedScalarFieldContainer[int]
    num_store_tokens: int
    store_load_block_ids: _containers.RepeatedScalarFieldContainer[int]
    store_load_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, seq_id: _Optional[int] = ..., status: _Optional[_Union[AllocationStatus, str]] = ..., num_cached_tokens: _Optional[int] = ..., start_position: _Optional[int] = ..., num_tokens: _Optional[int] = ..., block_table_offset: _Optional[int] = ..., block_table: _Optional[_Iterable[int]] = ..., copy_src: _Optional[_Iterable[int]] = ..., copy_dst: _Optional[_Iterable[int]] = ..., num_store_tokens: _Optional[int] = ..., store_load_block_ids: _Optional[_Iterable[int]] = ..., store_load_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AllocateResponse(_message.Message):
    __slots__ = ("results", "kv_cache_usage", "store_orders")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    STORE_ORDERS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SequenceAllocationResult]
    kv_cache_usage: float
    store_orders: StoreOrders
    def __init__(self, results: _Optional[_Iterable[_Union[SequenceAllocationResult, _Mapping]]] = ..., kv_cache_usage: _Optional[float] = ..., store_orders: _Optional[_Union[StoreOrders, _Mapping]] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("pool_id", "session_id", "parent_seq_id", "child_seq_ids")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    session_id: str
    parent_seq_id: int
    child_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pool_id: _Optional[str] = ..., session_id: _Optional[str] = ..., parent_seq_id: _Optional[int] = ..., child_seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ForkResponse(_message.Message):
    __slots__ = ("block_table",)
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    block_table: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_table: _Optional[_Iterable[int]] = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("pool_id", "session_id", "seq_ids", "written_seq_ids", "written_num_tokens", "store_report")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STORE_REPORT_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    session_id: str
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    written_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    written_num_tokens: _containers.RepeatedScalarFieldContainer[int]
    store_report: StoreReport
    def __init__(self, pool_id: _Optional[str] = ..., session_id: _Optional[str] = ..., seq_ids: _Optional[_Iterable[int]] = ..., written_seq_ids: _Optional[_Iterable[int]] = ..., written_num_tokens: _Optional[_Iterable[int]] = ..., store_report: _Optional[_Union[StoreReport, _Mapping]] = ...) -> None: ...

class FreeResponse(_message.Message):
    __slots__ = ("num_blocks_freed", "store_orders")
    NUM_BLOCKS_FREED_FIELD_NUMBER: _ClassVar[int]
    STORE_ORDERS_FIELD_NUMBER: _ClassVar[int]
    num_blocks_freed: int
    store_orders: StoreOrders
    def __init__(self, num_blocks_freed: _Optional[int] = ..., store_orders: _Optional[_Union[StoreOrders, _Mapping]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("pool_id",)
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    def __init__(self, pool_id: _Optional[str] = ...) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("pool_id", "num_blocks", "block_size", "num_free_blocks", "num_used_blocks", "num_cached_blocks", "usage", "num_sequences", "prefix_cache_queries", "prefix_cache_hits", "num_evictions", "num_copies", "num_stored_tokens", "num_allocated_slots", "allocation_policy", "enable_prefix_caching", "num_sessions", "kv_store", "kv_store_medium", "num_store_blocks", "store_hits", "num_store_saves", "num_store_save_failures", "num_store_load_failures", "num_store_evictions", "num_expired_blocks", "num_pins", "tenants")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_COPIES_FIELD_NUMBER: _ClassVar[int]
    NUM_STORED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ALLOCATED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_POLICY_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_MEDIUM_FIELD_NUMBER: _ClassVar[int]
    NUM_STORE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_STORE_SAVES_FIELD_NUMBER: _ClassVar[int]
    NUM_STORE_SAVE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    NUM_STORE_LOAD_FAILURES_FIELD_NUMBER: _ClassVar[int]
    NUM_STORE_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPIRED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PINS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    num_blocks: int
    block_size: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    usage: float
    num_sequences: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_evictions: int
    num_copies: int
    num_stored_tokens: int
    num_allocated_slots: int
    allocation_policy: AllocationPolicy
    enable_prefix_caching: bool
    num_sessions: int
    kv_store: str
    kv_store_medium: str
    num_store_blocks: int
    store_hits: int
    num_store_saves: int
    num_store_save_failures: int
    num_store_load_failures: int
    num_store_evictions: int
    num_expired_blocks: int
    num_pins: int
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    def __init__(self, pool_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_used_blocks: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., usage: _Optional[float] = ..., num_sequences: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_evictions: _Optional[int] = ..., num_copies: _Optional[int] = ..., num_stored_tokens: _Optional[int] = ..., num_allocated_slots: _Optional[int] = ..., allocation_policy: _Optional[_Union[AllocationPolicy, str]] = ..., enable_prefix_caching: _Optional[bool] = ..., num_sessions: _Optional[int] = ..., kv_store: _Optional[str] = ..., kv_store_medium: _Optional[str] = ..., num_store_blocks: _Optional[int] = ..., store_hits: _Optional[int] = ..., num_store_saves: _Optional[int] = ..., num_store_save_failures: _Optional[int] = ..., num_store_load_failures: _Optional[int] = ..., num_store_evictions: _Optional[int] = ..., num_expired_blocks: _Optional[int] = ..., num_pins: _Optional[int] = ..., tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("tenant", "weight", "quota_blocks", "store_quota_blocks", "num_cached_blocks", "num_pinned_blocks", "prefix_cache_queries", "prefix_cache_hits", "num_evictions_caused", "num_evictions_suffered", "num_quota_refusals", "num_store_blocks", "num_store_quota_evictions")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORE_QUOTA_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTIONS_CAUSED_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTIONS_SUFFERED_FIELD_NUMBER: _ClassVar[int]
    NUM_QUOTA_REFUSALS_FIELD_NUMBER: _ClassVar[int]
    NUM_STORE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_STORE_QUOTA_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    weight: float
    quota_blocks: int
    store_quota_blocks: int
    num_cached_blocks: int
    num_pinned_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_evictions_caused: int
    num_evictions_suffered: int
    num_quota_refusals: int
    num_store_blocks: int
    num_store_quota_evictions: int
    def __init__(self, tenant: _Optional[str] = ..., weight: _Optional[float] = ..., quota_blocks: _Optional[int] = ..., store_quota_blocks: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., num_pinned_blocks: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_evictions_caused: _Optional[int] = ..., num_evictions_suffered: _Optional[int] = ..., num_quota_refusals: _Optional[int] = ..., num_store_blocks: _Optional[int] = ..., num_store_quota_evictions: _Optional[int] = ...) -> None: ...

class SetTenantPolicyRequest(_message.Message):
    __slots__ = ("tenant", "weight", "quota_blocks", "store_quota_blocks")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORE_QUOTA_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    weight: float
    quota_blocks: int
    store_quota_blocks: int
    def __init__(self, tenant: _Optional[str] = ..., weight: _Optional[float] = ..., quota_blocks: _Optional[int] = ..., store_quota_blocks: _Optional[int] = ...) -> None: ...

class SetTenantPolicyResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PinPrefixRequest(_message.Message):
    __slots__ = ("pool_ids", "tenant", "token_ids", "shared", "cache_salt", "adapter_id")
    POOL_IDS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    pool_ids: _containers.RepeatedScalarFieldContainer[str]
    tenant: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    shared: bool
    cache_salt: str
    adapter_id: str
    def __init__(self, pool_ids: _Optional[_Iterable[str]] = ..., tenant: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., shared: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., adapter_id: _Optional[str] = ...) -> None: ...

class PinnedPool(_message.Message):
    __slots__ = ("pool_id", "num_blocks", "num_blocks_held")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_HELD_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    num_blocks: int
    num_blocks_held: int
    def __init__(self, pool_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_blocks_held: _Optional[int] = ...) -> None: ...

class PinPrefixResponse(_message.Message):
    __slots__ = ("pin_id", "pools")
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pin_id: int
    pools: _containers.RepeatedCompositeFieldContainer[PinnedPool]
    def __init__(self, pin_id: _Optional[int] = ..., pools: _Optional[_Iterable[_Union[PinnedPool, _Mapping]]] = ...) -> None: ...

class GetPinRequest(_message.Message):
    __slots__ = ("pin_id",)
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    pin_id: int
    def __init__(self, pin_id: _Optional[int] = ...) -> None: ...

class UnpinPrefixRequest(_message.Message):
    __slots__ = ("pin_id",)
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    pin_id: int
    def __init__(self, pin_id: _Optional[int] = ...) -> None: ...

class UnpinPrefixResponse(_message.Message):
    __slots__ = ("num_blocks_released",)
    NUM_BLOCKS_RELEASED_FIELD_NUMBER: _ClassVar[int]
    num_blocks_released: int
    def __init__(self, num_blocks_released: _Optional[int] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ("pool_id",)
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    def __init__(self, pool_id: _Optional[str] = ...) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("num_blocks_cleared",)
    NUM_BLOCKS_CLEARED_FIELD_NUMBER: _ClassVar[int]
    num_blocks_cleared: int
    def __init__(self, num_blocks_cleared: _Optional[int] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("pool_id", "start_event_id", "snapshot", "stream_epoch")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    START_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STREAM_EPOCH_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    start_event_id: int
    snapshot: bool
    stream_epoch: str
    def __init__(self, pool_id: _Optional[str] = ..., start_event_id: _Optional[int] = ..., snapshot: _Optional[bool] = ..., stream_epoch: _Optional[str] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("events", "timestamp", "pool_id", "stream_epoch", "snapshot", "snapshot_event_id", "snapshot_continues")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_CONTINUES_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    timestamp: float
    pool_id: str
    stream_epoch: str
    snapshot: bool
    snapshot_event_id: int
    snapshot_continues: bool
    def __init__(self, events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ..., timestamp: _Optional[float] = ..., pool_id: _Optional[str] = ..., stream_epoch: _Optional[str] = ..., snapshot: _Optional[bool] = ..., snapshot_event_id: _Optional[int] = ..., snapshot_continues: _Optional[bool] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("block_stored", "block_removed", "all_blocks_cleared", "event_id")
    BLOCK_STORED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALL_BLOCKS_CLEARED_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    block_stored: BlockStored
    block_removed: BlockRemoved
    all_blocks_cleared: AllBlocksCleared
    event_id: int
    def __init__(self, block_stored: _Optional[_Union[BlockStored, _Mapping]] = ..., block_removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., all_blocks_cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ..., event_id: _Optional[int] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "adapter_id", "medium")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_block_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    adapter_id: str
    medium: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_block_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., adapter_id: _Optional[str] = ..., medium: _Optional[str] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "medium")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    medium: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., medium: _Optional[str] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrefixQuery(_message.Message):
    __slots__ = ("token_ids", "cache_salt", "adapter_id", "block_hashes", "hashes_block_size", "hashes_model_fingerprint", "tenant", "num_shared_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    HASHES_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASHES_MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    adapter_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    hashes_block_size: int
    hashes_model_fingerprint: str
    tenant: str
    num_shared_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., adapter_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., hashes_block_size: _Optional[int] = ..., hashes_model_fingerprint: _Optional[str] = ..., tenant: _Optional[str] = ..., num_shared_tokens: _Optional[int] = ...) -> None: ...

class LookupPrefixRequest(_message.Message):
    __slots__ = ("pool_ids", "queries")
    POOL_IDS_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    pool_ids: _containers.RepeatedScalarFieldContainer[str]
    queries: _containers.RepeatedCompositeFieldContainer[PrefixQuery]
    def __init__(self, pool_ids: _Optional[_Iterable[str]] = ..., queries: _Optional[_Iterable[_Union[PrefixQuery, _Mapping]]] = ...) -> None: ...

class PoolPrefixHit(_message.Message):
    __slots__ = ("pool_id", "num_cached_tokens", "num_store_tokens")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_STORE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    num_cached_tokens: int
    num_store_tokens: int
    def __init__(self, pool_id: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., num_store_tokens: _Optional[int] = ...) -> None: ...

class PrefixMatches(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolPrefixHit]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolPrefixHit, _Mapping]]] = ...) -> None: ...

class LookupPrefixResponse(_message.Message):
    __slots__ = ("matches",)
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    matches: _containers.RepeatedCompositeFieldContainer[PrefixMatches]
    def __init__(self, matches: _Optional[_Iterable[_Union[PrefixMatches, _Mapping]]] = ...) -> None: ...
