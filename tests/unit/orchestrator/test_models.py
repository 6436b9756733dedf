"""Request validation of the session API: malformed bodies fail with the offending field named."""

import copy
import json
import sys

import pytest
import xgrammar
from pydantic import ValidationError

from serve_apps.orchestrator.models import (
    MAX_KEEP_LAST_ROUNDS,
    MAX_TOOL_RESULT_BYTES_CEILING,
    MAX_TURN_CONTENT_CHARS,
    SESSION_EVENT_ADAPTER,
    STORED,
    ClientExecution,
    CreateSessionRequest,
    HttpExecution,
    Message,
    SessionLimits,
    ToolCall,
    ToolResultsSubmission,
    ToolSpec,
    TurnRequest,
)
from serve_apps.orchestrator import tool_schema
from serve_apps.orchestrator.tool_schema import (
    MAX_PATTERN_GROUP_DEPTH, MAX_REF_HOPS, MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH, MAX_SESSION_PATTERN_UNROLLED,
    pattern_elements,
)
from serve_apps.orchestrator.tools import validate_tool_call

HTTP = {"kind": "http", "url": "http://127.0.0.1:9/tool", "timeout_s": 2}
OBJECT_SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}


def _tool(**overrides):
    body = {"name": "search", "description": "find", "parameters": OBJECT_SCHEMA, "execution": HTTP}
    body.update(overrides)
    return body


def _error_locations(err: ValidationError) -> list[str]:
    return [".".join(str(part) for part in item["loc"]) for item in err.errors()]


@pytest.mark.parametrize("name", ["search", "get_order", "a-b_c-9", "x" * 64])
def test_tool_name_accepted(name):
    assert ToolSpec.model_validate(_tool(name=name)).name == name


@pytest.mark.parametrize("name", ["", "x" * 65, "has space", "dot.name", "ünïcode", "semi;colon"])
def test_tool_name_rejected(name):
    with pytest.raises(ValidationError) as info:
        ToolSpec.model_validate(_tool(name=name))
    assert _error_locations(info.value) == ["name"]


@pytest.mark.parametrize(
    "parameters, fragment",
    [
        ({"type": "object", "properties": {"q": {"type": "strin"}}}, "Draft 2020-12"),
        ({"type": "object", "required": "q"}, "Draft 2020-12"),
        ({"type": "array", "items": {"type": "string"}}, '"type": "object"'),
        ({"properties": {}}, '"type": "object"'),
        ({"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}}, "only local references"),
        ({"type": "object", "properties": {"a": {"$ref": "#/properties/b"}}}, "only local references"),
        ({"type": "object", "$id": "https://example.com/root"}, "$id is not allowed"),
    ],
)
def test_tool_parameters_rejected(parameters, fragment):
    with pytest.raises(ValidationError) as info:
        ToolSpec.model_validate(_tool(parameters=parameters))
    assert _error_locations(info.value) == ["parameters"]
    assert fragment in str(info.value)


DRAFT_04 = "http://json-schema.org/draft-04/schema#"


def _ref_chain(num_hops):
    """A schema whose property starts a chain of `num_hops` in-place `$ref` hops (d0 -> d1 -> ...)."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(num_hops - 1)}
    defs[f"d{num_hops - 1}"] = {"type": "integer"}
    return {"type": "object", "$defs": defs, "properties": {"x": {"$ref": "#/$defs/d0"}}}


def _with_defs(properties, **defs):
    return {"type": "object", "$defs": defs, "properties": properties}


@pytest.mark.parametrize(
    "parameters, fragment",
    [
        ({"type": "object", "maximum": float("nan")}, "/maximum: nan is not a JSON number"),
        ({"type": "object", "properties": {"a": {"minimum": float("-inf")}}}, "/properties/a/minimum: -inf"),
        ({"type": "object", "maximum": 10**5000}, "cannot be written as JSON"),
        ({"type": "object", "description": "ok \ud800"}, "lone surrogate '\\ud800'"),
        ({"type": "object", "properties": {"\udc00": {}}}, "lone surrogate '\\udc00'"),
        (_with_defs({"a": {"$ref": "#/$defs/missing"}}), "/properties/a/$ref: $ref '#/$defs/missing' points to no"),
        (_with_defs({"a": {"$ref": "#/$defs/x/type"}}, x={"type": "string"}), "does not point to a subschema"),
        (_with_defs({"a": {"$ref": "#/$defs/x/enum/0"}}, x={"enum": [{}]}), "does not point to a subschema"),
        (_with_defs({"a": {"$ref": "#/$defs/x/allOf"}}, x={"allOf": [{}]}), "points to a list of subschemas"),
        (_with_defs({"a": {"$ref": "#/$defs/x/properties"}}, x={"properties": {}}), "points to a map of subschemas"),
        (_with_defs({"a": {"$ref": "#/$defs/x/allOf/1"}}, x={"allOf": [{}]}), "points to nothing"),
        (_with_defs({"a": {"$ref": "#/$defs/x/allOf/-1"}}, x={"allOf": [{}]}), "points to nothing"),
        (_with_defs({"a": {"$ref": "#/$defs/x/allOf/0/y"}}, x={"allOf": [True]}), "points to nothing"),
        (_with_defs({"a": {"$ref": "#/$defs/x"}}, x={"$ref": "#/$defs/x"}), "$ref cycle"),
        (
            _with_defs(
                {"a": {"$ref": "#/$defs/x"}}, x={"allOf": [{"$ref": "#/$defs/y"}]}, y={"not": {"$ref": "#/$defs/x"}}
            ),
            "$ref cycle",
        ),
        (_with_defs({}, x={"if": {"$ref": "#/$defs/x"}}), "$ref cycle"),
        ({"type": "object", "$ref": "#/$defs/x", "$defs": {"x": {"anyOf": [{"$ref": "#/$defs/x"}]}}}, "$ref cycle"),
        (_ref_chain(MAX_REF_HOPS + 1), f" {MAX_REF_HOPS + 1} hops that never descends into the arguments"),
        (_ref_chain(MAX_REF_HOPS + 1), f"over the limit MAX_REF_HOPS={MAX_REF_HOPS}"),
        ({"type": "object", "properties": {"a": {"$schema": DRAFT_04}}}, "only Draft 2020-12"),
        ({"type": "object", "$schema": "http://json-schema.org/draft-07/schema#"}, "only Draft 2020-12"),
    ],
)
def test_tool_parameters_that_would_crash_later_rejected(parameters, fragment):
    """Each of these used to pass and then raise later: in tools.validate_tool_call (RecursionError,
    TypeError, ...) or when the session store writes the request as JSON (surrogates, NaN)."""
    with pytest.raises(ValidationError) as info:
        ToolSpec.model_validate(_tool(parameters=parameters))
    assert _error_locations(info.value) == ["parameters"]
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "parameters",
    [
        _with_defs({"a": {"$ref": "#/$defs/x/properties/y"}}, x={"properties": {"y": {"type": "string"}}}),
        _with_defs({"a": {"$ref": "#/$defs/x/anyOf/1"}}, x={"anyOf": [{}, {"type": "string"}]}),
        _with_defs({"a": {"$ref": "#/$defs/a~1b"}}, **{"a/b": {"type": "string"}}),
        _with_defs({"a": {"$ref": "#/$defs/a%20b"}}, **{"a b": {"type": "string"}}),
        _with_defs({"a": {"$ref": "#/$defs/t"}}, t={"type": "array", "items": {"$ref": "#/$defs/t"}}),
        _with_defs({"a": {"$ref": "#/$defs/x"}}, x={"properties": {"next": {"$ref": "#/$defs/x"}}}),
        _ref_chain(MAX_REF_HOPS),
        {"type": "object", "$schema": "https://json-schema.org/draft/2020-12/schema"},
        {"type": "object", "const": {"$schema": {"type": "string"}}},
    ],
)
def test_tool_parameters_with_bounded_references_accepted(parameters):
    assert ToolSpec.model_validate(_tool(parameters=parameters)).parameters == parameters


_EMPTY_DESCRIBED = {"description": "", "type": "object"}
_EMPTY_DESCRIBED_BYTES = len('{"description":"","type":"object"}')


def _schema_of_bytes(num_bytes, pad_char):
    """An object schema whose compact JSON is exactly `num_bytes` UTF-8 bytes, padded in its description."""
    pad_bytes = num_bytes - _EMPTY_DESCRIBED_BYTES
    char_bytes = len(pad_char.encode("utf-8"))
    return {**_EMPTY_DESCRIBED, "description": pad_char * (pad_bytes // char_bytes) + "x" * (pad_bytes % char_bytes)}


def _assert_parameters_verdict(parameters, is_accepted, message_parts):
    """Accepted parameters come back unchanged; rejected ones fail on `parameters` with every part in the message."""
    if is_accepted:
        assert ToolSpec.model_validate(_tool(parameters=parameters)).parameters == parameters
        return
    with pytest.raises(ValidationError) as info:
        ToolSpec.model_validate(_tool(parameters=parameters))
    assert _error_locations(info.value) == ["parameters"]
    for part in message_parts:
        assert part in str(info.value)


@pytest.mark.parametrize(
    "num_bytes, pad_char, is_accepted",
    [
        (MAX_SCHEMA_BYTES, "x", True),
        (MAX_SCHEMA_BYTES + 1, "x", False),
        (MAX_SCHEMA_BYTES, "é", True),
        (MAX_SCHEMA_BYTES + 1, "é", False),
        (MAX_SCHEMA_BYTES + 1, "€", False),
        (10 * MAX_SCHEMA_BYTES, "x", False),
    ],
)
def test_tool_parameters_size_limit(num_bytes, pad_char, is_accepted):
    _assert_parameters_verdict(
        _schema_of_bytes(num_bytes, pad_char), is_accepted, [f"{num_bytes} bytes", f"MAX_SCHEMA_BYTES={MAX_SCHEMA_BYTES}"]
    )


def _nested_default(depth):
    """Depth counts the root object: `{"default": [[...]]}` with depth - 1 arrays."""
    value = []
    for _ in range(depth - 2):
        value = [value]
    return {"type": "object", "default": value}


def _nested_properties(depth):
    """Each property level adds two (the `properties` map and the subschema): depth = 2 * levels + 1."""
    schema = {"type": "string"}
    for _ in range((depth - 1) // 2):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    "build, depth, is_accepted",
    [
        (_nested_default, MAX_SCHEMA_DEPTH, True),
        (_nested_default, MAX_SCHEMA_DEPTH + 1, False),
        (_nested_properties, MAX_SCHEMA_DEPTH - 1, True),
        (_nested_properties, MAX_SCHEMA_DEPTH + 1, False),
        # Deep enough that the metaschema check would exhaust the stack were it run first.
        (_nested_properties, 201, False),
    ],
)
def test_tool_parameters_depth_limit(build, depth, is_accepted):
    _assert_parameters_verdict(
        build(depth), is_accepted, [f"nests {depth} levels", f"MAX_SCHEMA_DEPTH={MAX_SCHEMA_DEPTH}"]
    )


@pytest.mark.parametrize(
    "parameters, fragment",
    [
        ({**_schema_of_bytes(MAX_SCHEMA_BYTES + 1, "x"), "required": "q"}, "MAX_SCHEMA_BYTES"),
        ({**_nested_properties(MAX_SCHEMA_DEPTH + 1), "required": "q"}, "MAX_SCHEMA_DEPTH"),
    ],
)
def test_tool_parameters_bounds_checked_before_the_metaschema(parameters, fragment):
    with pytest.raises(ValidationError) as info:
        ToolSpec.model_validate(_tool(parameters=parameters))
    assert fragment in str(info.value) and "Draft 2020-12" not in str(info.value)


def test_tool_parameters_local_defs_and_property_named_ref_accepted():
    parameters = {
        "type": "object",
        "$defs": {"item": {"type": "object", "properties": {"sku": {"type": "string"}}}},
        "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}}, "$ref": {"type": "string"}},
    }
    assert ToolSpec.model_validate(_tool(parameters=parameters)).parameters == parameters


@pytest.mark.parametrize(
    "properties",
    [
        {"a": {"const": {"$ref": "https://example.com/s.json"}}},
        {"a": {"enum": [{"$id": "https://example.com/root"}, 1]}},
        {"a": {"type": "object", "default": {"$ref": "#/properties/b"}}},
        {"a": {"examples": [{"$anchor": "x", "$schema": "http://json-schema.org/draft-07/schema#"}]}},
    ],
)
def test_tool_parameters_with_reference_like_data_accepted(properties):
    # Values under const/enum/default/examples are data the arguments are compared with, not schema.
    parameters = {"type": "object", "properties": properties}
    assert ToolSpec.model_validate(_tool(parameters=parameters)).parameters == parameters


@pytest.mark.parametrize(
    "properties",
    [
        {"const": {"$ref": "https://example.com/s.json"}},  # a property named const is a schema
        {"enum": {"$id": "https://example.com/root"}},
        {"a": {"x-annotation": {"$ref": "https://example.com/s.json"}}},  # unknown keywords stay checked
    ],
)
def test_tool_parameters_checked_under_property_names_that_are_data_keywords(properties):
    with pytest.raises(ValidationError):
        ToolSpec.model_validate(_tool(parameters={"type": "object", "properties": properties}))


@pytest.mark.parametrize(
    "execution, expected_type",
    [(HTTP, HttpExecution), ({"kind": "client"}, ClientExecution)],
)
def test_execution_is_discriminated_by_kind(execution, expected_type):
    assert isinstance(ToolSpec.model_validate(_tool(execution=execution)).execution, expected_type)


@pytest.mark.parametrize(
    "execution, location",
    [
        ({"kind": "ftp"}, "execution"),
        ({"kind": "http"}, "execution.http.url"),
        ({"kind": "http", "url": "file:///etc/passwd"}, "execution.http.url"),
        ({"kind": "http", "url": "http://x", "timeout_s": 0}, "execution.http.timeout_s"),
        ({"kind": "client", "url": "http://x"}, "execution.client.url"),
    ],
)
def test_execution_errors_name_the_field(execution, location):
    with pytest.raises(ValidationError) as info:
        ToolSpec.model_validate(_tool(execution=execution))
    assert _error_locations(info.value) == [location]


@pytest.mark.parametrize(
    "body, location",
    [
        ({"model": "m", "sytem_prompt": "typo"}, "sytem_prompt"),
        ({"model": ""}, "model"),
        ({"model": "m", "tools": [_tool(extra=1)]}, "tools.0.extra"),
        ({"model": "m", "limits": {"max_steps_per_turn": 0}}, "limits.max_steps_per_turn"),
        ({"model": "m", "limits": {"compress_below_fraction": 1.5}}, "limits.compress_below_fraction"),
        ({"model": "m", "limits": {"keep_last_rounds": 0}}, "limits.keep_last_rounds"),
        ({"model": "m", "limits": {"keep_last_rounds": MAX_KEEP_LAST_ROUNDS + 1}}, "limits.keep_last_rounds"),
        ({"model": "m", "limits": {"context_budget_tokens": 100}}, "limits.context_budget_tokens"),
        ({"model": "m", "limits": {"context_budget_tokens": 512, "output_reserve_tokens": 512}}, "limits"),
        ({"model": "m", "tools": [_tool(), _tool()]}, ""),
    ],
)
def test_create_session_errors_name_the_field(body, location):
    with pytest.raises(ValidationError) as info:
        CreateSessionRequest.model_validate(body)
    assert _error_locations(info.value) == [location]


@pytest.mark.parametrize(
    "max_tool_result_bytes, is_accepted",
    [(256, True), (MAX_TOOL_RESULT_BYTES_CEILING, True), (255, False), (MAX_TOOL_RESULT_BYTES_CEILING + 1, False)],
)
def test_session_limits_tool_result_bytes_bounds(max_tool_result_bytes, is_accepted):
    body = {"model": "m", "limits": {"max_tool_result_bytes": max_tool_result_bytes}}
    if is_accepted:
        assert CreateSessionRequest.model_validate(body).limits.max_tool_result_bytes == max_tool_result_bytes
        return
    with pytest.raises(ValidationError) as info:
        CreateSessionRequest.model_validate(body)
    assert _error_locations(info.value) == ["limits.max_tool_result_bytes"]


@pytest.mark.parametrize("model, body, location", [
    (TurnRequest, {"content": "hi", "stream": "yes"}, "stream"),
    (TurnRequest, {"content": "hi", "stream": 1}, "stream"),
    (ToolResultsSubmission, {"results": [{"tool_call_id": "c1", "content": "x"}], "stream": "on"}, "stream"),
    (ToolResultsSubmission, {"results": [{"tool_call_id": "c1", "content": "x", "is_error": "false"}]},
     "results.0.is_error"),
    (CreateSessionRequest, {"model": "m", "limits": {"max_steps_per_turn": "8"}}, "limits.max_steps_per_turn"),
    (CreateSessionRequest, {"model": "m", "limits": {"keep_last_rounds": True}}, "limits.keep_last_rounds"),
    (CreateSessionRequest, {"model": "m", "limits": {"compress_below_fraction": "0.5"}},
     "limits.compress_below_fraction"),
    (CreateSessionRequest, {"model": "m", "tools": [_tool(execution={"kind": "http", "url": "http://t/x",
                                                                     "timeout_s": "5"})]}, "tools.0.execution.http.timeout_s"),
])
def test_numbers_and_true_false_values_are_read_as_json_writes_them(model, body, location):
    """Pydantic's lax mode read `"stream": "yes"` as true (the turn streamed), `"8"` as 8 and `true` as 1, where the
    chat routes answer 400, as OpenAI's API does."""
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    assert _error_locations(info.value) == [location]


def test_a_null_true_false_value_is_its_default_and_numbers_may_be_written_as_floats():
    assert TurnRequest.model_validate({"content": "hi", "stream": None}).stream is False
    limits = SessionLimits.model_validate({"max_steps_per_turn": 4.0, "compress_below_fraction": 1 / 2})
    assert (limits.max_steps_per_turn, limits.compress_below_fraction) == (4, 0.5)


def test_keep_last_rounds_is_bounded_at_creation_but_a_stored_session_above_the_bound_stays_readable():
    """An over-window turn searches every kept round count for a plan (a few ms each, on the event loop); a
    session created before the bound must still read back."""
    body = {"model": "m", "limits": {"keep_last_rounds": 1000}}
    with pytest.raises(ValidationError, match=f"at most {MAX_KEEP_LAST_ROUNDS}"):
        CreateSessionRequest.model_validate(body)
    assert CreateSessionRequest.model_validate(body, context=STORED).limits.keep_last_rounds == 1000
    assert SessionLimits(keep_last_rounds=MAX_KEEP_LAST_ROUNDS).keep_last_rounds == MAX_KEEP_LAST_ROUNDS


@pytest.mark.parametrize("tool", [
    {"name": "required", "execution": {"kind": "client"}},  # a `tool_choice` keyword
    {"name": "t", "required_permissions": [""], "execution": {"kind": "client"}},  # no key could hold it
])
def test_a_tool_refused_at_creation_now_still_reads_back_from_a_session_stored_before(tool):
    """Its session's turns, view and deletion failed as internal errors (500), and it held its quota place."""
    body = {"model": "m", "tools": [tool]}
    with pytest.raises(ValidationError):
        CreateSessionRequest.model_validate(body)
    assert CreateSessionRequest.model_validate(body, context=STORED).tools[0].name == tool["name"]


@pytest.mark.parametrize(
    "content, is_accepted",
    [("x", True), ("é" * MAX_TURN_CONTENT_CHARS, True), ("", False), ("x" * (MAX_TURN_CONTENT_CHARS + 1), False)],
)
def test_turn_content_length_bounds(content, is_accepted):
    if is_accepted:
        assert TurnRequest.model_validate({"content": content}).content == content
        return
    with pytest.raises(ValidationError) as info:
        TurnRequest.model_validate({"content": content})
    assert _error_locations(info.value) == ["content"]


def test_session_limits_defaults():
    limits = SessionLimits()
    assert (limits.max_steps_per_turn, limits.context_budget_tokens, limits.output_reserve_tokens) == (8, None, 512)
    assert (limits.compress_below_fraction, limits.keep_last_rounds, limits.max_tool_result_bytes) == (0.2, 3, 16384)


CALL = {"id": "c1", "name": "search", "arguments": "{}"}


@pytest.mark.parametrize(
    "body",
    [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "done"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "{}", "tool_call_id": "c1", "name": "search"},
    ],
)
def test_message_valid(body):
    assert Message.model_validate(body).role == body["role"]


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"role": "user", "content": "x", "tool_calls": [CALL]}, "only allowed on assistant"),
        ({"role": "tool", "content": "x"}, "tool_call_id is required"),
        ({"role": "user", "content": "x", "tool_call_id": "c1"}, "tool_call_id is required"),
        ({"role": "assistant"}, "need content"),
        ({"role": "user"}, "need content"),
        ({"role": "developer", "content": "x"}, "role"),
    ],
)
def test_message_invalid(body, fragment):
    with pytest.raises(ValidationError) as info:
        Message.model_validate(body)
    assert fragment in str(info.value)


def test_tool_results_submission_rejects_duplicate_ids():
    with pytest.raises(ValidationError, match="answered once"):
        ToolResultsSubmission.model_validate(
            {"results": [{"tool_call_id": "a", "content": "1"}, {"tool_call_id": "a", "content": "2"}]}
        )


@pytest.mark.parametrize(
    "event",
    [
        {"kind": "delta", "text": "Hel"},
        {"kind": "tool_call", "call": CALL},
        {"kind": "tool_result", "tool_call_id": "c1", "status": "timeout", "content": "{}"},
        {"kind": "final", "message": {"role": "assistant", "content": "ok"}},
        {"kind": "usage", "stats": {"step_index": 0, "prefix_fingerprint": "ab", "prompt_tokens": 9, "cached_tokens": 8}},
        {"kind": "requires_action", "tool_calls": [CALL]},
        {"kind": "error", "code": "context_exhausted", "message": "no room"},
        {
            "kind": "compression",
            "report": {
                "num_messages_compressed": 4,
                "tokens_before": 900,
                "tokens_after": 300,
                "ledger_size": 7,
                "ledger_retained_fraction": 1.0,
            },
        },
    ],
)
def test_session_event_round_trips_by_kind(event):
    parsed = SESSION_EVENT_ADAPTER.validate_python(event)
    assert parsed.kind == event["kind"]
    assert SESSION_EVENT_ADAPTER.validate_json(SESSION_EVENT_ADAPTER.dump_json(parsed)) == parsed


# Python's json.loads turns "\ud800" into a lone surrogate; every text field refuses it, naming the field.
LONE = "bad \ud800"


@pytest.mark.parametrize(
    "model, body, location",
    [
        (CreateSessionRequest, {"model": "m", "system_prompt": LONE}, "system_prompt"),
        (CreateSessionRequest, {"model": LONE}, "model"),
        (CreateSessionRequest, {"model": "m", "tools": [_tool(description=LONE)]}, "tools.0.description"),
        (CreateSessionRequest, {"model": "m", "tools": [_tool(required_permissions=["ok", LONE])]},
         "tools.0.required_permissions.1"),
        (CreateSessionRequest, {"model": "m", "tools": [_tool(parameters={**OBJECT_SCHEMA, "description": LONE})]},
         "tools.0.parameters"),
        (CreateSessionRequest, {"model": "m", "tools": [_tool(execution={**HTTP, "url": "http://h/\udc00"})]},
         "tools.0.execution.http.url"),
        (TurnRequest, {"content": LONE}, "content"),
        (TurnRequest, {"content": "x", "tool_choice": LONE}, "tool_choice"),
        (ToolResultsSubmission, {"results": [{"tool_call_id": "c1", "content": LONE}]}, "results.0.content"),
        (ToolResultsSubmission, {"results": [{"tool_call_id": LONE, "content": "x"}]}, "results.0.tool_call_id"),
        (Message, {"role": "user", "content": LONE}, "content"),
        (Message, {"role": "tool", "tool_call_id": "c1", "name": LONE, "content": "x"}, "name"),
    ],
)
def test_text_that_utf8_cannot_encode_is_refused_naming_the_field(model, body, location):
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    assert _error_locations(info.value) == [location]


def test_text_with_any_valid_unicode_is_accepted():
    text = "é 中文 \U0001F600 \x00 \u200b"
    request = CreateSessionRequest.model_validate({"model": "m", "system_prompt": text})
    assert request.system_prompt == text
    assert ToolResultsSubmission.model_validate({"results": [{"tool_call_id": "c", "content": text}]}).results[0].content == text


@pytest.mark.parametrize(
    "properties, fragment",
    [
        # The grammar of forced calls parses integers into int64 and numbers into float64.
        ({"a": {"type": "number", "maximum": 10**400}}, "/properties/a/maximum: an integer of 401 digits"),
        ({"a": {"enum": [1, 10**400]}}, "/properties/a/enum/1: an integer of 401 digits is beyond the float64 range"),
        ({"a": {"type": "integer", "maximum": 2**63}}, "/properties/a/maximum"),
        ({"a": {"type": "integer", "minimum": -(2**63) - 1}}, "/properties/a/minimum"),
        ({"a": {"type": "string", "minLength": 10**20}}, "/properties/a/minLength"),
        ({"a": {"type": "integer", "maximum": 1e300}}, "/properties/a/maximum: 1e+300 is outside"),
        ({"a": {"type": ["integer", "null"], "exclusiveMinimum": -1e19}}, "/properties/a/exclusiveMinimum"),
        # Counts are integers as written, and integer bounds whole numbers (JSON Schema allows 5.0 and 5.5).
        ({"a": {"type": "string", "maxLength": 5.0}}, "/properties/a/maxLength: write 5.0 as an integer"),
        ({"a": {"type": "array", "minItems": 1e20}}, "/properties/a/minItems: write 1e+20 as an integer"),
        ({"a": {"type": "object", "maxProperties": 2.0}}, "/properties/a/maxProperties"),
        ({"a": {"type": "string", "minLength": 2**31}}, "/properties/a/minLength: 2147483648 is over 2147483647"),
        ({"a": {"type": "integer", "maximum": 5.5}}, "/properties/a/maximum: 5.5 is not a whole number"),
    ],
)
def test_tool_parameters_with_numbers_the_grammar_cannot_hold_rejected(properties, fragment):
    with pytest.raises(ValidationError) as info:
        ToolSpec.model_validate(_tool(parameters={"type": "object", "properties": properties}))
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "properties",
    [
        {"a": {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}},
        {"a": {"type": "number", "maximum": 1e300, "minimum": -1.5e308}},
        {"a": {"type": "integer", "maximum": 1e18}},
        {"a": {"type": "string", "maxLength": 2**31 - 1}},
        {"a": {"type": "integer", "minimum": 2.0, "multipleOf": 0.5}},
        {"a": {"type": "number", "maximum": 5.5}},
        {"a": {"type": "array", "maxItems": 2**40}},
        # Values the arguments are compared with are not read as int64.
        {"a": {"const": 10**19}},
        {"a": {"enum": [2**64, -(10**300)]}},
    ],
)
def test_tool_parameters_with_numbers_in_range_accepted(properties):
    parameters = {"type": "object", "properties": properties}
    spec = ToolSpec.model_validate(_tool(parameters=copy.deepcopy(parameters)))
    # Kept as given: no bound clipped, no integer turned into a float (10**19 == 1e19, but not as JSON).
    assert spec.parameters == parameters
    assert json.dumps(spec.parameters, sort_keys=True) == json.dumps(parameters, sort_keys=True)
    xgrammar.Grammar.from_json_schema(json.dumps(parameters))  # what a forced call compiles: no error


@pytest.mark.parametrize("schema, fragment", [
    ({"properties": {"a": {"type": "string", "pattern": "^[[:foo:]]$"}}}, "/properties/a/pattern: '^[[:foo:]]$'"),
    ({"patternProperties": {"[[:foo:]]": {}}}, "/patternProperties/[[:foo:]]: '[[:foo:]]'"),
])
def test_a_pattern_only_pythons_re_compiles_is_refused_at_creation(schema, fragment):
    with pytest.raises(ValidationError) as info:
        ToolSpec.model_validate(_tool(parameters={"type": "object", **schema}))
    assert fragment in str(info.value) and "[:foo:] is a POSIX class" in str(info.value)


@pytest.mark.parametrize("pattern, fragment", [
    (r"\A[a-z]+\z", r"\A is no escape"),
    (r"^[a-z]+\Z$", r"\Z is no escape"),
    (r"^\h+$", r"\h is no escape"),
    ("^[[:digit:]]+$", "[:digit:] is a POSIX class"),
    ("^[a-z[:alpha:]]+$", "[:alpha:] is a POSIX class"),
    ("^[[:^alpha:]]+$", "[:^alpha:] is a POSIX class"),
    ("^[[:Digit:]]+$", "[:Digit:] is a POSIX class"),
    # ECMAScript's `[^]` is any character (the grammar let `xa]` through); Python's engines read `[^]a]`.
    ("^[^]a]$", "[^] matches any character"),
    ("^a[]b]$", "[] matches nothing"),
])
def test_a_pattern_the_grammar_and_the_call_checks_read_differently_is_refused_at_creation(pattern, fragment):
    """The checks run `regex`, which reads `\A` as an anchor and `[[:digit:]]` as a class; the grammar of forced
    calls reads the letter A, and a class then `]`: no value met both, and every forced call was refused."""
    parameters = {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}}
    with pytest.raises(ValidationError) as info:
        ToolSpec.model_validate(_tool(parameters=parameters))
    message = info.value.errors()[0]["msg"]
    assert fragment in message and "ECMAScript" in message and "\n" not in message


@pytest.mark.parametrize("pattern", [r"^\d{4}-\w+\s\S$", r"^[\-a-z]\x41\u0041\t$", r"[\]]", r"^(a|b)\.c$"])
def test_patterns_in_ecmascripts_own_escapes_are_accepted(pattern):
    ToolSpec.model_validate(_tool(parameters={"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}}))


@pytest.mark.parametrize("pattern, is_accepted", [
    ("^ORD-[0-9]{5}$", True),
    ("^[a-z]{1,4000}$", True),
    ("^[A-Za-z0-9+/]+={0,2}$", True),  # unbounded repeats are loops, not copies
    ("^[a-z]{1,30000}$", False),  # 74 s of grammar compiling on one core
    ("^(ab{1,200}){1,200}$", False),  # nested bounds multiply
    ("^(?:(?:(?:a{1,65535}){1,65535}){1,65535}){1,65535}$", False),
    ("^(a)(?(1)[a-z]{1,30000}|b)$", False),  # a conditional's branches count too
    # Optional copies nested in optional copies: 4,096 elements took 6.9 s to compile, ten times the flat ones.
    ("^(?:[a-z]{1,60}){1,60}$", False),
    ("^(?:[a-z0-9]{1,20}-){0,5}[a-z0-9]{1,20}$", True),
    ("^(?:\\d{1,3}\\.){3}\\d{1,3}$", True),  # exact copies nest cheaply
    # A group name used twice made the pattern unparsable to `re`, and its count the largest single bound.
    ("^(?<g>x)|(?<g>(?:(?:[a-z]{1,64}){1,64}){1,4})$", False),
    ("^(?<year>\\d{4})-(?<month>\\d{2})$", True),
])
def test_a_pattern_the_grammar_compiler_would_unroll_for_minutes_is_refused(pattern, is_accepted):
    parameters = {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}}
    if is_accepted:
        ToolSpec.model_validate(_tool(parameters=parameters))
        return
    with pytest.raises(ValidationError) as info:
        ToolSpec.model_validate(_tool(parameters=parameters))
    assert "unrolls to" in str(info.value) and "maxLength" in str(info.value)


def test_a_pattern_is_measured_before_it_is_compiled_and_compiled_uncached(monkeypatch):
    """`regex` writes counted repeats out as it compiles: `a{100000000,}` took gigabytes before its refusal,
    and its cache kept them after."""
    compiled = []
    real_compile = tool_schema.regex.compile
    monkeypatch.setattr(tool_schema.regex, "compile",
                        lambda pattern, *args, **kwargs: compiled.append((pattern, kwargs)) or real_compile(
                            pattern, *args, **kwargs))
    huge = {"type": "object", "properties": {"a": {"type": "string", "pattern": "a{100000000,}"}}}
    with pytest.raises(ValidationError, match="unrolls to 100000000 elements"):
        ToolSpec.model_validate(_tool(parameters=huge))
    assert compiled == []
    fine = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^ORD-[0-9]{5}$"}}}
    ToolSpec.model_validate(_tool(parameters=fine))
    assert [kwargs for _, kwargs in compiled] == [{"cache_pattern": False}]


@pytest.mark.parametrize("pattern, problem", [
    (r"^\bfoo\b$", "Word boundary is not supported yet"),
    ("(?<=a)b", "Regex parsing error"),
    ("(?i:a)", "Group modifier flag is not supported yet"),
    ("x{,5}", "Invalid repetition count"),
])
def test_a_pattern_the_grammar_compiler_cannot_read_is_refused_at_creation(pattern, problem):
    """Else every turn forced to call the tool would fail (400 invalid_tool_schema) for the session's life."""
    parameters = {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}}
    with pytest.raises(ValidationError) as info:
        ToolSpec.model_validate(_tool(parameters=parameters))
    message = info.value.errors()[0]["msg"]
    assert "grammar of forced tool calls (xgrammar) cannot read" in message and problem in message
    assert "\n" not in message
    xgrammar.Grammar.from_regex("^(?<area>[0-9]{3})-[0-9]{4}$")  # what is accepted, it reads


def _tools_with_patterns(count: int, pattern: str) -> dict:
    return {"model": "m", "tools": [
        _tool(name=f"t{i}", parameters={"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}},
                                       "patternProperties": {"^x-[a-z]{2}$": {}}})
        for i in range(count)]}


def test_the_patterns_of_all_a_sessions_tools_are_bounded_together(monkeypatch):
    """A forced call's grammar holds every tool: 355 patterns each within the bound took 308 s to compile."""
    per_tool = 4000 + 6  # `[a-z]{4000}` and `^x-[a-z]{2}$`
    fits = MAX_SESSION_PATTERN_UNROLLED // per_tool
    CreateSessionRequest.model_validate(_tools_with_patterns(fits, "[a-z]{4000}"))
    with pytest.raises(ValidationError, match=f"unroll to {(fits + 1) * per_tool} elements together"):
        CreateSessionRequest.model_validate(_tools_with_patterns(fits + 1, "[a-z]{4000}"))
    # Refused before any tool's patterns are compiled: 128 tools at the per-tool bound took most of a minute.
    checked = []
    monkeypatch.setattr("serve_apps.orchestrator.tool_schema._check_pattern", lambda *args: checked.append(args))
    with pytest.raises(ValidationError, match="elements together"):
        CreateSessionRequest.model_validate(_tools_with_patterns(128, "[a-z]{4000}"))
    assert checked == []
    # A value in `const` or `enum` is data, not a pattern.
    assert pattern_elements({"type": "object", "const": {"pattern": "a{4000}"},
                             "properties": {"pattern": {"type": "string", "pattern": "b{3}"}}}) == 3
    # ... and parameters over the schema bound are left to their tool's own check, unparsed: a 400,000-character
    # pattern was parsed for seconds before the size bound refused it.
    parsed = []
    monkeypatch.setattr("serve_apps.orchestrator.tool_schema._pattern_size", lambda pattern: parsed.append(1) or 1)
    huge = {"model": "m", "tools": [_tool(parameters={"type": "object", "properties": {
        "a": {"type": "string", "pattern": "\\W" * 200_000}}})]}
    with pytest.raises(ValidationError, match="over the limit MAX_SCHEMA_BYTES"):
        CreateSessionRequest.model_validate(huge)
    assert parsed == []


@pytest.mark.parametrize("pattern, is_accepted", [
    ("^(?<word>[a-z]{1,30000})$", False),
    ("^(?i)[a-z]{1,30000}$", False),  # inline flags not in front: `re` refuses, the bound still holds
    ("^(?<word>[a-z]{1,30})[0-9]{2}$", True),
])
def test_the_unrolled_size_is_bounded_also_in_syntax_pythons_re_reads_otherwise(pattern, is_accepted):
    """Named groups and inline flags, which `regex` compiles and `re` parses otherwise or not at all."""
    parameters = {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}}
    if is_accepted:
        ToolSpec.model_validate(_tool(parameters=parameters))
        return
    with pytest.raises(ValidationError, match="unrolls to"):
        ToolSpec.model_validate(_tool(parameters=parameters))


def test_patterns_are_read_in_json_schemas_own_dialect():
    """ECMAScript's named groups are valid JSON Schema (the metaschema's check compiled with Python's `re`,
    which refused them); a Unicode property class is refused, since the grammar compiler cannot take one."""
    named = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(?<area>[0-9]{3})-[0-9]{4}$"}}}
    ToolSpec.model_validate(_tool(parameters=named))
    letters = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^\\p{L}+$"}}}
    with pytest.raises(ValidationError, match="Unicode property class"):
        ToolSpec.model_validate(_tool(parameters=letters))


@pytest.mark.parametrize("key", ["pattern", "patternProperties"])
def test_a_pattern_nested_too_deeply_to_parse_is_refused_not_raised(key):
    pattern = "(" * 500 + "a" + ")" * 500  # 1 KB: Python's regular expression parsers recurse per group
    schema = {"pattern": pattern, "type": "string"} if key == "pattern" else {"patternProperties": {pattern: {}}}
    with pytest.raises(ValidationError) as info:
        ToolSpec.model_validate(_tool(parameters={"type": "object", "properties": {"a": schema}}))
    assert f"nests its groups 500 deep, over {MAX_PATTERN_GROUP_DEPTH}" in str(info.value)


def test_a_pattern_nested_past_the_bound_is_refused_where_the_checks_would_fail_on_it_later():
    """Compiled at creation from a shallow stack, a pattern nested about 200 deep passed, and the call check,
    deeper in the stack, refused every call of the tool as one it could not check."""
    def nested(depth: int) -> dict:
        pattern = "^" + "(?:" * depth + "a" + ")" * depth + "[(]$"  # a parenthesis in a class is no group
        return {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}}

    spec = ToolSpec.model_validate(_tool(parameters=nested(MAX_PATTERN_GROUP_DEPTH)))

    def deep_in_the_stack(frames: int):
        return deep_in_the_stack(frames - 1) if frames else validate_tool_call(
            ToolCall(id="c1", name=spec.name, arguments='{"s": "a("}'), [spec])

    assert isinstance(deep_in_the_stack(sys.getrecursionlimit() // 2), ToolCall)
    with pytest.raises(ValidationError, match=f"nests its groups {MAX_PATTERN_GROUP_DEPTH + 1} deep"):
        ToolSpec.model_validate(_tool(parameters=nested(MAX_PATTERN_GROUP_DEPTH + 1)))


@pytest.mark.parametrize("name", ["auto", "none", "required"])
def test_a_tool_named_as_a_tool_choice_keyword_is_refused(name):
    with pytest.raises(ValidationError) as info:
        ToolSpec.model_validate(_tool(name=name))
    assert "is a `tool_choice` keyword" in str(info.value)


@pytest.mark.parametrize("permission", ["", "orders write", " orders:write", "a\tb"])
def test_a_permission_no_key_could_hold_is_refused(permission):
    """Keys are granted non-empty names without whitespace: a tool requiring another could never run."""
    with pytest.raises(ValidationError, match="non-empty name without whitespace"):
        ToolSpec(name="t", execution={"kind": "client"}, required_permissions=["orders:read", permission])
