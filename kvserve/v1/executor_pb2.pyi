from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("model_name", "model_fingerprint", "architecture", "dtype", "device", "attention_backend", "block_size", "num_blocks", "kv_bytes_per_block", "max_model_len", "vocab_size", "eos_token_ids", "num_layers", "model_path", "instance_id", "tokenizer_fingerprint", "step_socket", "kv_store", "kv_store_namespace", "kv_store_capacity_blocks", "verifies_draft_tokens", "verifies_drafts_with_suppressed_tokens", "returns_prompt_logprobs")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    STEP_SOCKET_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    VERIFIES_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFIES_DRAFTS_WITH_SUPPRESSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETURNS_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_fingerprint: str
    architecture: str
    dtype: str
    device: str
    attention_backend: str
    block_size: int
    num_blocks: int
    kv_bytes_per_block: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_layers: int
    model_path: str
    instance_id: str
    tokenizer_fingerprint: str
    step_socket: str
    kv_store: str
    kv_store_namespace: str
    kv_store_capacity_blocks: int
    verifies_draft_tokens: bool
    verifies_drafts_with_suppressed_tokens: bool
    returns_prompt_logprobs: bool
    def __init__(self, model_name: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., attention_backend: _Optional[str] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., kv_bytes_per_block: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., num_layers: _Optional[int] = ..., model_path: _Optional[str] = ..., instance_id: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., step_socket: _Optional[str] = ..., kv_store: _Optional[str] = ..., kv_store_namespace: _Optional[str] = ..., kv_store_capacity_blocks: _Optional[int] = ..., verifies_draft_tokens: _Optional[bool] = ..., verifies_drafts_with_suppressed_tokens: _Optional[bool] = ..., returns_prompt_logprobs: _Optional[bool] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "top_logprobs", "suppressed_token_ids", "allowed_token_bitmask", "logit_bias_token_ids", "logit_bias_values", "presence_penalty", "frequency_penalty", "repetition_penalty", "penalty_token_ids", "penalty_output_counts", "min_p")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SUPPRESSED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_BITMASK_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PENALTY_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PENALTY_OUTPUT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    top_logprobs: int
    suppressed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    allowed_token_bitmask: bytes
    logit_bias_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_values: _containers.RepeatedScalarFieldContainer[float]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    penalty_token_ids: _containers.RepeatedScalarFieldContainer[int]
    penalty_output_counts: _containers.RepeatedScalarFieldContainer[int]
    min_p: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., top_logprobs: _Optional[int] = ..., suppressed_token_ids: _Optional[_Iterable[int]] = ..., allowed_token_bitmask: _Optional[bytes] = ..., logit_bias_token_ids: _Optional[_Iterable[int]] = ..., logit_bias_values: _Optional[_Iterable[float]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., penalty_token_ids: _Optional[_Iterable[int]] = ..., penalty_output_counts: _Optional[_Iterable[int]] = ..., min_p: _Optional[float] = ...) -> None: ...

class ExecuteSequence(_message.Message):
    __slots__ = ("seq_id", "token_ids", "start_position", "block_table", "sample", "sampling", "store_load_block_ids", "store_load_hashes", "num_draft_tokens", "prompt_logprob_token_ids", "prompt_top_logprobs")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STORE_LOAD_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    STORE_LOAD_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROB_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    start_position: int
    block_table: _containers.RepeatedScalarFieldContainer[int]
    sample: bool
    sampling: SamplingParams
    store_load_block_ids: _containers.RepeatedScalarFieldContainer[int]
    store_load_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    num_draft_tokens: int
    prompt_logprob_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_top_logprobs: int
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., start_position: _Optional[int] = ..., block_table: _Optional[_Iterable[int]] = ..., sample: _Optional[bool] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., store_load_block_ids: _Optional[_Iterable[int]] = ..., store_load_hashes: _Optional[_Iterable[bytes]] = ..., num_draft_tokens: _Optional[int] = ..., prompt_logprob_token_ids: _Optional[_Iterable[int]] = ..., prompt_top_logprobs: _Optional[int] = ...) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("copy_src", "copy_dst", "sequences", "store_save_block_ids", "store_save_hashes", "store_save_keys", "store_delete_hashes", "expected_instance_id")
    COPY_SRC_FIELD_NUMBER: _ClassVar[int]
    COPY_DST_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    STORE_SAVE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    STORE_SAVE_HASHES_FIELD_NUMBER: _ClassVar[int]
    STORE_SAVE_KEYS_FIELD_NUMBER: _ClassVar[int]
    STORE_DELETE_HASHES_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    copy_src: _containers.RepeatedScalarFieldContainer[int]
    copy_dst: _containers.RepeatedScalarFieldContainer[int]
    sequences: _containers.RepeatedCompositeFieldContainer[ExecuteSequence]
    store_save_block_ids: _containers.RepeatedScalarFieldContainer[int]
    store_save_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    store_save_keys: _containers.RepeatedScalarFieldContainer[bytes]
    store_delete_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    expected_instance_id: str
    def __init__(self, copy_src: _Optional[_Iterable[int]] = ..., copy_dst: _Optional[_Iterable[int]] = ..., sequences: _Optional[_Iterable[_Union[ExecuteSequence, _Mapping]]] = ..., store_save_block_ids: _Optional[_Iterable[int]] = ..., store_save_hashes: _Optional[_Iterable[bytes]] = ..., store_save_keys: _Optional[_Iterable[bytes]] = ..., store_delete_hashes: _Optional[_Iterable[bytes]] = ..., expected_instance_id: _Optional[str] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("logprobs", "top_logprobs")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class StepTimings(_message.Message):
    __slots__ = ("copy_ms", "forward_ms", "sample_ms", "total_ms", "store_ms")
    COPY_MS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    STORE_MS_FIELD_NUMBER: _ClassVar[int]
    copy_ms: float
    forward_ms: float
    sample_ms: float
    total_ms: float
    store_ms: float
    def __init__(self, copy_ms: _Optional[float] = ..., forward_ms: _Optional[float] = ..., sample_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., store_ms: _Optional[float] = ...) -> None: ...

class ExecuteResponse(_message.Message):
    __slots__ = ("sampled_token_ids", "sampled_logprobs", "top_logprobs", "timings", "num_tokens", "instance_id", "dropped_seq_ids", "store_missing_hashes", "store_saves_ok", "num_accepted_draft_tokens", "prompt_logprobs")
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DROPPED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    STORE_MISSING_HASHES_FIELD_NUMBER: _ClassVar[int]
    STORE_SAVES_OK_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampled_logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    timings: StepTimings
    num_tokens: int
    instance_id: str
    dropped_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    store_missing_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    store_saves_ok: _containers.RepeatedScalarFieldContainer[bool]
    num_accepted_draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    def __init__(self, sampled_token_ids: _Optional[_Iterable[int]] = ..., sampled_logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., timings: _Optional[_Union[StepTimings, _Mapping]] = ..., num_tokens: _Optional[int] = ..., instance_id: _Optional[str] = ..., dropped_seq_ids: _Optional[_Iterable[int]] = ..., store_missing_hashes: _Optional[_Iterable[bytes]] = ..., store_saves_ok: _Optional[_Iterable[bool]] = ..., num_accepted_draft_tokens: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ...) -> None: ...
