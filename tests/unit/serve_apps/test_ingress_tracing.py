"""Server spans of the HTTP and gRPC ingresses and the replica: status by OTel's conventions, ends, propagation.

Each test reads the spans the code under test ended from an in-memory exporter
of its own provider (`spans`), the way `/tmp`-style audit repros read them,
without a collector or a cluster.
"""

from __future__ import annotations

import asyncio
import gc
import json
from types import SimpleNamespace

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import StatusCode, get_current_span
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.llm._internal.serve.core.configs.openai_api_models import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    OpenAIHTTPException,
)
from ray.llm._internal.serve.core.protocol import RawRequestInfo
from ray.llm._internal.serve.core.server.llm_server import LLMServer
from starlette.requests import Request
from starlette.responses import StreamingResponse

from cluster import telemetry
from serve_apps import vllm_replica
from serve_apps.access import Caller
from serve_apps.grpc_status import RpcFailure
from serve_apps.ingress_grpc import GrpcIngress
from serve_apps.ingress_http import CreateSessionBody, WarmpathIngress
from serve_apps.orchestrator.models import CreateSessionRequest, TurnRequest
from serve_apps.vllm_replica import ServedBy, WarmpathLLMServer
from tests.unit.serve_apps.test_grpc_mapping import OPENAI_RESPONSE
from warmpath.v1 import agent_pb2, inference_pb2

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"

CHUNK = 'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
DONE = "data: [DONE]\n\n"


def _provider(exporter: InMemorySpanExporter, **options) -> TracerProvider:
    provider = TracerProvider(**options)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


@pytest.fixture
def spans(monkeypatch) -> InMemorySpanExporter:
    """The spans the code under test ends (a provider of its own: the global one can be set once per process)."""
    exporter = InMemorySpanExporter()
    provider = _provider(exporter)
    monkeypatch.setattr(telemetry, "tracer", lambda: provider.get_tracer(telemetry.TRACER_NAME))
    return exporter


def _only(exporter: InMemorySpanExporter):
    [span] = exporter.get_finished_spans()
    return span


def _run(coro):
    return asyncio.run(coro)


# ---- HTTP: chat/completions ----


def _http_request(headers=None, path="/v1/chat/completions", caller: Caller | None = None) -> Request:
    scope = {
        "type": "http", "method": "POST", "path": path, "query_string": b"",
        "headers": [(k.encode(), v.encode()) for k, v in (headers or {}).items()],
    }
    if caller is not None:
        scope["state"] = {"caller": caller}
    return Request(scope)


def _chat_ingress(*items) -> WarmpathIngress:
    """An ingress whose replicas answer `items` (an exception among them is raised); it keeps the headers sent on."""
    ingress = object.__new__(WarmpathIngress)

    async def get_response(body, call_method, raw_request):
        ingress.forwarded = dict(raw_request.headers)
        for item in items:
            if isinstance(item, BaseException):
                raise item
            yield item

    ingress._get_response = get_response
    ingress._default_serve_handles = {"m": None}  # the model it serves, by Ray Serve LLM's name for that map
    return ingress


def _chat(content="hi", **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": content}], max_tokens=5, **fields)


async def _frames(response) -> list[str]:
    return [frame async for frame in response.body_iterator]


async def _streamed(ingress: WarmpathIngress, body, request: Request) -> list[str]:
    """The frames of one streamed call, in the event loop that started it (as Serve's replica does)."""
    response = await ingress._process_llm_request(body, "chat", request)
    assert isinstance(response, StreamingResponse)
    return await _frames(response)


def _engine_error(status: int, message: str) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type="BadRequestError", code=status))


@pytest.mark.parametrize(
    ("items", "body", "status"),
    [
        ([ServedBy("r1"), _engine_error(400, "max_tokens too large")], _chat(), 400),
        ([OpenAIHTTPException(status_code=404, message="model m is not served", type="NotFoundError")], _chat(), 404),
        ([ServedBy("r1"), CHUNK], _chat("\ud800"), 400),  # refused by the ingress' own request checks
    ],
    ids=["engine-400", "unknown-model-404", "request-check-400"],
)
def test_a_client_error_leaves_the_chat_span_unset_with_its_status_code(spans, items, body, status):
    response = _run(_chat_ingress(*items)._process_llm_request(body, "chat", _http_request({"traceparent": TRACEPARENT})))
    assert response.status_code == status
    span = _only(spans)
    assert span.attributes["http.response.status_code"] == status
    assert span.status.status_code is StatusCode.UNSET and "error.type" not in span.attributes
    assert format(span.parent.span_id, "016x") == PARENT_ID


@pytest.mark.parametrize(("items", "replica"), [
    ([ServedBy("r1"), _engine_error(400, "max_tokens too large")], "r1"),  # the engine's refusal: its replica
    ([ServedBy("r1"), 'data: {"error": {"message": "grammar", "type": "BadRequestError", "code": 400}}\n\n'], "r1"),
    ([OpenAIHTTPException(status_code=404, message="model m is not served", type="NotFoundError")], None),
    ([ServedBy("r1"), RuntimeError("engine died")], "r1"),  # failed after it named itself
], ids=["error-response", "leading-error-frame", "no-replica", "failed-after-naming-itself"])
def test_an_engine_refusal_names_the_replica_that_refused_it(spans, items, replica, monkeypatch):
    from router import decision_log

    withdrawn = []
    monkeypatch.setattr(decision_log, "withdraw_placement", lambda logged, served: withdrawn.append(served))
    response = _run(_chat_ingress(*items)._process_llm_request(_chat(stream=True), "chat", _http_request()))
    assert response.status_code in (400, 404, 500)
    assert response.headers.get("x-warmpath-replica") == replica
    # The placement is withdrawn where Serve sent the call (the chosen replica may have been full).
    assert withdrawn == [replica]


def test_a_lone_surrogate_in_the_model_output_is_answered_as_a_question_mark(spans):
    """A tool parser's `json.loads` of the model's `"\\ud800"` leaves one in the arguments: a 200, not a 500."""
    answer = json.loads(json.dumps(OPENAI_RESPONSE))
    answer["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] = '{"q": "a\ud800"}'
    response = _run(_chat_ingress(ServedBy("r1"), ChatCompletionResponse(**answer))._process_llm_request(
        _chat(), "chat", _http_request()))
    assert response.status_code == 200
    call = json.loads(response.body)["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["arguments"] == '{"q": "a?"}'


@pytest.mark.parametrize("failure, retry_after", [
    (RayActorError(), "1"),
    (DeploymentUnavailableError("warmpath"), "1"),
    (BackPressureError(num_queued_requests=1, max_queued_requests=1), "1"),
    (BackPressureError(num_queued_requests=1, max_queued_requests=1, retry_after_s=2.5), "3"),  # Serve's own delay
], ids=["replica-died", "no-replica", "full", "full-with-delay"])
def test_a_call_no_replica_could_take_is_a_503_to_retry(spans, failure, retry_after):
    response = _run(_chat_ingress(failure)._process_llm_request(_chat(), "chat", _http_request()))
    error = json.loads(response.body)["error"]
    assert (response.status_code, response.headers.get("retry-after"), error["code"]) == (503, retry_after, "unavailable")
    streamed = _run(_streamed(_chat_ingress(ServedBy("r1"), CHUNK, failure), _chat(stream=True), _http_request()))
    error_frame, done = streamed[-1].split("\n\n", 1)  # the failure's frame, then [DONE], as vLLM ends one
    assert json.loads(error_frame.removeprefix("data: "))["error"]["code"] == "unavailable" and done == DONE


def test_a_caller_leaving_a_call_that_is_not_streamed_marks_its_span_incomplete_not_failed(spans):
    """It was ERROR with `error.type: CancelledError`, where the same leaving over gRPC, or from a stream, is none."""
    with pytest.raises(asyncio.CancelledError):
        _run(_chat_ingress(asyncio.CancelledError())._process_llm_request(_chat(), "chat", _http_request()))
    span = _only(spans)
    assert span.status.status_code is not StatusCode.ERROR and "error.type" not in span.attributes
    assert span.attributes["warmpath.stream.incomplete"] is True


def test_a_server_error_marks_the_chat_span_with_its_message(spans):
    items = [ServedBy("r1"), _engine_error(503, "the engine is overloaded")]
    response = _run(_chat_ingress(*items)._process_llm_request(_chat(), "chat", _http_request()))
    span = _only(spans)
    assert response.status_code == span.attributes["http.response.status_code"] == 503
    assert span.attributes["error.type"] == "503"
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == json.loads(response.body)["error"]["message"] != ""


@pytest.mark.parametrize(("status", "is_error"), [(500, True), (400, False)])
def test_an_error_frame_after_the_stream_started_is_recorded_on_the_span(spans, status, is_error):
    error = json.dumps({"error": {"message": "engine died", "type": "InternalServerError", "code": status}})
    _run(_streamed(_chat_ingress(ServedBy("r1"), CHUNK, f"data: {error}\n\n", DONE), _chat(stream=True), _http_request()))
    span = _only(spans)
    assert span.attributes["http.response.status_code"] == 200  # sent before the failure
    assert span.attributes["error.type"] == str(status)
    assert (span.status.status_code is StatusCode.ERROR) is is_error
    if is_error:
        assert span.status.description == "engine died"


def test_a_stream_the_client_left_ends_its_span_marked_incomplete(spans):
    ingress = _chat_ingress(ServedBy("r1"), CHUNK, CHUNK, CHUNK, DONE)

    async def leave_after_one_frame():
        response = await ingress._process_llm_request(_chat(stream=True), "chat", _http_request())
        frames = response.body_iterator
        await frames.__anext__()
        await frames.aclose()

    _run(leave_after_one_frame())
    span = _only(spans)
    assert span.attributes["warmpath.stream.incomplete"] is True
    assert span.status.status_code is StatusCode.UNSET


def test_a_streamed_response_dropped_before_its_body_started_still_ends_its_span(spans):
    async def drop():
        response = await _chat_ingress(ServedBy("r1"), CHUNK, DONE)._process_llm_request(
            _chat(stream=True), "chat", _http_request()
        )
        assert spans.get_finished_spans() == ()  # the stream is what ends it
        del response
        gc.collect()

    _run(drop())
    span = _only(spans)
    assert span.name == "chat m" and span.attributes["warmpath.stream.incomplete"] is True


def test_a_streamed_turn_dropped_before_its_body_started_ends_its_span_marked_incomplete(spans):
    final = {"kind": "final", "message": {"role": "assistant", "content": "x"}}
    ingress = _session_ingress(send_message=_turn({"status": 200}, final))

    async def drop():
        response = await ingress.post_message("s1", TurnRequest(content="hi", stream=True), _session_request())
        assert spans.get_finished_spans() == ()
        del response
        gc.collect()

    _run(drop())
    assert _only(spans).attributes["warmpath.stream.incomplete"] is True


def test_a_sampled_out_call_still_forwards_its_trace_context(monkeypatch):
    provider = _provider(InMemorySpanExporter(), sampler=ALWAYS_OFF)
    monkeypatch.setattr(telemetry, "tracer", lambda: provider.get_tracer(telemetry.TRACER_NAME))
    ingress = _chat_ingress(ServedBy("r1"), CHUNK, DONE)
    _run(_streamed(ingress, _chat(stream=True), _http_request()))
    # The replica continues the (unsampled) trace instead of starting a sampled root of its own.
    version, trace_id, span_id, flags = ingress.forwarded["traceparent"].split("-")
    assert int(flags, 16) & 1 == 0  # not sampled
    assert int(trace_id, 16) != 0 and int(span_id, 16) != 0


# ---- HTTP: session routes ----


class _Remote:
    def __init__(self, answer):
        self._answer = answer
        self.calls = []

    def remote(self, *args):
        self.calls.append(args)
        return self._answer(*args)


class _Orchestrator:
    """An orchestrator handle whose methods answer with the given functions (an async function or an async generator)."""

    def __init__(self, **methods):
        self._methods = {name: _Remote(answer) for name, answer in methods.items()}

    def options(self, **options):
        return self

    def __getattr__(self, name):
        return self._methods[name]


def _envelope(status: int, body=None):
    async def answer(*args):
        return {"status": status, "body": body}

    return answer


def _turn(*items):
    def answer(session_id, body, caller, carrier, idempotency_key):
        async def events():
            for item in items:
                if isinstance(item, BaseException):
                    raise item
                yield item

        return events()

    return answer


def _session_ingress(**methods) -> WarmpathIngress:
    ingress = object.__new__(WarmpathIngress)
    ingress._orchestrator = _Orchestrator(**methods)
    return ingress


def _session_request(path="/v1/sessions/s1/messages") -> Request:
    return _http_request({"traceparent": TRACEPARENT}, path, Caller("k1", ("*",)))


ERROR_BODY = {"error": {"message": "no such session", "type": "NotFoundError", "code": "session_not_found"}}
CREATE_BODY = CreateSessionBody(CreateSessionRequest(model="m", system_prompt="You help.").model_dump(mode="json"))


@pytest.mark.parametrize(
    ("call", "methods", "name", "status"),
    [
        (lambda i: i.create_session(CREATE_BODY, _session_request("/v1/sessions")),
         {"create_session": _envelope(201, {"session_id": "s1"})}, "POST /v1/sessions", 201),
        (lambda i: i.get_session("s1", _session_request("/v1/sessions/s1")),
         {"get_session": _envelope(404, ERROR_BODY)}, "GET /v1/sessions/{session_id}", 404),
        (lambda i: i.delete_session("s1", _session_request("/v1/sessions/s1")),
         {"delete_session": _envelope(204)}, "DELETE /v1/sessions/{session_id}", 204),
    ],
    ids=["create", "get", "delete"],
)
def test_every_session_route_has_a_span_named_by_method_and_route_template(spans, call, methods, name, status):
    response = _run(call(_session_ingress(**methods)))
    assert response.status_code == status
    span = _only(spans)
    method, route = name.split(" ")
    assert span.name == name
    assert span.attributes["http.request.method"] == method and span.attributes["http.route"] == route
    assert span.attributes["http.response.status_code"] == status
    assert span.status.status_code is StatusCode.UNSET
    assert span.context.trace_id == int(TRACE_ID, 16) and format(span.parent.span_id, "016x") == PARENT_ID


def _left(*args):
    async def answer(*args):
        raise asyncio.CancelledError

    return answer(*args)


@pytest.mark.parametrize("call, methods", [
    (lambda i: i.get_session("s1", _session_request("/v1/sessions/s1")), {"get_session": _left}),
    (lambda i: i.post_message("s1", TurnRequest(content="hi"), _session_request()), {"send_message": _turn(
        asyncio.CancelledError())}),
], ids=["get", "turn"])
def test_a_caller_leaving_a_session_call_marks_its_span_incomplete_not_failed(spans, call, methods):
    """Each was ERROR with `error.type: CancelledError`, where the chat routes and gRPC mark it incomplete: an
    unstreamed turn waits its whole loop for the answer, and every client timeout counted as a server error."""
    with pytest.raises(asyncio.CancelledError):
        _run(call(_session_ingress(**methods)))
    span = _only(spans)
    assert span.status.status_code is not StatusCode.ERROR and "error.type" not in span.attributes
    assert span.attributes["warmpath.stream.incomplete"] is True
    assert "url.scheme" in span.attributes and span.attributes["url.path"].startswith("/v1/sessions/s1")


@pytest.mark.parametrize(
    ("turn", "status", "is_error"),
    [
        (_turn(RuntimeError("actor died")), 500, True),
        (_turn({"status": 200}, {"kind": "delta", "text": "x"}, {"kind": "error", "code": "model_error", "message": "m"}),
         502, True),
        (_turn({"status": 404, "body": ERROR_BODY}), 404, False),
        (_turn({"status": 200}, {"kind": "final", "message": {"role": "assistant", "content": "x"}}), 200, False),
    ],
    ids=["orchestrator-raised", "model-error", "unknown-session", "completed"],
)
def test_a_turn_span_has_its_status_code_and_is_an_error_only_for_5xx(spans, turn, status, is_error):
    ingress = _session_ingress(send_message=turn)
    response = _run(ingress.post_message("s1", TurnRequest(content="hi"), _session_request()))
    assert response.status_code == status
    span = _only(spans)
    assert span.attributes["http.route"] == "/v1/sessions/{session_id}/messages"
    assert span.attributes["http.response.status_code"] == status
    assert (span.status.status_code is StatusCode.ERROR) is is_error
    if is_error:
        assert span.attributes["error.type"] == str(status) and span.status.description
    # The orchestrator continues this span's trace.
    carrier = ingress._orchestrator.send_message.calls[0][3]
    assert carrier["traceparent"].split("-")[2] == format(span.context.span_id, "016x")


@pytest.mark.parametrize(
    ("items", "status", "exception"),
    [
        (({"kind": "delta", "text": "x"}, {"kind": "final", "message": {"role": "assistant", "content": "x"}}), None, None),
        (({"kind": "delta", "text": "x"}, {"kind": "error", "code": "model_error", "message": "engine died"}), "502", None),
        (({"kind": "delta", "text": "x"}, RuntimeError("replica lost")), "RuntimeError", "RuntimeError"),
    ],
    ids=["completed", "model-error", "broke-off"],
)
def test_a_streamed_turn_span_ends_with_its_stream_and_records_its_failure(spans, items, status, exception):
    ingress = _session_ingress(submit_tool_results=_turn({"status": 200}, *items))

    async def stream():
        from serve_apps.orchestrator.models import ToolResultsSubmission

        body = ToolResultsSubmission(results=[{"tool_call_id": "c1", "content": "ok"}], stream=True)
        response = await ingress.post_tool_results("s1", body, _session_request("/v1/sessions/s1/tool_results"))
        assert spans.get_finished_spans() == ()  # the turn is still running
        return await _frames(response)

    frames = _run(stream())
    assert frames[-1] == "event: done\ndata: {}\n\n"
    span = _only(spans)
    assert span.attributes["http.response.status_code"] == 200
    assert span.attributes.get("error.type") == status
    assert (span.status.status_code is StatusCode.ERROR) is (status is not None)
    assert [e.attributes["exception.type"] for e in span.events if e.name == "exception"] == (
        [exception] if exception else []
    )
    assert "warmpath.stream.incomplete" not in span.attributes


def test_a_streamed_turn_its_client_left_ends_its_span_marked_incomplete(spans):
    final = {"kind": "final", "message": {"role": "assistant", "content": "x"}}
    ingress = _session_ingress(send_message=_turn({"status": 200}, {"kind": "delta", "text": "x"}, final))

    async def leave_after_one_frame():
        response = await ingress.post_message("s1", TurnRequest(content="hi", stream=True), _session_request())
        frames = response.body_iterator
        await frames.__anext__()
        await frames.aclose()

    _run(leave_after_one_frame())
    span = _only(spans)
    assert span.attributes["warmpath.stream.incomplete"] is True and span.status.status_code is StatusCode.UNSET


def test_an_unauthenticated_session_call_is_traced_as_a_401(spans):
    ingress = _session_ingress(get_session=_envelope(200, {}))
    with pytest.raises(OpenAIHTTPException):
        _run(ingress.get_session("s1", _http_request({"traceparent": TRACEPARENT}, "/v1/sessions/s1")))
    span = _only(spans)
    assert span.attributes["http.response.status_code"] == 401 and span.status.status_code is StatusCode.UNSET


# ---- replica ----


class _NoMetrics:
    """`WarmpathMetrics.get()` without Ray's metrics backend: every metric accepts every call."""

    @classmethod
    def get(cls):
        return cls()

    def __getattr__(self, name):
        return self

    def __call__(self, *args, **kwargs):
        return self


class _Replica(WarmpathLLMServer):
    def __del__(self) -> None:
        """Python's own collection of a test object: Serve's async shutdown hook is not under test here."""


@pytest.mark.parametrize("operation", ["chat", "completions"])
def test_the_replica_span_ends_when_the_engine_refuses_the_request(spans, monkeypatch, operation):
    async def refuse(self, request, raw_request_info=None):
        raise ValueError("Must setup lora config for multiplexed requests.")

    monkeypatch.setattr(LLMServer, operation, refuse)
    monkeypatch.setattr(vllm_replica, "WarmpathMetrics", _NoMetrics)
    server = object.__new__(_Replica)
    server._replica_id = "r1"
    if operation == "chat":
        request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}])
    else:
        request = CompletionRequest(model="m", prompt="x")
    with pytest.raises(ValueError):
        _run(getattr(server, operation)(request, RawRequestInfo(headers={"traceparent": TRACEPARENT})))
    span = _only(spans)
    assert span.name == f"vllm.{operation}" and span.status.status_code is StatusCode.ERROR
    assert [e.name for e in span.events] == ["exception"]


# ---- gRPC ----


class _GrpcContext:
    """Ray Serve's `grpc_context` surface the ingress uses."""

    def __init__(self):
        self.code = None

    def invocation_metadata(self):
        return [("traceparent", TRACEPARENT)]

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        pass

    def set_trailing_metadata(self, metadata):
        pass


def _grpc_ingress(**methods) -> GrpcIngress:
    # Auth off: the guard admits every call as the anonymous caller without Redis.
    return GrpcIngress(_Orchestrator(), _Orchestrator(**methods), "m", {"access": {"is_auth_enabled": False}})


def _grpc_error(status: int) -> dict:
    return {"status": status, "body": {"error": {"message": f"refused with {status}", "code": "refused"}}}


async def _get_session(ingress: GrpcIngress, context: _GrpcContext):
    return await ingress.GetSession(agent_pb2.GetSessionRequest(session_id="s1"), context)


@pytest.mark.parametrize(
    ("status", "code", "is_error"),
    [
        (404, grpc.StatusCode.NOT_FOUND, False),
        (400, grpc.StatusCode.INVALID_ARGUMENT, False),
        (429, grpc.StatusCode.RESOURCE_EXHAUSTED, False),
        (500, grpc.StatusCode.INTERNAL, True),
        (503, grpc.StatusCode.UNAVAILABLE, True),
    ],
)
def test_an_rpc_span_is_an_error_only_for_server_failures(spans, status, code, is_error):
    context = _GrpcContext()
    _run(_get_session(_grpc_ingress(get_session=_envelope(status, _grpc_error(status)["body"])), context))
    assert context.code is code
    span = _only(spans)
    assert span.attributes["rpc.grpc.status_code"] == code.value[0]
    assert span.attributes["rpc.response.status_code"] == code.name
    assert (span.status.status_code is StatusCode.ERROR) is is_error
    # As over HTTP, a failure of this service names its type; the caller's mistakes do not.
    assert span.attributes.get("error.type") == (code.name if is_error else None)
    assert format(span.parent.span_id, "016x") == PARENT_ID


def test_an_unauthenticated_rpc_span_is_not_an_error(spans, monkeypatch):
    async def deny(self, grpc_context, request):
        raise RpcFailure(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated", "no API key")

    monkeypatch.setattr(GrpcIngress, "_admit", deny)
    _run(_get_session(_grpc_ingress(), _GrpcContext()))
    span = _only(spans)
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNAUTHENTICATED.value[0]
    assert span.status.status_code is StatusCode.UNSET


def test_a_successful_rpc_span_has_status_code_ok(spans):
    get_session = _envelope(200, {"session_id": "s1", "model": "m", "transcript": []})
    _run(_get_session(_grpc_ingress(get_session=get_session), _GrpcContext()))
    span = _only(spans)
    assert span.attributes["rpc.grpc.status_code"] == 0 and span.status.status_code is StatusCode.UNSET


async def _send_message(ingress: GrpcIngress, context: _GrpcContext):
    return [m async for m in ingress.SendMessage(agent_pb2.SendMessageRequest(session_id="s1", content="hi"), context)]


@pytest.mark.parametrize(
    ("last", "code", "is_error"),
    [
        ({"kind": "error", "code": "internal", "message": "the turn failed"}, grpc.StatusCode.INTERNAL, True),
        ({"kind": "error", "code": "model_error", "message": "engine died"}, grpc.StatusCode.UNAVAILABLE, True),
        ({"kind": "error", "code": "session_not_found", "message": "deleted"}, grpc.StatusCode.NOT_FOUND, False),
        ({"kind": "error", "code": "max_steps", "message": "used all steps"}, grpc.StatusCode.OK, False),
        ({"kind": "final", "message": {"role": "assistant", "content": "a"}}, grpc.StatusCode.OK, False),
    ],
    ids=["internal", "model-error", "session-gone", "max-steps", "final"],
)
def test_a_turn_stream_span_has_the_status_its_last_event_sets(spans, last, code, is_error):
    context = _GrpcContext()
    ingress = _grpc_ingress(send_message=_turn({"status": 200}, {"kind": "delta", "text": "a"}, last))
    messages = _run(_send_message(ingress, context))
    assert len(messages) == 2 and (context.code or grpc.StatusCode.OK) is code
    span = _only(spans)
    assert span.attributes["rpc.grpc.status_code"] == code.value[0]
    assert (span.status.status_code is StatusCode.ERROR) is is_error


def test_a_turn_stream_that_ends_without_its_outcome_fails_as_interrupted(spans):
    context = _GrpcContext()
    ingress = _grpc_ingress(send_message=_turn({"status": 200}, {"kind": "delta", "text": "a"}))
    *_, last = _run(_send_message(ingress, context))
    assert context.code is grpc.StatusCode.UNAVAILABLE and last.error.code == "turn_interrupted"


def test_a_stream_its_caller_closes_ends_its_span_as_cancelled_without_leaking_it(spans):
    ingress = _grpc_ingress(send_message=_turn({"status": 200}, *[{"kind": "delta", "text": "a"}] * 3))

    async def leave():
        stream = ingress.SendMessage(agent_pb2.SendMessageRequest(session_id="s1", content="hi"), _GrpcContext())
        await stream.__anext__()
        assert not get_current_span().get_span_context().is_valid  # the RPC's span stays inside the stream
        await asyncio.get_running_loop().create_task(stream.aclose())  # closed elsewhere, as Ray's proxy may

    _run(leave())
    span = _only(spans)
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert span.status.status_code is StatusCode.UNSET


@pytest.mark.parametrize("model, name", [("m", "chat m"), ("made-up-" + "x" * 300, "chat")])
def test_a_chat_span_is_named_by_a_served_model_only_and_has_http_attributes(spans, model, name):
    body = ChatCompletionRequest(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    _run(_chat_ingress(ServedBy("r1"), OpenAIHTTPException(status_code=404, message="not served", type="NotFoundError"))
         ._process_llm_request(body, "chat", _http_request()))
    span = _only(spans)
    assert span.name == name and span.attributes["gen_ai.request.model"] == model[:256]
    assert span.attributes["http.request.method"] == "POST" and span.attributes["gen_ai.operation.name"] == "chat"


class _DecidingLLM:
    """An LLM handle whose call logs a routing decision, as the router does, then streams three chunks."""

    def options(self, **options):
        return self

    @property
    def chat(self):
        return self

    def remote(self, request, raw_request_info):
        import time
        from types import SimpleNamespace

        from ray.serve.context import _get_serve_request_context

        from router import decision_log

        context = _get_serve_request_context()
        decision = SimpleNamespace(reason="prefix-hit", replica_id="r1", predicted_cached_tokens={"r1": 32})
        now = time.time_ns()
        decision_log.DECISIONS.put(context.request_id, context._internal_request_id,
                                   decision_log.LoggedDecision(decision, now, now))

        async def outputs():
            yield ServedBy("r1")
            for _ in range(3):
                yield ['data: {"id":"c","model":"m","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n']
            yield ['data: {"id":"c","model":"m","choices":[],"usage":{"prompt_tokens":40,"completion_tokens":3,'
                   '"prompt_tokens_details":{"cached_tokens":32}}}\n\n']

        return outputs()


@pytest.mark.parametrize("is_left", [False, True], ids=["read-whole", "left-mid-stream"])
def test_a_streamed_rpc_keeps_its_routing_span_when_the_caller_leaves(spans, monkeypatch, is_left):
    from opentelemetry import trace as trace_api

    provider_tracer = telemetry.tracer()
    monkeypatch.setattr(trace_api, "get_tracer", lambda *args, **kwargs: provider_tracer)  # the route span's tracer
    monkeypatch.setattr("serve_apps.metrics.record_model_call", lambda *args: None)
    ingress = GrpcIngress(_DecidingLLM(), _Orchestrator(), "m", {"access": {"is_auth_enabled": False}})
    request = inference_pb2.ChatCompletionRequest(model="m", messages=[inference_pb2.ChatMessage(role="user", content="hi")])

    async def call():
        stream = ingress.StreamChatCompletion(request, _GrpcContext())
        if is_left:
            await anext(stream)
            await stream.aclose()
        else:
            [_ async for _ in stream]

    _run(call())
    by_name = {span.name: span for span in spans.get_finished_spans()}
    rpc = by_name["warmpath.v1.Inference/StreamChatCompletion"]
    assert by_name["warmpath.route"].parent.span_id == rpc.context.span_id
    # The model call on the RPC's span, as the HTTP chat span has it (usage only from a stream read to its end).
    assert (rpc.attributes["gen_ai.operation.name"], rpc.attributes["warmpath.replica"]) == ("chat", "r1")
    # Why it went there, as the HTTP chat span has it (it was on the child `warmpath.route` span only).
    assert rpc.attributes["warmpath.route.reason"] == "prefix-hit"
    assert rpc.attributes["warmpath.route.predicted_cached_tokens"] == 32
    assert rpc.attributes.get("warmpath.stream.incomplete", False) is is_left  # as the HTTP span says it
    if not is_left:
        assert (rpc.attributes["gen_ai.usage.input_tokens"], rpc.attributes["warmpath.cached_tokens"]) == (40, 32)


BAGGAGE = "tenant=acme,experiment=b7"


def test_the_callers_baggage_goes_on_with_a_turns_trace_over_http_and_grpc(spans):
    """W3C baggage is the caller's to send on with its trace; it reached the replica over HTTP chat only."""
    http = _session_ingress(send_message=_turn({"status": 200}, {"kind": "final", "message": {
        "role": "assistant", "content": "a"}}))
    request = _http_request({"traceparent": TRACEPARENT, "baggage": BAGGAGE}, "/v1/sessions/s1/messages",
                            Caller("k1", ("*",)))
    _run(http.post_message("s1", TurnRequest(content="hi"), request))
    carriers = [http._orchestrator.send_message.calls[0][3]]

    class _BaggageContext(_GrpcContext):
        def invocation_metadata(self):
            return [("traceparent", TRACEPARENT), ("baggage", BAGGAGE)]

    grpc_ingress = _grpc_ingress(send_message=_turn({"status": 200}, {"kind": "final", "message": {
        "role": "assistant", "content": "a"}}))
    _run(_send_message(grpc_ingress, _BaggageContext()))
    carriers.append(grpc_ingress._orchestrator.send_message.calls[0][3])
    for carrier in carriers:
        assert sorted(carrier["baggage"].split(",")) == sorted(BAGGAGE.split(","))
        assert carrier["traceparent"].split("-")[1] == TRACEPARENT.split("-")[1]


def test_a_tracestate_split_over_header_lines_reaches_the_span_whole(spans):
    """W3C lets `tracestate` come on several lines; the ingress kept only the first."""
    request = _http_request({"traceparent": TRACEPARENT})
    request.scope["headers"] += [(b"tracestate", b"vendor1=a"), (b"tracestate", b"vendor2=b")]
    _run(_chat_ingress(ServedBy("r1"), CHUNK, DONE)._process_llm_request(_chat(), "chat", request))
    span = _only(spans)
    assert dict(span.parent.trace_state) == {"vendor1": "a", "vendor2": "b"}


def test_a_replica_dying_mid_stream_is_typed_on_the_span_as_the_frame_says(spans):
    """The stream's last frame says 503 `unavailable`; the span said error.type 500 (it read the body's string code)."""
    from serve_apps.ingress_http import _usage_recorded

    async def frames():
        yield 'data: {"id":"c","choices":[{"index":0,"delta":{"content":"He"}}]}\n\n'
        raise RayActorError()

    import weakref

    span = TracerProvider().get_tracer("t").start_span("chat m")
    response = StreamingResponse(iter(()))  # what the finaliser watches: the response, dropped unread
    on_drop = [weakref.finalize(response, lambda: None)]

    async def run():
        return [frame async for frame in _usage_recorded(frames(), None, None, True, span, on_drop)]

    out = _run(run())
    assert '"unavailable"' in out[-1] and out[-1].endswith("data: [DONE]\n\n")
    assert span.attributes["error.type"] == "503" and span.status.status_code is StatusCode.ERROR


class _SlowCall:
    """A streaming handle call whose first output comes after the ingress' timeout; it notes being cancelled."""

    def __init__(self) -> None:
        self.is_cancelled = False

    async def _outputs(self):
        yield ServedBy("r1")
        await asyncio.sleep(30)
        yield CHUNK

    def __aiter__(self):
        return self._outputs()

    def cancel(self) -> None:
        self.is_cancelled = True


def test_a_call_answered_408_for_its_first_output_timing_out_is_cancelled(spans, monkeypatch):
    """The request ends normally with the 408, so Ray cancels none of its calls: the engine kept the call
    queued or decoding for no one (and OpenAI's clients send a 408 twice more)."""
    from serve_apps import ingress_http

    monkeypatch.setattr(ingress_http, "DEFAULT_LLM_ROUTER_HTTP_TIMEOUT", 0.2)
    call = _SlowCall()
    handle = SimpleNamespace(chat=SimpleNamespace(remote=lambda body, info: call), options=lambda **kw: handle)
    ingress = object.__new__(WarmpathIngress)
    ingress._default_serve_handles = {"m": handle}

    async def model_id(model):
        return model

    ingress._get_model_id = model_id
    ingress._get_configured_serve_handle = lambda model: handle
    response = _run(ingress._process_llm_request(_chat(stream=True), "chat", _http_request()))
    assert response.status_code == 408 and call.is_cancelled


def test_a_served_models_name_with_a_lora_suffix_is_an_unknown_model(spans):
    """No LoRA adapters are served: Serve LLM took the suffix for one, sent the call multiplexed to a replica
    that failed it (a 500), and kept a handle per distinct name for good."""
    ingress = object.__new__(WarmpathIngress)
    ingress._model_cards = {"m": None}
    ingress._default_serve_handles = {"m": SimpleNamespace(options=lambda **kw: pytest.fail("a handle was made"))}
    ingress._configured_serve_handles = {}
    body = ChatCompletionRequest(model="m:made-up", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    response = _run(ingress._process_llm_request(body, "chat", _http_request()))
    error = json.loads(response.body)["error"]
    assert response.status_code == 404 and 'model "m:made-up" is not served here' in error["message"]
    assert ingress._configured_serve_handles == {}


class _AnsweringCall:
    """A non-streamed call: the replica's tag, its one whole response, then the end; it notes being cancelled."""

    def __init__(self) -> None:
        self.num_cancels = 0

    async def _outputs(self):
        yield ServedBy("r1")
        yield ChatCompletionResponse(**json.loads(json.dumps(OPENAI_RESPONSE)))

    def __aiter__(self):
        return self._outputs()

    def cancel(self) -> None:
        self.num_cancels += 1


def test_a_call_that_gave_its_whole_response_is_not_cancelled(spans):
    """Its reader stops at the response; cancelling the call then (as the left generator is closed) cancelled
    every non-streamed call, and the replica could see it cancelled before its generator ended."""
    call = _AnsweringCall()
    handle = SimpleNamespace(chat=SimpleNamespace(remote=lambda body, info: call), options=lambda **kw: handle)
    ingress = object.__new__(WarmpathIngress)
    ingress._default_serve_handles = {"m": handle}
    ingress._model_cards = {"m": None}
    ingress._configured_serve_handles = {"m": handle}

    async def answer():
        response = await ingress._process_llm_request(_chat(), "chat", _http_request())
        gc.collect()
        for _ in range(5):
            await asyncio.sleep(0)  # the closing of the generators left suspended
        return response.status_code

    assert asyncio.run(answer()) == 200 and call.num_cancels == 0


def test_a_unary_call_its_caller_left_ends_its_span_cancelled_and_incomplete(spans):
    """As a stream its caller left, and as an HTTP call whose client left: no answer went out, no error."""
    started = asyncio.Event()

    async def get_session(*args, **kwargs):
        started.set()
        await asyncio.Event().wait()

    async def leave():
        call = asyncio.create_task(_get_session(_grpc_ingress(get_session=get_session), _GrpcContext()))
        await started.wait()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    _run(leave())
    span = _only(spans)
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert span.attributes["warmpath.stream.incomplete"] is True and span.status.status_code is StatusCode.UNSET
