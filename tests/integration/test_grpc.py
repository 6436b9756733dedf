"""gRPC API against the real cluster: Ray Serve's gRPC proxy on loopback, real grpcio client."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.integration.conftest import LOOKUP_SCHEMA
from warmpath.v1 import agent_pb2, agent_pb2_grpc, inference_pb2, inference_pb2_grpc

pytestmark = pytest.mark.integration


def _request(cluster, content="hello over grpc", max_tokens=6):
    return inference_pb2.ChatCompletionRequest(
        model=cluster.model_id, messages=[inference_pb2.ChatMessage(role="user", content=content)], max_tokens=max_tokens
    )


def test_health_and_reflection(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "warmpath.v1.Inference", "warmpath.v1.Agent"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    services = {s.name for answer in answers for s in answer.list_services_response.service}
    assert {"warmpath.v1.Inference", "warmpath.v1.Agent"} <= services


def test_unary_and_streamed_chat_completion(channel, metadata, cluster):
    stub = inference_pb2_grpc.InferenceStub(channel)
    reply = stub.ChatCompletion(_request(cluster), metadata=metadata, timeout=120)
    assert reply.content and reply.replica_id
    assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens == 6
    chunks = list(stub.StreamChatCompletion(_request(cluster), metadata=metadata, timeout=120))
    assert "".join(c.content for c in chunks)
    assert chunks[-1].usage.completion_tokens == 6


def test_an_assistant_messages_reasoning_is_taken_by_the_engine(channel, metadata, cluster):
    """The engine takes `reasoning` on an assistant message; a model served without a reasoning parser answers
    none."""
    stub = inference_pb2_grpc.InferenceStub(channel)
    request = _request(cluster, "and once more")
    request.messages.insert(0, inference_pb2.ChatMessage(role="user", content="hello"))
    request.messages.insert(1, inference_pb2.ChatMessage(role="assistant", content="hi", reasoning="Greet back."))
    reply = stub.ChatCompletion(request, metadata=metadata, timeout=120)
    assert reply.content and not reply.HasField("reasoning")
    assert all(not chunk.reasoning for chunk in stub.StreamChatCompletion(request, metadata=metadata, timeout=120))


def test_structured_output_and_stop_texts(channel, metadata, cluster):
    stub = inference_pb2_grpc.InferenceStub(channel)
    schema = {"type": "object", "properties": {"order_id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"}},
              "required": ["order_id"], "additionalProperties": False}
    request = _request(cluster, "Which order?", max_tokens=64)
    request.response_format.CopyFrom(inference_pb2.ResponseFormat(
        type="json_schema", name="order", schema_json=json.dumps(schema), strict=True))
    request.seed, request.top_p = 7, 0.9
    reply = stub.ChatCompletion(request, metadata=metadata, timeout=120)
    jsonschema.validate(json.loads(reply.content), schema)  # decoded under the schema's grammar
    # A JSON object's text starts with "{", whatever is sampled: the stop text ends it at once.
    stopped = _request(cluster, "Any object.", max_tokens=32)
    stopped.response_format.type = "json_object"
    stopped.stop.append("{")
    reply = stub.ChatCompletion(stopped, metadata=metadata, timeout=120)
    assert (reply.finish_reason, reply.content) == ("stop", "")


def test_agent_session_with_a_tool(channel, metadata, cluster, tool_server):
    agent = agent_pb2_grpc.AgentStub(channel)
    created = agent.CreateSession(agent_pb2.CreateSessionRequest(
        model=cluster.model_id, system_prompt="You are a support agent.",
        tools=[agent_pb2.Tool(name="lookup_order", description="Look up an order.", parameters_json=json.dumps(LOOKUP_SCHEMA),
                              http=agent_pb2.HttpExecution(url=f"{tool_server}/lookup", timeout_s=5))],
        limits=agent_pb2.SessionLimits(output_reserve_tokens=64),
    ), metadata=metadata, timeout=60)
    events = list(agent.SendMessage(
        agent_pb2.SendMessageRequest(session_id=created.session_id, content="Where is ORD-98231?", tool_choice="required"),
        metadata=metadata, timeout=300,
    ))
    kinds = [e.WhichOneof("event") for e in events]
    assert "tool_call" in kinds and "tool_result" in kinds and kinds[-1] == "final", kinds
    state = agent.GetSession(agent_pb2.GetSessionRequest(session_id=created.session_id), metadata=metadata, timeout=60)
    assert [m.role for m in state.transcript] == ["user", "assistant", "tool", "assistant"]
    agent.DeleteSession(agent_pb2.DeleteSessionRequest(session_id=created.session_id), metadata=metadata, timeout=60)
    with pytest.raises(grpc.RpcError) as err:
        agent.GetSession(agent_pb2.GetSessionRequest(session_id=created.session_id), metadata=metadata, timeout=60)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_error_codes(channel, metadata, cluster):
    agent = agent_pb2_grpc.AgentStub(channel)
    stub = inference_pb2_grpc.InferenceStub(channel)

    with pytest.raises(grpc.RpcError) as err:
        agent.CreateSession(agent_pb2.CreateSessionRequest(
            model=cluster.model_id,
            tools=[agent_pb2.Tool(name="x", description="d", parameters_json='{"type": "nope"}', client=agent_pb2.ClientExecution())],
        ), metadata=metadata, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("tools[0].parameters: ") and "\n" not in err.value.details()

    with pytest.raises(grpc.RpcError) as err:
        agent.CreateSession(agent_pb2.CreateSessionRequest(model="no-such-model"), metadata=metadata, timeout=60)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "no-such-model" in err.value.details()

    # A session paused on a client tool refuses a new message until the results arrive.
    created = agent.CreateSession(agent_pb2.CreateSessionRequest(
        model=cluster.model_id,
        tools=[agent_pb2.Tool(name="lookup_order", description="d", parameters_json=json.dumps(LOOKUP_SCHEMA), client=agent_pb2.ClientExecution())],
        limits=agent_pb2.SessionLimits(output_reserve_tokens=64),
    ), metadata=metadata, timeout=60)
    first = list(agent.SendMessage(agent_pb2.SendMessageRequest(session_id=created.session_id, content="x", tool_choice="required"),
                                   metadata=metadata, timeout=300))
    assert first[-1].WhichOneof("event") == "requires_action"
    with pytest.raises(grpc.RpcError) as err:
        list(agent.SendMessage(agent_pb2.SendMessageRequest(session_id=created.session_id, content="y"), metadata=metadata, timeout=60))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    too_long = _request(cluster, content="token " * (cluster.cfg.model.max_model_len_tokens + 100), max_tokens=4)
    with pytest.raises(grpc.RpcError) as err:
        stub.ChatCompletion(too_long, metadata=metadata, timeout=120)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and str(cluster.cfg.model.max_model_len_tokens) in err.value.details()
    assert "Internal exception" not in err.value.details() and "Request ID" not in err.value.details()

    window = cluster.cfg.model.max_model_len_tokens
    too_many = _request(cluster, content="a")
    too_many.messages.extend([inference_pb2.ChatMessage(role="user", content="a")] * window)
    with pytest.raises(grpc.RpcError) as err:
        stub.ChatCompletion(too_many, metadata=metadata, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"messages: the request holds {window + 1} messages"), err.value.details()

    with pytest.raises(grpc.RpcError) as err:
        stub.ChatCompletion(_request(cluster, max_tokens=64), metadata=metadata, timeout=0.001)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


LOOKUP_TOOL = inference_pb2.FunctionTool(name="lookup_order", description="Look up an order.", parameters_json=json.dumps(LOOKUP_SCHEMA))
NAMED_NOPE = {"type": "function", "function": {"name": "nope"}}


def _failures(stub, request, metadata) -> list[tuple[grpc.StatusCode, str, str | None]]:
    """(code, details, text of the last message) of `request` refused by ChatCompletion and by StreamChatCompletion
    (a unary call has no messages: None)."""
    with pytest.raises(grpc.RpcError) as err:
        stub.ChatCompletion(request, metadata=metadata, timeout=120)
    unary = (err.value.code(), err.value.details(), None)
    chunks = []
    with pytest.raises(grpc.RpcError) as err:
        for chunk in stub.StreamChatCompletion(request, metadata=metadata, timeout=120):
            chunks.append(chunk)
    return [unary, (err.value.code(), err.value.details(), chunks[-1].error.message if chunks else "")]


@pytest.mark.parametrize(
    "tool_choice, tools, http_tool_choice, phrase",
    [
        ("bogus", [], None, "`tools` must be set"),
        ("", [], None, "`tools` must be set"),
        ("required", [], "required", "`tools` must be set"),
        ("nope", [LOOKUP_TOOL], NAMED_NOPE, "does not match any of the specified `tools`"),
    ],
    ids=["bogus", "empty", "required-without-tools", "unknown-tool"],
)
def test_invalid_tool_choice_is_invalid_argument_as_over_http(channel, metadata, cluster, tool_choice, tools, http_tool_choice, phrase):
    stub = inference_pb2_grpc.InferenceStub(channel)
    request = _request(cluster)
    request.tool_choice = tool_choice
    request.tools.extend(tools)
    for code, details, last_message in _failures(stub, request, metadata):
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert phrase in details and "\n" not in details and "Internal" not in details
        assert last_message is None or last_message == details  # a stream's error frame says the same
    if http_tool_choice is not None:  # the same request in OpenAI form: the same refusal over HTTP
        body = {"model": cluster.model_id, "messages": [{"role": "user", "content": "hello over grpc"}], "max_tokens": 6,
                "tool_choice": http_tool_choice}
        if tools:
            body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                               "parameters": json.loads(t.parameters_json)}} for t in tools]
        resp = cluster.client.post("/v1/chat/completions", json=body, timeout=60)
        assert resp.status_code == 400 and resp.json()["error"]["message"] == details


@pytest.mark.parametrize("parameters_json, kind", [("[1, 2]", "an array"), ("5", "a number")])
def test_tool_schema_that_is_not_an_object_is_one_line_naming_the_field(channel, metadata, cluster, parameters_json, kind):
    stub = inference_pb2_grpc.InferenceStub(channel)
    request = _request(cluster)
    request.tools.append(inference_pb2.FunctionTool(name="x", description="d", parameters_json=parameters_json))
    message = f"tools[0].parameters_json: must be a JSON object (a JSON Schema), not {kind}"
    assert _failures(stub, request, metadata) == [(grpc.StatusCode.INVALID_ARGUMENT, message, None),
                                                  (grpc.StatusCode.INVALID_ARGUMENT, message, message)]


def test_a_huge_session_id_is_not_found_and_not_echoed(channel, metadata):
    agent = agent_pb2_grpc.AgentStub(channel)
    session_id = "x" * 100_000
    calls = [
        lambda: agent.GetSession(agent_pb2.GetSessionRequest(session_id=session_id), metadata=metadata, timeout=60),
        lambda: agent.DeleteSession(agent_pb2.DeleteSessionRequest(session_id=session_id), metadata=metadata, timeout=60),
        lambda: list(agent.SendMessage(agent_pb2.SendMessageRequest(session_id=session_id, content="hi"), metadata=metadata, timeout=60)),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.NOT_FOUND, err.value.details()
        # What is no session id is not quoted back (megabytes of it were), nor put on a span or looked up.
        assert "not a session id this service issues" in err.value.details() and "xxxx" not in err.value.details()


@pytest.mark.parametrize("method, is_streamed", [
    ("/warmpath.v1.Inference/ChatCompletion", False),
    ("/warmpath.v1.Agent/SendMessage", True),
])
def test_bytes_that_are_no_request_message_are_invalid_argument(channel, metadata, method, is_streamed):
    corrupt = b"\xff\xff\xff\xff\x0f"  # a field key whose varint never ends
    call = (channel.unary_stream if is_streamed else channel.unary_unary)(method)  # raw bytes in and out
    with pytest.raises(grpc.RpcError) as info:
        answer = call(corrupt, metadata=metadata, timeout=60)
        list(answer) if is_streamed else answer
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    request_type = "ChatCompletionRequest" if "Inference" in method else "SendMessageRequest"
    assert info.value.details().startswith(f"the request is not a valid warmpath.v1.{request_type} message: ")
