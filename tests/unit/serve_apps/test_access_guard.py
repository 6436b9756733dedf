"""The access guard with keys on, over a stand-in key store: which key a call presents, what a caller
learns when the store is down, and that every refusal made before a deployment is counted."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace

import grpc
import pytest

from cluster.api_keys import ApiKeyRecord, Authorization, StoreUnavailable
from serve_apps import access, metrics
from serve_apps.access import AccessDenied, AccessGuard, AccessMiddleware, Caller, GuardSettings, credentials_from
from serve_apps.grpc_status import RpcFailure
from serve_apps.ingress_grpc import GrpcIngress
from tests.unit.serve_apps.test_access_size import post_through
from warmpath.v1 import agent_pb2

KEY = "wp_good"
OTHER_KEY = "wp_other"
LIMIT = 1024
SETTINGS = {"access": {"is_auth_enabled": True, "max_request_bytes": LIMIT}, "redis_url": "redis://127.0.0.1:1/0"}


class _KeyStore:
    """`ApiKeyStore.authorize` over one known key (or failing as an unreachable store), recording what it was asked."""

    def __init__(self, error: Exception | None = None, max_sessions: int | None = None) -> None:
        self.error = error
        self.max_sessions = max_sessions
        self.asked: list[str] = []

    async def authorize(self, key: str) -> Authorization:
        self.asked.append(key)
        if self.error is not None:
            raise self.error
        if key != KEY:
            return Authorization(record=None, is_allowed=False, retry_after_s=0.0)
        record = ApiKeyRecord(
            key_id="key_good", name="n", permissions=("*",), requests_per_s=10, burst=10, created_at_s=0,
            max_sessions=self.max_sessions,
        )
        return Authorization(record=record, is_allowed=True, retry_after_s=0.0)


class _Denials:
    """`warmpath_access_denials`, counted in-process."""

    def __init__(self) -> None:
        self.by_code: dict[str, int] = {}

    def inc(self, tags):
        self.by_code[tags["code"]] = self.by_code.get(tags["code"], 0) + 1


@pytest.fixture
def denials(monkeypatch) -> _Denials:
    counted = _Denials()
    instruments = SimpleNamespace(access_denials=counted)
    monkeypatch.setattr(metrics.WarmpathMetrics, "get", classmethod(lambda cls: instruments))
    return counted


@pytest.fixture
def key_store(monkeypatch) -> _KeyStore:
    store = _KeyStore()
    monkeypatch.setattr(access.ApiKeyStore, "from_url", classmethod(lambda cls, url: store))
    return store


async def _ok(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _post(headers: list[tuple[str, str]], chunks: list[bytes]) -> tuple[int, dict[str, str], dict]:
    """Status, headers and JSON body (or {}) of a POST through the middleware with keys on."""
    middleware = AccessMiddleware(_ok, GuardSettings.model_validate(SETTINGS))
    start, body = post_through(middleware, [(k.encode(), v.encode()) for k, v in headers], chunks)
    response_headers = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], response_headers, json.loads(body) if start["status"] != 200 else {}


@pytest.mark.parametrize("headers, key", [
    ([("authorization", "Bearer "), ("x-api-key", KEY)], KEY),  # an empty Bearer does not end the search
    ([("x-api-key", KEY), ("authorization", "Bearer " + KEY)], KEY),  # the same key twice
    ([("x-api-key", ""), ("authorization", "Bearer " + KEY)], KEY),
    ([("authorization", "Basic dXNlcg=="), ("x-api-key", KEY)], KEY),
])
def test_the_key_a_call_presents_does_not_depend_on_header_order(headers, key):
    assert credentials_from(headers) == key
    assert credentials_from(list(reversed(headers))) == key


@pytest.mark.parametrize("headers", [
    [("authorization", "Bearer " + KEY), ("x-api-key", OTHER_KEY)],
    [("x-api-key", OTHER_KEY), ("authorization", "Bearer " + KEY)],
])
def test_two_different_keys_in_one_call_are_refused_whatever_their_order(headers):
    with pytest.raises(AccessDenied) as info:
        credentials_from(headers)
    assert (info.value.status, info.value.code) == (401, "invalid_api_key")
    assert "different API keys" in info.value.message


def test_a_call_with_two_different_keys_is_a_counted_401_that_checks_neither(key_store, denials):
    status, _, body = _post([("authorization", "Bearer " + KEY), ("x-api-key", OTHER_KEY)], [b"{}"])
    assert (status, body["error"]["code"]) == (401, "invalid_api_key")
    assert key_store.asked == [] and denials.by_code == {"invalid_api_key": 1}


def test_grpc_metadata_follows_the_same_key_rule(key_store, denials):
    class Context:
        def __init__(self, metadata):
            self.metadata = metadata

        def invocation_metadata(self):
            return self.metadata

    ingress = GrpcIngress(None, None, "m", SETTINGS)
    caller = asyncio.run(ingress._admit(Context([("authorization", "Bearer "), ("x-api-key", KEY)]), None))
    assert caller.key_id == "key_good"
    with pytest.raises(RpcFailure) as info:
        asyncio.run(ingress._admit(Context([("x-api-key", OTHER_KEY), ("authorization", "Bearer " + KEY)]), None))
    assert (info.value.status, info.value.code) == (grpc.StatusCode.UNAUTHENTICATED, "invalid_api_key")
    assert key_store.asked == [KEY] and denials.by_code == {"invalid_api_key": 1}


class _LogLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_caller_learns_only_that_the_key_store_is_unavailable(monkeypatch, denials):
    detail = "Error 111 connecting to redis-primary.internal:6379. Connection refused."
    store = _KeyStore(error=StoreUnavailable(detail))
    monkeypatch.setattr(access.ApiKeyStore, "from_url", classmethod(lambda cls, url: store))
    log = _LogLines()
    access.logger.addHandler(log)
    try:
        status, headers, body = _post([("x-api-key", "wp_any")], [b"{}"])
    finally:
        access.logger.removeHandler(log)
    assert (status, headers["retry-after"]) == (503, "1")
    assert body["error"]["message"] == "the API key store is unavailable"
    assert body["error"]["code"] == "key_store_unavailable"
    assert any(detail in line for line in log.lines)  # the reason stays in the server's log


@pytest.mark.parametrize("headers, chunks", [
    ([("content-length", str(LIMIT + 1))], [b"x" * (LIMIT + 1)]),
    ([], [b"x" * 300] * 4),  # no declared length: counted while it is read
], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_is_a_counted_413(key_store, denials, headers, chunks):
    status, _, body = _post([("x-api-key", KEY), *headers], chunks)
    assert (status, body["error"]["code"]) == (413, "request_too_large")
    assert denials.by_code == {"request_too_large": 1}


def test_a_grpc_request_over_the_limit_is_counted_as_over_http(key_store, denials):
    ingress = GrpcIngress(None, None, "m", SETTINGS)
    with pytest.raises(RpcFailure) as info:
        ingress._check_request(agent_pb2.SendMessageRequest(session_id="s", content="x" * LIMIT))
    assert (info.value.status, info.value.code) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "request_too_large")
    assert denials.by_code == {"request_too_large": 1}


@pytest.mark.parametrize("max_sessions", [None, 7])
def test_a_callers_session_limit_comes_from_its_key_and_survives_the_trip_to_the_orchestrator(
    key_store, denials, max_sessions
):
    key_store.max_sessions = max_sessions
    caller = asyncio.run(AccessGuard(GuardSettings.model_validate(SETTINGS)).admit_call([("x-api-key", KEY)]))
    assert caller.max_sessions == max_sessions
    assert Caller.from_dict(caller.to_dict()) == caller


def test_the_guards_refusals_carry_cors_headers(key_store, denials):
    """A browser on another origin reads a 401 or 429 (and its Retry-After) only with CORS headers on it."""
    from fastapi.testclient import TestClient

    from serve_apps.builders import ingress_app

    app = ingress_app(GuardSettings.model_validate(SETTINGS))
    app.add_api_route("/v1/models", lambda: {"data": []}, methods=["GET"])
    with TestClient(app) as client:
        refused = client.get("/v1/models", headers={"origin": "https://app.example"})
        allowed = client.get("/v1/models", headers={"origin": "https://app.example", "x-api-key": KEY})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "missing_api_key"
    assert refused.headers["www-authenticate"] == "Bearer"  # as HTTP asks of a 401 (RFC 9110)
    assert allowed.status_code == 200
    for response in (refused, allowed):
        assert response.headers["access-control-allow-origin"] in ("*", "https://app.example")


def test_a_grpc_call_from_another_machine_refused_with_keys_off_is_counted(denials):
    """Refused before any deployment, it was missing from `warmpath_access_denials`, which counts every such
    refusal over HTTP or gRPC."""
    import grpc

    from serve_apps import ingress_grpc
    from serve_apps.grpc_status import RpcFailure

    ingress = object.__new__(ingress_grpc.GrpcIngress)
    ingress._loopback_callers_only = True
    with pytest.raises(RpcFailure) as refused:
        ingress._check_call(SimpleNamespace(peer=lambda: "ipv4:10.0.0.5:41234"), object())
    assert refused.value.status is grpc.StatusCode.PERMISSION_DENIED and refused.value.code == "loopback_only"
    assert denials.by_code == {"loopback_only": 1}
