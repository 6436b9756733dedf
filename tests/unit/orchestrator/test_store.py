"""The idempotency pieces of the session store that need no Redis: key bounds, request fingerprints, records."""

import json

import pytest

from serve_apps.orchestrator.models import ToolResultsSubmission, TurnRequest
from redis.exceptions import ConnectionError as RedisConnectionError, TimeoutError as RedisTimeoutError

from serve_apps.orchestrator import store as store_module
from serve_apps.orchestrator.store import (
    MAX_IDEMPOTENCY_KEY_CHARS,
    RememberedTurn,
    StoreUnavailable,
    idempotency_key_problem,
    request_fingerprint,
)


@pytest.mark.parametrize(
    "key, is_accepted",
    [("k", True), ("x" * MAX_IDEMPOTENCY_KEY_CHARS, True), ("", False), ("x" * (MAX_IDEMPOTENCY_KEY_CHARS + 1), False)],
)
def test_idempotency_key_bounds(key, is_accepted):
    problem = idempotency_key_problem(key)
    if is_accepted:
        assert problem is None
    else:
        assert problem == f"idempotency-key must be 1-{MAX_IDEMPOTENCY_KEY_CHARS} characters"


def _results(content: str, is_error: bool = False) -> ToolResultsSubmission:
    return ToolResultsSubmission(results=[{"tool_call_id": "c1", "content": content, "is_error": is_error}])


@pytest.mark.parametrize(
    "first, second, is_same",
    [
        (("messages", TurnRequest(content="hi")), ("messages", TurnRequest(content="hi", stream=True)), True),
        (("messages", TurnRequest(content="hi")), ("messages", TurnRequest(content="hello")), False),
        (("messages", TurnRequest(content="hi")), ("messages", TurnRequest(content="hi", tool_choice="required")), False),
        (("tool_results", _results("ok")), ("tool_results", _results("ok")), True),
        (("tool_results", _results("ok")), ("tool_results", _results("ok", is_error=True)), False),
        (("tool_results", _results("ok")), ("tool_results", _results("other")), False),
        (("messages", TurnRequest(content="hi")), ("tool_results", TurnRequest(content="hi")), False),
    ],
)
def test_request_fingerprint_covers_everything_but_streaming(first, second, is_same):
    assert (request_fingerprint(*first) == request_fingerprint(*second)) == is_same


def test_remembered_turn_round_trips_and_reads_the_older_bare_list():
    remembered = RememberedTurn(request_sha256="ab", events=[{"kind": "delta", "text": "é"}, {"kind": "final"}])
    assert RememberedTurn.from_stored(remembered.model_dump_json()) == remembered
    older = json.dumps([{"kind": "final", "message": {"role": "assistant", "content": "x"}}])
    parsed = RememberedTurn.from_stored(older)
    assert parsed.request_sha256 is None and parsed.events[0]["kind"] == "final"


def test_a_remembered_turn_a_later_release_wrote_is_replayed_without_its_unknown_fields():
    later = json.dumps({"request_sha256": "ab", "events": [{"kind": "final", "is_new": True}], "field_of_later": 1})
    assert RememberedTurn.from_stored(later) == RememberedTurn(request_sha256="ab", events=[{"kind": "final", "is_new": True}])


@pytest.mark.parametrize("error, failure", [
    (RedisConnectionError("Error 111 connecting to 10.1.2.3:6391. Connection refused."), "no connection"),
    (RedisTimeoutError("Timeout connecting to 10.1.2.3:6391"), "timed out"),
])
def test_an_unreachable_store_says_what_failed_but_not_where_redis_lives(error, failure):
    with pytest.raises(StoreUnavailable) as unavailable:
        with store_module._redis_errors("s1"):
            raise error
    assert str(unavailable.value) == f"session store unreachable ({failure})"


def test_the_quota_refusal_counts_its_sessions_in_words():
    from serve_apps.orchestrator.owner_sessions import SessionQuotaExceeded

    assert "holds 1 live session, its limit" in str(SessionQuotaExceeded("k", 1))
    assert "holds 2 live sessions, its limit" in str(SessionQuotaExceeded("k", 2))
    assert "DELETE /v1/sessions/{session_id}, or Agent.DeleteSession over gRPC" in str(SessionQuotaExceeded("k", 2))
