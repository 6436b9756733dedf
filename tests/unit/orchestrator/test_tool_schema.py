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


# Values of every JSON kind, for each keyword of Draft 2020-12's metaschema: those it takes and those it refuses.
_KEYWORD_VALUES = [
    None, True, False, 0, 1, -1, 1.0, 5.0, -0.0, 0.5, 1.5, -1.5, 2**31, 2**53, 2**63, -(2**63), 1e20, 1e308,
    "", "x", "\u00e9", "string", "object", "#", "#/$defs/a", "(", "http://x/y", "urn:x", " bad uri",
    [], [None], [1, 1], [0.0, 0], ["a", "a"], ["a"], ["a", 1], ["string", "integer"], ["strin"], [{}],
    [{"type": "x"}], [True], {}, {"a": {}}, {"a": 1}, {"a": ["b"]}, {"a": "b"}, {"a": True}, {"(": {}},
    {"type": "string"}, {"type": 5}, {"$ref": "#"}, {"$defs": {"a": {}}},
]


def _metaschema_keywords() -> list[str]:
    from jsonschema_specifications import REGISTRY

    return sorted({keyword for uri in REGISTRY if "/draft/2020-12/" in uri
                   for keyword in REGISTRY[uri].contents.get("properties", {})})


def _python_verdict(schema) -> bool:
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    from serve_apps.orchestrator.tool_schema import _METASCHEMA_FORMATS

    try:
        Draft202012Validator.check_schema(schema, format_checker=_METASCHEMA_FORMATS)
    except SchemaError:
        return False
    return True


def test_jsonschema_rs_and_jsonschema_give_one_verdict_on_every_metaschema_keyword():
    """The metaschema check trusts jsonschema-rs's yes: where it said yes to a schema Python's refuses, a schema
    the later checks rely on (keyword values of their schema shapes) could fail a turn, or the orchestrator."""
    import jsonschema_rs

    keywords = _metaschema_keywords()
    assert len(keywords) >= 60 and {"$ref", "items", "minLength", "patternProperties"} <= set(keywords)
    differ = []
    for keyword in keywords:
        for value in _KEYWORD_VALUES:
            if keyword == "$schema" and value not in ("https://json-schema.org/draft/2020-12/schema",):
                continue  # another dialect's: the check leaves it to Python's (test below)
            for schema in ({keyword: value}, {"type": "object", "properties": {"x": {keyword: value}}},
                           {"items": {"anyOf": [{"type": "string"}, {keyword: value}]}}):
                if jsonschema_rs.meta.is_valid(schema) != _python_verdict(schema):
                    differ.append(schema)
    assert differ == []


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"q": {"type": "string", "minLength": 1}}, "$defs": {"d": {"enum": [1]}}},
    {"type": "object", "$schema": "https://json-schema.org/draft/2020-12/schema#",
     "properties": {"a": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}},
])
def test_a_valid_schema_is_not_walked_by_python(monkeypatch, schema):
    """Python's walk took 0.1-0.2 s per schema at the size bound: a session of 128 such tools held the one thread
    that checks bodies for 16-23 s, ahead of every tenant."""
    from serve_apps.orchestrator import tool_schema

    def walked(*args, **kwargs):
        raise AssertionError("the Python metaschema walk ran for a valid schema")

    monkeypatch.setattr(tool_schema.Draft202012Validator, "check_schema", walked)
    tool_schema.check_tool_parameters(schema)


@pytest.mark.parametrize("schema, message", [
    ({"type": "object", "properties": {"a": {"minLength": "x"}}},
     "not a valid Draft 2020-12 JSON Schema at properties/a/minLength: 'x' is not of type 'integer'"),
    ({"type": "object", "required": "a"}, "not a valid Draft 2020-12 JSON Schema at required: 'a' is not of type 'array'"),
    # Another dialect, or a name jsonschema-rs would look up as one: Python's check, then the dialect's refusal.
    ({"type": "object", "$schema": "http://x/y"}, "only Draft 2020-12"),
    ({"type": "object", "$schema": " bad uri"}, "only Draft 2020-12"),
    ({"type": "object", "$schema": "http://json-schema.org/draft-07/schema#", "minLength": "x"},
     "not a valid Draft 2020-12 JSON Schema at minLength"),
])
def test_a_refusal_is_worded_by_python(schema, message):
    from serve_apps.orchestrator.tool_schema import check_tool_parameters

    with pytest.raises(ValueError) as err:
        check_tool_parameters(schema)
    assert message in str(err.value)
