"""What the gRPC API promises in its proto comments and README, beyond the field mapping."""

from __future__ import annotations

import asyncio
import copy

import grpc
import pytest
from pydantic import ValidationError

from serve_apps.grpc_status import ProxyHealthServicer, RpcFailure
from serve_apps.ingress_grpc import (
    REPLAY_METADATA,
    GrpcIngress,
    chat_response_to_proto,
    create_session_body,
)
from serve_apps.orchestrator.models import TURN_INTERRUPTED, CreateSessionRequest
from warmpath.v1 import agent_pb2


@pytest.mark.parametrize("parameters_json", ["null", "[]", '"x"'])
def test_a_tool_schema_that_is_not_an_object_is_refused_as_over_http(parameters_json):
    tool = agent_pb2.Tool(name="t", parameters_json=parameters_json, client=agent_pb2.ClientExecution())
    with pytest.raises(ValidationError) as info:
        CreateSessionRequest.model_validate(create_session_body(agent_pb2.CreateSessionRequest(model="m", tools=[tool])))
    assert any(".".join(map(str, e["loc"])).startswith("tools.0.parameters") for e in info.value.errors())


def test_an_empty_tool_schema_still_means_the_default():
    tool = agent_pb2.Tool(name="t", client=agent_pb2.ClientExecution())
    assert "parameters" not in create_session_body(agent_pb2.CreateSessionRequest(model="m", tools=[tool]))["tools"][0]


def test_content_is_unset_when_the_model_only_called_tools():
    response = {
        "id": "c", "model": "m",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}],
    }
    assert not chat_response_to_proto(response, "r").HasField("content")
    spoken = copy.deepcopy(response)
    spoken["choices"][0]["message"]["content"] = "hi"
    assert chat_response_to_proto(spoken, "r").content == "hi"
    # An empty answer without calls is an answer: content set to "", as HTTP's `"content": ""`.
    silent = copy.deepcopy(response)
    silent["choices"][0]["message"].update(content="", tool_calls=[])
    assert chat_response_to_proto(silent, "r").HasField("content")


class _Context:
    def __init__(self):
        self.trailing = []
        self.code = None

    def set_trailing_metadata(self, metadata):
        self.trailing = list(metadata)

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        pass


class _Rpc:
    def record(self, status, message=""):
        pass


def _turn_events(items, broken: Exception | None = None):
    async def stream():
        for item in items:
            yield item
        if broken is not None:
            raise broken

    async def collect(context):
        return [event async for event in GrpcIngress._turn_events(None, stream(), context, _Rpc())]

    return collect


def test_a_replayed_turn_says_so_in_its_trailing_metadata():
    context = _Context()
    final = {"kind": "final", "message": {"role": "assistant", "content": "hi"}}
    events = asyncio.run(_turn_events([{"status": 200, "is_replay": True}, final])(context))
    assert len(events) == 1 and context.trailing == [(REPLAY_METADATA, "true")]
    fresh = _Context()
    asyncio.run(_turn_events([{"status": 200}, final])(fresh))
    assert fresh.trailing == []


def test_a_turn_stream_that_breaks_off_is_interrupted_as_over_http():
    from ray.exceptions import RayActorError

    collect = _turn_events([{"status": 200}, {"kind": "delta", "text": "He"}], broken=RayActorError())
    with pytest.raises(RpcFailure) as info:
        asyncio.run(collect(_Context()))
    failure = info.value
    assert (failure.status, failure.code) == (grpc.StatusCode.UNAVAILABLE, TURN_INTERRUPTED["code"])
    assert "may or may not have committed" in failure.message


def test_health_list_is_unimplemented_with_a_readable_message():
    class AbortingContext:
        async def abort(self, code, details):
            raise RuntimeError(f"{code.name}: {details}")

    servicer = ProxyHealthServicer([], ray_healthz=None)
    with pytest.raises(RuntimeError, match="UNIMPLEMENTED: use Check; List is not served by the proxy"):
        asyncio.run(servicer.List(None, AbortingContext()))


def test_a_request_over_the_size_limit_is_refused_before_its_key_is_checked():
    from tests.unit.serve_apps.test_grpc_mapping import FakeContext, FakeHandle

    limit = 1024
    settings = {"access": {"is_auth_enabled": True, "max_request_bytes": limit}, "redis_url": "redis://127.0.0.1:1/0"}
    ingress = GrpcIngress(FakeHandle(), FakeHandle(), "warmpath-tiny", settings)
    context = FakeContext()  # no key: the size is refused first, as HTTP's 413 comes before its 401
    response = asyncio.run(ingress.GetSession(agent_pb2.GetSessionRequest(session_id="x" * (limit + 1)), context))
    assert response == agent_pb2.GetSessionResponse()
    assert context.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert context.details.startswith(f"the request is {limit + 4} bytes; the limit is {limit}")

    async def first_event():
        stream = ingress.SendMessage(agent_pb2.SendMessageRequest(session_id="s", content="y" * limit), context)
        return [event async for event in stream]

    (event,) = asyncio.run(first_event())
    assert event.error.code == "request_too_large" and context.code is grpc.StatusCode.RESOURCE_EXHAUSTED


def test_every_ray_node_starts_with_the_grpc_proxy_message_limit():
    from cluster.config import load_config
    from cluster.k8s_render import rayservice_patch_ops
    from cluster.serve_config import GRPC_PROXY_MAX_MESSAGE_BYTES, grpc_proxy_env

    cfg = load_config(environ={})
    assert grpc_proxy_env(cfg) == {"RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(GRPC_PROXY_MAX_MESSAGE_BYTES)}
    env_ops = [op for op in rayservice_patch_ops(cfg) if op["path"].endswith("/env/-")]
    limits = [op for op in env_ops if op["value"]["name"] == "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"]
    assert {op["path"].split("/")[3] for op in limits} == {"headGroupSpec", "workerGroupSpecs"}
