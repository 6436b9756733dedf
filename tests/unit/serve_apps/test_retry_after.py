"""A refusal that waiting can clear tells the client when to retry: a 503 because the session store is
unavailable (as the key store's does) and a 409 because another turn runs on the session. `Retry-After`
over HTTP, `retry-after` trailing metadata over gRPC; other refusals carry none."""

from __future__ import annotations

import asyncio
import contextlib
import json
from types import SimpleNamespace

import grpc
import pytest

from serve_apps import ingress_http
from serve_apps.grpc_status import RpcFailure
from serve_apps.ingress_grpc import GrpcIngress, envelope_body
from serve_apps.orchestrator.deployment import Orchestrator, _error
from serve_apps.orchestrator.store import SessionBusy, StoreUnavailable
from warmpath.v1 import agent_pb2

CALLER = {"key_id": "key_x", "permissions": ["*"]}
STORE_DOWN = _error(503, "session store unavailable: Connection refused", "store_unavailable")
NOT_FOUND = _error(404, "no session s1", "session_not_found")


class _DownStore:
    """A session store whose Redis is unreachable."""

    async def get(self, session_id):
        raise StoreUnavailable("Error 111 connecting to warmpath-redis:6379. Connection refused.")

    delete = owner_of = transcript = step_stats = view = get

    @contextlib.asynccontextmanager
    async def turn_lock(self, session_id, owner_key_id=None):
        raise StoreUnavailable("Connection refused")
        yield


class _BusyStore:
    """A session store whose session is running another turn."""

    async def get(self, session_id):
        return SimpleNamespace(session_id=session_id, owner_key_id="key_x")

    @contextlib.asynccontextmanager
    async def turn_lock(self, session_id, owner_key_id=None):
        raise SessionBusy(f"session {session_id} is running another turn")
        yield


def _orchestrator(store=None) -> Orchestrator:
    orchestrator = Orchestrator.__new__(Orchestrator)
    orchestrator._store = store or _DownStore()
    orchestrator._max_sessions_per_key = None
    return orchestrator


def _message_turn(store=None):
    caller = SimpleNamespace(key_id="key_x", permissions=("*",))
    return _orchestrator(store)._turn("s1", "auto", caller, None, "sha", user_content="hi")


async def _events(*items):
    for item in items:
        yield item


@pytest.mark.parametrize("method", ["get_session", "delete_session"])
def test_a_session_call_refused_for_the_store_says_when_to_retry(method):
    envelope = asyncio.run(getattr(_orchestrator(), method)("s1", CALLER))
    response = ingress_http._unary(envelope)
    assert (response.status_code, response.headers.get("retry-after")) == (503, "1")
    assert json.loads(response.body)["error"]["code"] == "store_unavailable"


def test_other_refusals_carry_no_retry_after():
    assert "retry-after" not in ingress_http._unary(NOT_FOUND).headers
    turn = ingress_http._turn_response(
        "s1", _events({"status": 200}, {"kind": "error", "code": "model_error", "message": "engine died"}), False
    )
    assert "retry-after" not in asyncio.run(turn).headers


@pytest.mark.parametrize("store, status, code", [(None, 503, "store_unavailable"), (_BusyStore(), 409, "session_busy")])
def test_a_turn_refused_before_it_starts_says_when_to_retry(store, status, code):
    async def turn():
        return await ingress_http._turn_response("s1", _message_turn(store), is_streaming=False)

    response = asyncio.run(turn())
    assert (response.status_code, response.headers.get("retry-after")) == (status, "1")
    assert json.loads(response.body)["error"]["code"] == code


def test_a_turn_the_store_failed_midway_says_when_to_retry():
    failed = {"kind": "error", "code": "store_unavailable", "message": "session store unavailable: down"}
    response = asyncio.run(ingress_http._turn_response("s1", _events({"status": 200}, failed), is_streaming=False))
    assert (response.status_code, response.headers.get("retry-after")) == (503, "1")


class _Context:
    """Ray Serve's `grpc_context`, keeping the status and trailing metadata set on it."""

    def __init__(self) -> None:
        self.code = None
        self.trailing: list[tuple[str, str]] = []

    def invocation_metadata(self):
        return []

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        pass

    def set_trailing_metadata(self, metadata):
        self.trailing = list(metadata)


def test_grpc_carries_the_retry_hint_of_a_session_store_refusal():
    from tests.unit.serve_apps.test_grpc_mapping import FakeHandle

    ingress = GrpcIngress(FakeHandle(), FakeHandle(get_session=STORE_DOWN), "m", {"access": {"is_auth_enabled": False}})
    context = _Context()
    asyncio.run(ingress.GetSession(agent_pb2.GetSessionRequest(session_id="s1"), context))
    assert (context.code, context.trailing) == (grpc.StatusCode.UNAVAILABLE, [("retry-after", "1")])
    with pytest.raises(RpcFailure) as info:
        envelope_body(NOT_FOUND, 200)
    assert info.value.trailing_metadata == ()


def test_grpc_carries_the_retry_hint_of_a_turn_the_store_failed_midway():
    class Rpc:
        def record(self, status, message=""):
            pass

    failed = {"kind": "error", "code": "store_unavailable", "message": "session store unavailable: down"}
    context = _Context()

    async def collect():
        events = GrpcIngress._turn_events(None, _events({"status": 200}, failed), context, Rpc())
        return [event async for event in events]

    (event,) = asyncio.run(collect())
    assert event.error.code == "store_unavailable"
    assert (context.code, context.trailing) == (grpc.StatusCode.UNAVAILABLE, [("retry-after", "1")])


def test_grpc_carries_the_retry_hint_of_a_busy_session():
    async def refuse():
        envelope = await anext(_message_turn(_BusyStore()))
        envelope_body(envelope, 200)

    with pytest.raises(RpcFailure) as info:
        asyncio.run(refuse())
    assert (info.value.status, info.value.code) == (grpc.StatusCode.ABORTED, "session_busy")
    assert info.value.trailing_metadata == (("retry-after", "1"),)
