from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    ERROR_CODE_INVALID_ARGUMENT: _ClassVar[ErrorCode]
    ERROR_CODE_RESOURCE_EXHAUSTED: _ClassVar[ErrorCode]
    ERROR_CODE_DEADLINE_EXCEEDED: _ClassVar[ErrorCode]
    ERROR_CODE_CANCELLED: _ClassVar[ErrorCode]
    ERROR_CODE_UNAVAILABLE: _ClassVar[ErrorCode]
    ERROR_CODE_INTERNAL: _ClassVar[ErrorCode]
    ERROR_CODE_KV_FINGERPRINT_MISMATCH: _ClassVar[ErrorCode]
    ERROR_CODE_KV_SHAPE_MISMATCH: _ClassVar[ErrorCode]
    ERROR_CODE_KV_CHECKSUM_MISMATCH: _ClassVar[ErrorCode]
    ERROR_CODE_KV_TIMEOUT: _ClassVar[ErrorCode]
    ERROR_CODE_KV_UNKNOWN_TRANSFER: _ClassVar[ErrorCode]
    ERROR_CODE_KV_ABORTED: _ClassVar[ErrorCode]

class KVTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TIER_UNSPECIFIED: _ClassVar[KVTier]
    KV_TIER_POOL: _ClassVar[KVTier]
    KV_TIER_HOST: _ClassVar[KVTier]
    KV_TIER_DISK: _ClassVar[KVTier]
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
ERROR_CODE_UNSPECIFIED: ErrorCode
ERROR_CODE_INVALID_ARGUMENT: ErrorCode
ERROR_CODE_RESOURCE_EXHAUSTED: ErrorCode
ERROR_CODE_DEADLINE_EXCEEDED: ErrorCode
ERROR_CODE_CANCELLED: ErrorCode
ERROR_CODE_UNAVAILABLE: ErrorCode
ERROR_CODE_INTERNAL: ErrorCode
ERROR_CODE_KV_FINGERPRINT_MISMATCH: ErrorCode
ERROR_CODE_KV_SHAPE_MISMATCH: ErrorCode
ERROR_CODE_KV_CHECKSUM_MISMATCH: ErrorCode
ERROR_CODE_KV_TIMEOUT: ErrorCode
ERROR_CODE_KV_UNKNOWN_TRANSFER: ErrorCode
ERROR_CODE_KV_ABORTED: ErrorCode
KV_TIER_UNSPECIFIED: KVTier
KV_TIER_POOL: KVTier
KV_TIER_HOST: KVTier
KV_TIER_DISK: KVTier

class Error(_message.Message):
    __slots__ = ("code", "field", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: ErrorCode
    field: str
    message: str
    def __init__(self, code: _Optional[_Union[ErrorCode, str]] = ..., field: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "stop", "ignore_eos", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "n", "structured_output")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    n: int
    structured_output: StructuredOutput
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., n: _Optional[int] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "grammar", "accepted_token_ids")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    grammar: str
    accepted_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., accepted_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Logprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "index")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[Logprob]
    index: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[Logprob, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class StageTimings(_message.Message):
    __slots__ = ("router_queue_s", "prefill_queue_s", "prefill_compute_s", "kv_transfer_s", "decode_admission_s", "ttft_s", "e2e_s", "first_token_s", "decode_s", "other_s", "local_prefill", "kv_blocks_reused", "kv_blocks_moved")
    ROUTER_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADMISSION_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    OTHER_S_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_REUSED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_MOVED_FIELD_NUMBER: _ClassVar[int]
    router_queue_s: float
    prefill_queue_s: float
    prefill_compute_s: float
    kv_transfer_s: float
    decode_admission_s: float
    ttft_s: float
    e2e_s: float
    first_token_s: float
    decode_s: float
    other_s: float
    local_prefill: bool
    kv_blocks_reused: int
    kv_blocks_moved: int
    def __init__(self, router_queue_s: _Optional[float] = ..., prefill_queue_s: _Optional[float] = ..., prefill_compute_s: _Optional[float] = ..., kv_transfer_s: _Optional[float] = ..., decode_admission_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., e2e_s: _Optional[float] = ..., first_token_s: _Optional[float] = ..., decode_s: _Optional[float] = ..., other_s: _Optional[float] = ..., local_prefill: _Optional[bool] = ..., kv_blocks_reused: _Optional[int] = ..., kv_blocks_moved: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class KVEndpoint(_message.Message):
    __slots__ = ("host", "port", "transport")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    transport: str
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ..., transport: _Optional[str] = ...) -> None: ...

class KVDestination(_message.Message):
    __slots__ = ("endpoint", "transfer_id", "model_fingerprint", "rank_endpoints", "num_kv_heads", "held_tokens")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    RANK_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HELD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    endpoint: KVEndpoint
    transfer_id: str
    model_fingerprint: str
    rank_endpoints: _containers.RepeatedCompositeFieldContainer[KVEndpoint]
    num_kv_heads: int
    held_tokens: int
    def __init__(self, endpoint: _Optional[_Union[KVEndpoint, _Mapping]] = ..., transfer_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., rank_endpoints: _Optional[_Iterable[_Union[KVEndpoint, _Mapping]]] = ..., num_kv_heads: _Optional[int] = ..., held_tokens: _Optional[int] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "logprob", "finish_reason")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: Logprob
    finish_reason: FinishReason
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[_Union[Logprob, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "chat", "raw", "sampling", "model", "skip_detokenize", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SKIP_DETOKENIZE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: TokenIds
    text: str
    chat: ChatMessages
    raw: bool
    sampling: SamplingParams
    model: str
    skip_detokenize: bool
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., raw: _Optional[bool] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., model: _Optional[str] = ..., skip_detokenize: _Optional[bool] = ..., priority: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "chunk", "finish_reason", "usage", "timings", "error", "prompt_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: TokenChunk
    finish_reason: FinishReason
    usage: Usage
    timings: StageTimings
    error: Error
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[StageTimings, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "kv_destination", "kv_ack_timeout_s", "priority", "kv_source")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_DESTINATION_FIELD_NUMBER: _ClassVar[int]
    KV_ACK_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    kv_destination: KVDestination
    kv_ack_timeout_s: float
    priority: int
    kv_source: KVSource
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., kv_destination: _Optional[_Union[KVDestination, _Mapping]] = ..., kv_ack_timeout_s: _Optional[float] = ..., priority: _Optional[int] = ..., kv_source: _Optional[_Union[KVSource, _Mapping]] = ...) -> None: ...

class KVSource(_message.Message):
    __slots__ = ("worker_id", "address", "role", "num_tokens")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    role: Role
    num_tokens: int
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class SendPrefixRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "kv_destination")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_DESTINATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_destination: KVDestination
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., kv_destination: _Optional[_Union[KVDestination, _Mapping]] = ...) -> None: ...

class SendPrefixResponse(_message.Message):
    __slots__ = ("kv_bytes_sent",)
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    kv_bytes_sent: int
    def __init__(self, kv_bytes_sent: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token", "prompt_tokens", "cached_prompt_tokens", "kv_bytes_sent", "timings", "pulled_prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PULLED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token: FirstToken
    prompt_tokens: int
    cached_prompt_tokens: int
    kv_bytes_sent: int
    timings: StageTimings
    pulled_prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., kv_bytes_sent: _Optional[int] = ..., timings: _Optional[_Union[StageTimings, _Mapping]] = ..., pulled_prompt_tokens: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "local_prefill", "kv_timeout_s", "recompute", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    KV_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    local_prefill: bool
    kv_timeout_s: float
    recompute: bool
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., local_prefill: _Optional[bool] = ..., kv_timeout_s: _Optional[float] = ..., recompute: _Optional[bool] = ..., priority: _Optional[int] = ...) -> None: ...

class KVAdmission(_message.Message):
    __slots__ = ("kv_destination", "num_prompt_tokens", "num_blocks", "free_blocks", "cached_prompt_tokens", "admission_wait_s", "kv_blocks_reused", "kv_blocks_moved")
    KV_DESTINATION_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_REUSED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_MOVED_FIELD_NUMBER: _ClassVar[int]
    kv_destination: KVDestination
    num_prompt_tokens: int
    num_blocks: int
    free_blocks: int
    cached_prompt_tokens: int
    admission_wait_s: float
    kv_blocks_reused: int
    kv_blocks_moved: int
    def __init__(self, kv_destination: _Optional[_Union[KVDestination, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., admission_wait_s: _Optional[float] = ..., kv_blocks_reused: _Optional[int] = ..., kv_blocks_moved: _Optional[int] = ...) -> None: ...

class DecodeFinished(_message.Message):
    __slots__ = ("finish_reason", "usage", "timings", "error", "index", "chunk")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    usage: Usage
    timings: StageTimings
    error: Error
    index: int
    chunk: TokenChunk
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[StageTimings, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., index: _Optional[int] = ..., chunk: _Optional[_Union[TokenChunk, _Mapping]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("request_id", "admission", "chunk", "finished")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    admission: KVAdmission
    chunk: TokenChunk
    finished: DecodeFinished
    def __init__(self, request_id: _Optional[str] = ..., admission: _Optional[_Union[KVAdmission, _Mapping]] = ..., chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., finished: _Optional[_Union[DecodeFinished, _Mapping]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("include_block_hashes",)
    INCLUDE_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    include_block_hashes: bool
    def __init__(self, include_block_hashes: _Optional[bool] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "role", "queued_requests", "queued_prompt_tokens", "running_requests", "free_kv_blocks", "total_kv_blocks", "prefix_cache_hit_tokens", "prefix_cache_queried_tokens", "kv_bytes_received", "kv_bytes_sent", "draining", "timestamp_s", "preemptions", "prompt_tokens", "generation_tokens", "steps", "step_seconds", "prompt_steps", "prompt_step_seconds", "spec_proposed_tokens", "spec_accepted_tokens", "spec_steps", "kv_pulls", "kv_pulled_tokens", "kv_pull_failures", "kv_pulls_declined", "kv_pull_seconds", "cached_block_hashes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_S_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_STEPS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SPEC_PROPOSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_STEPS_FIELD_NUMBER: _ClassVar[int]
    KV_PULLS_FIELD_NUMBER: _ClassVar[int]
    KV_PULLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_PULL_FAILURES_FIELD_NUMBER: _ClassVar[int]
    KV_PULLS_DECLINED_FIELD_NUMBER: _ClassVar[int]
    KV_PULL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: Role
    queued_requests: int
    queued_prompt_tokens: int
    running_requests: int
    free_kv_blocks: int
    total_kv_blocks: int
    prefix_cache_hit_tokens: int
    prefix_cache_queried_tokens: int
    kv_bytes_received: int
    kv_bytes_sent: int
    draining: bool
    timestamp_s: float
    preemptions: int
    prompt_tokens: int
    generation_tokens: int
    steps: int
    step_seconds: float
    prompt_steps: int
    prompt_step_seconds: float
    spec_proposed_tokens: int
    spec_accepted_tokens: int
    spec_steps: int
    kv_pulls: int
    kv_pulled_tokens: int
    kv_pull_failures: int
    kv_pulls_declined: int
    kv_pull_seconds: float
    cached_block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., queued_requests: _Optional[int] = ..., queued_prompt_tokens: _Optional[int] = ..., running_requests: _Optional[int] = ..., free_kv_blocks: _Optional[int] = ..., total_kv_blocks: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., prefix_cache_queried_tokens: _Optional[int] = ..., kv_bytes_received: _Optional[int] = ..., kv_bytes_sent: _Optional[int] = ..., draining: _Optional[bool] = ..., timestamp_s: _Optional[float] = ..., preemptions: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., generation_tokens: _Optional[int] = ..., steps: _Optional[int] = ..., step_seconds: _Optional[float] = ..., prompt_steps: _Optional[int] = ..., prompt_step_seconds: _Optional[float] = ..., spec_proposed_tokens: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ..., spec_steps: _Optional[int] = ..., kv_pulls: _Optional[int] = ..., kv_pulled_tokens: _Optional[int] = ..., kv_pull_failures: _Optional[int] = ..., kv_pulls_declined: _Optional[int] = ..., kv_pull_seconds: _Optional[float] = ..., cached_block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "address", "kv_endpoint", "model", "model_fingerprint", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: Role
    address: str
    kv_endpoint: KVEndpoint
    model: str
    model_fingerprint: str
    labels: _containers.ScalarMap[str, str]
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., address: _Optional[str] = ..., kv_endpoint: _Optional[_Union[KVEndpoint, _Mapping]] = ..., model: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerInfo
    def __init__(self, worker: _Optional[_Union[WorkerInfo, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("heartbeat_interval_s", "heartbeat_timeout_s", "epoch")
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    epoch: int
    def __init__(self, heartbeat_interval_s: _Optional[float] = ..., heartbeat_timeout_s: _Optional[float] = ..., epoch: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "stats")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    stats: WorkerStats
    def __init__(self, worker_id: _Optional[str] = ..., stats: _Optional[_Union[WorkerStats, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known", "drain", "epoch")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    known: bool
    drain: bool
    epoch: int
    def __init__(self, known: _Optional[bool] = ..., drain: _Optional[bool] = ..., epoch: _Optional[int] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SwitchRoleRequest(_message.Message):
    __slots__ = ("worker_id", "role")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: Role
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ...) -> None: ...

class SwitchRoleResponse(_message.Message):
    __slots__ = ("worker_id", "previous_role", "role", "drain_s", "switch_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_ROLE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_S_FIELD_NUMBER: _ClassVar[int]
    SWITCH_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    previous_role: Role
    role: Role
    drain_s: float
    switch_s: float
    def __init__(self, worker_id: _Optional[str] = ..., previous_role: _Optional[_Union[Role, str]] = ..., role: _Optional[_Union[Role, str]] = ..., drain_s: _Optional[float] = ..., switch_s: _Optional[float] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("stored", "tier", "block_hashes")
    STORED_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    stored: bool
    tier: KVTier
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, stored: _Optional[bool] = ..., tier: _Optional[_Union[KVTier, str]] = ..., block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("worker_id", "epoch", "seq", "snapshot", "events")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    seq: int
    snapshot: bool
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ..., snapshot: _Optional[bool] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ...) -> None: ...

class KVEventsReply(_message.Message):
    __slots__ = ("snapshot_wanted",)
    SNAPSHOT_WANTED_FIELD_NUMBER: _ClassVar[int]
    snapshot_wanted: bool
    def __init__(self, snapshot_wanted: _Optional[bool] = ...) -> None: ...

class KVIndexRequest(_message.Message):
    __slots__ = ("worker_id", "include_hashes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_HASHES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    include_hashes: bool
    def __init__(self, worker_id: _Optional[str] = ..., include_hashes: _Optional[bool] = ...) -> None: ...

class KVIndexWorker(_message.Message):
    __slots__ = ("worker_id", "role", "epoch", "exact", "blocks", "applied_seq", "missing_batches", "lag_s", "stored", "removed", "block_hashes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_SEQ_FIELD_NUMBER: _ClassVar[int]
    MISSING_BATCHES_FIELD_NUMBER: _ClassVar[int]
    LAG_S_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: Role
    epoch: int
    exact: bool
    blocks: int
    applied_seq: int
    missing_batches: int
    lag_s: float
    stored: int
    removed: int
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., epoch: _Optional[int] = ..., exact: _Optional[bool] = ..., blocks: _Optional[int] = ..., applied_seq: _Optional[int] = ..., missing_batches: _Optional[int] = ..., lag_s: _Optional[float] = ..., stored: _Optional[int] = ..., removed: _Optional[int] = ..., block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class KVIndexReply(_message.Message):
    __slots__ = ("workers", "distinct_blocks")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    DISTINCT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[KVIndexWorker]
    distinct_blocks: int
    def __init__(self, workers: _Optional[_Iterable[_Union[KVIndexWorker, _Mapping]]] = ..., distinct_blocks: _Optional[int] = ...) -> None: ...
