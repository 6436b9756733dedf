"""schemathesis against the ingress's own OpenAPI schema: no input may produce a 5xx or an error without a message.

Every operation the schema lists is fuzzed (valid and invalid bodies, paths
and queries) for a bounded number of cases. Generated generation lengths are
clamped so the random-weight model never decodes for long: the subject is
input handling, not decoding.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

pytestmark = pytest.mark.integration

MAX_EXAMPLES_PER_OPERATION = 12
# Body fields that set how much the engine generates; clamped to keep each case short.
GENERATION_BOUNDS = {"max_tokens": 4, "max_completion_tokens": 4, "n": 1, "best_of": 1}


@pytest.fixture(scope="module")
def operations(cluster):
    schema = schemathesis.openapi.from_url(f"{cluster.base_url}/openapi.json", timeout=30)
    return {f"{op.method.upper()} {op.path}": op for op in (result.ok() for result in schema.get_all_operations())}


def _clamp_generation(body):
    if isinstance(body, dict):
        for field, bound in GENERATION_BOUNDS.items():
            value = body.get(field)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > bound:
                body[field] = bound
        if body.get("stream") is True:
            body["stream"] = False  # a stream's errors arrive after its 200; unary answers show them in the status
    return body


def test_the_schema_lists_every_public_route(operations):
    assert {"POST /v1/chat/completions", "POST /v1/sessions", "POST /v1/sessions/{session_id}/messages",
            "GET /v1/sessions/{session_id}", "DELETE /v1/sessions/{session_id}", "GET /v1/models"} <= set(operations)


@pytest.mark.parametrize("route", [
    "GET /v1/models", "GET /v1/models/{model}", "POST /v1/completions", "POST /v1/chat/completions",
    "POST /tokenize", "POST /detokenize", "GET /v1/router", "POST /v1/sessions", "GET /v1/sessions/{session_id}",
    "DELETE /v1/sessions/{session_id}", "POST /v1/sessions/{session_id}/messages",
    "POST /v1/sessions/{session_id}/tool_results",
])
def test_no_input_makes_the_ingress_fail(operations, cluster, route):
    if route not in operations:
        pytest.fail(f"{route} is missing from the OpenAPI schema")
    failures: list[str] = []

    @given(case=operations[route].as_strategy())
    @settings(max_examples=MAX_EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck),
              database=None)
    def fuzz(case):
        case.body = _clamp_generation(case.body)
        response = case.call(base_url=cluster.base_url, headers=cluster.headers, timeout=120)
        where = f"{case.method} {case.formatted_path} body={str(case.body)[:300]}"
        if response.status_code >= 500:
            failures.append(f"{where} -> {response.status_code} {response.text[:300]}")
        elif response.status_code >= 400 and not _error_message(response):
            failures.append(f"{where} -> {response.status_code} without a message: {response.text[:300]}")

    fuzz()
    assert not failures, "\n".join(failures[:5])


def _error_message(response) -> str | None:
    try:
        error = response.json()
    except ValueError:
        return None
    if isinstance(error.get("error"), dict):
        return error["error"].get("message")
    return error.get("detail") or error.get("message")
