"""OpenAI-compatible HTTP API against the real 2-replica cluster.

Uses the unmodified `openai` client where clients would, and raw httpx where
the test is about status codes and error bodies.
"""

from __future__ import annotations

import inspect
import json

import jsonschema
import pytest

pytestmark = pytest.mark.integration


def required_grammar_allows_one_call() -> bool:
    """Whether vLLM's `tool_choice: required` grammar honours `parallel_tool_calls: false` (an array of at
    most one call): vLLM 0.32 does; 0.29, the `gpu` extra's release, only keeps the first call after parsing."""
    from vllm.tool_parsers import utils

    schema_of_tools = getattr(utils, "_get_json_schema_from_tools", None)
    return schema_of_tools is None or "parallel_tool_calls" in inspect.signature(schema_of_tools).parameters

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                # A pattern, not maxLength: the grammar lets a JSON string hold any `\uXXXX`
                # escape, and a lone surrogate from a random-weight model makes vLLM's
                # pydantic parse of `required` output fail, which drops the call silently.
                "city": {"type": "string", "pattern": "^[A-Za-z ]{1,24}$"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup_order",
        "description": "Find an order by id.",
        "parameters": {
            "type": "object",
            "properties": {"order_id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"}},
            "required": ["order_id"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_TOOL, LOOKUP_TOOL)}


def test_models_lists_the_served_model(openai_client, cluster):
    assert [m.id for m in openai_client.models.list().data] == [cluster.model_id]


def test_health(cluster):
    body = cluster.client.get("/health", timeout=10).json()
    assert body == {"status": "ok", "models": [cluster.model_id]}


def test_chat_completion_reports_replica_and_cached_tokens(openai_client, cluster):
    raw = openai_client.chat.completions.with_raw_response.create(
        model=cluster.model_id, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8
    )
    completion = raw.parse()
    assert raw.headers["x-warmpath-replica"]
    assert completion.choices[0].message.role == "assistant"
    assert completion.usage.completion_tokens <= 8
    assert completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens >= 0


def test_streamed_chat_completion_ends_with_usage_when_asked(openai_client, cluster):
    stream = openai_client.chat.completions.create(
        model=cluster.model_id, messages=[{"role": "user", "content": "Count to three."}], max_tokens=6, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 6 and chunks[-1].choices == []
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens >= 0
    assert all(c.usage is None for c in chunks[:-1])


def _wait_until_the_router_predicts(cluster, timeout_s: float = 90.0) -> None:
    """Until the ingress's router has its tokenizer and counts predictions (it routes by load before)."""
    import time

    deadline = time.monotonic() + timeout_s
    while cluster.client.get("/v1/router", timeout=30).json()["stats"].get("num_predictions", 0) == 0:
        assert time.monotonic() < deadline, "the router made no prediction"
        cluster.client.post("/v1/chat/completions", json={
            "model": cluster.model_id, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 1}, timeout=120)
        time.sleep(0.5)


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_a_stream_that_did_not_ask_for_usage_has_a_choice_in_every_chunk(openai_client, cluster, kind):
    """As OpenAI's: `chunk.choices[0]` holds for every chunk; the router still counts the call."""
    if cluster.cfg.router.policy == "warmpath":
        _wait_until_the_router_predicts(cluster)
    before = cluster.client.get("/v1/router", timeout=30).json()["stats"].get("num_predictions", 0)
    if kind == "chat":
        stream = openai_client.chat.completions.create(
            model=cluster.model_id, messages=[{"role": "user", "content": "Count."}], max_tokens=4, stream=True)
    else:
        stream = openai_client.completions.create(model=cluster.model_id, prompt="Count.", max_tokens=4, stream=True)
    chunks = list(stream)
    assert chunks and all(c.choices and c.usage is None for c in chunks)
    # As vLLM sends a stream without usage: the fingerprint on the chunk that finishes the choice.
    assert chunks[-1].choices[0].finish_reason is not None and chunks[-1].system_fingerprint
    if cluster.cfg.router.policy == "warmpath":
        assert cluster.client.get("/v1/router", timeout=30).json()["stats"]["num_predictions"] > before


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "lookup_order"}}],
    ids=["required", "named"],
)
def test_tool_call_arguments_validate_against_the_schema(openai_client, cluster, tool_choice):
    if tool_choice == "required" and not required_grammar_allows_one_call():
        # A random-weight model appends calls until max_tokens cuts the array, which then fails to parse.
        pytest.skip("this vLLM's `required` grammar takes any number of calls")
    completion = openai_client.chat.completions.create(
        model=cluster.model_id,
        messages=[
            {"role": "system", "content": "You are a support agent."},
            {"role": "user", "content": "Where is order ORD-1234?"},
        ],
        tools=[WEATHER_TOOL, LOOKUP_TOOL],
        tool_choice=tool_choice,
        # One call: a random-weight model would otherwise append calls until max_tokens cuts the array.
        parallel_tool_calls=False,
        max_tokens=256,
    )
    calls = completion.choices[0].message.tool_calls
    assert calls, completion.choices[0].message
    for call in calls:
        assert call.function.name in SCHEMAS
        if isinstance(tool_choice, dict):
            assert call.function.name == "lookup_order"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_completions_endpoint(openai_client, cluster):
    completion = openai_client.completions.create(model=cluster.model_id, prompt="def main():", max_tokens=5)
    assert completion.choices[0].text
    assert completion.usage.prompt_tokens > 0


def test_repeated_long_prompt_hits_the_prefix_cache(openai_client, cluster):
    system = "\n".join(f"Rule {i}: order ids look like ORD-{1000 + i} and dates like 2026-11-{i % 28 + 1:02d}." for i in range(120))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Summarise the rules."}]
    seen: dict[str, int] = {}
    hits = []
    for _ in range(6):
        raw = openai_client.chat.completions.with_raw_response.create(
            model=cluster.model_id, messages=messages, max_tokens=2
        )
        usage = raw.parse().usage
        assert usage.prompt_tokens > 1000
        replica = raw.headers["x-warmpath-replica"]
        if replica in seen:
            hits.append(usage.prompt_tokens_details.cached_tokens)
        seen[replica] = usage.prompt_tokens
        if len(hits) >= 2:
            break
    assert hits, "the prompt never landed on the same replica twice"
    prompt_tokens = max(seen.values())
    block = cluster.cfg.replicas.block_size_tokens
    assert all(h >= prompt_tokens - block for h in hits), (hits, prompt_tokens)


def test_unknown_model_is_404(openai_client):
    import openai

    with pytest.raises(openai.NotFoundError) as err:
        openai_client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["type"] == "NotFoundError"
    assert "no-such-model" in err.value.body["message"]


@pytest.mark.parametrize("path", ["/v1/no-such-route", "/v1/chat/completions"])
def test_unknown_routes_and_methods_answer_openais_error_shape(cluster, path):
    resp = cluster.client.get(path, timeout=30)
    assert resp.status_code in (404, 405)
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


def test_engine_refusals_reach_the_client_as_their_own_text(openai_client, cluster):
    import openai

    window = cluster.cfg.model.max_model_len_tokens
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.chat.completions.create(
            model=cluster.model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=window * 10)
    error = err.value.body
    assert error["type"] == "BadRequestError" and error["param"] == "max_tokens"
    assert str(window * 10) in error["message"]
    assert "Internal exception" not in error["message"] and "Request ID" not in error["message"]


def test_a_tool_choice_naming_no_tool_is_a_clean_400(openai_client, cluster):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        openai_client.chat.completions.create(
            model=cluster.model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=4, tools=[LOOKUP_TOOL],
            tool_choice={"type": "function", "function": {"name": "no_such_tool"}})
    error = err.value.body
    assert (error["type"], error["param"]) == ("BadRequestError", "tool_choice")
    assert error["message"].startswith("The tool specified in `tool_choice`"), error["message"]


def test_prompt_longer_than_the_context_window_is_400_naming_both_lengths(cluster):
    window = cluster.cfg.model.max_model_len_tokens
    resp = cluster.client.post(
        "/v1/completions",
        json={"model": cluster.model_id, "prompt": "token " * (window + 500), "max_tokens": 4},
        timeout=120,
    )
    assert resp.status_code == 400, resp.text
    assert resp.headers["x-warmpath-replica"]  # the replica that refused it
    message = resp.json()["error"]["message"]
    assert not message.startswith("Message: "), message
    assert str(window) in message
    numbers = [int(n) for n in __import__("re").findall(r"\d+", message)]
    assert any(n > window for n in numbers), message


def test_more_messages_than_the_window_has_tokens_is_a_400_from_the_ingress(cluster):
    """Refused before the messages are validated, each one taking the ingress's event loop a few microseconds."""
    window = cluster.cfg.model.max_model_len_tokens
    messages = [{"role": "user", "content": "a"}] * (window + 1)
    resp = cluster.client.post("/v1/chat/completions", json={"model": cluster.model_id, "messages": messages},
                               timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_parameter", "messages")
    assert f"holds {window + 1} messages" in error["message"] and str(window) in error["message"]
    assert "x-warmpath-replica" not in resp.headers  # no replica saw it


@pytest.mark.parametrize(
    "body, field",
    [
        # No message form fits; the user form, whose role matched, is the one the client meant.
        ({"model": "warmpath-tiny", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"model": "warmpath-tiny", "messages": [{"role": "user", "content": [{"type": "bogus"}]}]},
         "messages[0].content[0].type"),
        ({"model": "warmpath-tiny"}, "messages"),
        ({"model": "warmpath-tiny", "messages": "not a list"}, "messages"),
        ({"model": "warmpath-tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}, "max_tokens"),
        ({"model": "warmpath-tiny", "messages": [{"role": "user", "content": "x"}], "temperature": -3}, "temperature"),
    ],
)
def test_malformed_bodies_are_rejected_with_the_field(cluster, body, field):
    resp = cluster.client.post("/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == field and field in resp.json()["error"]["message"]


def test_a_tool_call_that_is_not_a_function_call_is_refused_as_vllm_refuses_it(cluster):
    """The router forwards the ids it rendered, which skips vLLM's own rendering and its checks, for text-only
    requests; a call of another type is not one of them, so vLLM still sees it and refuses it."""
    call = {"id": "c1", "type": "custom", "custom": {"name": "lookup_order", "input": "ORD-1"},
            "function": {"name": "lookup_order", "arguments": "{}"}}
    messages = [{"role": "user", "content": "where is my order?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "shipped"}]
    resp = cluster.client.post("/v1/chat/completions", json={
        "model": cluster.model_id, "messages": messages, "max_tokens": 2}, timeout=60)
    assert resp.status_code == 400, resp.text
    assert "of type 'function'" in resp.json()["error"]["message"]


def test_a_custom_role_reaches_the_chat_template_as_vllm_takes_it(cluster, openai_client):
    messages = [{"role": "user", "content": "weather?"}, {"role": "ipython", "content": "sunny, 21 C"}]
    reply = openai_client.chat.completions.create(model=cluster.model_id, messages=messages, max_tokens=2)
    plain = openai_client.chat.completions.create(model=cluster.model_id, messages=messages[:1], max_tokens=2)
    assert reply.usage.prompt_tokens > plain.usage.prompt_tokens  # the custom message was rendered, not dropped


@pytest.mark.parametrize("path, body, field", [
    ("/v1/chat/completions", '{"model":"warmpath-tiny","messages":[{"role":"user","content":"a\\ud800"}],"max_tokens":2}',
     "messages[0].content"),
    ("/v1/completions", '{"model":"warmpath-tiny","prompt":"a\\udc00","max_tokens":2}', "prompt"),
])
def test_text_that_is_not_valid_unicode_is_a_400_naming_the_field(cluster, path, body, field):
    resp = cluster.client.post(path, content=body.encode(), headers={"content-type": "application/json"}, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == field and "not valid Unicode" in error["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_the_grammar_cannot_compile_is_a_400_without_the_compilers_log_prefix(cluster, stream):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}
    resp = cluster.client.post("/v1/chat/completions", json={
        "model": cluster.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream,
        "tools": [tool], "tool_choice": "required"}, timeout=60)
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    assert message.startswith("Failed to transform json schema into a grammar: ") and ".cc:" not in message


def test_tokenize_and_detokenize_round_trip(cluster):
    tokens = cluster.client.post("/tokenize", json={"model": cluster.model_id, "prompt": "hello world"}, timeout=30)
    assert tokens.status_code == 200, tokens.text
    ids = tokens.json()["tokens"]
    assert ids and tokens.json()["count"] == len(ids)
    text = cluster.client.post("/detokenize", json={"model": cluster.model_id, "tokens": ids}, timeout=30)
    assert text.status_code == 200 and text.json()["prompt"] == "hello world", text.text


def test_invalid_json_is_400_or_422(cluster):
    resp = cluster.client.post(
        "/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert resp.status_code in (400, 422)


def test_replicas_survive_bad_input(openai_client, cluster):
    """Runs after the error cases: both replicas still answer."""
    served = set()
    for i in range(8):
        raw = openai_client.chat.completions.with_raw_response.create(
            model=cluster.model_id, messages=[{"role": "user", "content": f"ping {i}"}], max_tokens=2
        )
        served.add(raw.headers["x-warmpath-replica"])
    assert served
