"""Property tests: whatever a client or a model sends, validation answers with its documented outcome.

Request models either accept a body or raise `pydantic.ValidationError` (the 422
path of `deployment.py`); nothing else may escape, since anything else is a 500
or a crashed turn. Accepted bodies survive both hops they take in production:
`model_dump(mode="json")` from the ingress to the orchestrator, and JSON in the
session store. Tool calls either validate or come back as a `ToolCallError` the
model can read and retry on.

Inputs are arbitrary JSON values (including the NaN/Infinity and lone surrogates
that Python's `json.loads`, and so the HTTP layer, lets through) and valid bodies
with a few random mutations, so the search also reaches the validators that run
after the field types have matched.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator
from pydantic import BaseModel, ValidationError

from serve_apps.orchestrator.models import (
    CreateSessionRequest,
    ToolCall,
    ToolResultsSubmission,
    ToolSpec,
    TurnRequest,
)
from serve_apps.orchestrator.tool_schema import MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH
from serve_apps.orchestrator.tools import (
    MAX_REPORTED_VIOLATIONS,
    ToolCallError,
    ToolOutcome,
    escape_raw_control_characters,
    parse_arguments,
    run_http_tool,
    tool_choice_schema,
    validate_tool_call,
)

# Derandomized, without an example database: every run (CI included) checks the same examples.
PROPERTY_SETTINGS = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

# --- arbitrary JSON -------------------------------------------------------------------------------

# Lone surrogates included: `json.loads('"\\ud800"')` produces one.
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=12)
SAFE_TEXT = st.text(max_size=12)
# Field and keyword names make random dicts land on real fields and schema keywords often.
KEYS = st.sampled_from(
    [
        "model", "system_prompt", "tools", "limits", "name", "description", "parameters", "execution",
        "required_permissions", "kind", "url", "timeout_s", "content", "tool_choice", "stream", "results",
        "tool_call_id", "is_error", "max_steps_per_turn", "context_budget_tokens", "output_reserve_tokens",
        "max_tool_result_bytes", "type", "properties", "items", "required", "$ref", "$defs", "$schema",
        "allOf", "anyOf", "not", "enum", "const", "minimum", "multipleOf", "pattern",
    ]
) | ANY_TEXT
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | ANY_TEXT
JSON = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(KEYS, children, max_size=4),
    max_leaves=24,
)
JSON_OBJECTS = st.dictionaries(KEYS, JSON, max_size=6)


def _positions(node):
    """Every (container, key) pair below `node`: the places a mutation can change."""
    found, stack = [], [node]
    while stack:
        current = stack.pop()
        if isinstance(current, dict):
            items = current.items()
        else:
            items = enumerate(current) if isinstance(current, list) else ()
        for key, value in items:
            found.append((current, key))
            stack.append(value)
    return found


@st.composite
def mutated(draw, valid):
    """A valid body with one to three random edits: a value replaced, a key or item removed, a key added."""
    body = copy.deepcopy(draw(valid))
    for _ in range(draw(st.integers(1, 3))):
        positions = _positions(body)
        operation = draw(st.sampled_from(["replace", "remove", "add"]))
        if operation == "add" or not positions:
            dicts = [body] + [c[k] for c, k in positions if isinstance(c[k], dict)]
            draw(st.sampled_from(dicts))[draw(KEYS)] = draw(JSON)
            continue
        container, key = draw(st.sampled_from(positions))
        if operation == "replace":
            container[key] = draw(JSON)
        else:
            del container[key]
    return body


# --- valid bodies ---------------------------------------------------------------------------------

SCALAR_TYPES = ["string", "integer", "number", "boolean", "null"]
TOOL_NAMES = st.from_regex(r"[a-zA-Z0-9_-]{1,16}", fullmatch=True)
URLS = st.from_regex(r"https?://[a-z0-9.-]{1,20}(:[0-9]{1,5})?(/[a-zA-Z0-9._~-]{0,10}){0,3}", fullmatch=True)
EXECUTIONS = st.fixed_dictionaries({"kind": st.just("client")}) | st.fixed_dictionaries(
    {"kind": st.just("http"), "url": URLS},
    optional={"timeout_s": st.floats(min_value=0, max_value=300, exclude_min=True)},
)


def _object_schema(properties: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": properties, "required": required}


SUBSCHEMAS = st.recursive(
    st.builds(lambda t: {"type": t}, st.sampled_from(SCALAR_TYPES)),
    lambda children: st.builds(lambda items: {"type": "array", "items": items}, children)
    | st.dictionaries(TOOL_NAMES, children, max_size=3).map(lambda props: _object_schema(props, sorted(props)[:1])),
    max_leaves=6,
)
PARAMETERS = st.dictionaries(TOOL_NAMES, SUBSCHEMAS, max_size=4).map(lambda props: _object_schema(props, sorted(props)))


def _tool_body(name, description, parameters, permissions, execution):
    return {
        "name": name, "description": description, "parameters": parameters,
        "required_permissions": permissions, "execution": execution,
    }


# As keys are granted them: non-empty, no whitespace.
PERMISSIONS = st.text(st.characters(exclude_categories=("Cs", "Z", "Cc")), min_size=1, max_size=16).filter(
    lambda p: not any(c.isspace() for c in p))
TOOL_BODIES = st.builds(_tool_body, TOOL_NAMES, SAFE_TEXT, PARAMETERS, st.lists(PERMISSIONS, max_size=2), EXECUTIONS)
LIMITS = st.fixed_dictionaries(
    {},
    optional={
        "max_steps_per_turn": st.integers(1, 64),
        "context_budget_tokens": st.none() | st.integers(1024, 1 << 20),
        "output_reserve_tokens": st.integers(1, 1023),
        "compress_below_fraction": st.floats(0, 1, exclude_min=True, exclude_max=True),
        "keep_last_rounds": st.integers(1, 16),
        "max_tool_result_bytes": st.integers(256, 1 << 20),
    },
)
CREATE_BODIES = st.fixed_dictionaries(
    {"model": st.text(min_size=1, max_size=12)},
    optional={
        "system_prompt": SAFE_TEXT,
        "tools": st.lists(TOOL_BODIES, max_size=3, unique_by=lambda tool: tool["name"]),
        "limits": LIMITS,
    },
)
TURN_BODIES = st.fixed_dictionaries(
    {"content": st.text(min_size=1, max_size=40)},
    optional={"tool_choice": st.text(min_size=1, max_size=64), "stream": st.booleans()},
)
RESULT_BODIES = st.fixed_dictionaries(
    {"tool_call_id": st.text(min_size=1, max_size=16), "content": SAFE_TEXT}, optional={"is_error": st.booleans()}
)
SUBMISSION_BODIES = st.fixed_dictionaries(
    {"results": st.lists(RESULT_BODIES, min_size=1, max_size=3, unique_by=lambda r: r["tool_call_id"])},
    optional={"stream": st.booleans()},
)

REQUEST_MODELS = [
    (CreateSessionRequest, CREATE_BODIES),
    (TurnRequest, TURN_BODIES),
    (ToolResultsSubmission, SUBMISSION_BODIES),
    (ToolSpec, TOOL_BODIES),
]
REQUEST_MODEL_IDS = [model.__name__ for model, _ in REQUEST_MODELS]


def _validate_or_explain(model: type[BaseModel], body) -> BaseModel | None:
    """The model, or None after checking the ValidationError says something; any other exception fails the test."""
    try:
        return model.model_validate(body)
    except ValidationError as err:
        assert str(err).strip()
        assert err.errors() and all(item["msg"].strip() for item in err.errors())
        return None


def _assert_round_trips(parsed: BaseModel) -> None:
    model = type(parsed)
    assert model.model_validate(parsed.model_dump(mode="json")) == parsed  # ingress -> orchestrator
    assert model.model_validate_json(parsed.model_dump_json()) == parsed  # session store


# --- request models -------------------------------------------------------------------------------


@pytest.mark.parametrize("model, valid", REQUEST_MODELS, ids=REQUEST_MODEL_IDS)
@PROPERTY_SETTINGS
@given(data=st.data())
def test_valid_request_bodies_validate_and_round_trip(model, valid, data):
    parsed = _validate_or_explain(model, data.draw(valid))
    assert parsed is not None
    _assert_round_trips(parsed)


@pytest.mark.parametrize("model, valid", REQUEST_MODELS, ids=REQUEST_MODEL_IDS)
@PROPERTY_SETTINGS
@given(data=st.data())
def test_arbitrary_request_bodies_validate_or_explain(model, valid, data):
    body = data.draw(JSON | JSON_OBJECTS | mutated(valid))
    parsed = _validate_or_explain(model, body)
    if parsed is not None:
        _assert_round_trips(parsed)


# --- tool schemas ---------------------------------------------------------------------------------

DRAFT_2020_12 = "https://json-schema.org/draft/2020-12/schema"
DRAFT_04 = "http://json-schema.org/draft-04/schema#"
# Schema-shaped objects with arbitrary keyword values: most pass the field types and reach the schema checks.
SCHEMA_KEYWORD_VALUES = st.fixed_dictionaries(
    {"type": st.just("object")},
    optional={
        "properties": st.dictionaries(KEYS, JSON_OBJECTS | SUBSCHEMAS, max_size=3),
        "$defs": st.dictionaries(st.sampled_from(["a", "b", "a/b"]), JSON_OBJECTS | SUBSCHEMAS, max_size=3),
        "$ref": st.sampled_from(["#/$defs/a", "#/$defs/b", "#/$defs/a~1b", "#/$defs/a/properties/a", "#/$defs/c"]),
        "allOf": st.lists(st.sampled_from([{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}, {}]), max_size=2),
        "required": st.lists(KEYS, max_size=3) | JSON,
        "minimum": JSON,
        "multipleOf": st.integers(1, 10) | st.floats(0.01, 10) | JSON,
        "pattern": st.sampled_from(["^a", "[", "(?P<x>a)", "\\d+"]) | JSON,
        "$schema": st.sampled_from([DRAFT_2020_12, DRAFT_04]),
    },
)


def _depth(node) -> int:
    if isinstance(node, dict):
        return 1 + max(map(_depth, node.values()), default=0)
    if isinstance(node, list):
        return 1 + max(map(_depth, node), default=0)
    return 0


def _has_non_finite(node) -> bool:
    if isinstance(node, float):
        return not math.isfinite(node)
    children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
    return any(_has_non_finite(child) for child in children)


def _has_lone_surrogate(node) -> bool:
    """In a string or a key. Check the value as parsed back from JSON text: an adjacent high and
    low surrogate written out as escapes reads back as one character."""
    if isinstance(node, str):
        return any(0xD800 <= ord(char) <= 0xDFFF for char in node)
    if isinstance(node, dict):
        return any(_has_lone_surrogate(key) or _has_lone_surrogate(value) for key, value in node.items())
    return isinstance(node, list) and any(_has_lone_surrogate(child) for child in node)


@PROPERTY_SETTINGS
@given(parameters=JSON | JSON_OBJECTS | SCHEMA_KEYWORD_VALUES | mutated(PARAMETERS))
@example(parameters={"type": "object", "default": json.loads("[" * 40 + "]" * 40)})
@example(parameters={"type": "object", "not": {"type": "object", "not": {"$ref": "#/$defs/a"}}, "$defs": {"a": True}})
@example(parameters={"type": "object", "maximum": float("nan")})
@example(parameters={"type": "object", "description": "\ud800"})
def test_tool_parameters_accepted_only_within_bounds(parameters):
    tool = _validate_or_explain(ToolSpec, {"name": "t", "parameters": parameters, "execution": {"kind": "client"}})
    if tool is None:
        return
    accepted = tool.parameters
    assert isinstance(accepted, dict) and accepted.get("type") == "object"
    assert len(json.dumps(accepted, separators=(",", ":"), sort_keys=True).encode("utf-8")) <= MAX_SCHEMA_BYTES
    assert _depth(accepted) <= MAX_SCHEMA_DEPTH
    assert not _has_non_finite(accepted)
    Draft202012Validator.check_schema(accepted)
    _assert_round_trips(tool)


@PROPERTY_SETTINGS
@given(parameters=SCHEMA_KEYWORD_VALUES | mutated(PARAMETERS), arguments=JSON)
@example(parameters={"type": "object", "$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, arguments={})
@example(
    parameters={"type": "object", "$defs": {"a": {"type": "string"}}, "properties": {"a": {"$ref": "#/$defs/a/type"}}},
    arguments={"a": 1},
)
@example(parameters={"type": "object", "properties": {"a": {"$schema": DRAFT_04, "items": True}}}, arguments={"a": [1]})
def test_accepted_schemas_validate_any_arguments_without_raising(parameters, arguments):
    """Whatever schema ToolSpec accepts, checking a call against it ends in a verdict, not an exception."""
    tool = _validate_or_explain(ToolSpec, {"name": "t", "parameters": parameters, "execution": {"kind": "client"}})
    if tool is None:
        return
    call = ToolCall(id="c1", name="t", arguments=json.dumps(arguments))
    outcome = validate_tool_call(call, [tool])
    assert outcome is call or isinstance(outcome, ToolCallError)
    # The constrained-decoding schema is built from it too, and must be strict JSON for the engine.
    assert json.loads(json.dumps(tool_choice_schema([tool]), allow_nan=False))["anyOf"]


# --- tool-call parsing and validation -------------------------------------------------------------

PLOT_TOOL = ToolSpec(
    name="plot",
    parameters={
        "type": "object",
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
        "properties": {"at": {"$ref": "#/$defs/point"}, "label": {"type": "string", "pattern": "^[a-z]+$"}},
        "required": ["at"],
    },
    execution={"kind": "client"},
)
LOOKUP_TOOL = ToolSpec(
    name="lookup",
    parameters={
        "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"], "additionalProperties": False,
    },
    execution={"kind": "client"},
)
SESSION_TOOLS = [PLOT_TOOL, LOOKUP_TOOL]
JSON_FRAGMENTS = ["{", "}", "[", "]", '"x"', ":", ",", "1e999", "-0", "NaN", "true", '"\\ud800"', " "]
# Raw argument text: arbitrary strings, JSON as Python writes it (NaN, Infinity included), and JSON-like fragments.
# No lone surrogates in the raw text: ToolCall.arguments refuses them, so validation never sees
# one (escaped ones, `"\\ud800"`, it does).
ARGUMENT_TEXTS = (
    SAFE_TEXT
    | JSON.map(json.dumps)
    | st.lists(st.sampled_from(JSON_FRAGMENTS), max_size=12).map("".join)
)


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity", '{"x": NaN}', "[1, Infinity]", "", "{", "'x'"])
def test_parse_arguments_refuses_non_json(text):
    with pytest.raises(ValueError):
        parse_arguments(text)


@PROPERTY_SETTINGS
@given(text=ARGUMENT_TEXTS)
@example(text="NaN")
@example(text='{"x": -Infinity}')
@example(text="1" * 5000)
def test_parse_arguments_returns_json_or_raises_value_error(text):
    try:
        parsed = parse_arguments(text)
    except ValueError:
        return
    # Whatever parses is plain JSON data: it writes and reads back as itself.
    assert json.loads(json.dumps(parsed)) == parsed


@PROPERTY_SETTINGS
@given(value=JSON, raw_whitespace=st.lists(st.sampled_from(["\n", "\t", "\r", "\x00", "\x1f"]), max_size=3))
def test_escaping_raw_control_characters_keeps_valid_json_and_the_lenient_value(value, raw_whitespace):
    text = json.dumps(value)
    assert escape_raw_control_characters(text) == text  # valid JSON holds no raw control characters in strings
    lax = '["' + "".join(raw_whitespace) + '", ' + text + "]"  # raw characters inside the first string
    assert json.loads(escape_raw_control_characters(lax)) == json.loads(lax, strict=False)


@PROPERTY_SETTINGS
@given(name=st.sampled_from(["plot", "lookup", "missing"]) | TOOL_NAMES, arguments=ARGUMENT_TEXTS)
def test_validate_tool_call_returns_the_call_or_an_error(name, arguments):
    call = ToolCall(id="call-1", name=name, arguments=arguments)
    outcome = validate_tool_call(call, SESSION_TOOLS)
    if isinstance(outcome, ToolCall):
        assert name in {"plot", "lookup"}
        # unchanged, or with raw control characters in strings escaped (same value)
        assert outcome is call or json.loads(outcome.arguments) == json.loads(arguments, strict=False)
        return
    assert isinstance(outcome, ToolCallError)
    assert outcome.call_id == "call-1" and outcome.tool_name == name
    assert outcome.kind in ("unknown_tool", "invalid_json", "schema_violation")
    assert outcome.message.strip()
    if outcome.kind == "schema_violation":
        paths = [v.path for v in outcome.violations]
        assert 1 <= len(paths) <= MAX_REPORTED_VIOLATIONS and paths == sorted(paths)


@st.composite
def schema_and_instance(draw, depth=0):
    """A subschema and a value it accepts, built together."""
    kinds = ["string", "integer", "number", "boolean", "null", "enum"] + ["array", "object"] * (depth < 3)
    kind = draw(st.sampled_from(kinds))
    if kind == "string":
        return {"type": "string", "maxLength": 8}, draw(st.text(max_size=8))
    if kind == "integer":
        return {"type": "integer", "minimum": -100, "maximum": 100}, draw(st.integers(-100, 100))
    if kind == "number":
        return {"type": "number"}, draw(st.floats(allow_nan=False, allow_infinity=False) | st.integers())
    if kind == "boolean":
        return {"type": "boolean"}, draw(st.booleans())
    if kind == "null":
        return {"type": "null"}, None
    if kind == "enum":
        choices = draw(st.lists(st.none() | st.booleans() | st.integers() | SAFE_TEXT, min_size=1, max_size=3))
        return {"enum": choices}, draw(st.sampled_from(choices))
    if kind == "array":
        items, first = draw(schema_and_instance(depth + 1))
        return {"type": "array", "items": items}, [first] * draw(st.integers(0, 3))
    return draw(object_schema_and_instance(depth + 1))


@st.composite
def object_schema_and_instance(draw, depth=0):
    names = draw(st.lists(st.text(min_size=1, max_size=6), max_size=4, unique=True))
    pairs = {name: draw(schema_and_instance(depth)) for name in names}
    required = sorted(draw(st.sets(st.sampled_from(names))) if names else [])
    instance = {name: value for name, (_, value) in pairs.items() if name in required or draw(st.booleans())}
    schema = {"type": "object", "properties": {n: s for n, (s, _) in pairs.items()}, "required": required}
    return schema, instance


@st.composite
def tool_with_defs(draw):
    """A top-level object schema, with its property schemas moved into `$defs` and referenced, half of the time."""
    schema, instance = draw(object_schema_and_instance())
    if draw(st.booleans()) and schema["properties"]:
        defs = {f"d{i}": sub for i, sub in enumerate(schema["properties"].values())}
        schema["properties"] = {name: {"$ref": f"#/$defs/d{i}"} for i, name in enumerate(schema["properties"])}
        schema["$defs"] = defs
    tool = ToolSpec(name=draw(TOOL_NAMES), parameters=schema, execution={"kind": "client"})
    return tool, instance


@PROPERTY_SETTINGS
@given(pair=tool_with_defs())
def test_arguments_generated_from_the_schema_validate(pair):
    tool, instance = pair
    call = ToolCall(id="c1", name=tool.name, arguments=json.dumps(instance))
    assert validate_tool_call(call, [tool]) is call
    # The grammar the engine is constrained with accepts the same call.
    assert Draft202012Validator(tool_choice_schema([tool])).is_valid({"name": tool.name, "arguments": instance})


@PROPERTY_SETTINGS
@given(pair=tool_with_defs(), data=st.data())
def test_validation_and_constrained_schema_agree_on_mutated_arguments(pair, data):
    tool, instance = pair
    arguments = data.draw(mutated(st.just(instance)) | JSON)
    call = ToolCall(id="c1", name=tool.name, arguments=json.dumps(arguments))
    outcome = validate_tool_call(call, [tool])
    assert outcome is call or isinstance(outcome, ToolCallError)
    # Text JSON cannot carry (NaN, a lone surrogate) is refused before the schema is consulted.
    if _has_non_finite(arguments) or _has_lone_surrogate(json.loads(call.arguments)):
        assert isinstance(outcome, ToolCallError) and outcome.kind == "invalid_json"
        return
    constrained = Draft202012Validator(tool_choice_schema([tool]))
    assert (outcome is call) == constrained.is_valid({"name": tool.name, "arguments": arguments})


# --- known failures in tools.py -------------------------------------------------------------------
# Inputs that still raise out of tools.py, which this change leaves alone. The markers are strict:
# once tools.py is fixed these XPASS and fail, as a reminder to drop the marker.

_DEEP_ARRAY_500 = "[" * 500 + "]" * 500
_TREE_SCHEMA = {
    "type": "object",
    "$defs": {"t": {"type": "array", "items": {"$ref": "#/$defs/t"}}},
    "properties": {"a": {"$ref": "#/$defs/t"}},
}


@pytest.mark.parametrize(
    "parameters, arguments",
    [
        pytest.param(
            {"type": "object"}, "[" * 100_000,
            id="deep-text",
        ),
        pytest.param(
            {"type": "object", "properties": {"a": {"multipleOf": 0.5}}}, '{"a": 1' + "0" * 400 + "}",
            id="multipleOf-huge-int",
        ),
        pytest.param(
            {"type": "object", "properties": {"a": {"uniqueItems": True}}},
            f'{{"a": [{_DEEP_ARRAY_500}, {_DEEP_ARRAY_500}]}}',
            id="uniqueItems-deep",
        ),
        pytest.param(
            _TREE_SCHEMA, f'{{"a": {"[" * 400 + "]" * 400}}}',
            id="recursive-schema-deep",
        ),
    ],
)
def test_hostile_arguments_become_tool_call_errors(parameters, arguments):
    tool = ToolSpec(name="t", parameters=parameters, execution={"kind": "client"})
    call = ToolCall(id="c1", name="t", arguments=arguments)
    outcome = validate_tool_call(call, [tool])
    assert outcome is call or isinstance(outcome, ToolCallError)


def test_run_http_tool_deeply_nested_reply_is_an_error_outcome():
    """The module promises that nothing a tool does raises into the session loop."""
    spec = ToolSpec(name="t", execution={"kind": "http", "url": "http://tool.invalid/t"})
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=b"[" * 100_000))

    async def call() -> ToolOutcome:
        async with httpx.AsyncClient(transport=transport) as client:
            return await run_http_tool(spec, "{}", 5, 1024, client=client)

    assert asyncio.run(call()).status == "error"
