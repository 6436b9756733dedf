"""Wire and stored models of the agent session API.

Requests forbid unknown fields, so a malformed body fails with a 422 that names
the offending field instead of being half-understood. The same models are what
the session store persists (as JSON), so a stored session always re-validates.

Invariants the validators hold:
- a tool's `parameters` is a Draft 2020-12 JSON Schema describing an object, and
  every `$ref` in it points into its own top-level `$defs` (no remote documents,
  no `$id` rebasing), so validation never does I/O and the schema can be
  embedded verbatim into the structured-output schema of `tools.tool_choice_schema`;
- `parameters` is bounded before anything walks it recursively: at most
  MAX_SCHEMA_BYTES of compact JSON, at most MAX_SCHEMA_DEPTH nested objects and
  arrays, only what JSON can carry (no NaN, which the store would write as null,
  and no lone surrogates, which it could not write at all), and every `$ref`
  lands on an existing subschema through chains of at most MAX_REF_HOPS `$ref`s
  that do not descend into the arguments, so nothing the client sends as a schema
  makes `tools.validate_tool_call` recurse without end or fail on the schema
  (how deep the arguments may nest is for tools.py to bound);
- `$schema`, where present, names Draft 2020-12: jsonschema switches dialect on a
  nested `$schema`, and older dialects read 2020-12 keywords differently;
- tool names are unique within a session;
- a message carries exactly the fields its role allows (a `tool` message answers
  one `tool_call_id`, only `assistant` messages carry `tool_calls`).
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Literal, NewType
from urllib.parse import unquote

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import BaseModel, ConfigDict, Field, JsonValue, TypeAdapter, field_validator, model_validator

SessionId = NewType("SessionId", str)
PrefixFingerprint = NewType("PrefixFingerprint", str)

TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
# Bounds on a tool's `parameters`. Real tool schemas are a few KiB and a handful of
# levels deep; these leave room for them while keeping validation cheap and its
# recursion (several Python frames per level) far below the interpreter's limit.
MAX_SCHEMA_BYTES = 16384
MAX_SCHEMA_DEPTH = 16
# `$ref`s followed without descending into the arguments (`$ref` to `$ref`, `allOf`, ...):
# a cycle of them never terminates, and a long chain exhausts the stack just the same.
MAX_REF_HOPS = 16
MAX_TURN_CONTENT_CHARS = 262_144
# Above this, a "truncated" result is no longer a bound worth having: it would fill the context by itself.
MAX_TOOL_RESULT_BYTES_CEILING = 1_048_576
# Keywords that would make a schema resolve references outside itself.
_REBASING_KEYWORDS = ("$id", "$anchor", "$dynamicRef", "$dynamicAnchor", "$recursiveRef")
_LOCAL_REF_PREFIX = "#/$defs/"
_DRAFT_2020_12_URIS = ("https://json-schema.org/draft/2020-12/schema", "https://json-schema.org/draft/2020-12/schema#")
# Draft 2020-12 keywords whose value is a subschema, a list of subschemas, or a map of
# names to subschemas: the only places a `$ref` may land.
_SUBSCHEMA_KEYWORDS = frozenset(
    {
        "additionalProperties", "contains", "contentSchema", "else", "if", "items", "not",
        "propertyNames", "then", "unevaluatedItems", "unevaluatedProperties",
    }
)
_SUBSCHEMA_LIST_KEYWORDS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})
_SUBSCHEMA_MAP_KEYWORDS = frozenset({"$defs", "dependentSchemas", "patternProperties", "properties"})
# Applicators that validate the instance they are given, not a part of it.
_IN_PLACE_KEYWORDS = frozenset({"allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentSchemas"})
_ARRAY_INDEX = re.compile(r"0|[1-9][0-9]*")

SchemaLocation = tuple[str | int, ...]

Role = Literal["system", "user", "assistant", "tool"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_bounds(schema: dict[str, JsonValue]) -> None:
    """Size, depth and finiteness, checked iteratively before anything recurses into the schema.

    Size goes first: it is measured in C, so a huge body is refused before a Python
    walk over it. What JSON cannot carry is refused here too, because the session
    store writes the schema as JSON: a lone surrogate (Python's `json.loads` accepts
    `"\\ud800"`, and pydantic's JsonValue keeps it) makes that write fail, and NaN or
    Infinity would be stored as null, so the schema re-read would not be the one sent.
    """
    try:
        text = json.dumps(schema, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
        num_bytes = len(text.encode("utf-8"))
    except UnicodeEncodeError as err:
        surrogate = err.object[err.start : err.end]
        raise ValueError(f"tool parameters hold a lone surrogate {surrogate!r}, which is not Unicode text") from None
    except ValueError as err:  # an integer too long to print
        raise ValueError(f"tool parameters cannot be written as JSON: {err}") from None
    if num_bytes > MAX_SCHEMA_BYTES:
        raise ValueError(
            f"tool parameters schema is {num_bytes} bytes of compact JSON, "
            f"over the limit MAX_SCHEMA_BYTES={MAX_SCHEMA_BYTES}"
        )
    depth = 0
    stack: list[tuple[JsonValue, int, str]] = [(schema, 1, "")]
    while stack:
        node, level, path = stack.pop()
        if isinstance(node, dict):
            depth = max(depth, level)
            stack.extend((value, level + 1, f"{path}/{key}") for key, value in node.items())
        elif isinstance(node, list):
            depth = max(depth, level)
            stack.extend((item, level + 1, f"{path}/{index}") for index, item in enumerate(node))
        elif isinstance(node, float) and not math.isfinite(node):
            raise ValueError(f"{path or '/'}: {node} is not a JSON number")
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(
            f"tool parameters schema nests {depth} levels of objects and arrays, "
            f"over the limit MAX_SCHEMA_DEPTH={MAX_SCHEMA_DEPTH}"
        )


def _check_keywords(node: JsonValue, path: str, refs: dict[str, str]) -> None:
    """Rejects keywords that leave the schema or switch dialect, and collects `$ref` values with where they occur.

    Keyword values are strings and property names are not, so a property named `$ref` passes.
    """
    if isinstance(node, dict):
        for key, value in node.items():
            where = f"{path}/{key}"
            if key == "$ref" and isinstance(value, str):
                if not value.startswith(_LOCAL_REF_PREFIX):
                    raise ValueError(f"{where}: only local references into '#/$defs/' are allowed, got {value!r}")
                refs.setdefault(value, where)
            if key in _REBASING_KEYWORDS and isinstance(value, str):
                raise ValueError(f"{where}: {key} is not allowed in tool parameters")
            if key == "$schema" and isinstance(value, str) and value not in _DRAFT_2020_12_URIS:
                raise ValueError(f"{where}: only Draft 2020-12 ({_DRAFT_2020_12_URIS[0]}) is supported, got {value!r}")
            _check_keywords(value, where, refs)
    elif isinstance(node, list):
        for index, item in enumerate(node):
            _check_keywords(item, f"{path}/{index}", refs)


def _resolve_ref(root: dict[str, JsonValue], ref: str) -> tuple[SchemaLocation, JsonValue]:
    """The subschema `ref` names, decoded the way `referencing` decodes it (percent-escapes, then `~1`/`~0`).

    Only locations that hold a subschema are accepted: `referencing` would follow a
    pointer to any value, and the validator then fails on a string or a property map.
    """
    node: JsonValue = root
    holds = "schema"  # what `node` is: a schema, a list of schemas, or a map of names to schemas
    location: list[str | int] = []
    for segment in unquote(ref[2:]).split("/"):
        if holds == "list":
            if not (isinstance(node, list) and _ARRAY_INDEX.fullmatch(segment) and int(segment) < len(node)):
                raise ValueError(f"$ref {ref!r} points to nothing: no item {segment!r}")
            node, holds = node[int(segment)], "schema"
            location.append(int(segment))
            continue
        key = segment.replace("~1", "/").replace("~0", "~")
        if not (isinstance(node, dict) and key in node):
            raise ValueError(f"$ref {ref!r} points to nothing: no {key!r}")
        if holds == "map" or key in _SUBSCHEMA_KEYWORDS:
            holds = "schema"
        elif key in _SUBSCHEMA_LIST_KEYWORDS:
            holds = "list"
        elif key in _SUBSCHEMA_MAP_KEYWORDS:
            holds = "map"
        else:
            raise ValueError(f"$ref {ref!r} does not point to a subschema: {key!r} holds none")
        node = node[key]
        location.append(key)
    if holds != "schema":
        raise ValueError(f"$ref {ref!r} points to a {holds} of subschemas, not to a subschema")
    return tuple(location), node


def _in_place_refs(schema: JsonValue) -> list[str]:
    """`$ref`s the validator follows on the instance `schema` is given, before descending into any part of it."""
    found: list[str] = []
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue  # a boolean schema; shapes below are guaranteed by the metaschema check
        if isinstance(node.get("$ref"), str):
            found.append(node["$ref"])
        for key in _IN_PLACE_KEYWORDS.intersection(node):
            value = node[key]
            if isinstance(value, list):
                stack.extend(value)
            elif key == "dependentSchemas" and isinstance(value, dict):
                stack.extend(value.values())
            else:
                stack.append(value)
    return found


def _check_ref_chains(root: dict[str, JsonValue], refs: dict[str, str]) -> None:
    """Every `$ref` resolves to a subschema; no chain of `$ref`s on one instance cycles or exceeds MAX_REF_HOPS.

    Chains that descend into the arguments (`properties`, `items`, ...) may recurse:
    they end with the arguments.
    """
    targets: dict[str, tuple[SchemaLocation, JsonValue]] = {}
    for ref, where in refs.items():
        try:
            targets[ref] = _resolve_ref(root, ref)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
    longest_hops: dict[SchemaLocation, int] = {}

    def visit(node: JsonValue, trail: list[SchemaLocation], followed: list[str]) -> int:
        # Recursion stays within MAX_REF_HOPS + 1 frames: longer trails raise first.
        if trail[-1] not in longest_hops:
            hops = 0
            for ref in _in_place_refs(node):
                location, target = targets[ref]
                chain = " -> ".join([*followed, ref])
                if location in trail:
                    raise ValueError(f"$ref cycle that never descends into the arguments: {chain}")
                if len(followed) + 1 > MAX_REF_HOPS:
                    raise ValueError(
                        f"$ref chain of at least {len(followed) + 1} hops that never descends into the arguments, "
                        f"over the limit MAX_REF_HOPS={MAX_REF_HOPS}: {chain}"
                    )
                hops = max(hops, 1 + visit(target, [*trail, location], [*followed, ref]))
            longest_hops[trail[-1]] = hops
        num_hops = len(followed) + longest_hops[trail[-1]]
        if num_hops > MAX_REF_HOPS:
            raise ValueError(
                f"$ref chain of {num_hops} hops that never descends into the arguments, "
                f"over the limit MAX_REF_HOPS={MAX_REF_HOPS}: {' -> '.join(followed)} -> ..."
            )
        return longest_hops[trail[-1]]

    visit(root, [()], [])
    # A target is entered through a `$ref`, and that hop counts too.
    for ref, (location, target) in targets.items():
        visit(target, [location], [ref])


class HttpExecution(_Strict):
    """The orchestrator POSTs `{"name", "arguments"}` as JSON to `url` and feeds the reply to the model."""

    kind: Literal["http"] = Field(description="Executed by the orchestrator over HTTP.")
    url: str = Field(description="http(s) endpoint of the tool.", pattern=r"^https?://\S+$", max_length=2048)
    timeout_s: float = Field(10.0, description="Deadline of one call, connect to last byte.", gt=0, le=300)


class ClientExecution(_Strict):
    """The client runs the tool: the turn pauses with `requires_action` until results are submitted."""

    kind: Literal["client"] = Field(description="Executed by the API client.")


ToolExecution = Annotated[HttpExecution | ClientExecution, Field(discriminator="kind")]


class ToolSpec(_Strict):
    """One tool as the client declares it. Only name, description and parameters reach the model."""

    name: str = Field(description="Tool name the model calls.", pattern=TOOL_NAME_PATTERN)
    description: str = Field("", description="What the tool does, shown to the model.", max_length=8192)
    parameters: dict[str, JsonValue] = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="Draft 2020-12 JSON Schema of the arguments object.",
    )
    required_permissions: list[str] = Field(
        default_factory=list, description="Permissions the caller must hold before the tool runs."
    )
    execution: ToolExecution = Field(description="Where the tool runs.")

    @field_validator("parameters")
    @classmethod
    def _check_parameters(cls, value: dict[str, JsonValue]) -> dict[str, JsonValue]:
        # Bounds first: the metaschema check recurses per level and would overflow the stack on deep input.
        _check_bounds(value)
        try:
            Draft202012Validator.check_schema(value)
        except SchemaError as err:
            where = "/".join(str(p) for p in err.absolute_path) or "<root>"
            raise ValueError(f"not a valid Draft 2020-12 JSON Schema at {where}: {err.message}") from None
        if value.get("type") != "object":
            raise ValueError('tool arguments are a JSON object: the schema needs "type": "object"')
        refs: dict[str, str] = {}
        _check_keywords(value, "", refs)
        # After the metaschema check: resolution relies on keyword values having their schema shapes.
        _check_ref_chains(value, refs)
        return value


class SessionLimits(_Strict):
    """Per-session bounds on steps, context and tool output."""

    max_steps_per_turn: int = Field(8, description="Model calls one user turn may take.", ge=1, le=64)
    context_budget_tokens: int | None = Field(
        None, description="Context window the session may use; None means the model's full window.", ge=256
    )
    output_reserve_tokens: int = Field(512, description="Tokens kept free for the model's answer.", ge=1)
    compress_below_fraction: float = Field(
        0.2, description="Compress when remaining tokens fall below this fraction of the window.", gt=0, lt=1
    )
    keep_last_rounds: int = Field(3, description="Rounds (a user message onwards) never compressed.", ge=1)
    max_tool_result_bytes: int = Field(
        16384, description="Tool results are truncated beyond this.", ge=256, le=MAX_TOOL_RESULT_BYTES_CEILING
    )

    @model_validator(mode="after")
    def _check_budget(self) -> "SessionLimits":
        if self.context_budget_tokens is not None and self.output_reserve_tokens >= self.context_budget_tokens:
            raise ValueError(
                f"output_reserve_tokens={self.output_reserve_tokens} must be below "
                f"context_budget_tokens={self.context_budget_tokens}"
            )
        return self


class CreateSessionRequest(_Strict):
    """Body of session creation. System prompt and tools are fixed for the session's life: they are the cached prefix."""

    model: str = Field(description="Served model id.", min_length=1)
    system_prompt: str = Field("", description="System prompt, first in every request.")
    tools: list[ToolSpec] = Field(default_factory=list, description="Tools the model may call.", max_length=128)
    limits: SessionLimits = Field(default_factory=SessionLimits, description="Session bounds.")

    @model_validator(mode="after")
    def _unique_tools(self) -> "CreateSessionRequest":
        names = [tool.name for tool in self.tools]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"tool names must be unique, repeated: {duplicates}")
        return self


class CreateSessionResponse(_Strict):
    """Reply to session creation."""

    session_id: SessionId = Field(description="Opaque session id.")
    prefix_fingerprint: PrefixFingerprint = Field(description="sha256 of the cacheable prefix token ids.")


class ToolCall(_Strict):
    """A call the model made. `arguments` is the raw JSON text, validated by `tools.validate_tool_call`."""

    id: str = Field(description="Call id, echoed by the tool result.", min_length=1, max_length=128)
    name: str = Field(description="Tool name as the model wrote it.", min_length=1, max_length=256)
    arguments: str = Field(description="Arguments as a JSON string.")


class Message(_Strict):
    """One transcript entry, in OpenAI chat roles."""

    role: Role = Field(description="Author role.")
    content: str | None = Field(None, description="Text; None only on assistant messages that call tools.")
    tool_calls: list[ToolCall] | None = Field(None, description="Assistant only: tool calls made.")
    tool_call_id: str | None = Field(None, description="Tool only: the call this message answers.")
    name: str | None = Field(None, description="Tool name (tool role) or a marker of generated messages.")

    @model_validator(mode="after")
    def _check_role_fields(self) -> "Message":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls are only allowed on assistant messages, not {self.role}")
        if (self.tool_call_id is None) == (self.role == "tool"):
            raise ValueError("tool_call_id is required on tool messages and allowed nowhere else")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"{self.role} messages need content")
        return self


class TurnRequest(_Strict):
    """A user turn: one user message, answered by up to `max_steps_per_turn` model calls."""

    content: str = Field(description="User message text.", min_length=1, max_length=MAX_TURN_CONTENT_CHARS)
    tool_choice: str = Field(
        "auto",
        description=(
            "First step only: 'auto', 'none', 'required' (a call, grammar-constrained to the tools' "
            "schemas) or a tool name (that tool). Later steps of the turn use 'auto'."
        ),
        min_length=1,
        max_length=64,
    )
    stream: bool = Field(False, description="Stream events as server-sent events.")


class ToolResult(_Strict):
    """Result of a client-executed tool call."""

    tool_call_id: str = Field(description="Id of the call answered.", min_length=1, max_length=128)
    content: str = Field(description="Result text shown to the model.")
    is_error: bool = Field(False, description="True when the tool failed; the model sees the content either way.")


class ToolResultsSubmission(_Strict):
    """Body answering a `requires_action` event: one result per pending call."""

    results: list[ToolResult] = Field(description="Results, one per pending call.", min_length=1)
    stream: bool = Field(False, description="Stream the resumed turn's events as server-sent events.")

    @model_validator(mode="after")
    def _unique_ids(self) -> "ToolResultsSubmission":
        ids = [result.tool_call_id for result in self.results]
        if len(set(ids)) != len(ids):
            raise ValueError("each tool_call_id may be answered once")
        return self


class CompressionReport(_Strict):
    """What one context compression did. `ledger_retained_fraction` is measured, and must be 1.0."""

    num_messages_compressed: int = Field(description="History messages replaced by the summary.", ge=1)
    tokens_before: int = Field(description="Prompt tokens before compression.", ge=0)
    tokens_after: int = Field(description="Prompt tokens after compression.", ge=0)
    ledger_size: int = Field(description="Exact values extracted from the compressed messages.", ge=0)
    ledger_retained_fraction: float = Field(
        description="Fraction of ledger values found verbatim in the new context.", ge=0, le=1
    )


class StepStats(_Strict):
    """Cache accounting of one model call, stored with the session."""

    step_index: int = Field(description="Step within the turn, from 0.", ge=0)
    prefix_fingerprint: PrefixFingerprint = Field(description="Fingerprint of the prefix the step sent.")
    prompt_tokens: int = Field(description="Prompt tokens the engine counted.", ge=0)
    cached_tokens: int = Field(description="Prompt tokens served from the prefix cache.", ge=0)
    completion_tokens: int = Field(0, description="Generated tokens.", ge=0)
    compression: CompressionReport | None = Field(None, description="Compression done before this step.")


class DeltaEvent(_Strict):
    """Streamed assistant text."""

    kind: Literal["delta"] = "delta"
    text: str = Field(description="Next piece of assistant text.")


class ToolCallEvent(_Strict):
    """The model called a tool; emitted before it runs."""

    kind: Literal["tool_call"] = "tool_call"
    call: ToolCall = Field(description="Validated call about to run.")


class ToolResultEvent(_Strict):
    """A tool finished (or failed or timed out); the content is what the model sees."""

    kind: Literal["tool_result"] = "tool_result"
    tool_call_id: str = Field(description="Call answered.")
    status: Literal["ok", "error", "timeout"] = Field(description="How the tool ended.")
    content: str = Field(description="What the model sees.")
    is_truncated: bool = Field(False, description="True when the result was cut to max_tool_result_bytes.")


class FinalEvent(_Strict):
    """The turn ended with an assistant answer."""

    kind: Literal["final"] = "final"
    message: Message = Field(description="The turn's last assistant message.")


class UsageEvent(_Strict):
    """Token and cache accounting of one step."""

    kind: Literal["usage"] = "usage"
    stats: StepStats = Field(description="Token and cache accounting of one step.")


class RequiresActionEvent(_Strict):
    """The turn is paused until the client submits results for these calls."""

    kind: Literal["requires_action"] = "requires_action"
    tool_calls: list[ToolCall] = Field(description="Client-executed calls awaiting results.", min_length=1)


class ErrorEvent(_Strict):
    """The turn failed; `code` says why in a machine-readable way."""

    kind: Literal["error"] = "error"
    code: str = Field(description="Machine-readable error code.")
    message: str = Field(description="Human-readable explanation.")


class CompressionEvent(_Strict):
    """Old rounds were replaced by a summary plus a facts ledger."""

    kind: Literal["compression"] = "compression"
    report: CompressionReport = Field(description="What the compression did.")


class ModelRetryEvent(_Strict):
    """A step's model call failed (its replica died) and runs again; discard this step's deltas so far."""

    kind: Literal["model_retry"] = "model_retry"
    step_index: int = Field(description="Step whose model call restarts.", ge=0)
    reason: str = Field(description="What failed.")


SessionEvent = Annotated[
    DeltaEvent
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
