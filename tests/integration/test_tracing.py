"""OpenTelemetry: one agent turn's spans, across ingress, orchestrator and replica processes."""

from __future__ import annotations

import secrets

import grpc
import pytest

from tests.integration.conftest import LOOKUP_SCHEMA
from warmpath.v1 import agent_pb2, agent_pb2_grpc

pytestmark = pytest.mark.integration


def _traceparent() -> tuple[str, str]:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, f"00-{trace_id}-{parent_id}-01"


def _by_name(spans):
    out = {}
    for span in spans:
        out.setdefault(span.name, []).append(span)
    return out


def test_agent_turn_trace_tree(cluster, otlp_receiver, tool_server, tool_traceparents):
    body = {
        "model": cluster.model_id, "system_prompt": "You are a support agent.",
        "tools": [{"name": "lookup_order", "description": "Look up an order.", "parameters": LOOKUP_SCHEMA,
                   "execution": {"kind": "http", "url": f"{tool_server}/lookup", "timeout_s": 5}}],
        "limits": {"output_reserve_tokens": 64},
    }
    sid = cluster.client.post("/v1/sessions", json=body, timeout=60).json()["session_id"]
    trace_id, traceparent = _traceparent()
    resp = cluster.client.post(
        f"/v1/sessions/{sid}/messages",
        json={"content": "Where is ORD-98231?", "tool_choice": "required"},
        headers={"traceparent": traceparent}, timeout=300,
    )
    assert resp.status_code == 200 and resp.json()["status"] == "completed", resp.text
    wanted = {"POST /v1/sessions/{session_id}/messages", "invoke_agent warmpath", f"chat {cluster.model_id}",
              "warmpath.route", "vllm.chat", "execute_tool lookup_order"}
    spans = otlp_receiver.wait_for(trace_id, wanted)
    names = _by_name(spans)
    assert wanted <= set(names), sorted(names)
    by_id = {s.span_id: s for s in spans}

    ingress = names["POST /v1/sessions/{session_id}/messages"][0]
    turn = names["invoke_agent warmpath"][0]
    assert ingress.parent_span_id == traceparent.split("-")[2]
    assert turn.parent_span_id == ingress.span_id
    assert turn.attributes["warmpath.turn.outcome"] == "final"
    model_calls = names[f"chat {cluster.model_id}"]
    assert len(model_calls) == 2 and all(c.parent_span_id == turn.span_id for c in model_calls)
    for route in names["warmpath.route"]:
        assert by_id[route.parent_span_id].name == f"chat {cluster.model_id}"
        assert route.attributes["warmpath.route.reason"]
    for engine in names["vllm.chat"]:
        call = by_id[engine.parent_span_id]
        assert call.name == f"chat {cluster.model_id}"
        assert engine.attributes["warmpath.replica"] == call.attributes["warmpath.replica"]
        assert engine.attributes["gen_ai.server.time_to_first_token"] > 0
    tool = names["execute_tool lookup_order"][0]
    assert tool.parent_span_id == turn.span_id and tool.attributes["warmpath.tool.status"] == "ok"
    # The tool server got the trace: its own spans would be children of the tool call's.
    assert any((header or "").startswith(f"00-{trace_id}-{tool.span_id}-") for header in tool_traceparents)
    second = max(model_calls, key=lambda c: c.attributes["warmpath.cached_tokens"])
    assert second.attributes["gen_ai.usage.input_tokens"] > 0 and second.attributes["warmpath.cached_tokens"] > 0
    # Three processes took part, each under the configured service name.
    assert {s.resource["warmpath.component"] for s in spans} == {"ingress", "orchestrator", "replica"}
    assert {s.resource["service.name"] for s in spans} == {"warmpath-test"}


def _wait_for_replicas_routing_stats(cluster, timeout_s: float = 90.0) -> None:
    """Until the ingress's routers have every replica's routing stats (KV cache size, how it renders prompts):
    a router made by this process's first call forwards no token ids before them."""
    import time

    cluster.client.post("/v1/chat/completions", json={
        "model": cluster.model_id, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 1}, timeout=120)
    deadline = time.monotonic() + timeout_s
    while True:
        routers = cluster.client.get("/v1/router", timeout=30).json()["routers"]
        if routers and all(replica["capacity_blocks"] for router in routers for replica in router["kv_cache"].values()):
            return
        assert time.monotonic() < deadline, routers
        time.sleep(0.5)


def test_chat_completion_trace(cluster, otlp_receiver):
    is_forwarded = cluster.cfg.router.policy == "warmpath" and cluster.cfg.router.forward_prompt_token_ids
    if is_forwarded:
        _wait_for_replicas_routing_stats(cluster)
    trace_id, traceparent = _traceparent()
    resp = cluster.client.post(
        "/v1/chat/completions",
        json={"model": cluster.model_id, "messages": [{"role": "user", "content": "trace me"}], "max_tokens": 4},
        headers={"traceparent": traceparent}, timeout=120,
    )
    assert resp.status_code == 200
    wanted = {f"chat {cluster.model_id}", "vllm.chat"}
    names = _by_name(otlp_receiver.wait_for(trace_id, wanted))
    assert wanted <= set(names), sorted(names)
    ingress = names[f"chat {cluster.model_id}"][0]
    assert ingress.attributes["warmpath.replica"] == resp.headers["x-warmpath-replica"]
    assert (ingress.attributes["http.request.method"], ingress.attributes["http.route"]) == ("POST", "/v1/chat/completions")
    assert ingress.attributes["gen_ai.usage.input_tokens"] > 0
    assert names["vllm.chat"][0].parent_span_id == ingress.span_id
    # The prefix-aware router hands the engine its token ids; other policies leave rendering to the engine.
    assert names["vllm.chat"][0].attributes["warmpath.prompt_ids_forwarded"] is is_forwarded


def test_a_client_error_is_recorded_but_not_a_span_error(cluster, otlp_receiver):
    trace_id, traceparent = _traceparent()
    resp = cluster.client.post(
        "/v1/chat/completions",
        json={"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        headers={"traceparent": traceparent}, timeout=120,
    )
    assert resp.status_code == 404, resp.text
    # A model name the client made up is an attribute, not a span name of its own.
    names = _by_name(otlp_receiver.wait_for(trace_id, {"chat"}))
    ingress = names["chat"][0]
    assert ingress.attributes["gen_ai.request.model"] == "no-such-model"
    assert ingress.attributes["http.response.status_code"] == 404
    assert "error.type" not in ingress.attributes and not ingress.is_error  # ERROR only for 5xx


def test_a_streamed_chat_span_ends_with_its_stream(cluster, otlp_receiver):
    trace_id, traceparent = _traceparent()
    body = {"model": cluster.model_id, "messages": [{"role": "user", "content": "stream me"}], "max_tokens": 4,
            "stream": True}
    with cluster.client.stream("POST", "/v1/chat/completions", json=body, headers={"traceparent": traceparent},
                               timeout=120) as resp:
        assert resp.status_code == 200
        frames = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "data: [DONE]"
    wanted = {f"chat {cluster.model_id}", "vllm.chat"}
    names = _by_name(otlp_receiver.wait_for(trace_id, wanted))
    assert wanted <= set(names), sorted(names)
    ingress = names[f"chat {cluster.model_id}"][0]
    # Usage arrives in the stream's last chunk: on the span only if it ended after the stream did.
    assert ingress.attributes["gen_ai.usage.input_tokens"] > 0
    assert ingress.attributes["http.response.status_code"] == 200
    assert "warmpath.stream.incomplete" not in ingress.attributes and "error.type" not in ingress.attributes


def test_session_routes_are_traced_with_their_route_template(cluster, otlp_receiver):
    trace_id, traceparent = _traceparent()
    body = {"model": cluster.model_id, "system_prompt": "You are terse."}
    resp = cluster.client.post("/v1/sessions", json=body, headers={"traceparent": traceparent}, timeout=60)
    assert resp.status_code == 201, resp.text
    sid = resp.json()["session_id"]
    resp = cluster.client.delete(f"/v1/sessions/{sid}", headers={"traceparent": traceparent}, timeout=60)
    assert resp.status_code == 204
    resp = cluster.client.get(f"/v1/sessions/{sid}", headers={"traceparent": traceparent}, timeout=60)
    assert resp.status_code == 404
    statuses = {"POST /v1/sessions": 201, "DELETE /v1/sessions/{session_id}": 204, "GET /v1/sessions/{session_id}": 404}
    names = _by_name(otlp_receiver.wait_for(trace_id, set(statuses)))
    assert set(statuses) <= set(names), sorted(names)
    for name, status in statuses.items():
        span = names[name][0]
        method, route = name.split(" ")
        assert span.parent_span_id == traceparent.split("-")[2]
        assert (span.attributes["http.request.method"], span.attributes["http.route"]) == (method, route)
        assert span.attributes["http.response.status_code"] == status
        assert "error.type" not in span.attributes and not span.is_error  # a 404 is the caller's, not an error


def test_a_streamed_turn_span_covers_the_turn(cluster, otlp_receiver):
    body = {"model": cluster.model_id, "system_prompt": "You are terse.", "limits": {"output_reserve_tokens": 64}}
    sid = cluster.client.post("/v1/sessions", json=body, timeout=60).json()["session_id"]
    trace_id, traceparent = _traceparent()
    with cluster.client.stream("POST", f"/v1/sessions/{sid}/messages", json={"content": "Say hi.", "stream": True},
                               headers={"traceparent": traceparent}, timeout=300) as resp:
        assert resp.status_code == 200
        kinds = [line.split(": ", 1)[1] for line in resp.iter_lines() if line.startswith("event: ")]
    assert kinds[-1] == "done", kinds
    wanted = {"POST /v1/sessions/{session_id}/messages", "invoke_agent warmpath"}
    names = _by_name(otlp_receiver.wait_for(trace_id, wanted))
    assert wanted <= set(names), sorted(names)
    ingress = names["POST /v1/sessions/{session_id}/messages"][0]
    # The turn ran under the route's span, which ended with the stream (it was exported after the turn's).
    assert names["invoke_agent warmpath"][0].parent_span_id == ingress.span_id
    assert ingress.attributes["http.route"] == "/v1/sessions/{session_id}/messages"
    assert ingress.attributes["http.response.status_code"] == 200


def test_grpc_calls_are_traced_with_their_status_code(channel, metadata, cluster, otlp_receiver):
    agent = agent_pb2_grpc.AgentStub(channel)
    trace_id, traceparent = _traceparent()
    traced = [*metadata, ("traceparent", traceparent)]
    created = agent.CreateSession(agent_pb2.CreateSessionRequest(
        model=cluster.model_id, system_prompt="You are terse.", limits=agent_pb2.SessionLimits(output_reserve_tokens=64),
    ), metadata=traced, timeout=60)
    # A stream that failed would raise here: the call ended OK.
    list(agent.SendMessage(
        agent_pb2.SendMessageRequest(session_id=created.session_id, content="Say hi."), metadata=traced, timeout=300,
    ))
    agent.DeleteSession(agent_pb2.DeleteSessionRequest(session_id=created.session_id), metadata=traced, timeout=60)
    with pytest.raises(grpc.RpcError) as err:
        agent.GetSession(agent_pb2.GetSessionRequest(session_id=created.session_id), metadata=traced, timeout=60)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    codes = {"warmpath.v1.Agent/CreateSession": 0, "warmpath.v1.Agent/SendMessage": 0,
             "warmpath.v1.Agent/DeleteSession": 0, "warmpath.v1.Agent/GetSession": grpc.StatusCode.NOT_FOUND.value[0]}
    wanted = {*codes, "invoke_agent warmpath"}
    names = _by_name(otlp_receiver.wait_for(trace_id, wanted))
    assert wanted <= set(names), sorted(names)
    assert {name: names[name][0].attributes["rpc.grpc.status_code"] for name in codes} == codes
    assert not any(names[name][0].is_error for name in codes)  # NOT_FOUND is the caller's
    send = names["warmpath.v1.Agent/SendMessage"][0]
    assert send.parent_span_id == traceparent.split("-")[2]
    assert names["invoke_agent warmpath"][0].parent_span_id == send.span_id
    assert send.resource["warmpath.component"] == "grpc-ingress"


# A caller leaving a stream: the cancellation must reach the replica, whose engine then abandons the request
# (vLLM aborts a request whose output stream is closed); a replica span marked incomplete is the proof.
# `max_tokens` is far beyond what a few chunks take, so a stream that ran to its end would not be marked.
LONG_ANSWER_TOKENS = 4000


def _replica_span_of(otlp_receiver, trace_id):
    spans = otlp_receiver.wait_for(trace_id, {"vllm.chat"}, timeout_s=120)
    names = _by_name(spans)
    assert "vllm.chat" in names, sorted(names)
    return names


def test_an_http_client_leaving_a_stream_abandons_the_engines_request(cluster, otlp_receiver):
    trace_id, traceparent = _traceparent()
    body = {"model": cluster.model_id, "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": LONG_ANSWER_TOKENS, "ignore_eos": True, "stream": True}
    with cluster.client.stream("POST", "/v1/chat/completions", json=body, headers={"traceparent": traceparent},
                               timeout=120) as resp:
        assert resp.status_code == 200
        first = next(line for line in resp.iter_lines() if line.startswith("data: {"))
        assert '"choices"' in first
    names = _replica_span_of(otlp_receiver, trace_id)
    (engine,) = names["vllm.chat"]
    assert engine.attributes.get("warmpath.stream.incomplete") is True, engine.attributes
    assert not engine.is_error


def test_an_http_client_leaving_a_streamed_turn_stops_the_turn_and_its_model_call(cluster, otlp_receiver):
    """Ingress, orchestrator, replica: each stops the streaming call it made when its reader leaves."""
    body = {"model": cluster.model_id, "system_prompt": "You are a storyteller.",
            "limits": {"output_reserve_tokens": LONG_ANSWER_TOKENS}}
    sid = cluster.client.post("/v1/sessions", json=body, timeout=60).json()["session_id"]
    trace_id, traceparent = _traceparent()
    with cluster.client.stream("POST", f"/v1/sessions/{sid}/messages", json={"content": "A long story.", "stream": True},
                               headers={"traceparent": traceparent}, timeout=300) as resp:
        assert resp.status_code == 200
        assert next(line for line in resp.iter_lines() if line == "event: delta")
    names = _by_name(otlp_receiver.wait_for(trace_id, {"vllm.chat", "invoke_agent warmpath"}, timeout_s=120))
    assert {"vllm.chat", "invoke_agent warmpath"} <= set(names), sorted(names)
    (engine,) = names["vllm.chat"]
    turn = names["invoke_agent warmpath"][0]
    seen = (engine.duration_s, engine.attributes, turn.duration_s, turn.attributes)
    assert engine.attributes.get("warmpath.stream.incomplete") is True, seen
    assert turn.attributes["warmpath.turn.outcome"] == "cancelled", seen
