"""A create-session body is checked off the ingress's event loop (its tool schemas take seconds at megabytes),
and refused as FastAPI refuses a body that fails its model: a 400 naming the field."""

from __future__ import annotations

import asyncio
import time

import pytest
from fastapi.exceptions import RequestValidationError

from serve_apps import ingress_http
from serve_apps.api_errors import validation_error_body
from serve_apps.ingress_http import CreateSessionBody
from serve_apps.orchestrator.models import CreateSessionRequest
from tests.unit.loop_ticks import with_loop_ticks


def test_a_valid_body_becomes_the_request_model():
    body = CreateSessionBody({"model": "m", "system_prompt": "You help."})
    request = asyncio.run(ingress_http._validated_off_loop(body))
    assert request == CreateSessionRequest(model="m", system_prompt="You help.")


def test_an_invalid_body_is_refused_naming_the_field_as_fastapi_would():
    body = CreateSessionBody({"model": "m", "tools": [
        {"name": "t", "parameters": {"type": "string"}, "execution": {"kind": "client"}}]})
    with pytest.raises(RequestValidationError) as info:
        asyncio.run(ingress_http._validated_off_loop(body))
    error = validation_error_body(info.value.errors())["error"]
    assert (error["code"], error["param"]) == ("invalid_parameter", "tools[0].parameters")
    assert 'needs "type": "object"' in error["message"]


def test_checking_a_body_leaves_the_event_loop_free(monkeypatch):
    real = CreateSessionRequest.model_validate

    def slow(value):
        time.sleep(0.3)  # a body of megabytes of tool schemas
        return real(value)

    monkeypatch.setattr(ingress_http.CreateSessionRequest, "model_validate", slow)

    _, ticks = asyncio.run(with_loop_ticks(ingress_http._validated_off_loop(CreateSessionBody({"model": "m"}))))
    assert ticks >= 10


def test_the_api_documents_the_body_as_the_request_model():
    from fastapi import FastAPI
    from ray.llm._internal.serve.core.ingress.ingress import make_fastapi_ingress

    app = FastAPI()
    make_fastapi_ingress(ingress_http.WarmpathIngress, endpoint_map=ingress_http.ENDPOINTS, app=app)
    schemas = app.openapi()["components"]["schemas"]
    assert schemas["CreateSessionBody"] == {"$ref": "#/components/schemas/CreateSessionRequest"}
    assert "tools" in schemas["CreateSessionRequest"]["properties"]
