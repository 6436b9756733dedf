from warmpath.v1 import inference_pb2 as _inference_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HttpExecution(_message.Message):
    __slots__ = ("url", "timeout_s")
    URL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    url: str
    timeout_s: float
    def __init__(self, url: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class ClientExecution(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters_json", "required_permissions", "http", "client")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_PERMISSIONS_FIELD_NUMBER: _ClassVar[int]
    HTTP_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json: str
    required_permissions: _containers.RepeatedScalarFieldContainer[str]
    http: HttpExecution
    client: ClientExecution
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json: _Optional[str] = ..., required_permissions: _Optional[_Iterable[str]] = ..., http: _Optional[_Union[HttpExecution, _Mapping]] = ..., client: _Optional[_Union[ClientExecution, _Mapping]] = ...) -> None: ...

class SessionLimits(_message.Message):
    __slots__ = ("max_steps_per_turn", "context_budget_tokens", "output_reserve_tokens", "compress_below_fraction", "keep_last_rounds", "max_tool_result_bytes")
    MAX_STEPS_PER_TURN_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_RESERVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_BELOW_FRACTION_FIELD_NUMBER: _ClassVar[int]
    KEEP_LAST_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOOL_RESULT_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_steps_per_turn: int
    context_budget_tokens: int
    output_reserve_tokens: int
    compress_below_fraction: float
    keep_last_rounds: int
    max_tool_result_bytes: int
    def __init__(self, max_steps_per_turn: _Optional[int] = ..., context_budget_tokens: _Optional[int] = ..., output_reserve_tokens: _Optional[int] = ..., compress_below_fraction: _Optional[float] = ..., keep_last_rounds: _Optional[int] = ..., max_tool_result_bytes: _Optional[int] = ...) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("model", "system_prompt", "tools", "limits")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    model: str
    system_prompt: str
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    limits: SessionLimits
    def __init__(self, model: _Optional[str] = ..., system_prompt: _Optional[str] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., limits: _Optional[_Union[SessionLimits, _Mapping]] = ...) -> None: ...

class CreateSessionResponse(_message.Message):
    __slots__ = ("session_id", "prefix_fingerprint")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prefix_fingerprint: str
    def __init__(self, session_id: _Optional[str] = ..., prefix_fingerprint: _Optional[str] = ...) -> None: ...

class SendMessageRequest(_message.Message):
    __slots__ = ("session_id", "content", "tool_choice")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    content: str
    tool_choice: str
    def __init__(self, session_id: _Optional[str] = ..., content: _Optional[str] = ..., tool_choice: _Optional[str] = ...) -> None: ...

class ToolResult(_message.Message):
    __slots__ = ("tool_call_id", "content", "is_error")
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    IS_ERROR_FIELD_NUMBER: _ClassVar[int]
    tool_call_id: str
    content: str
    is_error: bool
    def __init__(self, tool_call_id: _Optional[str] = ..., content: _Optional[str] = ..., is_error: _Optional[bool] = ...) -> None: ...

class SubmitToolResultsRequest(_message.Message):
    __slots__ = ("session_id", "results")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    results: _containers.RepeatedCompositeFieldContainer[ToolResult]
    def __init__(self, session_id: _Optional[str] = ..., results: _Optional[_Iterable[_Union[ToolResult, _Mapping]]] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CompressionReport(_message.Message):
    __slots__ = ("num_messages_compressed", "tokens_before", "tokens_after", "ledger_size", "ledger_retained_fraction")
    NUM_MESSAGES_COMPRESSED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_AFTER_FIELD_NUMBER: _ClassVar[int]
    LEDGER_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEDGER_RETAINED_FRACTION_FIELD_NUMBER: _ClassVar[int]
    num_messages_compressed: int
    tokens_before: int
    tokens_after: int
    ledger_size: int
    ledger_retained_fraction: float
    def __init__(self, num_messages_compressed: _Optional[int] = ..., tokens_before: _Optional[int] = ..., tokens_after: _Optional[int] = ..., ledger_size: _Optional[int] = ..., ledger_retained_fraction: _Optional[float] = ...) -> None: ...

class StepStats(_message.Message):
    __slots__ = ("step_index", "prefix_fingerprint", "prompt_tokens", "cached_tokens", "completion_tokens", "compression")
    STEP_INDEX_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    step_index: int
    prefix_fingerprint: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    compression: CompressionReport
    def __init__(self, step_index: _Optional[int] = ..., prefix_fingerprint: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., compression: _Optional[_Union[CompressionReport, _Mapping]] = ...) -> None: ...

class TokenAccounting(_message.Message):
    __slots__ = ("prefix_tokens", "message_tokens", "total_tokens", "context_window_tokens", "output_reserve_tokens", "remaining_tokens")
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_RESERVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REMAINING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prefix_tokens: int
    message_tokens: _containers.RepeatedScalarFieldContainer[int]
    total_tokens: int
    context_window_tokens: int
    output_reserve_tokens: int
    remaining_tokens: int
    def __init__(self, prefix_tokens: _Optional[int] = ..., message_tokens: _Optional[_Iterable[int]] = ..., total_tokens: _Optional[int] = ..., context_window_tokens: _Optional[int] = ..., output_reserve_tokens: _Optional[int] = ..., remaining_tokens: _Optional[int] = ...) -> None: ...

class CacheStats(_message.Message):
    __slots__ = ("cacheable_prefix_tokens", "prompt_tokens", "cached_tokens", "hit_ratio", "num_compressions", "steps", "num_steps")
    CACHEABLE_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_RATIO_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPRESSIONS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    cacheable_prefix_tokens: int
    prompt_tokens: int
    cached_tokens: int
    hit_ratio: float
    num_compressions: int
    steps: _containers.RepeatedCompositeFieldContainer[StepStats]
    num_steps: int
    def __init__(self, cacheable_prefix_tokens: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., hit_ratio: _Optional[float] = ..., num_compressions: _Optional[int] = ..., steps: _Optional[_Iterable[_Union[StepStats, _Mapping]]] = ..., num_steps: _Optional[int] = ...) -> None: ...

class GetSessionResponse(_message.Message):
    __slots__ = ("session_id", "model", "prefix_fingerprint", "transcript", "num_messages_total", "pending_tool_calls", "tokens", "cache")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    NUM_MESSAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PENDING_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model: str
    prefix_fingerprint: str
    transcript: _containers.RepeatedCompositeFieldContainer[_inference_pb2.ChatMessage]
    num_messages_total: int
    pending_tool_calls: _containers.RepeatedCompositeFieldContainer[_inference_pb2.ToolCall]
    tokens: TokenAccounting
    cache: CacheStats
    def __init__(self, session_id: _Optional[str] = ..., model: _Optional[str] = ..., prefix_fingerprint: _Optional[str] = ..., transcript: _Optional[_Iterable[_Union[_inference_pb2.ChatMessage, _Mapping]]] = ..., num_messages_total: _Optional[int] = ..., pending_tool_calls: _Optional[_Iterable[_Union[_inference_pb2.ToolCall, _Mapping]]] = ..., tokens: _Optional[_Union[TokenAccounting, _Mapping]] = ..., cache: _Optional[_Union[CacheStats, _Mapping]] = ...) -> None: ...

class DeleteSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DeleteSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeltaEvent(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class ReasoningEvent(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class ToolCallEvent(_message.Message):
    __slots__ = ("call",)
    CALL_FIELD_NUMBER: _ClassVar[int]
    call: _inference_pb2.ToolCall
    def __init__(self, call: _Optional[_Union[_inference_pb2.ToolCall, _Mapping]] = ...) -> None: ...

class ToolResultEvent(_message.Message):
    __slots__ = ("tool_call_id", "status", "content", "is_truncated")
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    IS_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    tool_call_id: str
    status: str
    content: str
    is_truncated: bool
    def __init__(self, tool_call_id: _Optional[str] = ..., status: _Optional[str] = ..., content: _Optional[str] = ..., is_truncated: _Optional[bool] = ...) -> None: ...

class FinalEvent(_message.Message):
    __slots__ = ("message", "is_truncated")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    IS_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    message: _inference_pb2.ChatMessage
    is_truncated: bool
    def __init__(self, message: _Optional[_Union[_inference_pb2.ChatMessage, _Mapping]] = ..., is_truncated: _Optional[bool] = ...) -> None: ...

class UsageEvent(_message.Message):
    __slots__ = ("stats",)
    STATS_FIELD_NUMBER: _ClassVar[int]
    stats: StepStats
    def __init__(self, stats: _Optional[_Union[StepStats, _Mapping]] = ...) -> None: ...

class RequiresActionEvent(_message.Message):
    __slots__ = ("tool_calls",)
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    tool_calls: _containers.RepeatedCompositeFieldContainer[_inference_pb2.ToolCall]
    def __init__(self, tool_calls: _Optional[_Iterable[_Union[_inference_pb2.ToolCall, _Mapping]]] = ...) -> None: ...

class ErrorEvent(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class CompressionEvent(_message.Message):
    __slots__ = ("report",)
    REPORT_FIELD_NUMBER: _ClassVar[int]
    report: CompressionReport
    def __init__(self, report: _Optional[_Union[CompressionReport, _Mapping]] = ...) -> None: ...

class ModelRetryEvent(_message.Message):
    __slots__ = ("step_index", "reason")
    STEP_INDEX_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    step_index: int
    reason: str
    def __init__(self, step_index: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("delta", "tool_call", "tool_result", "final", "usage", "requires_action", "error", "compression", "model_retry", "reasoning")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FIELD_NUMBER: _ClassVar[int]
    TOOL_RESULT_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    REQUIRES_ACTION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_RETRY_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    delta: DeltaEvent
    tool_call: ToolCallEvent
    tool_result: ToolResultEvent
    final: FinalEvent
    usage: UsageEvent
    requires_action: RequiresActionEvent
    error: ErrorEvent
    compression: CompressionEvent
    model_retry: ModelRetryEvent
    reasoning: ReasoningEvent
    def __init__(self, delta: _Optional[_Union[DeltaEvent, _Mapping]] = ..., tool_call: _Optional[_Union[ToolCallEvent, _Mapping]] = ..., tool_result: _Optional[_Union[ToolResultEvent, _Mapping]] = ..., final: _Optional[_Union[FinalEvent, _Mapping]] = ..., usage: _Optional[_Union[UsageEvent, _Mapping]] = ..., requires_action: _Optional[_Union[RequiresActionEvent, _Mapping]] = ..., error: _Optional[_Union[ErrorEvent, _Mapping]] = ..., compression: _Optional[_Union[CompressionEvent, _Mapping]] = ..., model_retry: _Optional[_Union[ModelRetryEvent, _Mapping]] = ..., reasoning: _Optional[_Union[ReasoningEvent, _Mapping]] = ...) -> None: ...
