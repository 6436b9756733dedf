"""Wire and stored models of the agent session API.

Requests forbid unknown fields, so a malformed body is refused naming the
offending field instead of being half-understood (400 `invalid_parameter` over
HTTP, where the ingress validates these models first; INVALID_ARGUMENT over gRPC). The same models are what
the session store persists (as JSON), so a stored session always re-validates.

Invariants the validators hold:
- a tool's `parameters` passes `tool_schema.check_tool_parameters` (a bounded
  Draft 2020-12 object schema whose references stay inside it);
- tool names are unique within a session;
- a message carries exactly the fields its role allows (a `tool` message answers
  one `tool_call_id`, only `assistant` messages carry `tool_calls`);
- every text field is `Text`: Unicode that UTF-8 can encode. Python's `json.loads`
  turns `"\\ud800"` into a lone surrogate, which neither the tokenizer nor the
  store's JSON can take, so it is refused here with the field's name (a 400 at
  the ingress) instead of failing later (a 500).
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal, NewType

from pydantic import (
    AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, JsonValue, Strict, TypeAdapter, ValidationInfo,
    field_validator, model_validator,
)
from pydantic_core import PydanticCustomError

from cluster.config import bad_permissions
from serve_apps.orchestrator.tool_schema import (
    MAX_SESSION_PATTERN_UNROLLED, check_tool_parameters, unchecked_pattern_elements,
)
from serve_apps.request_checks import lone_surrogate_at

# The validation context of what is read back from the store: the rules a tool schema met at its session's
# creation, which a later release may tighten, are not applied again, so an accepted session stays readable;
# and a field a later release added is left out (see `StrictModel`).
STORED = {"is_stored": True}


def _is_stored(info: ValidationInfo) -> bool:
    return isinstance(info.context, dict) and info.context.get("is_stored") is True


SessionId = NewType("SessionId", str)
# The shape of every session id the store issues (`secrets.token_urlsafe(24)`: 32 URL-safe characters), with room.
_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


def is_session_id(text: str) -> bool:
    """Whether `text` could be a session id: anything else is no session's, whatever it is (megabytes of it,
    over gRPC, went onto the turn's span, into Redis lookups, and back in the 404's message)."""
    return _SESSION_ID.fullmatch(text) is not None


PrefixFingerprint = NewType("PrefixFingerprint", str)

TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
# What `tool_choice` means besides a tool's name: no tool may be named so, or it could never be forced by name.
TOOL_CHOICE_KEYWORDS = frozenset({"auto", "none", "required"})
# Bounds of what a model-written call may hold; a declared tool's name is far shorter (TOOL_NAME_PATTERN).
TOOL_NAME_MAX_CHARS = 256
TOOL_CALL_ID_MAX_CHARS = 128
MAX_TURN_CONTENT_CHARS = 262_144
# Above this, a "truncated" result is no longer a bound worth having: it would fill the context by itself.
MAX_TOOL_RESULT_BYTES_CEILING = 1_048_576
# Rounds a session may keep out of compression: an over-window turn searches the rounds kept for a plan that
# fits, applying the ledger and counting the prompt per candidate, on the orchestrator's event loop (a
# second and more at a few hundred rounds).
MAX_KEEP_LAST_ROUNDS = 32

Role = Literal["system", "user", "assistant", "tool"]


def _check_utf8(value: str) -> str:
    position = lone_surrogate_at(value)
    if position is not None:
        raise ValueError(f"text must be valid Unicode, but holds a lone surrogate {value[position]!r} at index {position}")
    return value


# Every free-text field of the API: a string UTF-8 can encode (no lone surrogates).
Text = Annotated[str, AfterValidator(_check_utf8)]


class StrictModel(BaseModel):
    """A model that refuses fields it does not know, except in what is read back from the store.

    Why: a client's misspelt field is an error to name, but during a rolling update the releases before
    and after share one Redis, and a session, step or remembered turn a later release wrote (an assistant
    message's `reasoning` was one such field) failed every turn, view and deletion of that session on the
    replicas not yet updated. Stored messages and steps are appended, never rewritten, so leaving out a
    field loses nothing stored.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _fields_of_later_releases_left_out(cls, data: object, info: ValidationInfo) -> object:
        if isinstance(data, dict) and _is_stored(info) and not data.keys() <= cls.model_fields.keys():
            return {key: value for key, value in data.items() if key in cls.model_fields}
        return data


def _json_number(value: object) -> object:
    """A number as JSON writes one: pydantic's lax mode read `"8"` as 8 and `true` as 1."""
    if isinstance(value, (str, bool)):
        raise PydanticCustomError("number_type", "Input should be a number, not {kind}",
                                  {"kind": "text" if isinstance(value, str) else "true or false"})
    return value


# A client's numbers and true/false values as JSON writes them, as the chat routes read them (OpenAI's API):
# pydantic's lax mode read `"yes"`, `"on"` and `1` as true (a turn asked with `"stream": "yes"` streamed) and
# `"0.5"` as a number. `null` is a true/false field's default, false.
JsonInt = Annotated[int, BeforeValidator(_json_number)]
JsonFloat = Annotated[float, BeforeValidator(_json_number)]
Flag = Annotated[bool, Strict(), BeforeValidator(lambda value: False if value is None else value)]


class HttpExecution(StrictModel):
    """The orchestrator POSTs `{"name", "arguments"}` as JSON to `url` and feeds the reply to the model."""

    kind: Literal["http"] = Field(description="Executed by the orchestrator over HTTP.")
    url: Text = Field(description="http(s) endpoint of the tool.", pattern=r"^https?://\S+$", max_length=2048)
    timeout_s: JsonFloat = Field(10.0, description="Deadline of one call, connect to last byte.", gt=0, le=300)


class ClientExecution(StrictModel):
    """The client runs the tool: the turn pauses with `requires_action` until results are submitted."""

    kind: Literal["client"] = Field(description="Executed by the API client.")


ToolExecution = Annotated[HttpExecution | ClientExecution, Field(discriminator="kind")]


class ToolSpec(StrictModel):
    """One tool as the client declares it. Only name, description and parameters reach the model."""

    name: Text = Field(description="Tool name the model calls.", pattern=TOOL_NAME_PATTERN)
    description: Text = Field("", description="What the tool does, shown to the model.", max_length=8192)
    parameters: dict[str, JsonValue] = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="Draft 2020-12 JSON Schema of the arguments object.",
    )
    required_permissions: list[Text] = Field(
        default_factory=list, description="Permissions the caller must hold before the tool runs."
    )
    execution: ToolExecution = Field(description="Where the tool runs.")

    # The checks below apply where a session is created; a session stored before one of them was added
    # stays readable (its turns, view and deletion failed as internal errors).

    @field_validator("required_permissions")
    @classmethod
    def _check_permissions(cls, permissions: list[str], info: ValidationInfo) -> list[str]:
        # As keys are granted them (`keys create --permission`): no key could hold one of these, so the tool
        # could never run.
        if not _is_stored(info) and (bad := bad_permissions(permissions)):
            raise ValueError(f"each permission is a non-empty name without whitespace, got {', '.join(map(repr, bad))}")
        return permissions

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str, info: ValidationInfo) -> str:
        if name in TOOL_CHOICE_KEYWORDS and not _is_stored(info):
            raise ValueError(f"{name!r} is a `tool_choice` keyword, so a tool named so could never be chosen by name")
        return name

    @field_validator("parameters")
    @classmethod
    def _check_parameters(cls, value: dict[str, JsonValue], info: ValidationInfo) -> dict[str, JsonValue]:
        if not _is_stored(info):
            check_tool_parameters(value)
        return value


class SessionLimits(StrictModel):
    """Per-session bounds on steps, context and tool output."""

    max_steps_per_turn: JsonInt = Field(8, description="Model calls one user turn may take.", ge=1, le=64)
    context_budget_tokens: JsonInt | None = Field(
        None, description="Context window the session may use; None means the model's full window.", ge=256
    )
    output_reserve_tokens: JsonInt = Field(512, description="Tokens kept free for the model's answer.", ge=1)
    compress_below_fraction: JsonFloat = Field(
        0.2, description="Compress when remaining tokens fall below this fraction of the window.", gt=0, lt=1
    )
    keep_last_rounds: JsonInt = Field(
        3, description=f"Rounds (a user message onwards) never compressed; at most {MAX_KEEP_LAST_ROUNDS}.", ge=1
    )
    max_tool_result_bytes: JsonInt = Field(
        16384, description="Tool results are truncated beyond this.", ge=256, le=MAX_TOOL_RESULT_BYTES_CEILING
    )

    @field_validator("keep_last_rounds")
    @classmethod
    def _bounded_rounds(cls, value: int, info: ValidationInfo) -> int:
        if value > MAX_KEEP_LAST_ROUNDS and not _is_stored(info):  # a session stored before the bound stays readable
            raise ValueError(f"keep_last_rounds must be at most {MAX_KEEP_LAST_ROUNDS}, got {value}")
        return value

    @model_validator(mode="after")
    def _check_budget(self) -> "SessionLimits":
        if self.context_budget_tokens is not None and self.output_reserve_tokens >= self.context_budget_tokens:
            raise ValueError(
                f"output_reserve_tokens={self.output_reserve_tokens} must be below "
                f"context_budget_tokens={self.context_budget_tokens}"
            )
        return self


class CreateSessionRequest(StrictModel):
    """Body of session creation. System prompt and tools are fixed for the session's life: they are the cached prefix."""

    model: Text = Field(description="Served model id.", min_length=1)
    system_prompt: Text = Field("", description="System prompt, first in every request.")
    tools: list[ToolSpec] = Field(default_factory=list, description="Tools the model may call.", max_length=128)
    limits: SessionLimits = Field(default_factory=SessionLimits, description="Session bounds.")

    @model_validator(mode="after")
    def _unique_tools(self) -> "CreateSessionRequest":
        names = [tool.name for tool in self.tools]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"tool names must be unique, repeated: {duplicates}")
        return self

    @model_validator(mode="before")
    @classmethod
    def _bounded_grammar(cls, data: Any, info: ValidationInfo) -> Any:
        # Before the tools are validated: each tool's check compiles its patterns, which for a body of
        # hundreds of tools at the per-tool bound took most of a minute, to be refused here after.
        tools = data.get("tools") if isinstance(data, dict) else None
        if _is_stored(info) or not isinstance(tools, list):
            return data
        elements = 0
        for index, tool in enumerate(tools):
            parameters = tool.parameters if isinstance(tool, ToolSpec) else (
                tool.get("parameters") if isinstance(tool, dict) else None)
            elements += unchecked_pattern_elements(parameters)
            if elements > MAX_SESSION_PATTERN_UNROLLED:
                break  # refused whatever the rest hold
        if elements > MAX_SESSION_PATTERN_UNROLLED:
            counted = "" if index == len(tools) - 1 else f" (counted up to tools[{index}])"
            raise ValueError(
                f"the tools' patterns unroll to {elements} elements together{counted}, over {MAX_SESSION_PATTERN_UNROLLED}: "
                "a turn forced to call a tool builds one grammar of every tool, which would take minutes; "
                "bound long strings with maxLength instead of counted repeats ({n,m})"
            )
        return data


class CreateSessionResponse(StrictModel):
    """Reply to session creation."""

    session_id: SessionId = Field(description="Opaque session id.")
    prefix_fingerprint: PrefixFingerprint = Field(description="sha256 of the cacheable prefix token ids.")


class ToolCall(StrictModel):
    """A call the model made. `arguments` is the raw JSON text, validated by `tools.validate_tool_call`."""

    id: Text = Field(description="Call id, echoed by the tool result.", min_length=1, max_length=TOOL_CALL_ID_MAX_CHARS)
    name: Text = Field(description="Tool name as the model wrote it.", min_length=1, max_length=TOOL_NAME_MAX_CHARS)
    arguments: Text = Field(description="Arguments as a JSON string.")


class Message(StrictModel):
    """One transcript entry, in OpenAI chat roles."""

    role: Role = Field(description="Author role.")
    content: Text | None = Field(None, description="Text; None only on assistant messages that call tools.")
    tool_calls: list[ToolCall] | None = Field(None, description="Assistant only: tool calls made.")
    tool_call_id: Text | None = Field(None, description="Tool only: the call this message answers.")
    name: Text | None = Field(None, description="Tool name (tool role) or a marker of generated messages.")
    reasoning: Text | None = Field(
        None,
        description=(
            "Assistant only: the model's reasoning before this answer or call, where the replicas run vLLM's "
            "`reasoning_parser`; sent back to the model with the message, for its chat template to keep or drop."
        ),
    )

    @model_validator(mode="after")
    def _check_role_fields(self) -> "Message":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls are only allowed on assistant messages, not {self.role}")
        if self.reasoning is not None and self.role != "assistant":
            raise ValueError(f"reasoning is only allowed on assistant messages, not {self.role}")
        if (self.tool_call_id is None) == (self.role == "tool"):
            raise ValueError("tool_call_id is required on tool messages and allowed nowhere else")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"{self.role} messages need content")
        return self


class TurnRequest(StrictModel):
    """A user turn: one user message, answered by up to `max_steps_per_turn` model calls."""

    content: Text = Field(description="User message text.", min_length=1, max_length=MAX_TURN_CONTENT_CHARS)
    tool_choice: Text = Field(
        "auto",
        description=(
            "First step only: 'auto', 'none', 'required' (a call, grammar-constrained to the tools' "
            "schemas) or a tool name (that tool). Later steps of the turn use 'auto'."
        ),
        min_length=1,
        max_length=64,
    )
    stream: Flag = Field(False, description="Stream events as server-sent events.")


class ToolResult(StrictModel):
    """Result of a client-executed tool call."""

    tool_call_id: Text = Field(description="Id of the call answered.", min_length=1, max_length=TOOL_CALL_ID_MAX_CHARS)
    content: Text = Field(description="Result text shown to the model.")
    is_error: Flag = Field(False, description="True when the tool failed; the model sees the content either way.")


class ToolResultsSubmission(StrictModel):
    """Body answering a `requires_action` event: one result per pending call."""

    results: list[ToolResult] = Field(description="Results, one per pending call.", min_length=1)
    stream: Flag = Field(False, description="Stream the resumed turn's events as server-sent events.")

    @model_validator(mode="after")
    def _unique_ids(self) -> "ToolResultsSubmission":
        ids = [result.tool_call_id for result in self.results]
        if len(set(ids)) != len(ids):
            raise ValueError("each tool_call_id may be answered once")
        return self

    def by_call_id(self) -> "ToolResultsSubmission":
        """The same submission with its results in `tool_call_id` order.

        Why: results answer calls by id, and the turn resumes with them in the calls'
        order whatever order they came in, so a retry that lists them otherwise is the
        same request (its idempotency fingerprint is taken of this form).
        """
        return self.model_copy(update={"results": sorted(self.results, key=lambda result: result.tool_call_id)})


class CompressionReport(StrictModel):
    """What one context compression did. `ledger_retained_fraction` is measured, and must be 1.0."""

    num_messages_compressed: int = Field(description="History messages replaced by the summary.", ge=1)
    tokens_before: int = Field(description="Prompt tokens before compression.", ge=0)
    tokens_after: int = Field(description="Prompt tokens after compression.", ge=0)
    ledger_size: int = Field(description="Exact values extracted from the compressed messages.", ge=0)
    ledger_retained_fraction: float = Field(
        description="Fraction of ledger values found verbatim in the new context.", ge=0, le=1
    )


class StepStats(StrictModel):
    """Cache accounting of one model call, stored with the session."""

    step_index: int = Field(description="Step within the turn, from 0.", ge=0)
    prefix_fingerprint: PrefixFingerprint = Field(description="Fingerprint of the prefix the step sent.")
    prompt_tokens: int = Field(description="Prompt tokens the engine counted.", ge=0)
    cached_tokens: int = Field(description="Prompt tokens served from the prefix cache.", ge=0)
    completion_tokens: int = Field(0, description="Generated tokens.", ge=0)
    compression: CompressionReport | None = Field(None, description="Compression done before this step.")


class DeltaEvent(StrictModel):
    """Streamed assistant text."""

    kind: Literal["delta"] = "delta"
    text: str = Field(description="Next piece of assistant text.")


class ToolCallEvent(StrictModel):
    """The model called a tool; emitted before it runs, or before its `error` result where it was refused
    (an invalid call, or one beside an invalid one in its step: none of that step's calls run)."""

    kind: Literal["tool_call"] = "tool_call"
    call: ToolCall = Field(description="The call as made: about to run, or refused (its `error` result follows).")


class ToolResultEvent(StrictModel):
    """A tool finished (or failed or timed out); the content is what the model sees."""

    kind: Literal["tool_result"] = "tool_result"
    tool_call_id: str = Field(description="Call answered.")
    status: Literal["ok", "error", "timeout"] = Field(description="How the tool ended.")
    content: str = Field(description="What the model sees.")
    is_truncated: bool = Field(False, description="True when the result was cut to max_tool_result_bytes.")


class FinalEvent(StrictModel):
    """The turn ended with an assistant answer."""

    kind: Literal["final"] = "final"
    message: Message = Field(description="The turn's last assistant message.")
    # Absent unless true: an ingress of the release before, reading this event into its protobuf, refuses a
    # field it does not know (a rolling update changes the orchestrator and the gRPC ingress one at a time).
    is_truncated: Literal[True] | None = Field(
        None,
        description=(
            "True when the answer stopped at the step's token budget (`limits.output_reserve_tokens`, which a "
            "reasoning model's thought spends too) before the model ended it; absent otherwise."
        ),
    )


class UsageEvent(StrictModel):
    """Token and cache accounting of one step."""

    kind: Literal["usage"] = "usage"
    stats: StepStats = Field(description="Token and cache accounting of one step.")


class RequiresActionEvent(StrictModel):
    """The turn is paused until the client submits results for these calls."""

    kind: Literal["requires_action"] = "requires_action"
    tool_calls: list[ToolCall] = Field(description="Client-executed calls awaiting results.", min_length=1)


class ErrorEvent(StrictModel):
    """The turn failed; `code` says why in a machine-readable way."""

    kind: Literal["error"] = "error"
    code: str = Field(description="Machine-readable error code.")
    message: str = Field(description="Human-readable explanation.")


# The served model's chat template refuses a session's prompt (its own `raise_exception`, a field it needs).
CHAT_TEMPLATE_REFUSED = "chat_template_refused"
# HTTP status of a turn that was accepted but ended in an error event (gRPC maps it on to a code).
# A 5xx is the service's own failure; the rest are the caller's or the session's, except `max_steps`:
# the turn's messages are committed, an outcome rather than a failure.
TURN_ERROR_STATUS = {
    "max_steps": 200,
    "context_overflow": 400,
    "unknown_tool": 400,
    "invalid_tool_schema": 400,
    "invalid_tool_call": 422,
    "compression_lost_values": 500,
    "model_refused": 422,
    "model_error": 502,
    "stale_turn": 409,
    "session_not_found": 404,
    "store_unavailable": 503,
    "turn_interrupted": 503,
    CHAT_TEMPLATE_REFUSED: 500,
    "internal": 500,
}


logger = logging.getLogger("ray.serve")

# Events that end a turn: a turn's stream holds exactly one.
TURN_OUTCOME_KINDS = frozenset({"final", "requires_action", "error"})


class TurnCutShort(RuntimeError):
    """A turn's stream ended without its outcome: to its client, the turn was interrupted (`TURN_INTERRUPTED`)."""


async def outcome_checked(events: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """A turn's events as the orchestrator streams them; raises TurnCutShort after them when none ended the turn.

    So an ingress answers a stream that stopped short as one that broke off (503 `turn_interrupted`,
    UNAVAILABLE over gRPC), never as a turn that ended well with nothing said. A stream that breaks
    after its outcome (the orchestrator died freeing the turn's lock) ends there: the outcome went out
    after the turn committed, and reported as interrupted too it was two outcomes (the answer dropped,
    over HTTP without streaming).
    """
    has_outcome = False
    try:
        async for event in events:
            has_outcome = has_outcome or event.get("kind") in TURN_OUTCOME_KINDS
            yield event
    except Exception:
        if not has_outcome:
            raise
        logger.warning("a turn's stream broke off after its outcome, which stands", exc_info=True)
        return
    if not has_outcome:
        raise TurnCutShort("the turn's stream ended without its outcome")


# A turn's stream broke off between orchestrator and ingress (the orchestrator replica died or was replaced).
TURN_INTERRUPTED = {
    "code": "turn_interrupted",
    "message": "the turn was interrupted before its last event reached the ingress; it may or may not have "
               "committed (compare the session's num_messages_total). Retry with the same Idempotency-Key: "
               "a turn that did commit is replayed, not run twice.",
}


class CompressionEvent(StrictModel):
    """Old rounds were replaced by a summary plus a facts ledger."""

    kind: Literal["compression"] = "compression"
    report: CompressionReport = Field(description="What the compression did.")


class ReasoningEvent(StrictModel):
    """Streamed reasoning of a reasoning model (the engine's `reasoning`, apart from the answer's text); the step's
    assistant message keeps it whole."""

    kind: Literal["reasoning"] = "reasoning"
    text: str = Field(description="Next piece of the model's reasoning.")


class ModelRetryEvent(StrictModel):
    """A step's model call failed (its replica died) and runs again, or a step forced to call a tool answered
    without one (`forced_call_missing`) and the next runs instead; discard this step's deltas and reasoning so far."""

    kind: Literal["model_retry"] = "model_retry"
    step_index: int = Field(description="Step whose model call restarts.", ge=0)
    reason: str = Field(description="What failed.")


SessionEvent = Annotated[
    DeltaEvent
    | ReasoningEvent
    | ModelRetryEvent
    | ToolCallEvent
    | ToolResultEvent
    | FinalEvent
    | UsageEvent
    | RequiresActionEvent
    | ErrorEvent
    | CompressionEvent,
    Field(discriminator="kind"),
]
SESSION_EVENT_ADAPTER: TypeAdapter[SessionEvent] = TypeAdapter(SessionEvent)
