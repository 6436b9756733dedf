"""warmpath's gRPC services as the proxy registers them (`serve_apps.grpc_decoding`): the generated handlers,
but a request that does not decode reaches the ingress, which answers INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio
import pickle
from types import SimpleNamespace

import grpc
import pytest
from warmpath.v1 import agent_pb2, agent_pb2_grpc, inference_pb2, inference_pb2_grpc

from serve_apps.grpc_decoding import UndecodableRequest, add_agent_servicer, add_inference_servicer

CORRUPT = b"\xff\xff\xff\xff\x0f"  # a field key whose varint never ends


class RecordingServer:
    """What a grpc server is told by a servicer function: its generic handlers and registered methods."""

    def __init__(self) -> None:
        self.generic: list = []
        self.registered: dict[str, dict] = {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        self.generic += handlers

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.registered[service] = handlers


class AnyServicer:
    """Each method answers its own name."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda request, context: name


@pytest.mark.parametrize("ours, generated", [
    (add_inference_servicer, inference_pb2_grpc.add_InferenceServicer_to_server),
    (add_agent_servicer, agent_pb2_grpc.add_AgentServicer_to_server),
])
def test_the_handlers_are_the_generated_ones_but_for_a_request_that_does_not_decode(ours, generated):
    servicer = AnyServicer()
    mine, theirs = RecordingServer(), RecordingServer()
    ours(servicer, mine)
    generated(servicer, theirs)
    assert mine.registered.keys() == theirs.registered.keys()
    (service,) = theirs.registered
    assert mine.registered[service].keys() == theirs.registered[service].keys()
    assert mine.generic[0].service_name() == theirs.generic[0].service_name() == service
    for name, handler in theirs.registered[service].items():
        got = mine.registered[service][name]
        assert (got.request_streaming, got.response_streaming) == (handler.request_streaming, handler.response_streaming)
        assert got.response_serializer == handler.response_serializer
        assert (got.unary_unary or got.unary_stream)(None, None) == name
        request_type = handler.request_deserializer(b"")
        valid = type(request_type)().SerializeToString()
        assert got.request_deserializer(valid) == handler.request_deserializer(valid)
        with pytest.raises(Exception):
            handler.request_deserializer(CORRUPT)
        undecodable = got.request_deserializer(CORRUPT)
        assert undecodable == UndecodableRequest(type(request_type).DESCRIPTOR.full_name, undecodable.detail,
                                                 len(CORRUPT))
        assert "parsing message" in undecodable.detail
        assert pickle.loads(pickle.dumps(undecodable)) == undecodable  # the proxy pickles it to the replica


@pytest.mark.parametrize("has_key", [True, False])
def test_the_ingress_answers_an_undecodable_request_invalid_argument_after_its_key(has_key):
    """Checked before the key, a malformed request without one was 400 over gRPC and 401 over HTTP, which reads
    a body only after its key; a size over the limit is refused before the key on both."""
    from serve_apps import ingress_grpc
    from serve_apps.access import AccessDenied

    async def admit_call(metadata):
        if not has_key:
            raise AccessDenied(401, "missing_api_key", "no API key")
        return SimpleNamespace(key_id="k1")

    ingress = object.__new__(ingress_grpc.GrpcIngress)
    ingress._loopback_callers_only = False  # keys on: any machine may call
    ingress._guard = SimpleNamespace(settings=SimpleNamespace(access=SimpleNamespace(max_request_bytes=1000)),
                                     admit_call=admit_call)
    context = SimpleNamespace(
        invocation_metadata=lambda: [], set_code=lambda code: seen.setdefault("code", code),
        set_details=lambda details: seen.setdefault("details", details),
        set_trailing_metadata=lambda metadata: None,
    )
    seen: dict = {}
    expected = grpc.StatusCode.INVALID_ARGUMENT if has_key else grpc.StatusCode.UNAUTHENTICATED
    request = UndecodableRequest("warmpath.v1.GetSessionRequest", "Error parsing message", 12)
    asyncio.run(ingress._unary("warmpath.v1.Agent", "GetSession", context, request, lambda caller: None,
                               agent_pb2.GetSessionResponse()))
    assert seen["code"] == expected
    if has_key:
        assert seen["details"] == ("the request is not a valid warmpath.v1.GetSessionRequest message: "
                                   "Error parsing message")
    seen.clear()
    chunks = []

    async def stream(request):
        async for chunk in ingress._streamed("warmpath.v1.Inference", "StreamChatCompletion", context, request,
                                             lambda caller, rpc: pytest.fail("streamed"), ingress_grpc.error_chunk):
            chunks.append(chunk)

    asyncio.run(stream(UndecodableRequest("warmpath.v1.ChatCompletionRequest", "corrupt", 12)))
    assert seen["code"] == expected
    assert chunks[-1].error.code == ("invalid_parameter" if has_key else "missing_api_key")  # as over HTTP
    assert isinstance(chunks[-1], inference_pb2.ChatCompletionChunk)
    seen.clear()
    asyncio.run(stream(UndecodableRequest("warmpath.v1.ChatCompletionRequest", "corrupt", 1001)))
    assert seen["code"] == grpc.StatusCode.RESOURCE_EXHAUSTED  # over the size limit, with or without a key
