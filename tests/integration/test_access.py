"""API keys, permissions, session ownership, rate limits and request size on the real cluster (HTTP and gRPC).

Keys are created the way an operator creates them (`ApiKeyStore` on the
cluster's Redis, as `warmpath keys create` does); the admin key is the one
`warmpath up` wrote to the state directory.
"""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
import redis

from cluster.api_keys import hash_api_key, run_with_store
from cluster.serve_config import grpc_app_name
from tests.integration.test_openai_api import LOOKUP_TOOL
from warmpath.v1 import agent_pb2, agent_pb2_grpc, inference_pb2, inference_pb2_grpc

pytestmark = pytest.mark.integration

LOOKUP_SCHEMA = LOOKUP_TOOL["function"]["parameters"]


def _make_key(cluster, permissions, requests_per_s=100.0, burst=100, name="test", max_sessions=None):
    return run_with_store(
        cluster.redis_url,
        lambda store: store.create(name, permissions, requests_per_s, burst, max_sessions=max_sessions),
    )


def _revoke(cluster, key_id):
    return run_with_store(cluster.redis_url, lambda store: store.revoke(key_id))


def _tool(name, permissions):
    return {"name": name, "description": "d", "parameters": LOOKUP_SCHEMA, "required_permissions": permissions,
            "execution": {"kind": "client"}}


def _chat_body(cluster):
    return {"model": cluster.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("headers, code", [
    ({}, "missing_api_key"),
    ({"authorization": "Bearer wp_not-a-key"}, "invalid_api_key"),
    ({"x-api-key": "wp_not-a-key"}, "invalid_api_key"),
    ({"authorization": "Basic dXNlcjpwdw=="}, "missing_api_key"),
])
@pytest.mark.parametrize("method, path", [("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                                          ("POST", "/v1/sessions"), ("GET", "/v1/sessions/anything")])
def test_calls_without_a_valid_key_get_401_with_a_message(cluster, headers, code, method, path):
    body = _chat_body(cluster) if method == "POST" else None
    resp = httpx.request(method, f"{cluster.base_url}{path}", json=body, headers=headers, timeout=30)
    assert resp.status_code == 401, resp.text
    assert resp.json()["error"]["code"] == code
    assert resp.json()["error"]["message"]


def test_health_and_openapi_need_no_key(cluster):
    assert httpx.get(f"{cluster.base_url}/health", timeout=10).status_code == 200
    assert "/v1/sessions" in httpx.get(f"{cluster.base_url}/openapi.json", timeout=10).json()["paths"]


def test_the_openai_client_authenticates_with_the_key(openai_client, cluster):
    reply = openai_client.chat.completions.create(model=cluster.model_id, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=2)
    assert reply.choices[0].message is not None


def test_keys_are_stored_hashed_never_in_plain_text(cluster):
    key, record = _make_key(cluster, ["orders:read"])
    client = redis.Redis.from_url(cluster.redis_url)
    try:
        dumped = {k: client.dump(k) for k in client.scan_iter(match="warmpath:*")}
        assert f"warmpath:apikey:{hash_api_key(key)}".encode() in dumped
        assert all(key.encode() not in (v or b"") and key.encode() not in k for k, v in dumped.items())
    finally:
        client.close()
        _revoke(cluster, record.key_id)


def test_tool_permissions_are_checked_at_registration(cluster):
    key, record = _make_key(cluster, ["orders:read"])
    try:
        with cluster.http(api_key=key) as client:
            denied = client.post("/v1/sessions", json={
                "model": cluster.model_id, "tools": [_tool("lookup_order", ["orders:read"]), _tool("refund", ["payments:write"])],
            })
            assert denied.status_code == 403, denied.text
            assert denied.json()["error"]["code"] == "missing_permission"
            assert "payments:write" in denied.json()["error"]["message"] and "refund" in denied.json()["error"]["message"]
            allowed = client.post("/v1/sessions", json={"model": cluster.model_id, "tools": [_tool("lookup_order", ["orders:read"])]})
            assert allowed.status_code == 201, allowed.text
    finally:
        _revoke(cluster, record.key_id)


def test_only_a_key_with_the_http_tools_permission_gives_a_session_server_side_tools(cluster, tool_server):
    http_tool = {"name": "lookup_order", "parameters": LOOKUP_SCHEMA,
                 "execution": {"kind": "http", "url": f"{tool_server}/lookup"}}
    scoped, scoped_record = _make_key(cluster, ["orders:read"])
    trusted, trusted_record = _make_key(cluster, ["orders:read", "tools:http"])
    try:
        with cluster.http(api_key=scoped) as client:
            denied = client.post("/v1/sessions", json={"model": cluster.model_id, "tools": [http_tool]})
            assert denied.status_code == 403, denied.text
            assert denied.json()["error"]["code"] == "missing_permission" and "tools:http" in denied.text
            allowed = client.post("/v1/sessions", json={"model": cluster.model_id,
                                                        "tools": [_tool("lookup_order", ["orders:read"])]})
            assert allowed.status_code == 201, allowed.text  # a client-side tool sends nothing from the cluster
        with cluster.http(api_key=trusted) as client:
            created = client.post("/v1/sessions", json={"model": cluster.model_id, "tools": [http_tool]})
            assert created.status_code == 201, created.text
    finally:
        _revoke(cluster, scoped_record.key_id)
        _revoke(cluster, trusted_record.key_id)


def test_a_tool_aimed_at_the_cloud_metadata_service_is_refused(cluster):
    tool = {"name": "steal", "parameters": {"type": "object"},
            "execution": {"kind": "http", "url": "http://169.254.169.254/latest/meta-data/"}}
    refused = cluster.client.post("/v1/sessions", json={"model": cluster.model_id, "tools": [tool]}, timeout=60)
    assert refused.status_code == 403, refused.text
    error = refused.json()["error"]
    assert error["code"] == "tool_url_not_allowed" and "169.254.169.254" in error["message"]
    assert error["type"] == "PermissionDeniedError"


def test_sessions_belong_to_the_key_that_created_them(cluster):
    created = cluster.client.post("/v1/sessions", json={"model": cluster.model_id, "system_prompt": "private"})
    assert created.status_code == 201, created.text
    sid = created.json()["session_id"]
    assert len(sid) >= 32  # secrets.token_urlsafe(24): 192 random bits
    key, record = _make_key(cluster, ["*"])
    try:
        with cluster.http(api_key=key) as other:
            for method, path, body in [("GET", f"/v1/sessions/{sid}", None), ("DELETE", f"/v1/sessions/{sid}", None),
                                       ("POST", f"/v1/sessions/{sid}/messages", {"content": "hi"}),
                                       ("POST", f"/v1/sessions/{sid}/tool_results",
                                        {"results": [{"tool_call_id": "c1", "content": "x"}]})]:
                resp = other.request(method, path, json=body)
                assert resp.status_code == 404, (method, path, resp.text)
                assert "private" not in resp.text
        assert cluster.client.get(f"/v1/sessions/{sid}").status_code == 200  # untouched for its owner
    finally:
        _revoke(cluster, record.key_id)


def test_rate_limit_answers_429_with_retry_after(cluster):
    key, record = _make_key(cluster, ["*"], requests_per_s=0.2, burst=2)
    try:
        with cluster.http(api_key=key) as client:
            statuses = [client.get("/v1/models") for _ in range(3)]
        assert [r.status_code for r in statuses] == [200, 200, 429], [r.text for r in statuses]
        limited = statuses[-1]
        assert limited.json()["error"]["code"] == "rate_limited"
        assert 1 <= int(limited.headers["retry-after"]) <= 5
    finally:
        _revoke(cluster, record.key_id)


def test_a_key_at_its_session_quota_gets_429_over_http_and_grpc_until_it_deletes_one(cluster):
    key, record = _make_key(cluster, [], max_sessions=2)
    app = ("application", grpc_app_name(cluster.cfg))
    body = {"model": cluster.model_id, "system_prompt": "quota"}
    try:
        with cluster.http(api_key=key) as client:
            sids = [client.post("/v1/sessions", json=body).json()["session_id"] for _ in range(2)]
            refused = client.post("/v1/sessions", json=body)
            assert refused.status_code == 429, refused.text
            error = refused.json()["error"]
            assert error["code"] == "session_quota_exceeded" and f"API key {record.key_id} holds 2" in error["message"]
            # OpenAI's clients would retry a 429 twice by themselves; a full quota does not clear in seconds.
            assert refused.headers["x-should-retry"] == "false" and "retry-after" not in refused.headers
            with grpc.insecure_channel(f"127.0.0.1:{cluster.cfg.ports.grpc_port}") as channel:
                agent = agent_pb2_grpc.AgentStub(channel)
                with pytest.raises(grpc.RpcError) as err:
                    agent.CreateSession(agent_pb2.CreateSessionRequest(model=cluster.model_id),
                                        metadata=[app, ("x-api-key", key)], timeout=60)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "live sessions" in err.value.details()
            # The admin key holds '*': no quota, and another key's full quota is not its concern.
            assert cluster.client.post("/v1/sessions", json=body).status_code == 201
            assert client.delete(f"/v1/sessions/{sids[0]}").status_code == 204
            assert client.post("/v1/sessions", json=body).status_code == 201
    finally:
        _revoke(cluster, record.key_id)


def test_an_expiring_key_works_until_redis_removes_it(cluster):
    key, record = run_with_store(
        cluster.redis_url, lambda store: store.create("expiring", ["*"], 100.0, 100, expires_in_s=3600))
    try:
        assert record.expires_at_s == pytest.approx(record.created_at_s + 3600)
        with redis.Redis.from_url(cluster.redis_url) as store, cluster.http(api_key=key) as client:
            for entry in (f"warmpath:apikey:{hash_api_key(key)}", f"warmpath:apikey-id:{record.key_id}"):
                assert 3_500_000 < store.pttl(entry) <= 3_600_000, entry
            assert client.get("/v1/models").status_code == 200
            # Expiry is Redis' own: moving it to now is what the clock would do in an hour.
            store.pexpireat(f"warmpath:apikey:{hash_api_key(key)}", 1)
            refused = client.get("/v1/models")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    finally:
        _revoke(cluster, record.key_id)


def test_key_expiry_must_be_in_the_future(cluster):
    with pytest.raises(ValueError, match="expires_in_s"):
        run_with_store(cluster.redis_url, lambda store: store.create("never", ["*"], 1.0, 1, expires_in_s=0))


def test_a_revoked_key_stops_working(cluster):
    key, record = _make_key(cluster, ["*"])
    with cluster.http(api_key=key) as client:
        assert client.get("/v1/models").status_code == 200
        assert _revoke(cluster, record.key_id)
        assert client.get("/v1/models").status_code == 401


@pytest.mark.parametrize("is_chunked", [False, True], ids=["content-length", "chunked"])
def test_oversized_bodies_get_413(cluster, is_chunked):
    limit = cluster.cfg.access.max_request_bytes
    payload = json.dumps({**_chat_body(cluster), "messages": [{"role": "user", "content": "x" * (limit + 10)}]}).encode()
    content = iter([payload[i:i + 65536] for i in range(0, len(payload), 65536)]) if is_chunked else payload
    resp = cluster.client.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    assert resp.status_code == 413, resp.text[:300]
    assert resp.json()["error"]["code"] == "request_too_large"


def test_grpc_calls_need_a_key_and_honour_ownership(cluster):
    app = ("application", grpc_app_name(cluster.cfg))
    key, record = _make_key(cluster, ["*"], requests_per_s=0.2, burst=2)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{cluster.cfg.ports.grpc_port}") as channel:
            inference = inference_pb2_grpc.InferenceStub(channel)
            agent = agent_pb2_grpc.AgentStub(channel)
            request = inference_pb2.ChatCompletionRequest(
                model=cluster.model_id, messages=[inference_pb2.ChatMessage(role="user", content="hi")], max_tokens=2)
            with pytest.raises(grpc.RpcError) as err:
                inference.ChatCompletion(request, metadata=[app], timeout=60)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and err.value.details()

            admin = [app, ("authorization", f"Bearer {cluster.api_key}")]
            sid = agent.CreateSession(agent_pb2.CreateSessionRequest(model=cluster.model_id), metadata=admin, timeout=60).session_id
            other = [app, ("x-api-key", key)]
            with pytest.raises(grpc.RpcError) as err:
                agent.GetSession(agent_pb2.GetSessionRequest(session_id=sid), metadata=other, timeout=60)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            agent.CreateSession(agent_pb2.CreateSessionRequest(model=cluster.model_id), metadata=other, timeout=60)
            with pytest.raises(grpc.RpcError) as err:
                agent.CreateSession(agent_pb2.CreateSessionRequest(model=cluster.model_id), metadata=other, timeout=60)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "rate limit" in err.value.details()
            assert 1 <= int(dict(err.value.trailing_metadata())["retry-after"]) <= 5
    finally:
        _revoke(cluster, record.key_id)
