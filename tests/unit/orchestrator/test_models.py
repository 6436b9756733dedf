"""Request validation of the session API: malformed bodies fail with the offending field named."""

import pytest
from pydantic import ValidationError

from serve_apps.orchestrator.models import (
    SESSION_EVENT_ADAPTER,
    ClientExecution,
    CreateSessionRequest,
    HttpExecution,
    Message,
    SessionLimits,
    ToolResultsSubmission,
    ToolSpec,
)

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


def test_tool_parameters_local_defs_and_property_named_ref_accepted():
    parameters = {
        "type": "object",
        "$defs": {"item": {"type": "object", "properties": {"sku": {"type": "string"}}}},
        "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}}, "$ref": {"type": "string"}},
    }
    assert ToolSpec.model_validate(_tool(parameters=parameters)).parameters == parameters


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
        ({"model": "m", "limits": {"context_budget_tokens": 100}}, "limits.context_budget_tokens"),
        ({"model": "m", "limits": {"context_budget_tokens": 512, "output_reserve_tokens": 512}}, "limits"),
        ({"model": "m", "tools": [_tool(), _tool()]}, ""),
    ],
)
def test_create_session_errors_name_the_field(body, location):
    with pytest.raises(ValidationError) as info:
        CreateSessionRequest.model_validate(body)
    assert _error_locations(info.value) == [location]


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
