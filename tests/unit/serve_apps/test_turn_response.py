"""How the HTTP ingress maps a turn's last event to a status code."""

from __future__ import annotations

import asyncio
import json

import pytest

from serve_apps import api_errors, ingress_http


async def _events(*items):
    for item in items:
        yield item


@pytest.mark.parametrize(
    ("last", "status", "outcome"),
    [
        ({"kind": "final", "message": {"role": "assistant", "content": ""}}, 200, "completed"),
        ({"kind": "error", "code": "max_steps", "message": "used all steps"}, 200, "max_steps"),
        ({"kind": "error", "code": "model_error", "message": "engine failed"}, 502, "failed"),
        ({"kind": "error", "code": "model_refused", "message": "the engine refused the step"}, 422, "failed"),
        ({"kind": "error", "code": "store_unavailable", "message": "redis down"}, 503, "failed"),
        ({"kind": "error", "code": "internal", "message": "nothing was committed"}, 500, "failed"),
        ({"kind": "error", "code": "session_not_found", "message": "deleted while the turn ran"}, 404, "failed"),
        ({"kind": "error", "code": "invalid_tool_schema", "message": "no grammar"}, 400, "failed"),
    ],
)
def test_turn_outcomes_map_to_status_codes(last, status, outcome):
    response = asyncio.run(ingress_http._turn_response("s1", _events({"status": 200}, last), is_streaming=False))
    assert response.status_code == status
    body = json.loads(response.body)
    assert body["status"] == outcome
    if outcome == "failed":
        assert body["error"]["code"] == last["code"] and body["error"]["message"] == last["message"]
        assert body["error"]["type"] == api_errors.error_type(status) and "param" in body["error"]


def test_a_whole_answer_is_one_delta_in_a_unary_turn_and_retries_keep_their_boundary():
    deltas = [{"kind": "delta", "text": t} for t in ("Hel", "lo", " there")]
    retry = {"kind": "model_retry", "step_index": 0, "reason": "replica died"}
    final = {"kind": "final", "message": {"role": "assistant", "content": "Hello there"}}
    events = [deltas[0], retry, *deltas, final]
    response = asyncio.run(ingress_http._turn_response("s1", _events({"status": 200}, *events), is_streaming=False))
    assert json.loads(response.body)["events"] == [
        {"kind": "delta", "text": "Hel"}, retry, {"kind": "delta", "text": "Hello there"}, final,
    ]
    assert ingress_http.merged_deltas([]) == []


def test_a_whole_thought_is_one_reasoning_event_in_a_unary_turn():
    pieces = [{"kind": "reasoning", "text": t} for t in ("Two and ", "two.")]
    events = [*pieces, {"kind": "delta", "text": "4"}]
    assert ingress_http.merged_deltas(events) == [{"kind": "reasoning", "text": "Two and two."}, events[-1]]


def _dead_orchestrator():
    from ray.exceptions import RayActorError

    return RayActorError()


@pytest.mark.parametrize("failure, status, code", [
    (_dead_orchestrator, 503, "unavailable"),  # retryable, as gRPC's UNAVAILABLE says
    (lambda: RuntimeError("a bug at /app/x.py"), 500, "internal"),
])
def test_an_orchestrator_that_cannot_take_the_call_is_a_503_to_retry_not_a_500(failure, status, code):
    async def failing():
        raise failure()
        yield  # pragma: no cover

    turn = asyncio.run(ingress_http._turn_response("s1", failing(), is_streaming=False))

    async def unary():
        raise failure()

    call = asyncio.run(ingress_http._call(unary()))
    for response in (turn, call):
        assert response.status_code == status
        body = json.loads(response.body)
        assert body["error"]["code"] == code and "/app" not in body["error"]["message"]
        assert ("retry-after" in response.headers) is (status == 503)


def test_a_turn_that_broke_off_tells_openai_clients_not_to_retry_it_by_themselves():
    async def broke_off():
        yield {"status": 200}
        raise ConnectionError("the orchestrator replica died")

    response = asyncio.run(ingress_http._turn_response("s1", broke_off(), is_streaming=False))
    assert response.status_code == 503 and json.loads(response.body)["error"]["code"] == "turn_interrupted"
    assert response.headers["x-should-retry"] == "false"  # it may have committed: only a retry under its key is safe


@pytest.mark.parametrize("is_streaming", [False, True])
def test_a_turn_stream_that_ends_without_its_outcome_is_an_interrupted_turn(is_streaming):
    """No final, requires_action or error event: the turn was cut short, not finished with nothing to say."""
    events = _events({"status": 200}, {"kind": "delta", "text": "Hel"})
    response = asyncio.run(ingress_http._turn_response("s1", events, is_streaming=is_streaming))
    if not is_streaming:
        assert response.status_code == 503 and json.loads(response.body)["error"]["code"] == "turn_interrupted"
        return

    async def frames():
        return [frame async for frame in response.body_iterator]

    *_, error, done = asyncio.run(frames())
    assert error.startswith("event: error\n") and '"code": "turn_interrupted"' in error
    assert done == "event: done\ndata: {}\n\n"


@pytest.mark.parametrize("is_streaming", [False, True], ids=["unary", "streamed"])
def test_a_turn_stream_that_breaks_after_its_outcome_keeps_that_outcome(is_streaming):
    """The orchestrator died freeing the turn's lock, after `final` went out (it goes out after the commit): the
    client got `final` and then `turn_interrupted` (two outcomes), or without streaming a 503 for the answer."""
    final = {"kind": "final", "message": {"role": "assistant", "content": "done"}}

    async def broke_after_final():
        yield {"status": 200}
        yield final
        raise RuntimeError("the orchestrator replica died")

    async def respond():  # one event loop for the response and its frames
        response = await ingress_http._turn_response("s1", broke_after_final(), is_streaming=is_streaming)
        frames = [frame async for frame in response.body_iterator] if is_streaming else []
        return response, frames

    response, frames = asyncio.run(respond())
    assert response.status_code == 200
    if is_streaming:
        assert [frame.split("\n")[0] for frame in frames] == ["event: final", "event: done"]
    else:
        body = json.loads(response.body)
        assert (body["status"], body["message"]) == ("completed", final["message"])


@pytest.mark.parametrize("code", ["compression_lost_values", "turn_interrupted"])
def test_a_turn_failure_a_retry_cannot_change_tells_openai_clients_not_to_retry_it(code):
    """OpenAI's clients retry a 5xx twice by themselves: each ran the turn's model calls again to fail the same
    way (a compression that would drop values), or ran a turn that may have committed a second time."""
    response = asyncio.run(ingress_http._turn_response(
        "s1", _events({"status": 200}, {"kind": "error", "code": code, "message": "no"}), is_streaming=False))
    assert response.headers.get("x-should-retry") == "false" and "retry-after" not in response.headers


@pytest.mark.parametrize("status, code", [(409, "requires_action"), (409, "tool_results_mismatch")])
def test_a_refusal_only_the_client_can_clear_tells_openai_clients_not_to_retry_it(status, code):
    response = ingress_http._unary({"status": status, "body": api_errors.error_body(status, "answer first", code=code)})
    assert response.headers.get("x-should-retry") == "false"
