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
    __slots__ = ("model_name", "model_fingerprint", "architecture", "dtype", "device", "attention_backend", "block_size", "num_blocks", "kv_bytes_per_block", "max_model_len", "vocab_size", "eos_token_ids", "num_layers", "model_path", "instance_id", "tokenizer_fingerprint", "step_socket")
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
    def __init__(self, model_name: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., attention_backend: _Optional[str] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., kv_bytes_per_block: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., num_layers: _Optional[int] = ..., model_path: _Optional[str] = ..., instance_id: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., step_socket: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "top_logprobs", "suppressed_token_ids")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SUPPRESSED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    top_logprobs: int
    suppressed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., top_logprobs: _Optional[int] = ..., suppressed_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ExecuteSequence(_message.Message):
    __slots__ = ("seq_id", "token_ids", "start_position", "block_table", "sample", "sampling")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    start_position: int
    block_table: _containers.RepeatedScalarFieldContainer[int]
    sample: bool
    sampling: SamplingParams
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., start_position: _Optional[int] = ..., block_table: _Optional[_Iterable[int]] = ..., sample: _Optional[bool] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("copy_src", "copy_dst", "sequences")
    COPY_SRC_FIELD_NUMBER: _ClassVar[int]
    COPY_DST_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    copy_src: _containers.RepeatedScalarFieldContainer[int]
    copy_dst: _containers.RepeatedScalarFieldContainer[int]
    sequences: _containers.RepeatedCompositeFieldContainer[ExecuteSequence]
    def __init__(self, copy_src: _Optional[_Iterable[int]] = ..., copy_dst: _Optional[_Iterable[int]] = ..., sequences: _Optional[_Iterable[_Union[ExecuteSequence, _Mapping]]] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class StepTimings(_message.Message):
    __slots__ = ("copy_ms", "forward_ms", "sample_ms", "total_ms")
    COPY_MS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    copy_ms: float
    forward_ms: float
    sample_ms: float
    total_ms: float
    def __init__(self, copy_ms: _Optional[float] = ..., forward_ms: _Optional[float] = ..., sample_ms: _Optional[float] = ..., total_ms: _Optional[float] = ...) -> None: ...

class ExecuteResponse(_message.Message):
    __slots__ = ("sampled_token_ids", "sampled_logprobs", "top_logprobs", "timings", "num_tokens", "instance_id")
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampled_logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    timings: StepTimings
    num_tokens: int
    instance_id: str
    def __init__(self, sampled_token_ids: _Optional[_Iterable[int]] = ..., sampled_logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., timings: _Optional[_Union[StepTimings, _Mapping]] = ..., num_tokens: _Optional[int] = ..., instance_id: _Optional[str] = ...) -> None: ...
