"""Agent sessions over HTTP on the real cluster: tools, commits, compression, Redis."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json

import httpx
import pytest

from tests.integration.conftest import LOOKUP_SCHEMA, ORDER_RESULT

pytestmark = pytest.mark.integration


def _tool(name, url=None, description="Look up an order by id."):
    execution = {"kind": "http", "url": url, "timeout_s": 5} if url else {"kind": "client"}
    return {"name": name, "description": description, "parameters": LOOKUP_SCHEMA, "execution": execution}


def _create(cluster, tools, system="You are a support agent for ACME.", **limits):
    # A short answer budget keeps the random-weight model's answers (and the suite) short.
    body = {"model": cluster.model_id, "system_prompt": system, "tools": tools,
            "limits": {"output_reserve_tokens": 64, **limits}}
    resp = cluster.client.post("/v1/sessions", json=body, timeout=60)
    assert resp.status_code == 201, resp.text
    return resp.json()


def _send(cluster, session_id, content, tool_choice="auto", timeout=300):
    return cluster.client.post(
        f"/v1/sessions/{session_id}/messages",
        json={"content": content, "tool_choice": tool_choice}, timeout=timeout,
    )


def _get(cluster, session_id):
    resp = cluster.client.get(f"/v1/sessions/{session_id}", timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


@contextlib.contextmanager
def _turn_held_at_its_tool(cluster, tool_gate, sid: str, content: str):
    """A turn of `sid` (forced to call its `/gate` tool) running in the background, held at that call while
    the block runs; yields the turn's future. The gate opens when the block ends, whatever its outcome."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        turn = pool.submit(_send, cluster, sid, content, "required")
        try:
            assert tool_gate.gate_reached.wait(240), "the turn never called its tool"
            yield turn
        finally:
            tool_gate.gate_open.set()


def test_a_session_deleted_while_its_turn_runs_ends_the_turn_as_not_found(cluster, tool_server, tool_gate):
    """The turn's commit finds the session gone: a 404 with the API's shape, nothing saved (was a 500)."""
    sid = _create(cluster, [_tool("lookup_order", f"{tool_server}/gate")])["session_id"]
    with _turn_held_at_its_tool(cluster, tool_gate, sid, "Where is my order ORD-98231?") as turn:
        assert cluster.client.delete(f"/v1/sessions/{sid}", timeout=60).status_code == 204
    resp = turn.result(timeout=300)
    assert resp.status_code == 404, resp.text
    body = resp.json()
    assert body["status"] == "failed" and body["error"]["code"] == "session_not_found", body
    assert body["error"]["type"] == "NotFoundError"
    assert cluster.client.get(f"/v1/sessions/{sid}", timeout=60).status_code == 404


def test_server_side_tool_turn_commits_every_message(cluster, tool_server):
    created = _create(cluster, [_tool("lookup_order", f"{tool_server}/lookup")])
    sid = created["session_id"]
    resp = _send(cluster, sid, "Where is my order ORD-98231?", tool_choice="required")
    assert resp.status_code == 200, resp.text
    turn = resp.json()
    assert turn["status"] == "completed", turn
    kinds = [e["kind"] for e in turn["events"]]
    assert kinds.index("tool_call") < kinds.index("tool_result") < kinds.index("final")
    assert all(not a == b == "delta" for a, b in zip(kinds, kinds[1:])), kinds  # one delta per answer
    call = next(e["call"] for e in turn["events"] if e["kind"] == "tool_call")
    assert call["name"] == "lookup_order"
    import jsonschema

    jsonschema.validate(json.loads(call["arguments"]), LOOKUP_SCHEMA)
    result = next(e for e in turn["events"] if e["kind"] == "tool_result")
    assert result["status"] == "ok" and "ORD-98231" in result["content"]

    session = _get(cluster, sid)
    roles = [m["role"] for m in session["transcript"]]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert session["prefix_fingerprint"] == created["prefix_fingerprint"]
    steps = session["cache"]["steps"]
    assert len(steps) == 2 and all(s["prefix_fingerprint"] == created["prefix_fingerprint"] for s in steps)
    # Append-only prompts: step 2 reuses step 1's prompt from the prefix cache.
    block = cluster.cfg.replicas.block_size_tokens
    assert steps[1]["cached_tokens"] >= steps[0]["prompt_tokens"] - block, steps


def test_client_side_tool_pauses_and_resumes(cluster):
    sid = _create(cluster, [_tool("lookup_order")])["session_id"]
    paused = _send(cluster, sid, "Check ORD-12345 for me.", tool_choice="required").json()
    assert paused["status"] == "requires_action", paused
    (call,) = paused["required_action"]["tool_calls"]
    assert _get(cluster, sid)["pending_tool_calls"] == [call]
    busy = _send(cluster, sid, "another question")
    assert busy.status_code == 409
    wrong = cluster.client.post(
        f"/v1/sessions/{sid}/tool_results",
        json={"results": [{"tool_call_id": "nope", "content": "x"}]}, timeout=60,
    )
    assert wrong.status_code == 400 and call["id"] in wrong.text
    resumed = cluster.client.post(
        f"/v1/sessions/{sid}/tool_results",
        json={"results": [{"tool_call_id": call["id"], "content": json.dumps(ORDER_RESULT)}]}, timeout=300,
    )
    assert resumed.status_code == 200 and resumed.json()["status"] == "completed", resumed.text
    assert [m["role"] for m in _get(cluster, sid)["transcript"]] == ["user", "assistant", "tool", "assistant"]


@pytest.mark.parametrize("path", ["/fail", "/garbage"])
def test_failing_tools_become_results_the_model_sees(cluster, tool_server, path):
    sid = _create(cluster, [_tool("lookup_order", f"{tool_server}{path}")])["session_id"]
    turn = _send(cluster, sid, "Where is ORD-55555?", tool_choice="required").json()
    assert turn["status"] == "completed", turn
    result = next(e for e in turn["events"] if e["kind"] == "tool_result")
    assert result["status"] == "error"


def test_changing_tools_changes_the_fingerprint(cluster, tool_server):
    a = _create(cluster, [_tool("lookup_order", f"{tool_server}/lookup")])
    b = _create(cluster, [_tool("lookup_order", f"{tool_server}/lookup", description="Find an order.")])
    c = _create(cluster, [_tool("lookup_order", f"{tool_server}/lookup")])
    assert a["prefix_fingerprint"] != b["prefix_fingerprint"]
    assert a["prefix_fingerprint"] == c["prefix_fingerprint"]


def test_compression_keeps_exact_values(cluster, tool_server):
    sid = _create(
        cluster, [_tool("lookup_order", f"{tool_server}/lookup")],
        context_budget_tokens=900, output_reserve_tokens=64, keep_last_rounds=1, compress_below_fraction=0.5,
    )["session_id"]
    first = _send(cluster, sid, "Look up ORD-98231 please.", tool_choice="required").json()
    assert first["status"] == "completed", first
    compressed = None
    for i in range(12):
        turn = _send(cluster, sid, f"Follow-up question number {i} about the delivery window and the invoice.").json()
        assert turn["status"] in ("completed", "max_steps"), turn
        compressed = next((e for e in turn["events"] if e["kind"] == "compression"), compressed)
        if compressed:
            break
    assert compressed is not None, "no compression happened"
    assert compressed["report"]["ledger_retained_fraction"] == 1.0
    assert compressed["report"]["tokens_after"] < compressed["report"]["tokens_before"]
    context = json.dumps(_get(cluster, sid)["transcript"])
    for value in ("ORD-98231", "1,284.50", "2026-11-30", "ZX-44017"):
        assert value in context, value
    assert _get(cluster, sid)["cache"]["num_compressions"] == 1


def test_concurrent_messages_to_one_session_do_not_interleave(cluster, tool_server, tool_gate):
    """A message sent while the session's turn runs (held at its tool call) is refused, not interleaved."""
    sid = _create(cluster, [_tool("lookup_order", f"{tool_server}/gate")])["session_id"]
    with _turn_held_at_its_tool(cluster, tool_gate, sid, "message 0: where is ORD-98231?") as first:
        second = _send(cluster, sid, "message 1", timeout=60)
    first_resp = first.result(timeout=300)
    assert second.status_code == 409, second.text
    assert second.json()["error"]["code"] == "session_busy", second.text
    assert second.headers.get("retry-after") == "1"  # through Ray's proxy too: clients wait and send again
    assert first_resp.status_code == 200 and first_resp.json()["status"] == "completed", first_resp.text
    transcript = _get(cluster, sid)["transcript"]
    assert [m["content"] for m in transcript if m["role"] == "user"] == ["message 0: where is ORD-98231?"]
    assert [m["role"] for m in transcript[:3]] == ["user", "assistant", "tool"] and transcript[-1]["role"] == "assistant"


def test_session_errors(cluster):
    assert cluster.client.get("/v1/sessions/does-not-exist", timeout=30).status_code == 404
    assert cluster.client.delete("/v1/sessions/does-not-exist", timeout=30).status_code == 404
    bad_schema = {"model": cluster.model_id, "tools": [{"name": "x", "description": "d", "parameters": {"type": "nope"}, "execution": {"kind": "client"}}]}
    resp = cluster.client.post("/v1/sessions", json=bad_schema, timeout=30)
    assert resp.status_code in (400, 422) and "parameters" in resp.text
    resp = cluster.client.post("/v1/sessions", json={"model": "other-model"}, timeout=30)
    assert resp.status_code == 404
    sid = _create(cluster, [])["session_id"]
    assert cluster.client.delete(f"/v1/sessions/{sid}", timeout=30).status_code == 204
    assert cluster.client.get(f"/v1/sessions/{sid}", timeout=30).status_code == 404


@pytest.mark.disrupts_replicas
def test_sessions_survive_an_orchestrator_restart(cluster, ray_connection):
    ray = ray_connection
    sid = _create(cluster, [])["session_id"]
    assert _send(cluster, sid, "remember me").json()["status"] == "completed"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "Orchestrator" in a["name"]]
    assert names
    for name in names:
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    # Serve replaces the replica; the session is read back from Redis by the new one.
    from cluster import local

    state = local.LocalState.load(local.state_dir_of(cluster.cfg))
    local.wait_running(cluster.cfg, state, progress=print, timeout_s=300)
    session = _get(cluster, sid)
    assert [m["role"] for m in session["transcript"]] == ["user", "assistant"]
    assert _send(cluster, sid, "still there?").json()["status"] == "completed"


def test_operator_metrics_on_rays_prometheus_endpoint(cluster, tool_server):
    """Routing decisions, per-replica cache counters, TTFT, turn latency and tool calls reach Prometheus."""
    import time

    sid = _create(cluster, [_tool("lookup_order", f"{tool_server}/lookup")])["session_id"]
    assert _send(cluster, sid, "Where is ORD-98231?", tool_choice="required").json()["status"] == "completed"
    wanted = [
        "ray_warmpath_routing_decisions_total", "ray_warmpath_prompt_tokens_total", "ray_warmpath_cached_tokens_total",
        "ray_warmpath_ttft_seconds_bucket", "ray_warmpath_turn_seconds_bucket", "ray_warmpath_tool_calls_total",
        "ray_warmpath_prompts_rendered_total",
    ]
    url = f"http://127.0.0.1:{cluster.cfg.ports.metrics_export_port}/metrics"
    deadline = time.monotonic() + 120
    while True:  # Ray's metrics agent exports on an interval
        text = httpx.get(url, timeout=10).text
        missing = [name for name in wanted if name not in text]
        if not missing:
            break
        assert time.monotonic() < deadline, missing
        time.sleep(1)
    calls = [line for line in text.splitlines() if line.startswith("ray_warmpath_tool_calls_total{")]
    # No client-chosen label: the tool's name is not one (a Ray session that ran an older build may still
    # export that build's series, and then shows the label empty on the new ones).
    assert any('status="ok"' in line and ("tool=" not in line or 'tool=""' in line) for line in calls), calls


def test_text_that_is_not_unicode_is_refused_naming_the_field(cluster):
    # Raw JSON: "\ud800" decodes to a lone surrogate, which neither the tokenizer nor Redis can take.
    headers = {"content-type": "application/json"}
    raw = '{"model": "%s", "system_prompt": "\\ud800"}' % cluster.model_id
    resp = cluster.client.post("/v1/sessions", content=raw, headers=headers, timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "system_prompt"
    sid = _create(cluster, [_tool("lookup_order")])["session_id"]
    paused = _send(cluster, sid, "Check ORD-12345 for me.", tool_choice="required").json()
    assert paused["status"] == "requires_action", paused
    call_id = paused["required_action"]["tool_calls"][0]["id"]
    raw = '{"results": [{"tool_call_id": "%s", "content": "bad \\ud800"}]}' % call_id
    resp = cluster.client.post(f"/v1/sessions/{sid}/tool_results", content=raw, headers=headers, timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "results[0].content"
    # The session still waits for its results.
    assert [c["id"] for c in _get(cluster, sid)["pending_tool_calls"]] == [call_id]


def test_a_prefix_over_the_window_is_refused_at_creation(cluster):
    body = {"model": cluster.model_id, "system_prompt": "You are a support agent. " * 200,
            "limits": {"context_budget_tokens": 512, "output_reserve_tokens": 64}}
    resp = cluster.client.post("/v1/sessions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "context_overflow"
    assert "tokens" in error["message"] and "512-token window" in error["message"] and "output_reserve_tokens=64" in error["message"]


def test_a_number_the_grammar_cannot_hold_is_refused_at_creation(cluster):
    schema = {"type": "object", "properties": {"a": {"type": "number", "maximum": 10**400}}, "required": ["a"]}
    tool = {"name": "t", "description": "d", "parameters": schema, "execution": {"kind": "client"}}
    resp = cluster.client.post("/v1/sessions", json={"model": cluster.model_id, "tools": [tool]}, timeout=60)
    assert resp.status_code == 400, resp.text
    assert "float64" in resp.json()["error"]["message"] and "maximum" in resp.json()["error"]["message"]


def test_a_schema_the_grammar_compiler_refuses_fails_the_forced_turn_as_the_requests_fault(cluster):
    # Valid JSON Schema that passes creation, but xgrammar finds no object it allows: at least two
    # properties, of which only one may exist.
    inner = {"type": "object", "properties": {"x": {"type": "integer"}}, "minProperties": 2, "additionalProperties": False}
    schema = {"type": "object", "properties": {"a": inner}, "required": ["a"]}
    tool = {"name": "t", "description": "d", "parameters": schema, "execution": {"kind": "client"}}
    sid = _create(cluster, [tool])["session_id"]
    resp = _send(cluster, sid, "Call t.", tool_choice="required")
    assert resp.status_code == 400, resp.text
    body = resp.json()
    assert body["error"]["code"] == "invalid_tool_schema", body
    assert "minProperties" in body["error"]["message"]
    assert ".cc:" not in body["error"]["message"]
    # Not taken for a dead replica: no retry.
    assert not any(e["kind"] == "model_retry" for e in body["events"])
    assert _get(cluster, sid)["transcript"] == []


def test_a_required_turn_cut_off_by_the_budget_is_no_answer(cluster):
    # Four tokens cannot hold a call under the grammar: the turn fails, nothing is committed.
    sid = _create(cluster, [_tool("lookup_order")], output_reserve_tokens=4)["session_id"]
    resp = _send(cluster, sid, "Where is ORD-98231?", tool_choice="required")
    body = resp.json()
    assert body["status"] == "failed", body
    assert body["error"]["code"] == "invalid_tool_call"
    assert "limits.output_reserve_tokens" in body["error"]["message"]
    assert not any(e["kind"] == "final" for e in body["events"])
    assert _get(cluster, sid)["transcript"] == []
