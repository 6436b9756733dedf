"""Recognising the engine's grammar-compile failures (the request's fault) in its readable error text."""

import pytest

from serve_apps.orchestrator.tool_schema import grammar_failure_message, unsupported_grammar_features


@pytest.mark.parametrize(
    "message, expected",
    [
        (
            "Failed to transform json schema into a grammar: Cannot find field nope\n",
            "Failed to transform json schema into a grammar: Cannot find field nope",
        ),
        ("Failed to transform json schema into a grammar:", "Failed to transform json schema into a grammar:"),
        ("Failed to transform regex into a grammar: bad", "Failed to transform regex into a grammar: bad"),
        (
            "The provided JSON schema contains features not supported by xgrammar.",
            "The provided JSON schema contains features not supported by xgrammar.",
        ),
        (
            "Tool definition 'Item' has multiple schemas, which is not supported.",
            "Tool definition 'Item' has multiple schemas, which is not supported.",
        ),
    ],
)
def test_grammar_failures_are_recognised(message, expected):
    assert grammar_failure_message(message) == expected


@pytest.mark.parametrize("message", ["EngineDeadError: the engine died", "This model's maximum context length is 4096", ""])
def test_other_engine_errors_are_not_grammar_failures(message):
    assert grammar_failure_message(message) is None


@pytest.mark.parametrize("schema, found", [
    ({"type": "object", "properties": {"q": {"type": "string"}}}, None),
    ({"type": "object", "properties": {"total": {"type": "number", "multipleOf": 0.01}}}, "multipleOf at /properties/total"),
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}},
     "uniqueItems at /properties/tags"),
    ({"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]+$", "maxLength": 8}}},
     "pattern, maxLength at /properties/code"),
    ({"type": "object", "$defs": {"Item": {"type": "object", "allOf": [{"required": ["a"]}, {"required": ["b"]}]}},
      "properties": {"item": {"$ref": "#/$defs/Item"}}}, "allOf at /$defs/Item"),
    ({"type": "object", "anyOf": [{"type": "object", "properties": {"at": {"type": "string", "format": "regex"}}}]},
     'format: "regex" at /anyOf/0/properties/at'),
])
def test_what_vllms_grammar_refuses_is_named_where_it_is(schema, found):
    assert unsupported_grammar_features(schema) == found
