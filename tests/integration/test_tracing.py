"""OpenTelemetry: one agent turn's spans, across ingress, orchestrator and replica processes."""

from __future__ import annotations

import secrets

import httpx
import pytest

from tests.integration.test_sessions import LOOKUP_SCHEMA, tool_server  # noqa: F401 - fixture

pytestmark = pytest.mark.integration


def _traceparent() -> tuple[str, str]:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, f"00-{trace_id}-{parent_id}-01"


def _by_name(spans):
    out = {}
    for span in spans:
        out.setdefault(span.name, []).append(span)
    return out


def test_agent_turn_trace_tree(cluster, otlp_receiver, tool_server):  # noqa: F811
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
    second = max(model_calls, key=lambda c: c.attributes["warmpath.cached_tokens"])
    assert second.attributes["gen_ai.usage.input_tokens"] > 0 and second.attributes["warmpath.cached_tokens"] > 0
    # Three processes took part, each under the configured service name.
    assert {s.resource["warmpath.component"] for s in spans} == {"ingress", "orchestrator", "replica"}
    assert {s.resource["service.name"] for s in spans} == {"warmpath-test"}


def test_chat_completion_trace(cluster, otlp_receiver):
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
    assert ingress.attributes["gen_ai.usage.input_tokens"] > 0
    assert names["vllm.chat"][0].parent_span_id == ingress.span_id
    # The prefix-aware router hands the engine its token ids; other policies leave rendering to the engine.
    is_forwarded = cluster.cfg.router.policy == "warmpath" and cluster.cfg.router.forward_prompt_token_ids
    assert names["vllm.chat"][0].attributes["warmpath.prompt_ids_forwarded"] is is_forwarded
