"""Recognising the engine's grammar-compile failures (the request's fault) in its readable error text."""

import pytest

from serve_apps.orchestrator.tool_schema import grammar_failure_message


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
