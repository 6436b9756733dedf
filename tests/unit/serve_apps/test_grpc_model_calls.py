"""gRPC Inference calls settle their routing decision as the HTTP ingress does: the call's own decision
(by both of Serve's request ids), recorded in the metrics with the last usage the engine sent, or
withdrawn when the engine refused the call before any output."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import grpc
import pytest
import ray.serve.context
from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionResponse, ErrorInfo, ErrorResponse

from router import decision_log
from router.types import Decision
from serve_apps import ingress_grpc, metrics
from serve_apps.vllm_replica import ServedBy
from tests.unit.serve_apps.test_grpc_mapping import OPENAI_RESPONSE, FakeContext, FakeHandle, _items
from warmpath.v1 import agent_pb2, inference_pb2

CLIENT_REQUEST_ID = "client-chosen-id"  # two calls in flight share it: each has its own internal id


class _Recorded:
    """What `WarmpathMetrics` was asked to record."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def record_usage(self, replica_id, prompt_tokens, cached_tokens):
        self.calls.append(("usage", replica_id, prompt_tokens, cached_tokens))

    def record_decision(self, reason, predicted_tokens, actual_tokens, block_size_tokens):
        self.calls.append(("decision", reason, predicted_tokens, actual_tokens))


@pytest.fixture
def recorded(monkeypatch) -> _Recorded:
    spy = _Recorded()
    monkeypatch.setattr(metrics.WarmpathMetrics, "get", classmethod(lambda cls: spy))
    return spy


@pytest.fixture
def two_decisions(monkeypatch):
    """A decision for this call (internal id "mine") and one for another call sharing its client request id."""
    def logged(reason, replica):
        decision = Decision(ranked_tiers=[[replica]], reason=reason, predicted_cached_tokens={replica: 64}, scores={})
        return decision_log.LoggedDecision(decision=decision, start_ns=0, end_ns=1)

    decision_log.DECISIONS.put(CLIENT_REQUEST_ID, "mine", logged("prefix-hit", "replica-a"))
    decision_log.DECISIONS.put(CLIENT_REQUEST_ID, "theirs", logged("cold", "replica-b"))
    context = SimpleNamespace(request_id=CLIENT_REQUEST_ID, _internal_request_id="mine", route="", app_name="")
    monkeypatch.setattr(ray.serve.context, "_get_serve_request_context", lambda: context)
    yield
    for internal_id in ("mine", "theirs"):
        decision_log.DECISIONS.pop(CLIENT_REQUEST_ID, internal_id)


def _ingress(*items) -> ingress_grpc.GrpcIngress:
    llm = FakeHandle(chat=lambda request, raw_request_info: _items(*items))
    return ingress_grpc.GrpcIngress(llm, FakeHandle(), "warmpath-tiny", {"access": {"is_auth_enabled": False}})


def _request() -> inference_pb2.ChatCompletionRequest:
    return inference_pb2.ChatCompletionRequest(messages=[inference_pb2.ChatMessage(role="user", content="hi")])


def test_a_unary_call_records_its_own_decision_and_usage(recorded, two_decisions):
    ingress = _ingress(ServedBy("replica-a"), ChatCompletionResponse(**OPENAI_RESPONSE))
    asyncio.run(ingress.ChatCompletion(_request(), FakeContext()))
    assert recorded.calls == [("usage", "replica-a", 120, 96), ("decision", "prefix-hit", 64, 96)]
    assert decision_log.DECISIONS.pop(CLIENT_REQUEST_ID, "mine") is None  # taken, not left to age out


def test_a_streamed_call_records_the_last_usage_it_saw(recorded, two_decisions):
    frames = [
        'data: {"id":"c","model":"warmpath-tiny","choices":[{"index":0,"delta":{"content":"Hi"}}],"usage":null}\n\n',
        'data: {"id":"c","model":"warmpath-tiny","choices":[],"usage":{"prompt_tokens":640,"completion_tokens":2,'
        '"prompt_tokens_details":{"cached_tokens":608}}}\n\ndata: [DONE]\n\n',
    ]
    ingress = _ingress(ServedBy("replica-a"), [frames[0]], [frames[1]])

    async def read():
        return [chunk async for chunk in ingress.StreamChatCompletion(_request(), FakeContext())]

    asyncio.run(read())
    assert recorded.calls == [("usage", "replica-a", 640, 608), ("decision", "prefix-hit", 64, 608)]


def test_a_stream_its_caller_leaves_is_still_recorded(recorded, two_decisions):
    frame = 'data: {"id":"c","model":"warmpath-tiny","choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'
    ingress = _ingress(ServedBy("replica-a"), [frame], [frame])

    async def read_one():
        stream = ingress.StreamChatCompletion(_request(), FakeContext())
        await anext(stream)
        await stream.aclose()
        return list(recorded.calls)  # settled by the close itself, not left to the garbage collector

    assert asyncio.run(read_one()) == [("usage", "replica-a", 0, 0), ("decision", "prefix-hit", 64, None)]


def test_a_call_the_engine_refused_withdraws_its_own_placement_and_records_nothing(
    recorded, two_decisions, monkeypatch
):
    withdrawn = []
    monkeypatch.setattr(decision_log, "withdraw_placement",
                        lambda logged, replica: withdrawn.append((logged.decision.reason, replica)))
    refusal = ErrorResponse(error=ErrorInfo(message="prompt too long", type="BadRequestError", code=400))
    asyncio.run(_ingress(ServedBy("replica-a"), [refusal]).ChatCompletion(_request(), FakeContext()))
    assert recorded.calls == []
    # On the replica that refused it: where Serve sent it, which need not be the chosen one.
    assert withdrawn == [("prefix-hit", "replica-a")]


class _SilentStream:
    """A handle stream that names its replica and then sends nothing, until it is cancelled."""

    def __init__(self) -> None:
        self.cancelled = False
        self._sent_tag = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._sent_tag:
            self._sent_tag = True
            return ServedBy("replica-a")
        await asyncio.Event().wait()

    def cancel(self) -> None:
        self.cancelled = True


@pytest.mark.parametrize("streamed", [False, True])
def test_a_call_with_no_output_in_time_is_cancelled_and_fails_deadline_exceeded(
    recorded, two_decisions, monkeypatch, streamed
):
    withdrawn = []
    monkeypatch.setattr(decision_log, "withdraw_placement", lambda logged, replica: withdrawn.append(logged))
    silent = _SilentStream()
    ingress = _ingress()
    ingress._llm = SimpleNamespace(
        options=lambda **options: SimpleNamespace(chat=SimpleNamespace(remote=lambda *args: silent))
    )
    ingress.first_output_timeout_s = 0.05
    context = FakeContext()

    async def call():
        if streamed:
            return [chunk async for chunk in ingress.StreamChatCompletion(_request(), context)]
        return [await ingress.ChatCompletion(_request(), context)]

    answers = asyncio.run(asyncio.wait_for(call(), timeout=10))
    assert context.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "no output within 0.05 s" in context.details
    assert silent.cancelled
    assert recorded.calls == []
    assert [logged.decision.reason for logged in withdrawn] == ["prefix-hit"]
    if streamed:
        assert answers[-1].error.code == "request_timeout"


def test_the_first_output_deadline_does_not_bound_the_rest_of_a_stream(recorded, two_decisions):
    frame = 'data: {"id":"c","model":"warmpath-tiny","choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'

    async def slow_after_first():
        yield ServedBy("replica-a")
        yield [frame]
        await asyncio.sleep(0.2)  # a long decode, past the first-output limit
        yield [frame]

    ingress = _ingress()
    ingress._llm = FakeHandle(chat=lambda request, raw_request_info: slow_after_first())
    ingress.first_output_timeout_s = 0.05
    context = FakeContext()

    async def read():
        return [chunk async for chunk in ingress.StreamChatCompletion(_request(), context)]

    chunks = asyncio.run(read())
    assert context.code is None
    assert [chunk.content for chunk in chunks] == ["Hi", "Hi"]


def test_a_stream_the_engine_refuses_in_its_first_frame_withdraws_its_placement(recorded, two_decisions, monkeypatch):
    """vLLM refuses a streamed call with an error frame before any token: a refusal, as HTTP takes it."""
    withdrawn = []
    monkeypatch.setattr(decision_log, "withdraw_placement", lambda logged, replica: withdrawn.append(logged))
    frame = 'data: {"error": {"message": "prompt too long", "type": "BadRequestError", "code": 400}}\n\n'
    context = FakeContext()

    async def read():
        ingress = _ingress(ServedBy("replica-a"), [frame])
        return [chunk async for chunk in ingress.StreamChatCompletion(_request(), context)]

    chunks = asyncio.run(read())
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and chunks[-1].error.message == "prompt too long"
    assert recorded.calls == []
    assert [logged.decision.reason for logged in withdrawn] == ["prefix-hit"]


@pytest.mark.parametrize("error", ["actor", "deployment"])
def test_no_process_to_take_the_call_is_unavailable_with_a_retry_after(error):
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import DeploymentUnavailableError

    err = RayActorError() if error == "actor" else DeploymentUnavailableError("llm")
    failure = ingress_grpc.failure_from_exception(err)
    assert failure.status == grpc.StatusCode.UNAVAILABLE
    assert ("retry-after", "1") in tuple(failure.trailing_metadata)


def test_a_stream_the_engine_sends_nothing_for_fails_as_the_unary_call_does(recorded, two_decisions):
    context = FakeContext()

    async def read():
        return [chunk async for chunk in _ingress(ServedBy("replica-a")).StreamChatCompletion(_request(), context)]

    chunks = asyncio.run(read())
    assert context.code == grpc.StatusCode.INTERNAL and chunks[-1].error.code == "empty_response"


@pytest.mark.parametrize(
    ("field", "metadata", "expected"),
    [
        ("s-field", [], "s-field"),
        ("", [("x-session-id", "s-header")], "s-header"),
        ("s-field", [("x-session-id", "s-header")], "s-field"),  # the message's own field wins
        # Serve reads the HTTP header in either spelling (a gateway may rewrite it); gRPC read one only.
        ("", [("x_session_id", "s-underscored")], "s-underscored"),
        # Repeated, the first counts, as in HTTP's header list (a dict kept the last).
        ("", [("x-session-id", "s-first"), ("x-session-id", "s-second")], "s-first"),
        ("", [], None),
    ],
)
def test_a_call_routes_by_its_session_field_else_its_session_metadata(recorded, two_decisions, field, metadata, expected):
    for streamed in (False, True):
        llm = FakeHandle(chat=lambda request, raw_request_info: _items(ServedBy("replica-a"), ChatCompletionResponse(**OPENAI_RESPONSE)))
        ingress = ingress_grpc.GrpcIngress(llm, FakeHandle(), "warmpath-tiny", {"access": {"is_auth_enabled": False}})
        request = inference_pb2.ChatCompletionRequest(
            messages=[inference_pb2.ChatMessage(role="user", content="hi")], session_id=field
        )
        if streamed:
            async def drain():
                return [chunk async for chunk in ingress.StreamChatCompletion(request, FakeContext(metadata))]
            asyncio.run(drain())
        else:
            asyncio.run(ingress.ChatCompletion(request, FakeContext(metadata)))
        assert [options.get("session_id") for options in llm.options_calls] == [expected]


def test_a_lone_surrogate_in_the_model_output_is_answered_as_a_question_mark(recorded):
    """A tool parser's `json.loads` of the model's `"\\ud800"` leaves a lone surrogate, which no protobuf string takes."""
    response = json.loads(json.dumps(OPENAI_RESPONSE))
    response["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] = '{"q": "a\ud800"}'
    response["choices"][0]["message"]["content"] = "b\udc00"
    ingress = _ingress(ServedBy("replica-a"), ChatCompletionResponse(**response))
    context = FakeContext()
    answer = asyncio.run(ingress.ChatCompletion(_request(), context))
    assert (answer.content, answer.tool_calls[0].arguments) == ("b?", '{"q": "a?"}')


@pytest.mark.parametrize("field", ["messages", "tools"])
def test_more_messages_or_tools_than_the_window_has_tokens_are_refused_before_conversion(field):
    """As over HTTP (`openai_bodies.limit_items`): converting and validating 300,000 tiny messages held the
    gRPC ingress's loop for seconds."""
    ingress = ingress_grpc.GrpcIngress(None, None, "m", {"access": {"is_auth_enabled": False}}, window_tokens=2)
    request = inference_pb2.ChatCompletionRequest(messages=[inference_pb2.ChatMessage(role="user", content="a")])
    many = request.messages if field == "messages" else request.tools
    for i in range(3 - len(many)):
        many.add(**({"role": "user", "content": "a"} if field == "messages" else {"name": f"f{i}"}))
    with pytest.raises(ingress_grpc.RpcFailure) as refused:
        ingress._chat_request(request, is_streaming=False)
    assert refused.value.status is grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.message.startswith(f"{field}: the request holds 3 {field}; the model's context window is 2")
    del many[-1]
    if field == "messages":
        del many[-1]
    assert ingress._chat_request(request, is_streaming=False).model == "m"


@pytest.mark.parametrize("peer, is_local", [
    ("ipv4:127.0.0.1:5050", True), ("ipv6:[::1]:5050", True), ("ipv6:%5B::1%5D:5050", True),
    ("ipv6:[::ffff:127.0.0.1]:5050", True), ("unix:/tmp/s", True),
    ("ipv4:192.0.2.2:5050", False), ("ipv6:[2001:db8::1]:5050", False), ("ipv6:%5B2001:db8::1%5D:5050", False),
    ("", False), ("ipv4:not-an-address:1", False),
])
def test_a_peer_is_this_machine_only_at_a_loopback_address(peer, is_local):
    assert ingress_grpc.is_loopback_peer(peer) is is_local


def test_real_grpc_peers_over_loopback_are_recognised_as_this_machine():
    """The peer strings the gRPC runtime writes (Ray Serve's context hands the ingress `peer()` as it is)."""
    from concurrent import futures

    seen: list[str] = []

    def handle(request, context):
        seen.append(context.peer())
        return b""

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.method_handlers_generic_handler("probe", {"Call": grpc.unary_unary_rpc_method_handler(handle)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            channel.unary_unary("/probe/Call")(b"", timeout=10)
    finally:
        server.stop(None)
    assert len(seen) == 1 and seen[0].startswith("ipv4:127.0.0.1:") and ingress_grpc.is_loopback_peer(seen[0])


class _PeerContext(FakeContext):
    def __init__(self, peer: str) -> None:
        super().__init__()
        self._peer = peer

    def peer(self) -> str:
        return self._peer


def test_with_keys_off_on_a_loopback_host_calls_from_other_machines_are_refused():
    """Serve's gRPC proxy listens on every address whatever `ports.host`: without this, `up --no-auth` served
    unauthenticated model calls (and every permission, server-side tools included) to the network."""
    orchestrator = FakeHandle(get_session={"status": 200, "body": {"session_id": "s1", "model": "m", "transcript": []}})
    ingress = ingress_grpc.GrpcIngress(None, orchestrator, "m", {"access": {"is_auth_enabled": False}},
                                       loopback_callers_only=True)
    request = agent_pb2.GetSessionRequest(session_id="s1")
    remote, local = _PeerContext("ipv4:192.0.2.2:40000"), _PeerContext("ipv4:127.0.0.1:40000")
    asyncio.run(ingress.GetSession(request, remote))
    assert remote.code is grpc.StatusCode.PERMISSION_DENIED and "API keys are off" in remote.details
    assert asyncio.run(ingress.GetSession(request, local)).session_id == "s1" and local.code is None
    # Refused before anything else of the call is read: a malformed or oversized request is no one else's to judge.
    malformed = _PeerContext("ipv4:192.0.2.2:40000")
    asyncio.run(ingress.GetSession(agent_pb2.GetSessionRequest(session_id="x" * 5_000_000), malformed))
    assert malformed.code is grpc.StatusCode.PERMISSION_DENIED


def test_the_grpc_application_refuses_other_machines_only_with_keys_off_on_a_loopback_host():
    from cluster.config import validate_config
    from serve_apps.builders import build_grpc_app

    def refuses_others(config: dict) -> bool:
        app = build_grpc_app(validate_config(config).model_dump(mode="json"))
        return app._bound_deployment.init_kwargs["loopback_callers_only"]

    assert refuses_others({"access": {"is_auth_enabled": False}}) is True
    for host in ("localhost", "LOCALHOST", "localhost.", "::1"):  # as the HTTP proxy binds them: loopback
        assert refuses_others({"access": {"is_auth_enabled": False}, "ports": {"host": host}}) is True, host
    assert refuses_others({"access": {"is_auth_enabled": False}, "ports": {"host": "0.0.0.0"}}) is False
    assert refuses_others({"redis_url": "redis://127.0.0.1:6380/0"}) is False  # keys on: keys decide
