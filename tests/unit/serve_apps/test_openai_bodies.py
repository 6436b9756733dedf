"""A field of the wrong type on the OpenAI routes is a 400 naming it, through the real FastAPI app.

vLLM's `mode="before"` validators raised TypeError/AttributeError on such bodies, which pydantic let
through: FastAPI answered 500 with Ray's wrapping and the Python error, and the OpenAI client retried it.
"""

from __future__ import annotations

import logging

import openai
import pytest
from fastapi.testclient import TestClient

from cluster.config import AccessConfig
from serve_apps.access import GuardSettings
from serve_apps.builders import ingress_app
from serve_apps.ingress_http import ENDPOINTS, WarmpathIngress

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def client():
    """The ingress' app, its routes bound to an ingress whose replicas are never reached."""
    ingress = object.__new__(WarmpathIngress)

    async def get_response(body, call_method, raw_request):
        raise AssertionError(f"a refused body reached the replicas: {body}")
        yield  # pragma: no cover - a generator, as the real one

    ingress._get_response = get_response
    ingress._default_serve_handles = {"m": None}
    ingress._model_cards = {"m": None}
    ingress._orchestrator = None
    app = ingress_app(GuardSettings(access=AccessConfig(is_auth_enabled=False)))
    for name, route in ENDPOINTS.items():
        route(app)(getattr(ingress, name))
    logging.disable(logging.ERROR)
    try:
        yield TestClient(app, raise_server_exceptions=False)
    finally:
        logging.disable(logging.NOTSET)


@pytest.mark.parametrize("route, body, param", [
    ("/v1/chat/completions", {"model": "m", "messages": 5}, "messages"),
    ("/v1/chat/completions", {"model": "m", "messages": HI, "structured_outputs": "x"}, "structured_outputs"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "assistant", "content": "x", "tool_calls": 5}]},
     "messages[0].tool_calls"),
    ("/v1/chat/completions", {"model": "m", "messages": HI, "tools": ["abc"]}, "tools[0]"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "structured_outputs": 5}, "structured_outputs"),
    # A bad entry of an assistant's tool calls, named where it sits (it was `[0]`: vLLM validates the
    # list lazily, so pydantic's location started at the list).
    ("/v1/chat/completions", {"model": "m", "messages": [*HI, {"role": "assistant", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": 5, "arguments": "{}"}}]}]},
     "messages[1].tool_calls[0].function.name"),
    # A shape no check foresees: still the body's fault, said without a parameter.
    ("/v1/chat/completions", {"model": "m", "messages": HI, "tools": [{"type": "function"}],
                              "tool_choice": {"type": "function", "function": {"name": "f"}}}, None),
    # A true/false field given text: pydantic's lax mode read "yes" as true (`"stream": "yes"` streamed).
    ("/v1/chat/completions", {"model": "m", "messages": HI, "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"model": "m", "messages": HI, "logprobs": "on"}, "logprobs"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "echo": 1}, "echo"),
    # A tool choice that is neither a word nor an object: vLLM's check answered "tools must be set".
    ("/v1/chat/completions", {"model": "m", "messages": HI, "tool_choice": 5}, "tool_choice"),
], ids=["messages", "structured-outputs", "tool-calls", "tool", "completion", "tool-call-entry", "unforeseen",
        "stream-text", "logprobs-text", "echo-number", "tool-choice-number"])
def test_a_field_of_the_wrong_type_is_a_400_naming_it(client, route, body, param):
    response = client.post(route, json=body)
    error = response.json()["error"]
    assert (response.status_code, error["code"], error["param"]) == (400, "invalid_parameter", param)
    assert "Internal" not in error["message"] and "Request ID" not in error["message"]


def test_the_openai_client_is_told_once_and_the_schema_keeps_vllms_names(client):
    sent = []
    client.event_hooks["request"] = [sent.append]
    with pytest.raises(openai.BadRequestError):
        openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client).chat.completions.create(
            model="m", messages=5)
    assert len(sent) == 1  # a 500 was retried twice
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    assert {"ChatCompletionRequest", "CompletionRequest"} <= set(schemas)


def test_fields_a_completion_does_not_have_are_not_checked_on_it():
    """vLLM's completion request ignores chat fields; refusing their shape there would refuse what vLLM takes."""
    from serve_apps import openai_bodies

    body = {"model": "m", "prompt": "hi", "tools": ["abc"], "messages": [{"role": "assistant", "tool_calls": "x"}]}
    assert openai_bodies.CompletionRequest.model_validate(body).prompt == "hi"


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded"])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/sessions"])
def test_a_json_body_sent_without_a_json_content_type_is_told_so(client, route, content_type):
    """curl's `-d` sends a form: FastAPI did not read the JSON, and the refusal said "Input should be a valid
    dictionary" of a body that was one."""
    headers = {"content-type": content_type} if content_type else {}
    response = client.post(route, content=b'{"model": "m", "messages": []}', headers=headers)
    error = response.json()["error"]
    assert (response.status_code, error["code"]) == (400, "invalid_json")
    assert "content-type: application/json" in error["message"]


def test_a_custom_tool_call_is_left_to_vllms_validation():
    """Only function calls have `function`; a custom call (which vLLM takes) was refused as lacking one."""
    from serve_apps import openai_bodies

    call = {"id": "c", "type": "custom", "custom": {"name": "f", "input": "x"}}
    body = {"model": "m", "messages": [*HI, {"role": "assistant", "content": None, "tool_calls": [call]}]}
    assert len(openai_bodies.ChatCompletionRequest.model_validate(body).messages) == 2


@pytest.fixture
def window_of_four():
    from serve_apps import openai_bodies

    openai_bodies.limit_items(4)
    yield 4
    openai_bodies.limit_items(None)


@pytest.mark.parametrize("field, body", [
    ("messages", {"model": "m", "messages": HI * 5}),
    ("tools", {"model": "m", "messages": HI, "tools": [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}} for i in range(5)]}),
])
def test_more_messages_or_tools_than_the_window_has_tokens_is_a_400_before_they_are_validated(
        client, window_of_four, field, body):
    """Each renders to a token at least, so such a request can never fit; validating 100,000 one-letter messages
    held the ingress's event loop for a second or more."""
    response = client.post("/v1/chat/completions", json=body)
    error = response.json()["error"]
    assert (response.status_code, error["code"], error["param"]) == (400, "invalid_parameter", field)
    assert error["message"] == (f"{field}: the request holds 5 {field}; the model's context window is 4 tokens, "
                                f"and each of its {field} takes one at least")


def test_a_request_at_the_window_and_one_without_a_window_pass(window_of_four):
    from serve_apps import openai_bodies

    assert len(openai_bodies.ChatCompletionRequest.model_validate({"model": "m", "messages": HI * 4}).messages) == 4
    openai_bodies.limit_items(None)
    assert len(openai_bodies.ChatCompletionRequest.model_validate({"model": "m", "messages": HI * 50}).messages) == 50
