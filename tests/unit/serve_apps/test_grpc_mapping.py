"""gRPC mapping: protobuf <-> the session/OpenAI plain data, status codes, and the RPC contract.

Covers `serve_apps.grpc_status` (HTTP -> gRPC codes, bounded details, health in Ray's proxy) and
the conversions and status ordering of `serve_apps.ingress_grpc.GrpcIngress`,
driven through fake handles. No Ray cluster: the proxy test runs Ray Serve's
own gRPC server start-up (`start_grpc_server`, a real `gRPCProxy`) in-process.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import socket
import typing

import grpc
import pytest
from google.protobuf import json_format
from pydantic import ValidationError

from cluster.serve_config import GRPC_SERVICER_FUNCTIONS
from serve_apps import ingress_grpc
from serve_apps.access import AccessDenied
from serve_apps.grpc_status import MAX_DETAILS_BYTES, MAX_ECHOED_CHARS, RpcFailure, grpc_code, shorten, status_details
from serve_apps.ingress_grpc import (
    GrpcIngress,
    chat_chunk_to_proto,
    chat_completion_fields,
    chat_response_to_proto,
    create_session_body,
    denial_failure,
    engine_failure,
    failure_from_exception,
    send_message_body,
    session_event_to_proto,
    tool_results_body,
    turn_error_status,
)
from serve_apps.orchestrator.models import TURN_ERROR_STATUS
from serve_apps.orchestrator.deployment import _error
from serve_apps.orchestrator.models import (
    CompressionEvent,
    CompressionReport,
    CreateSessionRequest,
    DeltaEvent,
    ErrorEvent,
    FinalEvent,
    Message,
    ReasoningEvent,
    RequiresActionEvent,
    SessionEvent,
    StepStats,
    ToolCall,
    ToolCallEvent,
    ToolResultEvent,
    ToolResultsSubmission,
    TurnRequest,
    UsageEvent,
)
from serve_apps.request_checks import MAX_NESTING_DEPTH
from serve_apps.vllm_replica import ServedBy
from warmpath.v1 import agent_pb2, inference_pb2

Code = grpc.StatusCode
OBJECT_SCHEMA = '{"type":"object","properties":{"q":{"type":"string"}},"required":["q"]}'
CALL = ToolCall(id="call_1", name="search", arguments='{"q":"x"}')
REPORT = CompressionReport(
    num_messages_compressed=4, tokens_before=900, tokens_after=300, ledger_size=3, ledger_retained_fraction=1.0
)


# ---- status mapping ----


@pytest.mark.parametrize(
    "http_status, error_code, expected",
    [
        (200, None, Code.OK),
        (201, None, Code.OK),
        (204, None, Code.OK),
        (400, "invalid_limits", Code.INVALID_ARGUMENT),
        (422, "invalid_request", Code.INVALID_ARGUMENT),
        (401, None, Code.UNAUTHENTICATED),
        (403, None, Code.PERMISSION_DENIED),
        (404, "session_not_found", Code.NOT_FOUND),
        (409, "requires_action", Code.FAILED_PRECONDITION),
        (409, "tool_results_mismatch", Code.FAILED_PRECONDITION),
        (409, "session_busy", Code.ABORTED),
        (409, "stale_turn", Code.ABORTED),
        (429, None, Code.RESOURCE_EXHAUSTED),
        (500, None, Code.INTERNAL),
        (502, "model_error", Code.UNAVAILABLE),
        (503, "store_unavailable", Code.UNAVAILABLE),
        (504, None, Code.DEADLINE_EXCEEDED),
        (418, None, Code.UNKNOWN),
    ],
)
def test_grpc_code(http_status, error_code, expected):
    assert grpc_code(http_status, error_code) is expected


@pytest.mark.parametrize(
    "envelope, status, code",
    [
        (_error(404, "no session s1", "session_not_found"), Code.NOT_FOUND, "session_not_found"),
        (_error(422, "1 validation error", "invalid_request"), Code.INVALID_ARGUMENT, "invalid_request"),
        (_error(409, "answer the pending tool calls first", "requires_action"), Code.FAILED_PRECONDITION, "requires_action"),
        (_error(409, "a turn is running", "session_busy"), Code.ABORTED, "session_busy"),
        (_error(503, "session store unavailable: down", "store_unavailable"), Code.UNAVAILABLE, "store_unavailable"),
        ({"status": 500, "body": None}, Code.INTERNAL, "error"),
    ],
)
def test_failure_from_orchestrator_envelope(envelope, status, code):
    failure = RpcFailure.from_envelope(envelope)
    assert (failure.status, failure.code) == (status, code)
    assert failure.message  # always readable


@pytest.mark.parametrize(
    "turn_code, expected",
    [(code, grpc_code(status, code)) for code, status in TURN_ERROR_STATUS.items()]
    + [("max_steps", Code.OK), ("internal", Code.INTERNAL), ("stale_turn", Code.ABORTED), ("model_error", Code.UNAVAILABLE)],
)
def test_turn_error_status(turn_code, expected):
    assert turn_error_status(turn_code) is expected


def _exceptions():
    from ray.exceptions import RayActorError
    from ray.serve._private.common import DeploymentID
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    return [
        (BackPressureError(num_queued_requests=9, max_queued_requests=8), Code.RESOURCE_EXHAUSTED),
        (DeploymentUnavailableError(DeploymentID(name="Orchestrator", app_name="warmpath")), Code.UNAVAILABLE),
        (RayActorError(), Code.UNAVAILABLE),
        (asyncio.TimeoutError(), Code.DEADLINE_EXCEEDED),
        # Another actor's timeout, as Ray hands it on: its text is the remote traceback.
        (TimeoutError("boom: Traceback (most recent call last): pid=4242, ip=10.0.0.7, redis://10.0.0.9"),
         Code.DEADLINE_EXCEEDED),
        (RuntimeError("boom"), Code.INTERNAL),
        (RpcFailure(Code.NOT_FOUND, "session_not_found", "no session"), Code.NOT_FOUND),
    ]


class _RecordingContext:
    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details

    def set_trailing_metadata(self, metadata):
        self.trailing = list(metadata)


@pytest.mark.parametrize("retry_after_s, expected", [(0.2, [("retry-after", "1")]), (2.01, [("retry-after", "3")]), (None, None)])
def test_a_failure_with_a_known_wait_carries_retry_after_in_trailing_metadata(retry_after_s, expected):
    context = _RecordingContext()
    denial_failure(AccessDenied(429, "rate_limited", "slow down", retry_after_s)).set_on(context)
    assert (context.code, context.details) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "slow down")
    assert getattr(context, "trailing", None) == expected


@pytest.mark.parametrize("retry_after_s, expected", [(None, ("retry-after", "1")), (4.5, ("retry-after", "5"))])
def test_back_pressure_suggests_when_to_retry(retry_after_s, expected):
    from ray.serve.exceptions import BackPressureError

    err = BackPressureError(num_queued_requests=9, max_queued_requests=8, retry_after_s=retry_after_s)
    context = _RecordingContext()
    failure_from_exception(err).set_on(context)
    assert (context.code, context.trailing) == (grpc.StatusCode.RESOURCE_EXHAUSTED, [expected])


@pytest.mark.parametrize("err, expected", _exceptions())
def test_failure_from_exception(err, expected):
    failure = failure_from_exception(err)
    assert failure.status is expected
    assert "boom" not in failure.message  # internal details stay in the log


@pytest.mark.parametrize(
    "error, status, code, message",
    [
        ({"message": "prompt too long", "type": "BadRequestError", "code": 400}, Code.INVALID_ARGUMENT,
         "BadRequestError", "prompt too long"),
        # The engine's own failure: its text stays in the log, as over HTTP.
        ({"message": "engine dead at /opt/vllm/worker.py:1432", "type": "InternalServerError", "code": 500},
         Code.INTERNAL, "InternalServerError", "Internal Server Error"),
        ({"message": "odd"}, Code.INTERNAL, "InternalServerError", "Internal Server Error"),
        # as Ray Serve LLM wraps an engine's refusal: the details carry the text alone
        ({"message": "Message: max_tokens must be at least 1, got -1. (Request ID: 5f2a), Internal exception: "
                     "ray.llm._internal.serve.core.configs.openai_api_models.OpenAIHTTPException (Request ID: 5f2a), "
                     "original exception: ", "type": "OpenAIHTTPException", "code": 400},
         Code.INVALID_ARGUMENT, "BadRequestError", "max_tokens must be at least 1, got -1."),
    ],
)
def test_engine_failure(error, status, code, message):
    failure = engine_failure(error)
    assert (failure.status, failure.code, failure.message) == (status, code, message)


def _client_errors():
    from ray.exceptions import RayTaskError
    from vllm.exceptions import VLLMNotFoundError, VLLMValidationError

    def wrapped_by_ray(err: Exception) -> Exception:
        """`err` as a handle call re-raises it from another process."""
        return RayTaskError("chat", f"Traceback (most recent call last):\n  ...\n{err}", err).as_instanceof_cause()

    try:
        ingress_grpc.ChatCompletionRequest(
            model="m", messages=[{"role": "user", "content": "hi"}],
            tools=[{"type": "function", "function": {"name": "a", "parameters": [1]}}],
        )
    except ValidationError as err:
        schema_error = err
    choice = VLLMValidationError("The tool specified in `tool_choice` does not match any of the specified `tools`",
                                 parameter="tool_choice")
    return [
        pytest.param(choice, Code.INVALID_ARGUMENT, "BadRequestError",
                     "The tool specified in `tool_choice` does not match any of the specified `tools` (parameter=tool_choice)",
                     id="vllm-validation"),
        pytest.param(VLLMValidationError("When using `tool_choice`, `tools` must be set."), Code.INVALID_ARGUMENT,
                     "BadRequestError", "When using `tool_choice`, `tools` must be set.", id="vllm-validation-no-param"),
        pytest.param(VLLMNotFoundError("no adapter named x"), Code.INVALID_ARGUMENT, "BadRequestError", "no adapter named x",
                     id="vllm-client-error"),
        pytest.param(wrapped_by_ray(VLLMValidationError("bad tool_choice")), Code.INVALID_ARGUMENT, "BadRequestError",
                     "bad tool_choice", id="raised-in-a-replica"),
        pytest.param(schema_error, Code.INVALID_ARGUMENT, "invalid_parameter",
                     "tools[0].function.parameters: Input should be a valid dictionary", id="pydantic"),
    ]


@pytest.mark.parametrize("err, status, code, message", _client_errors())
def test_client_errors_are_classified_as_over_http(err, status, code, message):
    """What Ray Serve LLM calls a client error is the caller's fault, with the same one-line text as HTTP's 400."""
    failure = failure_from_exception(err, "req-1")
    assert (failure.status, failure.code, failure.message) == (status, code, message)


# ---- status details: bounded whatever the caller sent ----

LONG_ID = "x" * 100_000


@pytest.mark.parametrize(
    "message, expected",
    [
        ("no session s1", "no session s1"),
        (f"no session {LONG_ID}", f"no session {'x' * MAX_ECHOED_CHARS}..."),
        (f"unknown service '{LONG_ID}'", f"unknown service '{'x' * MAX_ECHOED_CHARS}...'"),
        (f"tool `{LONG_ID}` and tool `{LONG_ID}`", f"tool `{'x' * 64}...` and tool `{'x' * 64}...`"),
        ("y" * MAX_ECHOED_CHARS, "y" * MAX_ECHOED_CHARS),
        ("tools[0].parameters_json: must be a JSON object", "tools[0].parameters_json: must be a JSON object"),
    ],
    ids=["short", "long-id", "quoted-long-id", "two-long-names", "at-the-limit", "field-path"],
)
def test_status_details_shorten_echoed_tokens(message, expected):
    assert status_details(message) == expected


@pytest.mark.parametrize("message", ["word " * 10_000, "é " * 10_000, "€ü " * 5_000], ids=["ascii", "2-byte", "3-byte"])
def test_status_details_fit_grpc_metadata_limits(message):
    details = status_details(message)
    assert len(details.encode()) <= MAX_DETAILS_BYTES and details.endswith("...")
    assert message.startswith(details[: -len("...")])
    assert 3 * len(details.encode()) < 8192  # percent-encoded in `grpc-message`: under the 8 KiB soft limit


@pytest.mark.parametrize("text, expected", [("abc", "abc"), ("a" * 65, "a" * 64 + "...")])
def test_shorten(text, expected):
    assert shorten(text) == expected


def test_failure_from_an_envelope_echoing_a_long_id_is_bounded():
    failure = RpcFailure.from_envelope(_error(404, f"no session {LONG_ID}", "session_not_found"))
    context = _RecordingContext()
    failure.set_on(context)
    assert (context.code, context.details) == (Code.NOT_FOUND, f"no session {'x' * 64}...")
    assert failure.message == context.details  # a stream's last message says the same


async def _served_status(failure: RpcFailure) -> tuple[grpc.StatusCode, str]:
    """Code and details a grpcio client receives from a grpcio server that sets `failure` on its context."""
    async def handler(request, context):
        failure.set_on(context)
        return b""

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("test.Echo", {"Fail": grpc.unary_unary_rpc_method_handler(handler)})]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await channel.unary_unary("/test.Echo/Fail")(b"", timeout=10)
    finally:
        await server.stop(None)
    return info.value.code(), info.value.details()


@pytest.mark.parametrize(
    "message, expected",
    [(f"no session {LONG_ID}", f"no session {'x' * 64}..."), ("é " * 50_000, None)],
    ids=["long-id", "long-non-ascii-text"],
)
def test_long_details_reach_a_real_client_with_their_code(message, expected):
    """Unbounded, these details would exceed the client's metadata limit: RESOURCE_EXHAUSTED instead of NOT_FOUND."""
    code, details = _run(_served_status(RpcFailure(Code.NOT_FOUND, "session_not_found", message)))
    assert code is Code.NOT_FOUND
    assert details == (expected or status_details(message))


# ---- agent requests: protobuf -> HTTP API bodies ----


def _tool(**overrides) -> agent_pb2.Tool:
    fields = {"name": "search", "description": "find", "parameters_json": OBJECT_SCHEMA, "client": agent_pb2.ClientExecution()}
    fields.update(overrides)
    return agent_pb2.Tool(**fields)


@pytest.mark.parametrize(
    "request_pb, expected_http_body",
    [
        (
            agent_pb2.CreateSessionRequest(model="m"),
            {"model": "m"},
        ),
        (
            agent_pb2.CreateSessionRequest(
                model="m",
                system_prompt="be brief",
                tools=[_tool(required_permissions=["orders:read"])],
                limits=agent_pb2.SessionLimits(max_steps_per_turn=3, compress_below_fraction=0.25),
            ),
            {
                "model": "m",
                "system_prompt": "be brief",
                "tools": [
                    {
                        "name": "search", "description": "find", "required_permissions": ["orders:read"],
                        "parameters": json.loads(OBJECT_SCHEMA),
                        "execution": {"kind": "client"},
                    }
                ],
                "limits": {"max_steps_per_turn": 3, "compress_below_fraction": 0.25},
            },
        ),
        (
            agent_pb2.CreateSessionRequest(
                model="m",
                tools=[_tool(parameters_json="", http=agent_pb2.HttpExecution(url="http://127.0.0.1:9/t", timeout_s=2.5))],
            ),
            {
                "model": "m",
                "tools": [
                    {
                        "name": "search", "description": "find",
                        "execution": {"kind": "http", "url": "http://127.0.0.1:9/t", "timeout_s": 2.5},
                    }
                ],
            },
        ),
        (
            agent_pb2.CreateSessionRequest(model="m", tools=[_tool(http=agent_pb2.HttpExecution(url="https://t.example/x"))]),
            {
                "model": "m",
                "tools": [
                    {
                        "name": "search", "description": "find", "parameters": json.loads(OBJECT_SCHEMA),
                        "execution": {"kind": "http", "url": "https://t.example/x"},
                    }
                ],
            },
        ),
    ],
    ids=["defaults", "client-tool-and-limits", "http-tool-default-schema", "http-tool-default-timeout"],
)
def test_create_session_body_equals_http_body(request_pb, expected_http_body):
    # Same validated request as the HTTP API builds from its JSON body.
    assert CreateSessionRequest.model_validate(create_session_body(request_pb)) == CreateSessionRequest.model_validate(
        expected_http_body
    )


def test_create_session_bad_schema_json_names_the_tool():
    with pytest.raises(RpcFailure) as info:
        create_session_body(agent_pb2.CreateSessionRequest(model="m", tools=[_tool(), _tool(parameters_json="{nope")]))
    assert info.value.status is Code.INVALID_ARGUMENT
    assert info.value.message.startswith("tools[1].parameters_json: not JSON")
    with pytest.raises(RpcFailure) as info:
        create_session_body(agent_pb2.CreateSessionRequest(
            model="m", tools=[_tool(parameters_json='{"a":' * 100_000 + "1" + "}" * 100_000)]))
    assert (info.value.status, info.value.message) == (Code.INVALID_ARGUMENT, "tools[0].parameters_json: nested too deeply to parse")
    # Nested a few hundred levels, it parses, and Ray's pickling of the call to the orchestrator failed (INTERNAL).
    with pytest.raises(RpcFailure) as info:
        create_session_body(agent_pb2.CreateSessionRequest(
            model="m", tools=[_tool(parameters_json='{"a":' * 600 + "1" + "}" * 600)]))
    assert (info.value.status, info.value.message) == (
        Code.INVALID_ARGUMENT, f"tools[0].parameters_json: nests arrays or objects more than {MAX_NESTING_DEPTH} levels deep")
    # An integer too long for Python to convert is malformed JSON over HTTP (400 invalid_json) too.
    with pytest.raises(RpcFailure) as info:
        create_session_body(agent_pb2.CreateSessionRequest(
            model="m", tools=[_tool(parameters_json='{"type": "object", "maxLength": ' + "9" * 5000 + "}")]))
    assert info.value.status is Code.INVALID_ARGUMENT and info.value.message.startswith("tools[0].parameters_json: not JSON")


@pytest.mark.parametrize(
    "request_pb, location",
    [
        (agent_pb2.CreateSessionRequest(model="m", tools=[agent_pb2.Tool(name="search")]), "tools.0.execution"),
        (agent_pb2.CreateSessionRequest(model="m", tools=[_tool(parameters_json='{"type":"array"}')]), "tools.0.parameters"),
        (agent_pb2.CreateSessionRequest(model=""), "model"),
        (agent_pb2.CreateSessionRequest(model="m", limits=agent_pb2.SessionLimits(max_steps_per_turn=0)), "limits.max_steps_per_turn"),
    ],
)
def test_invalid_create_session_fails_validation_at_the_field(request_pb, location):
    # The orchestrator validates with this model and answers 422 -> INVALID_ARGUMENT.
    with pytest.raises(ValidationError) as info:
        CreateSessionRequest.model_validate(create_session_body(request_pb))
    assert location in [".".join(str(p) for p in e["loc"])[: len(location)] for e in info.value.errors()]


@pytest.mark.parametrize(
    "request_pb, expected",
    [
        (agent_pb2.SendMessageRequest(session_id="s", content="hi"), TurnRequest(content="hi")),
        (
            agent_pb2.SendMessageRequest(session_id="s", content="hi", tool_choice="required"),
            TurnRequest(content="hi", tool_choice="required"),
        ),
        (
            agent_pb2.SendMessageRequest(session_id="s", content="hi", tool_choice="search"),
            TurnRequest(content="hi", tool_choice="search"),
        ),
    ],
)
def test_send_message_body(request_pb, expected):
    assert TurnRequest.model_validate(send_message_body(request_pb)) == expected


def test_tool_results_body_keeps_empty_content_and_flags():
    request_pb = agent_pb2.SubmitToolResultsRequest(
        session_id="s",
        results=[agent_pb2.ToolResult(tool_call_id="a", content=""), agent_pb2.ToolResult(tool_call_id="b", content="no", is_error=True)],
    )
    submission = ToolResultsSubmission.model_validate(tool_results_body(request_pb))
    assert [(r.tool_call_id, r.content, r.is_error) for r in submission.results] == [("a", "", False), ("b", "no", True)]


# ---- agent responses and events: HTTP API data -> protobuf ----


def _event_kinds() -> set[str]:
    union = typing.get_args(SessionEvent)[0]
    return {member.model_fields["kind"].default for member in typing.get_args(union)}


def test_every_session_event_kind_has_a_oneof_field():
    oneof = agent_pb2.SessionEvent.DESCRIPTOR.oneofs_by_name["event"]
    assert {field.name for field in oneof.fields} == _event_kinds()


EVENTS = [
    DeltaEvent(text="Hel"),
    ReasoningEvent(text="First, the order."),
    ToolCallEvent(call=CALL),
    ToolResultEvent(tool_call_id="call_1", status="timeout", content="", is_truncated=True),
    FinalEvent(message=Message(role="assistant", content="done")),
    FinalEvent(message=Message(role="assistant", content=None, tool_calls=[CALL])),
    FinalEvent(message=Message(role="assistant", content="4", reasoning="Two and two."), is_truncated=True),
    UsageEvent(stats=StepStats(step_index=0, prefix_fingerprint="ab", prompt_tokens=120, cached_tokens=96)),
    UsageEvent(
        stats=StepStats(
            step_index=2, prefix_fingerprint="ab", prompt_tokens=9, cached_tokens=0, completion_tokens=4, compression=REPORT
        )
    ),
    RequiresActionEvent(tool_calls=[CALL, ToolCall(id="call_2", name="lookup", arguments="{}")]),
    ErrorEvent(code="context_overflow", message="the prompt no longer fits"),
    CompressionEvent(report=REPORT),
]


def _contains(actual, expected) -> bool:
    """`actual` has every value of `expected`; anything extra is a protobuf default."""
    if isinstance(expected, dict):
        return all(_contains(actual.get(k), v) for k, v in expected.items()) and all(
            v in ("", 0, 0.0, False, []) for k, v in actual.items() if k not in expected
        )
    if isinstance(expected, list):
        return len(actual) == len(expected) and all(_contains(a, e) for a, e in zip(actual, expected))
    return actual == expected


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: e.kind)
def test_session_event_round_trip(event):
    wire = event.model_dump(exclude_none=True)  # what the orchestrator yields
    proto = session_event_to_proto(wire)
    assert proto.WhichOneof("event") == event.kind
    back = json_format.MessageToDict(
        getattr(proto, event.kind), preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    assert _contains(back, {k: v for k, v in wire.items() if k != "kind"})


def test_a_field_of_a_later_release_is_left_out_not_refused():
    """A rolling update changes the orchestrator and the gRPC ingress one at a time: an event field this ingress
    does not know failed the whole turn stream."""
    assert session_event_to_proto({"kind": "delta", "text": "x", "new_field": 1}).delta.text == "x"
    # An event of a kind it does not know is not sent: an empty `SessionEvent` reached the client as no event.
    assert session_event_to_proto({"kind": "thought_summary", "text": "x"}) is None
    assert session_event_to_proto({"kind": "delta"}).WhichOneof("event") == "delta"  # no fields: still that event


def _fields(model) -> set[str]:
    return set(model.model_fields) - {"kind"}


@pytest.mark.parametrize("event_model", typing.get_args(typing.get_args(SessionEvent)[0]), ids=lambda m: m.__name__)
def test_every_field_of_every_session_event_is_in_the_proto(event_model):
    """Unknown fields are left out when read (a later release's); so a field added to the models and not to the
    proto would vanish silently: each must be there, and the transcript's message fields in `ChatMessage`."""
    kind = event_model.model_fields["kind"].default
    proto_fields = set(agent_pb2.SessionEvent.DESCRIPTOR.fields_by_name[kind].message_type.fields_by_name)
    assert _fields(event_model) <= proto_fields
    assert _fields(Message) <= set(inference_pb2.ChatMessage.DESCRIPTOR.fields_by_name)


def _get_session_body() -> dict:
    """Shaped like `Orchestrator.get_session`'s body."""
    steps = [
        StepStats(step_index=0, prefix_fingerprint="ab", prompt_tokens=100, cached_tokens=0, completion_tokens=5),
        StepStats(step_index=1, prefix_fingerprint="ab", prompt_tokens=140, cached_tokens=96, completion_tokens=7, compression=REPORT),
    ]
    transcript = [
        Message(role="user", content="find x"),
        Message(role="assistant", content=None, tool_calls=[CALL]),
        Message(role="tool", content="found", tool_call_id="call_1", name="search"),
    ]
    return {
        "session_id": "s1",
        "model": "warmpath-tiny",
        "prefix_fingerprint": "ab",
        "transcript": [m.model_dump(exclude_none=True) for m in transcript],
        "num_messages_total": 3,
        "pending_tool_calls": [CALL.model_dump()],
        "tokens": {
            "prefix_tokens": 60, "message_tokens": [5, 12, 4], "total_tokens": 81,
            "context_window_tokens": 2048, "output_reserve_tokens": 512, "remaining_tokens": 1455,
        },
        "cache": {
            "cacheable_prefix_tokens": 60, "prompt_tokens": 240, "cached_tokens": 96, "hit_ratio": 0.4,
            "num_compressions": 1, "steps": [s.model_dump() for s in steps],
        },
    }


def test_get_session_response_mirrors_the_http_body():
    body = _get_session_body()
    proto = json_format.ParseDict(body, agent_pb2.GetSessionResponse())
    assert proto.transcript[1].tool_calls[0].arguments == '{"q":"x"}'
    assert not proto.transcript[1].HasField("content")
    assert proto.transcript[2].tool_call_id == "call_1"
    assert list(proto.tokens.message_tokens) == [5, 12, 4]
    assert proto.cache.hit_ratio == pytest.approx(0.4)
    assert not proto.cache.steps[0].HasField("compression")
    assert proto.cache.steps[1].compression.tokens_after == 300
    back = json_format.MessageToDict(proto, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    assert _contains(back, json_format.MessageToDict(proto, preserving_proto_field_name=True))
    assert back["cache"]["steps"][1]["compression"] == REPORT.model_dump()


# ---- inference: protobuf <-> OpenAI ----


def _chat_request(**overrides) -> inference_pb2.ChatCompletionRequest:
    fields = {
        "messages": [
            inference_pb2.ChatMessage(role="system", content="be brief"),
            inference_pb2.ChatMessage(role="user", content="find x"),
            inference_pb2.ChatMessage(role="assistant", tool_calls=[inference_pb2.ToolCall(id="c1", name="search", arguments='{"q":"x"}')]),
            inference_pb2.ChatMessage(role="tool", content="found", tool_call_id="c1", name="search"),
        ],
    }
    fields.update(overrides)
    return inference_pb2.ChatCompletionRequest(**fields)


def test_chat_messages_become_openai_wire_messages():
    fields = chat_completion_fields(_chat_request())
    assert fields["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "find x"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q":"x"}'}}],
        },
        {"role": "tool", "content": "found", "tool_call_id": "c1", "name": "search"},
    ]
    assert fields["tools"] is None
    assert set(fields) == {"messages", "tools"}  # unset options stay the engine's defaults


@pytest.mark.parametrize(
    "tool_choice, expected",
    [
        ("auto", "auto"),
        ("none", "none"),
        ("required", "required"),
        ("search", {"type": "function", "function": {"name": "search"}}),
    ],
)
def test_tool_choice(tool_choice, expected):
    tools = [inference_pb2.FunctionTool(name="search", description="find", parameters_json=OBJECT_SCHEMA)]
    fields = chat_completion_fields(_chat_request(tools=tools, tool_choice=tool_choice, max_tokens=64, temperature=0.0))
    assert fields["tool_choice"] == expected
    assert (fields["max_tokens"], fields["temperature"]) == (64, 0.0)
    assert fields["tools"][0]["function"]["parameters"]["required"] == ["q"]
    # The engine's own request model accepts what we build.
    ingress_grpc.ChatCompletionRequest(model="m", stream=False, **fields)


def test_sampling_options_and_response_format_carry_over_as_the_http_api_names_them():
    schema = {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}
    form = inference_pb2.ResponseFormat(type="json_schema", name="order", schema_json=json.dumps(schema), strict=True)
    fields = chat_completion_fields(_chat_request(
        stop=["\n\n", "END"], seed=7, top_p=0.5, parallel_tool_calls=False, response_format=form))
    assert {name: fields[name] for name in ("stop", "seed", "top_p", "parallel_tool_calls")} == {
        "stop": ["\n\n", "END"], "seed": 7, "top_p": 0.5, "parallel_tool_calls": False}
    assert fields["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "order", "schema": schema, "strict": True}}
    request = ingress_grpc.ChatCompletionRequest(model="m", stream=False, **fields)  # the engine's model takes it
    assert request.response_format.json_schema.json_schema == schema
    json_object = chat_completion_fields(_chat_request(response_format=inference_pb2.ResponseFormat(type="json_object")))
    assert json_object["response_format"] == {"type": "json_object"}


@pytest.mark.parametrize("form, message", [
    (inference_pb2.ResponseFormat(type="yaml"), "response_format.type: 'yaml' is not one of text, json_object, json_schema"),
    (inference_pb2.ResponseFormat(type="json_schema"), "response_format.schema_json: must be a JSON object (a JSON Schema), not empty"),
    (inference_pb2.ResponseFormat(type="json_schema", schema_json="[1]"), "response_format.schema_json: must be a JSON object (a JSON Schema), not an array"),
    (inference_pb2.ResponseFormat(type="json_schema", schema_json="{"), "response_format.schema_json: not JSON: "),
    (inference_pb2.ResponseFormat(type="json_schema", schema_json="[" * 200_000 + "]" * 200_000),
     "response_format.schema_json: nested too deeply to parse"),  # a client's error, not an INTERNAL
    (inference_pb2.ResponseFormat(type="text", schema_json="{}"), "response_format: name, schema_json and strict belong to type json_schema, not text"),
])
def test_a_response_format_the_api_cannot_pass_on_is_invalid_argument(form, message):
    with pytest.raises(RpcFailure) as info:
        chat_completion_fields(_chat_request(response_format=form))
    assert info.value.status is Code.INVALID_ARGUMENT
    assert info.value.message.startswith(message), info.value.message


def test_function_tool_without_schema_gets_an_empty_object_schema():
    fields = chat_completion_fields(_chat_request(tools=[inference_pb2.FunctionTool(name="now")]))
    function = {"name": "now", "description": "", "parameters": {"type": "object", "properties": {}}}
    assert fields["tools"] == [{"type": "function", "function": function}]


@pytest.mark.parametrize(
    "messages, prefix",
    [
        ([inference_pb2.ChatMessage(role="robot", content="x")], "messages[0].role: "),
        ([inference_pb2.ChatMessage(role="user", content="x"), inference_pb2.ChatMessage(role="tool", content="x")], "messages[1]: "),
        ([inference_pb2.ChatMessage(role="user")], "messages[0]: "),
        ([inference_pb2.ChatMessage(role="user", content="x", reasoning="y")],
         "messages[0]: Value error, reasoning is only allowed on assistant messages"),
    ],
    ids=["unknown-role", "tool-without-call-id", "user-without-content", "reasoning-off-assistant"],
)
def test_invalid_chat_messages(messages, prefix):
    with pytest.raises(RpcFailure) as info:
        chat_completion_fields(inference_pb2.ChatCompletionRequest(messages=messages))
    assert info.value.status is Code.INVALID_ARGUMENT
    assert info.value.message.startswith(prefix), info.value.message
    assert "\n" not in info.value.message and "errors.pydantic.dev" not in info.value.message  # one readable line


def test_an_assistant_messages_reasoning_reaches_the_engine():
    """Sent back as the engine's `reasoning` field; its template decides whether to render it."""
    fields = chat_completion_fields(inference_pb2.ChatCompletionRequest(messages=[
        inference_pb2.ChatMessage(role="user", content="2+2?"),
        inference_pb2.ChatMessage(role="assistant", content="4", reasoning="Two and two make four."),
        inference_pb2.ChatMessage(role="user", content="and 3+3?"),
    ]))
    assert fields["messages"][1] == {"role": "assistant", "content": "4", "reasoning": "Two and two make four."}
    assert "reasoning" not in fields["messages"][0] and "reasoning" not in fields["messages"][2]


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_the_models_reasoning_reaches_the_client(field):
    """A reasoning model served with a `reasoning_parser` answers its reasoning apart from its content."""
    response = {"id": "chatcmpl-2", "model": "m", "choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "4", field: "Two and two make four."}}]}
    assert chat_response_to_proto(response, "r").reasoning == "Two and two make four."
    assert not chat_response_to_proto(OPENAI_RESPONSE, "r").HasField("reasoning")
    chunk = {"id": "c", "model": "m", "choices": [{"index": 0, "delta": {field: "Two and"}, "finish_reason": None}]}
    assert chat_chunk_to_proto(chunk, "r") == inference_pb2.ChatCompletionChunk(
        id="c", model="m", reasoning="Two and", replica_id="r")


OPENAI_RESPONSE = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "warmpath-tiny",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q":"x"}'}}],
            },
            "finish_reason": "tool_calls",
        }
    ],
    "usage": {"prompt_tokens": 120, "completion_tokens": 9, "total_tokens": 129, "prompt_tokens_details": {"cached_tokens": 96}},
}


def test_chat_response_to_proto():
    proto = chat_response_to_proto(OPENAI_RESPONSE, "replica-a")
    assert (proto.id, proto.model, proto.finish_reason, proto.replica_id) == ("chatcmpl-1", "warmpath-tiny", "tool_calls", "replica-a")
    assert not proto.HasField("content")
    assert [(c.id, c.name, c.arguments) for c in proto.tool_calls] == [("c1", "search", '{"q":"x"}')]
    assert (proto.usage.prompt_tokens, proto.usage.completion_tokens, proto.usage.cached_tokens) == (120, 9, 96)


def _tool_call_payload(call: dict) -> dict:
    return {"id": "c", "model": "m", "choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}


@pytest.mark.parametrize(
    "payload, expected",
    [
        (
            {"id": "c", "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}, "finish_reason": None}]},
            inference_pb2.ChatCompletionChunk(id="c", model="m", content="Hel", replica_id="r"),
        ),
        (
            _tool_call_payload({"index": 1, "id": "c2", "type": "function", "function": {"name": "search", "arguments": ""}}),
            inference_pb2.ChatCompletionChunk(
                id="c", model="m", replica_id="r", tool_calls=[inference_pb2.ToolCallDelta(index=1, id="c2", name="search")]
            ),
        ),
        (
            _tool_call_payload({"index": 1, "function": {"arguments": '{"q"'}}),
            inference_pb2.ChatCompletionChunk(
                id="c", model="m", replica_id="r", tool_calls=[inference_pb2.ToolCallDelta(index=1, arguments='{"q"')]
            ),
        ),
        (
            {"id": "c", "model": "m", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
            inference_pb2.ChatCompletionChunk(id="c", model="m", finish_reason="stop", replica_id="r"),
        ),
        (
            {"id": "c", "model": "m", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2, "prompt_tokens_details": None}},
            inference_pb2.ChatCompletionChunk(
                id="c", model="m", replica_id="r", usage=inference_pb2.Usage(prompt_tokens=7, completion_tokens=2)
            ),
        ),
    ],
    ids=["text", "tool-call-start", "tool-call-arguments", "finish", "usage"],
)
def test_chat_chunk_to_proto(payload, expected):
    assert chat_chunk_to_proto(payload, "r") == expected


# ---- GrpcIngress: RPC contract and status ordering, through fake handles ----


class FakeContext:
    """Ray Serve's `grpc_context` surface the ingress uses."""

    def __init__(self, metadata=()):
        self._metadata = list(metadata)
        self.code = None
        self.details = None
        self.trailing_metadata = []

    def invocation_metadata(self):
        return self._metadata

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details

    def set_trailing_metadata(self, metadata):
        self.trailing_metadata = list(metadata)


class FakeMethod:
    def __init__(self, result):
        self._result = result
        self.calls = []

    def remote(self, *args):
        self.calls.append(args)
        result = self._result(*args) if callable(self._result) else self._result
        if inspect.isasyncgen(result):
            return result

        async def value():
            return result

        return value()


class FakeHandle:
    def __init__(self, **methods):
        self._methods = {name: FakeMethod(result) for name, result in methods.items()}
        self.options_calls = []

    def options(self, **options):
        self.options_calls.append(options)
        return self

    def __getattr__(self, name):
        return self._methods[name]


async def _items(*items):
    for item in items:
        yield item


# Auth off: the guard admits every call as the anonymous caller without Redis.
NO_AUTH = {"access": {"is_auth_enabled": False}}


def _ingress(llm=None, orchestrator=None) -> GrpcIngress:
    return GrpcIngress(llm or FakeHandle(), orchestrator or FakeHandle(), "warmpath-tiny", NO_AUTH)


def _run(coro):
    return asyncio.run(coro)


async def _collect(stream, context):
    """Messages of a stream, each with the status code the context held when it was yielded."""
    return [(message, context.code) async for message in stream]


def test_ingress_implements_every_rpc():
    for pb, service in ((inference_pb2, "Inference"), (agent_pb2, "Agent")):
        for method in pb.DESCRIPTOR.services_by_name[service].methods:
            implementation = getattr(GrpcIngress, method.name)
            assert "grpc_context" in inspect.signature(implementation).parameters
            assert inspect.isasyncgenfunction(implementation) is method.server_streaming, method.name
            if not method.server_streaming:
                assert inspect.iscoroutinefunction(implementation), method.name


def test_create_session_ok_and_error():
    orchestrator = FakeHandle(create_session=lambda body, caller: {"status": 201, "body": {"session_id": "s1", "prefix_fingerprint": "ab"}})
    context = FakeContext()
    response = _run(_ingress(orchestrator=orchestrator).CreateSession(agent_pb2.CreateSessionRequest(model="warmpath-tiny"), context))
    assert (response.session_id, response.prefix_fingerprint, context.code) == ("s1", "ab", None)
    assert orchestrator.create_session.calls[0][0]["model"] == "warmpath-tiny"

    orchestrator = FakeHandle(create_session=_error(404, 'model "x" is not served here', "model_not_found"))
    context = FakeContext()
    response = _run(_ingress(orchestrator=orchestrator).CreateSession(agent_pb2.CreateSessionRequest(model="x"), context))
    assert response == agent_pb2.CreateSessionResponse()
    assert (context.code, context.details) == (Code.NOT_FOUND, 'model "x" is not served here')


@pytest.mark.parametrize(
    "envelope, expected",
    [({"status": 204, "body": None}, None), (_error(404, "no session s1", "session_not_found"), Code.NOT_FOUND)],
)
def test_delete_session(envelope, expected):
    context = FakeContext()
    _run(_ingress(orchestrator=FakeHandle(delete_session=envelope)).DeleteSession(agent_pb2.DeleteSessionRequest(session_id="s1"), context))
    assert context.code == expected


def test_get_session():
    context = FakeContext()
    orchestrator = FakeHandle(get_session={"status": 200, "body": _get_session_body()})
    response = _run(_ingress(orchestrator=orchestrator).GetSession(agent_pb2.GetSessionRequest(session_id="s1"), context))
    assert (response.session_id, response.cache.cached_tokens, context.code) == ("s1", 96, None)


def test_unexpected_orchestrator_reply_is_internal():
    context = FakeContext()
    orchestrator = FakeHandle(get_session={"status": 200, "body": {"session_id": {"surprise": 1}}})
    _run(_ingress(orchestrator=orchestrator).GetSession(agent_pb2.GetSessionRequest(session_id="s1"), context))
    assert context.code is Code.INTERNAL
    assert "surprise" not in context.details


@pytest.mark.parametrize("method, request_message, reply", [
    ("GetSession", agent_pb2.GetSessionRequest(session_id="s1"),
     {"status": 200, "body": {"session_id": "s1", "cache": {"num_replays": 3}, "transcript": [
         {"role": "user", "content": "hi", "audio": {"id": "a1"}}]}}),
    ("CreateSession", agent_pb2.CreateSessionRequest(model="m"),
     {"status": 201, "body": {"session_id": "s1", "prefix_fingerprint": "ab", "region": "eu"}}),
])
def test_a_field_a_later_orchestrator_adds_is_left_out_of_the_reply(method, request_message, reply):
    """A rolling update changes the orchestrator and this ingress one at a time: read strictly, every GetSession
    failed INTERNAL from the first orchestrator that added a field (`cache.num_steps` once) until the ingress
    followed, while HTTP passed the body through."""
    context = FakeContext()
    handle_name = "get_session" if method == "GetSession" else "create_session"
    orchestrator = FakeHandle(**{handle_name: reply})
    answer = _run(getattr(_ingress(orchestrator=orchestrator), method)(request_message, context))
    assert context.code is None and answer.session_id == "s1"


def _turn(*items):
    return lambda session_id, body, caller, carrier, idempotency_key: _items(*items)


@pytest.mark.parametrize(
    "stream, expected_kinds, expected_codes",
    [
        (
            _turn(
                {"status": 200},
                DeltaEvent(text="hi").model_dump(),
                FinalEvent(message=Message(role="assistant", content="hi")).model_dump(exclude_none=True),
            ),
            ["delta", "final"],
            [None, None],
        ),
        (
            _turn({"status": 200}, DeltaEvent(text="h").model_dump(), {"kind": "error", "code": "model_error", "message": "engine died"}),
            ["delta", "error"],
            [None, Code.UNAVAILABLE],  # set before the error event, so Ray ships it
        ),
        (
            _turn({"status": 200}, {"kind": "error", "code": "max_steps", "message": "the turn used all 8 steps"}),
            ["error"],
            [None],
        ),
        (
            _turn(_error(404, "no session s9", "session_not_found")),
            ["error"],
            [Code.NOT_FOUND],
        ),
        (
            _turn(_error(409, "answer the pending tool calls ['c1'] first", "requires_action")),
            ["error"],
            [Code.FAILED_PRECONDITION],
        ),
        (  # an event of a kind a later release's orchestrator sends, during a rolling update: not sent on
            _turn({"status": 200}, {"kind": "thought_summary", "text": "x"},
                  FinalEvent(message=Message(role="assistant", content="hi")).model_dump(exclude_none=True)),
            ["final"],
            [None],
        ),
    ],
    ids=["completed", "failed-midway", "max-steps", "unknown-session", "pending-calls", "later-release-event"],
)
def test_send_message_stream_and_status(stream, expected_kinds, expected_codes):
    orchestrator = FakeHandle(send_message=stream)
    context = FakeContext()
    request = agent_pb2.SendMessageRequest(session_id="s1", content="hi")
    got = _run(_collect(_ingress(orchestrator=orchestrator).SendMessage(request, context), context))
    assert [m.WhichOneof("event") for m, _ in got] == expected_kinds
    assert [code for _, code in got] == expected_codes
    assert orchestrator.options_calls == [{"stream": True}]
    assert orchestrator.send_message.calls[0][:2] == ("s1", {"content": "hi"})


def test_turn_failure_event_carries_the_envelope_error():
    orchestrator = FakeHandle(submit_tool_results=_turn(_error(409, "a turn is running", "session_busy")))
    context = FakeContext()
    request = agent_pb2.SubmitToolResultsRequest(session_id="s1", results=[agent_pb2.ToolResult(tool_call_id="c1", content="ok")])
    [(event, code)] = _run(_collect(_ingress(orchestrator=orchestrator).SubmitToolResults(request, context), context))
    assert (event.error.code, event.error.message) == ("session_busy", "a turn is running")
    assert (code, context.details) == (Code.ABORTED, "a turn is running")
    assert context.trailing_metadata == [("retry-after", "1")]


def test_orchestrator_crash_mid_turn_is_an_interrupted_turn():
    """As over HTTP (503 turn_interrupted): the turn may have committed, and a retry with its key is safe."""
    async def crash(session_id, body, caller, carrier, idempotency_key):
        yield {"status": 200}
        yield DeltaEvent(text="h").model_dump()
        raise RuntimeError("replica lost")

    context = FakeContext()
    ingress = _ingress(orchestrator=FakeHandle(send_message=crash))
    got = _run(_collect(ingress.SendMessage(agent_pb2.SendMessageRequest(session_id="s1", content="hi"), context), context))
    assert [m.WhichOneof("event") for m, _ in got] == ["delta", "error"]
    assert got[-1][0].error.code == "turn_interrupted" and got[-1][1] is Code.UNAVAILABLE


def _llm_stream(*items):
    return lambda request, raw_request_info: _items(*items)


SEARCH_TOOL = inference_pb2.FunctionTool(name="search", description="find", parameters_json=OBJECT_SCHEMA)


def _user_request(**overrides) -> inference_pb2.ChatCompletionRequest:
    return inference_pb2.ChatCompletionRequest(messages=[inference_pb2.ChatMessage(role="user", content="hi")], **overrides)


async def _unary_and_streamed_failures(ingress: GrpcIngress, request) -> list[tuple[grpc.StatusCode, str, str]]:
    """(status code, details, last message's error text) of `ChatCompletion` and of `StreamChatCompletion`."""
    unary = FakeContext()
    await ingress.ChatCompletion(request, unary)
    streamed = FakeContext()
    chunks = [chunk async for chunk in ingress.StreamChatCompletion(request, streamed)]
    return [(unary.code, unary.details, unary.details), (streamed.code, streamed.details, chunks[-1].error.message)]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"tool_choice": "bogus"}, "When using `tool_choice`, `tools` must be set. (parameter=tool_choice)"),
        ({"tool_choice": ""}, "When using `tool_choice`, `tools` must be set. (parameter=tool_choice)"),
        ({"tool_choice": "required"}, "When using `tool_choice`, `tools` must be set. (parameter=tool_choice)"),
        ({"tools": [SEARCH_TOOL], "tool_choice": "lookup"},
         "The tool specified in `tool_choice` does not match any of the specified `tools` (parameter=tool_choice)"),
        ({"tools": [SEARCH_TOOL], "tool_choice": ""},
         'Invalid `name` in `function`: `` in `tool_choice`! Correct usage: `{"type": "function", "function": '
         '{"name": "my_function"}}` (parameter=tool_choice.function.name)'),
    ],
    ids=["bogus", "empty", "required-without-tools", "unknown-tool", "empty-with-tools"],
)
def test_invalid_tool_choice_is_invalid_argument(overrides, message):
    """vLLM refuses these while the request is built (`VLLMValidationError`): the caller's fault, with vLLM's text."""
    llm = FakeHandle()
    got = _run(_unary_and_streamed_failures(_ingress(llm=llm), _user_request(**overrides)))
    assert got == [(Code.INVALID_ARGUMENT, message, message)] * 2
    assert llm.options_calls == []  # refused before any engine call


@pytest.mark.parametrize(
    "parameters_json, kind",
    [("[1, 2]", "an array"), ("5", "a number"), ('"s"', "a string"), ("true", "a boolean"), ("null", "null")],
)
def test_function_tool_schema_that_is_not_an_object_is_one_line_naming_the_field(parameters_json, kind):
    tools = [SEARCH_TOOL, inference_pb2.FunctionTool(name="x", description="d", parameters_json=parameters_json)]
    message = f"tools[1].parameters_json: must be a JSON object (a JSON Schema), not {kind}"
    got = _run(_unary_and_streamed_failures(_ingress(), _user_request(tools=tools)))
    assert got == [(Code.INVALID_ARGUMENT, message, message)] * 2


def test_engine_client_error_raised_by_the_replica_is_invalid_argument():
    from vllm.exceptions import VLLMValidationError

    def chat(request, raw_request_info):
        raise VLLMValidationError("`max_tokens` is too large", parameter="max_tokens")

    got = _run(_unary_and_streamed_failures(_ingress(llm=FakeHandle(chat=chat)), _user_request()))
    message = "`max_tokens` is too large (parameter=max_tokens)"
    assert got == [(Code.INVALID_ARGUMENT, message, message)] * 2


@pytest.mark.parametrize("rpc", ["GetSession", "DeleteSession"])
def test_unknown_long_session_id_is_not_found_with_the_id_shortened(rpc):
    envelope = _error(404, f"no session {LONG_ID}", "session_not_found")
    method = {"GetSession": "get_session", "DeleteSession": "delete_session"}[rpc]
    context = FakeContext()
    request = getattr(agent_pb2, f"{rpc}Request")(session_id=LONG_ID)
    _run(getattr(_ingress(orchestrator=FakeHandle(**{method: envelope})), rpc)(request, context))
    assert (context.code, context.details) == (Code.NOT_FOUND, f"no session {'x' * 64}...")


def test_turn_on_an_unknown_long_session_id_ends_with_the_id_shortened():
    orchestrator = FakeHandle(send_message=_turn(_error(404, f"no session {LONG_ID}", "session_not_found")))
    context = FakeContext()
    request = agent_pb2.SendMessageRequest(session_id=LONG_ID, content="hi")
    [(event, code)] = _run(_collect(_ingress(orchestrator=orchestrator).SendMessage(request, context), context))
    assert (code, context.details, event.error.message) == (Code.NOT_FOUND, f"no session {'x' * 64}...", context.details)


def test_chat_completion_unary():
    from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionResponse

    llm = FakeHandle(chat=_llm_stream(ServedBy("replica-a"), ChatCompletionResponse(**OPENAI_RESPONSE)))
    context = FakeContext()
    response = _run(_ingress(llm=llm).ChatCompletion(_chat_request(session_id="s1"), context))
    assert (response.replica_id, response.finish_reason, response.usage.cached_tokens) == ("replica-a", "tool_calls", 96)
    assert context.code is None
    request, raw_request_info = llm.chat.calls[0]
    assert (request.model, request.stream) == ("warmpath-tiny", False)
    assert llm.options_calls == [{"stream": True, "session_id": "s1"}]


def test_a_unary_answer_stands_when_the_call_fails_after_it():
    """The whole response came: a failure of the call after it (its replica dying as it closes) took the
    answer away (UNAVAILABLE), and a client would ask again for a completion it had been sent."""
    from ray.exceptions import RayActorError
    from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionResponse

    async def answer_then_die():
        yield ServedBy("replica-a")
        yield ChatCompletionResponse(**OPENAI_RESPONSE)
        raise RayActorError()

    context = FakeContext()
    llm = FakeHandle(chat=lambda request, raw_request_info: answer_then_die())
    response = _run(_ingress(llm=llm).ChatCompletion(_chat_request(), context))
    assert context.code is None and response.replica_id == "replica-a" and response.finish_reason == "tool_calls"


def test_chat_completion_engine_error_and_unknown_model():
    from ray.llm._internal.serve.core.configs.openai_api_models import ErrorInfo, ErrorResponse

    error = ErrorResponse(error=ErrorInfo(message="prompt too long", type="BadRequestError", code=400))
    context = FakeContext()
    _run(_ingress(llm=FakeHandle(chat=_llm_stream(ServedBy("r"), [error]))).ChatCompletion(_chat_request(), context))
    assert (context.code, context.details) == (Code.INVALID_ARGUMENT, "prompt too long")
    assert ("x-warmpath-replica", "r") in context.trailing_metadata  # as over HTTP: the refusal names its replica

    # A replica that names itself and then fails (raises) before any output is named too.
    for failure in (RuntimeError("engine gone"), ValueError("bad")):
        async def failing():
            yield ServedBy("r")
            raise failure

        context = FakeContext()
        _run(_ingress(llm=FakeHandle(chat=lambda request, raw_request_info: failing())).ChatCompletion(
            _chat_request(), context))
        assert context.code is not None and ("x-warmpath-replica", "r") in context.trailing_metadata
        context = FakeContext()
        stream = _ingress(llm=FakeHandle(chat=lambda request, raw_request_info: failing())).StreamChatCompletion(
            _chat_request(), context)
        (last, code), = _run(_collect(stream, context))
        assert last.replica_id == "r" and code == context.code != Code.OK

    # Streamed, the same refusal comes before any chunk: its error chunk named no replica.
    context = FakeContext()
    ingress = _ingress(llm=FakeHandle(chat=_llm_stream(ServedBy("r"), [error])))
    (last, code), = _run(_collect(ingress.StreamChatCompletion(_chat_request(), context), context))
    assert (last.error.message, last.replica_id, code) == ("prompt too long", "r", Code.INVALID_ARGUMENT)

    context = FakeContext()
    llm = FakeHandle()
    _run(_ingress(llm=llm).ChatCompletion(_chat_request(model="other"), context))
    assert context.code is Code.NOT_FOUND
    assert llm.options_calls == []  # rejected before any engine call


def test_text_utf8_cannot_encode_is_refused_before_the_engine_as_over_http():
    """A schema's `\\ud800` escape is valid JSON and valid UTF-8 on the wire; parsed, it fails inside the engine."""
    schema = '{"type":"object","properties":{"\\ud800":{"type":"string"}}}'
    request = inference_pb2.ChatCompletionRequest(
        messages=[inference_pb2.ChatMessage(role="user", content="hi")],
        tools=[inference_pb2.FunctionTool(name="f", description="d", parameters_json=schema)],
    )
    for call in ("ChatCompletion", "StreamChatCompletion"):
        context, llm = FakeContext(), FakeHandle()
        outcome = getattr(_ingress(llm=llm), call)(request, context)
        _run(outcome if call == "ChatCompletion" else _collect(outcome, context))
        assert context.code is Code.INVALID_ARGUMENT and "a key is not valid Unicode" in context.details, call
        assert llm.options_calls == []


def test_stream_chat_completion():
    frames = [
        'data: {"id":"c","model":"warmpath-tiny","choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n',
        'data: {"id":"c","model":"warmpath-tiny","choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":"stop"}]}\n\n',
    ]
    usage = 'data: {"id":"c","model":"warmpath-tiny","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\ndata: [DONE]\n\n'
    llm = FakeHandle(chat=_llm_stream(ServedBy("replica-b"), frames, [usage]))
    context = FakeContext()
    got = _run(_collect(_ingress(llm=llm).StreamChatCompletion(_chat_request(), context), context))
    chunks = [c for c, _ in got]
    assert "".join(c.content for c in chunks) == "Hello"
    assert {c.replica_id for c in chunks} == {"replica-b"}
    assert chunks[-1].usage.prompt_tokens == 5 and context.code is None
    request, _ = llm.chat.calls[0]
    assert request.stream and request.stream_options.include_usage
    assert llm.options_calls == [{"stream": True}]  # no session id: no affinity key


def test_stream_chat_completion_error_midway():
    frames = [
        'data: {"id":"c","model":"warmpath-tiny","choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n',
        'data: {"error":{"message":"engine overloaded","type":"ServiceUnavailableError","code":503}}\n\n',
    ]
    context = FakeContext()
    ingress = _ingress(llm=FakeHandle(chat=_llm_stream(ServedBy("r"), frames)))
    got = _run(_collect(ingress.StreamChatCompletion(_chat_request(), context), context))
    assert [c.content for c, _ in got] == ["Hel", ""]
    last, code = got[-1]
    assert (last.error.code, last.error.message, code) == ("ServiceUnavailableError", "engine overloaded", Code.UNAVAILABLE)
    # The contract promises the replica on every chunk: the error chunk named none, nor the stream's id and model.
    assert (last.replica_id, last.id, last.model) == ("r", "c", "warmpath-tiny")


# ---- health and reflection, hosted by Ray Serve's gRPC proxy ----


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _proxy_checks() -> dict:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    from ray.serve._private.common import DeploymentID, EndpointInfo
    from ray.serve._private.grpc_util import start_grpc_server
    from ray.serve._private.proxy import gRPCProxy
    from ray.serve._private.proxy_router import ProxyRouter
    from ray.serve.config import gRPCOptions
    from warmpath.v1 import agent_pb2_grpc

    proxy = gRPCProxy(
        node_id="node-1", node_ip_address="127.0.0.1", is_head=True, proxy_router=ProxyRouter(get_handle=lambda *args: None)
    )
    port = _free_port()
    options = gRPCOptions(port=port, grpc_servicer_functions=GRPC_SERVICER_FUNCTIONS)
    _, server = await start_grpc_server(proxy.service_handler_factory, options, event_loop=asyncio.get_running_loop())
    seen: dict = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)

            async def status(service=""):
                return (await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)).status

            seen["no_routes"] = await status()
            # A warmpath RPC is routed to replicas, not answered in the proxy.
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await agent_pb2_grpc.AgentStub(channel).GetSession(agent_pb2.GetSessionRequest(session_id="s"), timeout=10)
            seen["routed"] = (info.value.code(), info.value.details())
            proxy.proxy_router.update_routes({DeploymentID(name="GrpcIngress", app_name="warmpath-grpc"): EndpointInfo(route="/grpc")})
            seen["ready"] = await status()
            seen["ready_agent"] = await status("warmpath.v1.Agent")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await status("no.such.Service")
            seen["unknown"] = info.value.code()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await status("x" * 100_000)  # echoed whole, the details would pass the metadata limit
            seen["unknown_long"] = (info.value.code(), info.value.details())
            proxy.update_draining(True)
            seen["draining"] = await status("warmpath.v1.Inference")
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            async for reply in reflection.ServerReflectionInfo(iter([request]), timeout=10):
                seen["reflected"] = {s.name for s in reply.list_services_response.service}
    finally:
        await server.stop(None)
    return seen


def test_health_and_reflection_in_ray_grpc_proxy():
    from grpc_health.v1 import health_pb2

    seen = _run(_proxy_checks())
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert seen["no_routes"] == not_serving  # Ray: "Route table is not populated yet."
    assert seen["routed"][0] is Code.NOT_FOUND and "Application metadata not set" in seen["routed"][1]
    assert (seen["ready"], seen["ready_agent"]) == (serving, serving)
    assert seen["unknown"] is Code.NOT_FOUND
    assert seen["unknown_long"] == (Code.NOT_FOUND, f"unknown service '{'x' * 64}...'")
    assert seen["draining"] == not_serving
    assert {"warmpath.v1.Inference", "warmpath.v1.Agent", "grpc.health.v1.Health"} <= seen["reflected"]


def test_a_failure_is_logged_once():
    """What Ray Serve LLM classifies it logs itself (traceback included); the ingress logs only the rest."""
    import logging

    from ray.llm._internal.serve.utils import server_utils
    from vllm.exceptions import VLLMValidationError

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    ray_llm_logger = server_utils.logger
    ray_llm_logger.addHandler(handler)
    try:
        classified = failure_from_exception(VLLMValidationError("bad tool_choice", parameter="tool_choice"), "req-1")
    finally:
        ray_llm_logger.removeHandler(handler)
    assert classified.is_logged and len(records) == 1
    assert not failure_from_exception(TimeoutError("slow")).is_logged


def test_plain_http_to_the_grpc_application_gets_openais_error_shape():
    response = _run(_ingress().__call__(None))
    body = json.loads(response.body)
    assert response.status_code == 404
    assert body["error"]["code"] == "grpc_only" and {"type", "param", "message"} <= set(body["error"])


def test_a_failure_a_replica_raised_is_not_blamed_on_the_grpc_ingress():
    from serve_apps.ingress_grpc import failure_from_exception

    failure = failure_from_exception(RuntimeError("engine core died"), "req-1")
    assert failure.status is Code.INTERNAL and "gRPC ingress" not in failure.message


def test_a_deployment_that_cannot_take_a_call_is_answered_with_https_message():
    """Ray's own text went to gRPC clients: the deployment's and app's names, and "failed to deploy" where HTTP
    says to retry."""
    from ray.serve._private.common import DeploymentID
    from ray.serve.exceptions import DeploymentUnavailableError

    from serve_apps.api_errors import UNAVAILABLE_MESSAGE

    failure = ingress_grpc.failure_from_exception(
        DeploymentUnavailableError(DeploymentID(name="Orchestrator", app_name="warmpath")))
    assert (failure.status, failure.message) == (Code.UNAVAILABLE, UNAVAILABLE_MESSAGE)
    assert "Orchestrator" not in failure.message and ("retry-after", "1") in failure.trailing_metadata
