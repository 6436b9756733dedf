"""gRPC ingress: `warmpath.v1.Inference` and `warmpath.v1.Agent` behind Ray Serve's gRPC proxy.

Why a deployment of its own: Ray Serve's gRPC proxy calls the ingress
deployment of an application by RPC method name, and the LLM application's
ingress is the HTTP one. `GrpcIngress` is the ingress of a second application;
it holds handles to the LLM application's replica and orchestrator
deployments, so both protocols share the same replicas, router and sessions.

What it does, per RPC: protobuf request -> the plain data the HTTP API
carries (validated by the same models downstream) -> handle call -> protobuf
response. Inference calls the replicas' `chat` with a `ChatCompletionRequest`
the way the orchestrator's `HandleModelClient` does (session id as routing
key, `ServedBy` first, trace context in `RawRequestInfo`); session calls go to
the `Orchestrator` methods, whose `{"status", "body"}` envelopes and event
dicts are converted here.

Every RPC is first admitted by `serve_apps.access.AccessGuard` (the HTTP
ingress' guard): the key in `authorization: Bearer <key>` or `x-api-key`
metadata (by the HTTP headers' rule), its rate limit, then the caller goes to
the orchestrator, which checks session ownership and tool permissions.
`idempotency-key` metadata makes a turn retry-safe as the HTTP header does.
Where HTTP answers `Retry-After` (rate limit, Redis unavailable), the status
carries it as `retry-after` trailing metadata.

Metrics: an Inference call is recorded as the HTTP ingress records a chat
call (`serve_apps.metrics.settle_model_call`, with the last usage the engine
sent), and its routing decision is taken out of the log by both of Serve's
request ids, so calls sharing a client's `x-request-id` never swap decisions.

Status and ordering rules:
- a unary failure sets the code and details on `grpc_context` and returns an
  empty response (Ray ships the context with the response);
- a stream sets the code before yielding its last message, because Ray ships
  the context with each yielded message and drops a code set afterwards. A
  stream that fails therefore ends with one message carrying the error
  (`SessionEvent.error`, `ChatCompletionChunk.error`), then the status;
- a turn's own `error` event ends the stream with the code its HTTP status
  maps to (`max_steps` is a 200, so OK: the turn's messages are committed);
- Ray's overload, unavailability and timeout errors keep their meaning;
  any other exception is classified as the HTTP ingress classifies it (Ray
  Serve LLM's `get_response_for_error`, through `api_errors.exception_body`):
  a client error (vLLM's `VLLMClientError`, a request model's validation
  error) is INVALID_ARGUMENT with its readable text, the rest INTERNAL with a
  generic message;
- details never echo more than a bounded part of what the caller sent
  (`grpc_status.status_details`).

Tracing: every RPC has a server span, child of the W3C context in its
metadata, that ends with the RPC's final status (`record_rpc_status`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
from contextlib import AbstractContextManager, aclosing, contextmanager
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Mapping, Optional, TypeVar
from urllib.parse import unquote

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message as ProtoMessage
from opentelemetry import context as otel_context
from opentelemetry import trace
from pydantic import ValidationError
from ray.exceptions import RayActorError
from ray.llm._internal.serve.core.configs.openai_api_models import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ErrorResponse,
)
from ray.llm._internal.serve.constants import DEFAULT_LLM_ROUTER_HTTP_TIMEOUT
from ray.llm._internal.serve.core.protocol import RawRequestInfo
from ray.serve._private.http_util import session_id_from_headers
from ray.serve.context import _get_serve_request_context
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RequestCancelledError
from starlette.responses import JSONResponse

from cluster import telemetry
from router import decision_log
from cluster.config import TelemetryConfig
from serve_apps.access import (
    AccessDenied,
    AccessGuard,
    Caller,
    GuardSettings,
    count_denial,
    request_too_large,
    retry_headers,
)
from serve_apps.api_errors import (
    UNAVAILABLE_MESSAGE,
    client_engine_error,
    error_body,
    error_type,
    exception_body,
    retry_after_header,
    validation_problem,
)
from serve_apps.grpc_decoding import UndecodableRequest
from serve_apps.grpc_status import RpcFailure, grpc_code
from serve_apps.handle_streams import cancelled_if_left
from serve_apps.metrics import settle_model_call, usage_tokens
from serve_apps.openai_bodies import too_many_items
from serve_apps.request_checks import chat_request_problem, unencodable_text_problem, utf8_text
from serve_apps.orchestrator.models import (
    TOOL_CHOICE_KEYWORDS,
    TURN_ERROR_STATUS,
    TURN_INTERRUPTED,
    Message,
    outcome_checked,
)
from serve_apps.orchestrator.prompt import to_wire_message
from serve_apps.sse_frames import sse_payloads, stream_leading_error
from serve_apps.vllm_replica import ServedBy
from warmpath.v1 import agent_pb2, inference_pb2

logger = logging.getLogger("ray.serve")

INFERENCE_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
AGENT_SERVICE = agent_pb2.DESCRIPTOR.services_by_name["Agent"].full_name
# Names the replica that refused a call, as the HTTP ingress's `x-warmpath-replica` header does.
REPLICA_METADATA = "x-warmpath-replica"
INTERNAL_MESSAGE = "internal error; see the server logs"  # the ingress's own, or one a replica raised
# Suggested wait before retrying a call refused by back-pressure when Serve names none.
BACK_PRESSURE_RETRY_AFTER_S = 1.0
IDEMPOTENCY_METADATA = "idempotency-key"
# Trailing metadata of a turn answered from its idempotency record (HTTP's `x-warmpath-idempotent-replay` header).
REPLAY_METADATA = "x-warmpath-idempotent-replay"

ResponseT = TypeVar("ResponseT", bound=ProtoMessage)

# The codes OTel's RPC conventions count as the server's failure; any other code is the caller's (or OK).
SERVER_ERROR_CODES = frozenset({
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS,
})


# ---- protobuf -> plain data (requests) ----


def tool_call_to_dict(call: inference_pb2.ToolCall) -> dict[str, str]:
    """A `ToolCall` in the HTTP API's shape (`serve_apps.orchestrator.models.ToolCall`)."""
    return {"id": call.id, "name": call.name, "arguments": call.arguments}


def chat_message_to_dict(message: inference_pb2.ChatMessage) -> dict[str, Any]:
    """A `ChatMessage` in the HTTP API's message shape (`serve_apps.orchestrator.models.Message`)."""
    out: dict[str, Any] = {"role": message.role}
    if message.HasField("content"):
        out["content"] = message.content
    if message.tool_calls:
        out["tool_calls"] = [tool_call_to_dict(c) for c in message.tool_calls]
    if message.HasField("tool_call_id"):
        out["tool_call_id"] = message.tool_call_id
    if message.HasField("name"):
        out["name"] = message.name
    if message.HasField("reasoning"):
        out["reasoning"] = message.reasoning
    return out


_NO_SCHEMA = object()


def _schema(parameters_json: str, where: str) -> Any:
    """The parsed JSON Schema text, or `_NO_SCHEMA` when empty (the API's default schema applies).

    Any parsed value goes on to validation, so `null` or `[]` is refused as over HTTP.
    """
    if not parameters_json:
        return _NO_SCHEMA
    try:
        return json.loads(parameters_json)
    except ValueError as err:  # bad syntax, or an integer past Python's 4,300 digits to convert (as over HTTP)
        raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, "invalid_parameter", f"{where}: not JSON: {err}") from None
    except RecursionError:  # arrays or objects nested thousands deep: the parser recurses per level
        raise RpcFailure(
            grpc.StatusCode.INVALID_ARGUMENT, "invalid_parameter", f"{where}: nested too deeply to parse"
        ) from None


def tool_to_dict(tool: agent_pb2.Tool, index: int) -> dict[str, Any]:
    """A session `Tool` in the HTTP API's shape (`ToolSpec`); a missing execution is left for validation to name."""
    out: dict[str, Any] = {
        "name": tool.name,
        "description": tool.description,
        "required_permissions": list(tool.required_permissions),
    }
    where = f"tools[{index}].parameters_json"
    parameters = _schema(tool.parameters_json, where)
    if parameters is not _NO_SCHEMA:
        # Refused here as the HTTP ingress's validation refuses it: nested a few hundred levels, it parses,
        # and Ray's pickling of the call to the orchestrator fails (INTERNAL).
        if (problem := unencodable_text_problem(parameters, where)) is not None:
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, "invalid_parameter", problem[0])
        out["parameters"] = parameters
    execution = tool.WhichOneof("execution")
    if execution == "http":
        out["execution"] = {"kind": "http", "url": tool.http.url}
        if tool.http.HasField("timeout_s"):
            out["execution"]["timeout_s"] = tool.http.timeout_s
    elif execution == "client":
        out["execution"] = {"kind": "client"}
    return out


def _set_fields(message: ProtoMessage) -> dict[str, Any]:
    """Fields with presence that are set, by name (unset ones keep the API's defaults)."""
    return {field.name: value for field, value in message.ListFields()}


def create_session_body(request: agent_pb2.CreateSessionRequest) -> dict[str, Any]:
    """Body of `Orchestrator.create_session` (the HTTP `POST /v1/sessions` body)."""
    body: dict[str, Any] = {
        "model": request.model,
        "system_prompt": request.system_prompt,
        "tools": [tool_to_dict(tool, i) for i, tool in enumerate(request.tools)],
    }
    if request.HasField("limits"):
        body["limits"] = _set_fields(request.limits)
    return body


def send_message_body(request: agent_pb2.SendMessageRequest) -> dict[str, Any]:
    """Body of `Orchestrator.send_message` (the HTTP `TurnRequest`)."""
    body: dict[str, Any] = {"content": request.content}
    if request.HasField("tool_choice"):
        body["tool_choice"] = request.tool_choice
    return body


def tool_results_body(request: agent_pb2.SubmitToolResultsRequest) -> dict[str, Any]:
    """Body of `Orchestrator.submit_tool_results` (the HTTP `ToolResultsSubmission`)."""
    return {
        "results": [
            {"tool_call_id": r.tool_call_id, "content": r.content, "is_error": r.is_error} for r in request.results
        ]
    }


def openai_tool_choice(tool_choice: str) -> str | dict[str, Any]:
    """The session API's tool choice ("auto", "none", "required" or a tool name) in OpenAI form."""
    if tool_choice in TOOL_CHOICE_KEYWORDS:
        return tool_choice
    return {"type": "function", "function": {"name": tool_choice}}


def chat_completion_fields(request: inference_pb2.ChatCompletionRequest) -> dict[str, Any]:
    """`ChatCompletionRequest` fields for the engine: messages, tools and sampling options.

    Messages are validated by the session API's `Message` model and rendered by
    the same `to_wire_message` the orchestrator uses, so both APIs send the
    engine identical messages.

    Raises:
        RpcFailure: INVALID_ARGUMENT naming the offending message or tool.
    """
    messages = []
    for index, message in enumerate(request.messages):
        try:
            wire = to_wire_message(Message.model_validate(chat_message_to_dict(message)))
        except ValidationError as err:
            problem, _ = validation_problem(err.errors(), prefix=f"messages[{index}]")
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, "invalid_parameter", problem) from None
        messages.append(wire)
    tools = []
    for index, tool in enumerate(request.tools):
        function: dict[str, Any] = {"name": tool.name, "description": tool.description}
        where = f"tools[{index}].parameters_json"
        parameters = _schema(tool.parameters_json, where)
        if tool.parameters_json and not isinstance(parameters, dict):
            # Named here: the engine's model would name `tools[0].function.parameters`, a field gRPC lacks.
            raise RpcFailure(
                grpc.StatusCode.INVALID_ARGUMENT, "invalid_parameter",
                f"{where}: must be a JSON object (a JSON Schema), not {_json_kind(parameters)}",
            )
        function["parameters"] = parameters if parameters is not _NO_SCHEMA else {"type": "object", "properties": {}}
        tools.append({"type": "function", "function": function})
    fields: dict[str, Any] = {"messages": messages, "tools": tools or None}
    if request.HasField("tool_choice"):
        fields["tool_choice"] = openai_tool_choice(request.tool_choice)
    for name in ("max_tokens", "temperature", "seed", "top_p", "parallel_tool_calls"):
        if request.HasField(name):
            fields[name] = getattr(request, name)
    if request.stop:
        fields["stop"] = list(request.stop)
    if request.HasField("response_format"):
        fields["response_format"] = response_format(request.response_format)
    return fields


RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def response_format(form: inference_pb2.ResponseFormat) -> dict[str, Any]:
    """OpenAI's `response_format` of a `ResponseFormat`; the schema must be a JSON object.

    Raises:
        RpcFailure: INVALID_ARGUMENT naming the field.
    """
    if form.type not in RESPONSE_FORMAT_TYPES:
        raise RpcFailure(
            grpc.StatusCode.INVALID_ARGUMENT, "invalid_parameter",
            f"response_format.type: {form.type!r} is not one of {', '.join(RESPONSE_FORMAT_TYPES)}",
        )
    if form.type != "json_schema":
        if form.name or form.schema_json or form.strict:
            raise RpcFailure(
                grpc.StatusCode.INVALID_ARGUMENT, "invalid_parameter",
                f"response_format: name, schema_json and strict belong to type json_schema, not {form.type}",
            )
        return {"type": form.type}
    schema = _schema(form.schema_json, "response_format.schema_json")
    if not isinstance(schema, dict):
        raise RpcFailure(
            grpc.StatusCode.INVALID_ARGUMENT, "invalid_parameter",
            "response_format.schema_json: must be a JSON object (a JSON Schema), not "
            + ("empty" if schema is _NO_SCHEMA else _json_kind(schema)),
        )
    return {"type": "json_schema", "json_schema": {"name": form.name or "response", "schema": schema,
                                                   "strict": form.strict}}


def _json_kind(value: Any) -> str:
    """How JSON names the type of a parsed value ("an array", "a number", ...)."""
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if value is None:
        return "null"
    return "a number"


# ---- plain data -> protobuf (responses and events) ----


def usage_to_proto(usage: Mapping[str, Any] | None) -> inference_pb2.Usage | None:
    """OpenAI usage (with `prompt_tokens_details.cached_tokens`) as `Usage`; None when absent."""
    if not usage:
        return None
    details = usage.get("prompt_tokens_details") or {}
    return inference_pb2.Usage(
        prompt_tokens=usage.get("prompt_tokens") or 0,
        completion_tokens=usage.get("completion_tokens") or 0,
        cached_tokens=details.get("cached_tokens") or 0,
    )


def chat_response_to_proto(response: Mapping[str, Any], replica_id: str) -> inference_pb2.ChatCompletionResponse:
    """A non-streamed OpenAI chat completion (first choice) as `ChatCompletionResponse`.

    Lone surrogates in the model's text (`utf8_text`) become '?': a protobuf string refuses them.
    """
    choice = response["choices"][0]
    message = choice.get("message") or {}
    out = inference_pb2.ChatCompletionResponse(
        id=response.get("id") or "",
        model=response.get("model") or "",
        tool_calls=[
            inference_pb2.ToolCall(
                id=utf8_text(call.get("id") or ""),
                name=utf8_text((call.get("function") or {}).get("name") or ""),
                arguments=utf8_text((call.get("function") or {}).get("arguments") or ""),
            )
            for call in message.get("tool_calls") or ()
        ],
        finish_reason=choice.get("finish_reason") or "",
        usage=usage_to_proto(response.get("usage")),
        replica_id=replica_id,
    )
    if message.get("content") or not message.get("tool_calls"):  # unset when the model only called tools
        out.content = utf8_text(message.get("content") or "")
    if reasoning := _reasoning(message):
        out.reasoning = utf8_text(reasoning)
    return out


def _reasoning(message: Mapping[str, Any]) -> str | None:
    """The engine's reasoning text of a message or delta: `reasoning`, or `reasoning_content`, its older name."""
    return message.get("reasoning") or message.get("reasoning_content")


def chat_chunk_to_proto(payload: Mapping[str, Any], replica_id: str) -> inference_pb2.ChatCompletionChunk:
    """One OpenAI stream payload (`data: {...}`; first choice, if any) as `ChatCompletionChunk`."""
    chunk = inference_pb2.ChatCompletionChunk(
        id=payload.get("id") or "",
        model=payload.get("model") or "",
        usage=usage_to_proto(payload.get("usage")),
        replica_id=replica_id,
    )
    choices = payload.get("choices") or ()
    if choices:
        choice = choices[0]
        delta = choice.get("delta") or {}
        chunk.content = utf8_text(delta.get("content") or "")
        chunk.reasoning = utf8_text(_reasoning(delta) or "")
        chunk.finish_reason = choice.get("finish_reason") or ""
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            chunk.tool_calls.add(
                index=call.get("index") or 0,
                id=utf8_text(call.get("id") or ""),
                name=utf8_text(function.get("name") or ""),
                arguments=utf8_text(function.get("arguments") or ""),
            )
    return chunk


def engine_failure(error: Mapping[str, Any], replica_id: str = "") -> RpcFailure:
    """An engine error (`ErrorResponse.error`: message, type, HTTP `code`) as an RPC failure.

    The code names the status as the HTTP API's `error.type` does; the details are the
    message without Ray Serve LLM's wrapping (`serve_apps.api_errors`). The replica that
    answered it, where known, is named as over HTTP (`x-warmpath-replica`): on a stream's
    error chunk, and in a unary call's trailing metadata.
    """
    status, message = client_engine_error(error)  # the engine's own failure said as over HTTP
    status = status or 500  # none named: the engine's own failure, a 500 over HTTP (not a turn's `model_error`)
    return answered_by(RpcFailure(grpc_code(status), error_type(status), message), replica_id)


def answered_by(failure: RpcFailure, replica_id: str) -> RpcFailure:
    """`failure` naming the replica that answered with it (where one did), as HTTP's `x-warmpath-replica` does."""
    if replica_id:
        failure.replica_id = replica_id
        failure.trailing_metadata = (*failure.trailing_metadata, (REPLICA_METADATA, replica_id))
    return failure


def session_event_to_proto(event: Mapping[str, Any]) -> agent_pb2.SessionEvent | None:
    """A session event dict (`kind` plus the event's fields) as `SessionEvent`; the oneof field is the kind.

    What an orchestrator of a later release adds is left out, not refused (a rolling update changes the
    orchestrator and this ingress one at a time): a field this ingress does not know, and an event of a kind
    it does not know (None: not sent; an empty `SessionEvent` would reach the client as no event at all).
    """
    kind = event["kind"]
    if kind not in agent_pb2.SessionEvent.DESCRIPTOR.fields_by_name:
        return None
    message = agent_pb2.SessionEvent()
    json_format.ParseDict({k: v for k, v in event.items() if k != "kind"}, getattr(message, kind),
                          ignore_unknown_fields=True)
    getattr(message, kind).SetInParent()  # an event without fields is still that event
    return message


def error_event(failure: RpcFailure) -> agent_pb2.SessionEvent:
    """The last message of a failed turn stream."""
    return agent_pb2.SessionEvent(error=agent_pb2.ErrorEvent(code=failure.code, message=failure.message))


def error_chunk(failure: RpcFailure) -> inference_pb2.ChatCompletionChunk:
    """The last message of a failed completion stream."""
    return inference_pb2.ChatCompletionChunk(error=inference_pb2.StreamError(code=failure.code, message=failure.message))


def envelope_body(envelope: Mapping[str, Any], expected_status: int) -> Any:
    """The body of an orchestrator envelope with the expected status.

    Raises:
        RpcFailure: the envelope is an error (its status mapped to a gRPC code; `retry-after`
            trailing metadata where HTTP sends `Retry-After`).
    """
    if envelope["status"] != expected_status:
        failure = RpcFailure.from_envelope(envelope)
        failure.trailing_metadata = tuple(retry_headers(failure.code).items())
        raise failure
    return envelope.get("body")


def turn_error_status(code: str) -> grpc.StatusCode:
    """The status a turn stream ends with after an `error` event with this code (HTTP's table, then `grpc_code`)."""
    return grpc_code(TURN_ERROR_STATUS.get(code, 500), code)


def denial_failure(denied: AccessDenied) -> RpcFailure:
    """The gRPC form of a refused call; its `retry-after` travels as trailing metadata (HTTP's other headers,
    `WWW-Authenticate`, are HTTP's)."""
    trailing = [retry_after_header(denied.retry_after_s)] if denied.retry_after_s is not None else []
    return RpcFailure(grpc_code(denied.status, denied.code), denied.code, denied.message, trailing)


def failure_from_exception(err: Exception, request_id: str = "") -> RpcFailure:
    """The failure an exception raised while serving an RPC stands for.

    Ray's own errors keep their meaning (overload, unavailability, cancellation, timeout). A
    request model's validation error names its first problem and field in one line, as the HTTP
    API's 400 does. Anything else is classified as the HTTP ingress classifies it
    (`api_errors.exception_body`, i.e. Ray Serve LLM's `get_response_for_error`), which logs it:
    a client error (`vllm.exceptions.VLLMClientError` and the like) keeps its status and readable
    text; a server error is INTERNAL with a generic message, its details left to the log.

    Args:
        err: The exception.
        request_id: Serve's id of the request, for Ray Serve LLM's log line.

    Returns:
        The failure to report.
    """
    if isinstance(err, RpcFailure):
        return err
    if isinstance(err, BackPressureError):
        # Serve's HTTP proxy sends Retry-After only when Serve names a delay; a gRPC client gets a hint either way.
        retry_after_s = err.retry_after_s if err.retry_after_s is not None else BACK_PRESSURE_RETRY_AFTER_S
        return RpcFailure(
            grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded", err.message, [retry_after_header(retry_after_s)]
        )
    # Where HTTP answers 503 with `Retry-After: 1`, so does the status' trailing metadata.
    if isinstance(err, (DeploymentUnavailableError, RayActorError)):
        # HTTP's message: Ray's own names deployments and apps ("failed to deploy"); the log has it.
        logger.warning("no serving process could take the call: %r", err)
        return RpcFailure(
            grpc.StatusCode.UNAVAILABLE, "unavailable", UNAVAILABLE_MESSAGE, [retry_after_header(1)]
        )
    if isinstance(err, RequestCancelledError):
        return RpcFailure(grpc.StatusCode.CANCELLED, "cancelled", "the request was cancelled")
    if isinstance(err, TimeoutError):
        # Fixed text: a timeout another actor raised reaches here wrapped in Ray's error, whose text is the
        # remote traceback (its pid, address, paths); the log has it.
        logger.warning("a call timed out: %s", err)
        return RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, "timeout", "the request timed out")
    if isinstance(err, ValidationError):
        # Ray Serve LLM calls these 400s too, but in pydantic's multi-line developer text.
        message, _ = validation_problem(err.errors())
        return RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, "invalid_parameter", message)
    http_status, body = exception_body(err, request_id)
    status = grpc_code(http_status)
    if status in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
        failure = RpcFailure(grpc.StatusCode.INTERNAL, "internal", INTERNAL_MESSAGE)
    else:
        error = body["error"]
        failure = RpcFailure(status, error["code"] or error["type"], error["message"])
    failure.is_logged = True  # `exception_body` logged it, traceback included
    return failure


# ---- the deployment ----


class GrpcIngress:
    """Implements the RPCs of `warmpath.v1.Inference` and `warmpath.v1.Agent` (methods named like the RPCs).

    Every RPC takes the request message and Ray Serve's `grpc_context`. Unary
    RPCs return the response message; server-streaming RPCs are async
    generators. Method names are unique across both services because the proxy
    dispatches on the method name alone.
    """

    # Longest wait for an Inference call's first output: Ray Serve LLM's router timeout, as over HTTP.
    first_output_timeout_s: float = DEFAULT_LLM_ROUTER_HTTP_TIMEOUT

    def __init__(
        self,
        llm_handle,
        orchestrator_handle,
        model_id: str,
        guard_settings: dict[str, Any],
        telemetry_config: dict[str, Any] | None = None,
        window_tokens: Optional[int] = None,
        loopback_callers_only: bool = False,
    ) -> None:
        self._llm = llm_handle
        self._orchestrator = orchestrator_handle
        self._model_id = model_id
        self._window_tokens = window_tokens  # the most messages or tools a request may hold (`openai_bodies`)
        # Keys off and `ports.host` loopback: Serve's gRPC proxy listens on every address whatever the host
        # (it binds `[::]`), so calls from elsewhere are refused here (`_check_call`), as the HTTP proxy never sees them.
        self._loopback_callers_only = loopback_callers_only
        self._guard = AccessGuard(GuardSettings.model_validate(guard_settings))
        telemetry.setup_tracing(TelemetryConfig.model_validate(telemetry_config or {}), "grpc-ingress")

    def __del__(self) -> None:
        """Ray Serve's shutdown hook (then it kills the actor): the queued spans go out first, within a bound."""
        if telemetry is not None:  # None when the interpreter exits and has cleared module globals
            telemetry.flush_spans()

    # Inference

    async def ChatCompletion(self, request: inference_pb2.ChatCompletionRequest, grpc_context):
        """One completion, returned whole (the engine runs it unstreamed)."""
        return await self._unary(
            INFERENCE_SERVICE, "ChatCompletion", grpc_context, request,
            lambda caller: self._chat_completion(request, _session_of(request, grpc_context)),
            inference_pb2.ChatCompletionResponse(),
        )

    async def StreamChatCompletion(self, request: inference_pb2.ChatCompletionRequest, grpc_context):
        """One completion, streamed chunk by chunk; a failure ends it with an `error` chunk."""
        chunks = self._streamed(
            INFERENCE_SERVICE, "StreamChatCompletion", grpc_context, request,
            lambda caller, rpc: self._chat_chunks(request, _session_of(request, grpc_context)),
            error_chunk,
        )
        async with aclosing(chunks):  # closed with this stream, so the RPC's span ends when the caller leaves
            async for chunk in chunks:
                yield chunk

    # Agent

    async def CreateSession(self, request: agent_pb2.CreateSessionRequest, grpc_context):
        """`Orchestrator.create_session`; 201 -> `CreateSessionResponse`."""
        async def create(caller: Caller) -> agent_pb2.CreateSessionResponse:
            envelope = await self._orchestrator.create_session.remote(create_session_body(request), caller.to_dict())
            return json_format.ParseDict(envelope_body(envelope, 201), agent_pb2.CreateSessionResponse(),
                                         ignore_unknown_fields=True)  # a later orchestrator's (`session_event_to_proto`)

        return await self._unary(AGENT_SERVICE, "CreateSession", grpc_context, request, create, agent_pb2.CreateSessionResponse())

    async def GetSession(self, request: agent_pb2.GetSessionRequest, grpc_context):
        """`Orchestrator.get_session`; its body maps field by field onto `GetSessionResponse`."""
        async def get(caller: Caller) -> agent_pb2.GetSessionResponse:
            envelope = await self._orchestrator.get_session.remote(request.session_id, caller.to_dict())
            return json_format.ParseDict(envelope_body(envelope, 200), agent_pb2.GetSessionResponse(),
                                         ignore_unknown_fields=True)  # a later orchestrator's (`session_event_to_proto`)

        return await self._unary(AGENT_SERVICE, "GetSession", grpc_context, request, get, agent_pb2.GetSessionResponse())

    async def DeleteSession(self, request: agent_pb2.DeleteSessionRequest, grpc_context):
        """`Orchestrator.delete_session`; 204 -> empty `DeleteSessionResponse`."""
        async def delete(caller: Caller) -> agent_pb2.DeleteSessionResponse:
            envelope_body(await self._orchestrator.delete_session.remote(request.session_id, caller.to_dict()), 204)
            return agent_pb2.DeleteSessionResponse()

        return await self._unary(AGENT_SERVICE, "DeleteSession", grpc_context, request, delete, agent_pb2.DeleteSessionResponse())

    async def SendMessage(self, request: agent_pb2.SendMessageRequest, grpc_context):
        """`Orchestrator.send_message`: the turn's events, as they happen."""
        def events(caller: Caller, rpc: _RpcSpan) -> AsyncIterator[agent_pb2.SessionEvent]:
            handle = self._orchestrator.options(stream=True)
            stream = handle.send_message.remote(
                request.session_id, send_message_body(request), caller.to_dict(), telemetry.inject(),
                _metadata(grpc_context, IDEMPOTENCY_METADATA),
            )
            return self._turn_events(stream, grpc_context, rpc)

        stream = self._streamed(AGENT_SERVICE, "SendMessage", grpc_context, request, events, error_event)
        async with aclosing(stream):  # closed with this stream, so the RPC's span ends when the caller leaves
            async for event in stream:
                yield event

    async def SubmitToolResults(self, request: agent_pb2.SubmitToolResultsRequest, grpc_context):
        """`Orchestrator.submit_tool_results`: the resumed turn's events, as they happen."""
        def events(caller: Caller, rpc: _RpcSpan) -> AsyncIterator[agent_pb2.SessionEvent]:
            handle = self._orchestrator.options(stream=True)
            stream = handle.submit_tool_results.remote(
                request.session_id, tool_results_body(request), caller.to_dict(), telemetry.inject(),
                _metadata(grpc_context, IDEMPOTENCY_METADATA),
            )
            return self._turn_events(stream, grpc_context, rpc)

        stream = self._streamed(AGENT_SERVICE, "SubmitToolResults", grpc_context, request, events, error_event)
        async with aclosing(stream):  # closed with this stream, so the RPC's span ends when the caller leaves
            async for event in stream:
                yield event

    async def __call__(self, request) -> JSONResponse:
        """Plain HTTP reaching this application's route prefix: point the caller at the gRPC port."""
        return JSONResponse(error_body(404, "this application serves gRPC only, on the gRPC port", code="grpc_only"),
                            status_code=404)

    # Helpers

    async def _chat_completion(
        self, request: inference_pb2.ChatCompletionRequest, session_id: str
    ) -> inference_pb2.ChatCompletionResponse:
        chat_request = self._chat_request(request, is_streaming=False)
        response: inference_pb2.ChatCompletionResponse | None = None
        usage = _LastUsage()
        async with aclosing(self._engine_outputs(chat_request, session_id, usage)) as outputs:
            async for replica_id, output in outputs:
                if isinstance(output, ChatCompletionResponse):
                    body = output.model_dump()
                    usage.note(body.get("usage"))
                    response = chat_response_to_proto(body, replica_id)
                    break  # the whole answer: a failure of the call after it must not take it away
        if response is None:
            raise RpcFailure(grpc.StatusCode.INTERNAL, "empty_response", "the engine returned no completion")
        return response

    async def _chat_chunks(
        self, request: inference_pb2.ChatCompletionRequest, session_id: str
    ) -> AsyncIterator[inference_pb2.ChatCompletionChunk]:
        chat_request = self._chat_request(request, is_streaming=True)
        usage = _LastUsage()
        has_chunks = False
        async with aclosing(self._engine_outputs(chat_request, session_id, usage)) as outputs:
            async for replica_id, output in outputs:
                for payload in sse_payloads(output):
                    if "error" in payload:
                        raise engine_failure(payload["error"], replica_id)
                    usage.note(payload.get("usage"))
                    has_chunks = True
                    yield chat_chunk_to_proto(payload, replica_id)
        if not has_chunks:  # as the unary call and HTTP answer it, not an OK stream of nothing
            raise RpcFailure(grpc.StatusCode.INTERNAL, "empty_response", "the engine returned no completion")

    def _chat_request(self, request: inference_pb2.ChatCompletionRequest, is_streaming: bool) -> ChatCompletionRequest:
        if request.model and request.model != self._model_id:
            raise RpcFailure(
                grpc.StatusCode.NOT_FOUND, "model_not_found",
                f'model "{request.model}" is not served here (serving "{self._model_id}")',
            )
        for field, items in (("messages", request.messages), ("tools", request.tools)):
            # Before each message is converted and validated, on this ingress's event loop (`openai_bodies`).
            if self._window_tokens is not None and len(items) > self._window_tokens:
                raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, "invalid_parameter",
                                 f"{field}: {too_many_items(field, len(items), self._window_tokens)}")
        # The engine's request model validates the rest: its pydantic and vLLM client errors (an unknown
        # `tool_choice`, one without tools) become INVALID_ARGUMENT in `failure_from_exception`.
        chat_request = ChatCompletionRequest(
            model=self._model_id,
            stream=is_streaming,
            stream_options={"include_usage": True} if is_streaming else None,
            **chat_completion_fields(request),
        )
        # What the HTTP ingress refuses before the engine too: text UTF-8 cannot encode (a JSON schema's
        # `\ud800` escape) fails inside the engine as an internal error.
        if (problem := chat_request_problem(chat_request)) is not None:
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, "invalid_parameter", problem[0])
        return chat_request

    async def _engine_outputs(
        self, chat_request: ChatCompletionRequest, session_id: str, usage: "_LastUsage"
    ) -> AsyncIterator[tuple[str, Any]]:
        """(serving replica id, engine output) pairs of one chat call, routed by session id when there is one.

        The caller notes each output's usage in `usage`; once the call is over (or the
        caller stops reading it), its routing decision is settled (`metrics.settle_model_call`).
        A call with no output after `first_output_timeout_s` (routing, queueing and prefill:
        what the HTTP ingress bounds with Ray Serve LLM's router timeout, answered 408
        there) is cancelled and fails DEADLINE_EXCEEDED; the stream after it is unbounded.
        """
        options: dict[str, Any] = {"stream": True}
        if session_id:
            options["session_id"] = session_id
        replica_id = ""
        has_output = is_whole = False
        # Ray handle calls carry no trace context: it travels in the request headers.
        raw_request_info = RawRequestInfo(headers=telemetry.inject())
        stream = self._llm.options(**options).chat.remote(chat_request, raw_request_info)
        try:
            # The caller left, or the call failed: the engine stops decoding. A whole answer read is left be.
            with cancelled_if_left(stream, is_answered=lambda: is_whole):
                async with asyncio.timeout(self.first_output_timeout_s) as first_output_deadline:
                    async for item in stream:
                        if isinstance(item, ServedBy):
                            replica_id = item.replica_id
                            continue
                        for output in item if isinstance(item, list) else [item]:
                            if isinstance(output, ErrorResponse):
                                raise engine_failure(output.error.model_dump(), replica_id)
                            if not has_output and (refused := stream_leading_error(output)) is not None:
                                # Refused before any token: settled as a refusal.
                                raise engine_failure(refused, replica_id)
                            has_output = True
                            is_whole = isinstance(output, ChatCompletionResponse)
                            first_output_deadline.reschedule(None)
                            yield replica_id, output
        except TimeoutError:
            if not first_output_deadline.expired():  # the engine's own timeout, not this wait
                raise
            raise RpcFailure(  # the call was cancelled on the way out
                grpc.StatusCode.DEADLINE_EXCEEDED, "request_timeout",
                f"the engine sent no output within {self.first_output_timeout_s:g} s "
                "(RAY_SERVE_LLM_ROUTER_HTTP_TIMEOUT sets this limit)",
            ) from None
        except Exception as err:
            if not replica_id or has_output or isinstance(err, RpcFailure):
                raise
            # The replica named itself, then failed before any output: the failure names it, as over HTTP.
            failure = failure_from_exception(err, _get_serve_request_context().request_id)
            raise answered_by(failure, replica_id) from err
        finally:
            logged = settle_model_call(replica_id, has_output, *usage_tokens(usage.usage if has_output else None))
            _annotate_model_call(chat_request, replica_id, usage.usage if has_output else None,
                                 logged if has_output else None)

    async def _turn_events(self, stream, grpc_context, rpc: _RpcSpan) -> AsyncIterator[agent_pb2.SessionEvent]:
        """An orchestrator turn stream (envelope, then event dicts) as `SessionEvent`s.

        A turn's own `error` event sets the RPC's status (context and span) before it is yielded.
        """
        events = stream.__aiter__()
        with cancelled_if_left(stream):  # the caller left, or the RPC failed: the turn stops with it
            envelope = await anext(events)
        envelope_body(envelope, 200)
        if envelope.get("is_replay"):
            grpc_context.set_trailing_metadata([(REPLAY_METADATA, "true")])
        try:
            with cancelled_if_left(stream):
                async for event in outcome_checked(events):
                    message = session_event_to_proto(event)
                    if message is None:
                        continue
                    if event["kind"] == "error":
                        status = turn_error_status(event["code"])
                        if status != grpc.StatusCode.OK:
                            retry_after = retry_headers(event["code"]).items()
                            failure = RpcFailure(status, event["code"], event["message"], retry_after)
                            failure.set_on(grpc_context)
                            rpc.record(failure.status, failure.message)
                    yield message
        except (RpcFailure, RequestCancelledError):
            raise
        except Exception as err:
            # The turn started, then its stream broke off: it may have committed, as HTTP says too.
            logger.warning("turn stream broke off: %s: %s", type(err).__name__, err)
            raise RpcFailure(
                grpc.StatusCode.UNAVAILABLE, TURN_INTERRUPTED["code"], TURN_INTERRUPTED["message"]
            ) from None

    def _check_call(self, grpc_context, request) -> None:
        """What every call is refused for before its key is checked: its caller on another machine (keys off on a
        loopback `ports.host`), before anything else of it is read; then its size (`_check_request`)."""
        if self._loopback_callers_only and not is_loopback_peer(grpc_context.peer()):
            raise denial_failure(count_denial(AccessDenied(
                403, "loopback_only",
                "API keys are off (access.is_auth_enabled: false) and ports.host is loopback: this server answers "
                "calls from its own machine only; turn keys on to serve others",
            )))
        self._check_request(request)

    def _check_request(self, request) -> None:
        """Refuses, before the call's key is checked, a request over `access.max_request_bytes`, as the HTTP API
        does (413).

        The proxy's own limit (`RAY_SERVE_GRPC_MAX_MESSAGE_SIZE`, set by `warmpath up` and the KubeRay
        manifests) bounds what it reads at all; this one makes the API's limit the same on both.
        """
        limit = self._guard.settings.access.max_request_bytes
        size = request.num_bytes if isinstance(request, UndecodableRequest) else request.ByteSize()
        if size > limit:
            raise denial_failure(
                request_too_large(f"the request is {size} bytes; the limit is {limit} (access.max_request_bytes)")
            )

    async def _admit(self, grpc_context, request) -> Caller:
        """The caller behind the call's `authorization: Bearer <key>` (or `x-api-key`) metadata, whose request
        must then have decoded (`grpc_decoding`): 400 after the key's 401, as over HTTP, where a body is read
        after the key is checked."""
        try:
            caller = await self._guard.admit_call(_string_metadata(grpc_context))
        except AccessDenied as denied:
            raise denial_failure(denied) from None
        if isinstance(request, UndecodableRequest):
            raise RpcFailure(
                grpc.StatusCode.INVALID_ARGUMENT, "invalid_parameter",
                f"the request is not a valid {request.message_type} message: {request.detail}",
            )
        return caller

    async def _unary(
        self, service: str, method: str, grpc_context, request, work: Callable[[Caller], Awaitable[ResponseT]],
        empty: ResponseT,
    ) -> ResponseT:
        rpc = _RpcSpan.start(service, method, grpc_context)
        with rpc.lifetime(), rpc.current():
            try:
                self._check_call(grpc_context, request)
                return await work(await self._admit(grpc_context, request))
            except Exception as err:
                _fail(grpc_context, rpc, method, err)
                return empty

    async def _streamed(
        self,
        service: str,
        method: str,
        grpc_context,
        request,
        messages: Callable[[Caller, "_RpcSpan"], AsyncIterator[ResponseT]],
        error_message: Callable[[RpcFailure], ResponseT],
    ) -> AsyncIterator[ResponseT]:
        rpc = _RpcSpan.start(service, method, grpc_context)
        last: Optional[ResponseT] = None
        with rpc.lifetime():
            try:
                with rpc.current():
                    self._check_call(grpc_context, request)
                    stream = messages(await self._admit(grpc_context, request), rpc).__aiter__()
                # Closed with this stream, in the caller's task: one left to the garbage collector would
                # settle its model call (`metrics.settle_model_call`) in whichever request's context runs then.
                # Closed under the RPC's span, so a caller that leaves mid-stream keeps its routing span.
                try:
                    while True:
                        with rpc.current():  # current while the stream works, not while its consumer holds a message
                            try:
                                message = await anext(stream)
                            except StopAsyncIteration:
                                break
                        last = message
                        yield message
                finally:
                    with rpc.current():
                        await stream.aclose()
            except Exception as err:
                failure = _fail(grpc_context, rpc, method, err)
                yield _with_stream_identity(error_message(failure), last, failure.replica_id)


def is_loopback_peer(peer: str) -> bool:
    """Whether a gRPC peer (`ipv4:127.0.0.1:5050`, `ipv6:[::1]:5050`, `ipv6:%5B::1%5D:5050`, `unix:...`) is this
    machine."""
    kind, _, address = peer.partition(":")
    if kind == "unix":
        return True
    if kind not in ("ipv4", "ipv6"):
        return False
    host = unquote(address).rsplit(":", 1)[0].strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def _with_stream_identity(error: ResponseT, last: Optional[ResponseT], replica_id: str = "") -> ResponseT:
    """A failed stream's last message naming what its earlier ones named (a completion chunk's id, model and
    replica, which the contract promises on every chunk), or the replica that refused the call before any
    chunk: a client attributing failures read ""."""
    fields = type(error).DESCRIPTOR.fields_by_name
    if replica_id and "replica_id" in fields:
        error.replica_id = replica_id
    if last is not None:
        for field in _STREAM_IDENTITY_FIELDS:
            if field in fields and getattr(last, field, ""):
                setattr(error, field, getattr(last, field))
    return error


_STREAM_IDENTITY_FIELDS = ("id", "model", "replica_id")


class _LastUsage:
    """The last `usage` the outputs of one engine call carried (vLLM sends it last), for the metrics."""

    def __init__(self) -> None:
        self.usage: Optional[Mapping[str, Any]] = None

    def note(self, usage: Any) -> None:
        if isinstance(usage, Mapping):
            self.usage = usage


def _annotate_model_call(
    chat_request: ChatCompletionRequest, replica_id: str, usage: Optional[Mapping[str, Any]],
    logged: Optional[decision_log.LoggedDecision] = None,
) -> None:
    """The model call on the RPC's span, as the HTTP ingress has it on its own: GenAI's names, the replica
    that served it, the last usage it sent, and why the router placed it there (where it decided)."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    span.set_attribute("gen_ai.operation.name", "chat")
    span.set_attribute("gen_ai.request.model", str(chat_request.model))
    if replica_id:
        span.set_attribute("warmpath.replica", replica_id)
        if logged is not None:
            span.set_attribute("warmpath.route.reason", decision_log.served_reason(logged.decision, replica_id))
            span.set_attribute("warmpath.route.predicted_cached_tokens",
                               logged.decision.predicted_cached_tokens.get(replica_id, 0))
    telemetry.annotate_usage(span, usage)


class _RpcSpan:
    """The server span of one RPC and the status it ends with.

    Why an object: the status is decided in different places (a failure in
    `_fail`, a turn's own `error` event in `_turn_events`, success when the
    work is done), and a stream that ends normally after a failed turn must
    keep that turn's status rather than end as OK.
    """

    def __init__(self, span: trace.Span, parent: Optional[otel_context.Context] = None) -> None:
        self.span = span
        self.parent = parent  # the caller's context: its baggage goes on with the span's trace
        self.status: Optional[grpc.StatusCode] = None

    @classmethod
    def start(cls, service: str, method: str, grpc_context) -> "_RpcSpan":
        """The span of `service/method`, child of the W3C context in the call's metadata; not yet current."""
        parent = telemetry.extract(_string_metadata(grpc_context))
        return cls(telemetry.tracer().start_span(
            f"{service}/{method}", context=parent, kind=trace.SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method},
        ), parent)

    def record(self, status: grpc.StatusCode, message: str = "") -> None:
        """The RPC's final status (a later one replaces it)."""
        self.status = status
        record_rpc_status(self.span, status, message)

    def current(self) -> AbstractContextManager:
        """The span as the current one, so the trace context sent downstream (`telemetry.inject`) is its own.

        A stream holds it only between two of its messages, never across a
        yield: its consumer may close it from another task, where the
        attached context could not be detached (and would leak into the consumer).
        """
        return telemetry.current_context(trace.set_span_in_context(self.span, self.parent))

    @contextmanager
    def lifetime(self) -> Iterator["_RpcSpan"]:
        """Ends the span when the RPC is over: with its recorded status, else OK, CANCELLED if the caller left.

        A caller that left (the call's task cancelled, its stream closed) marks the span incomplete, unary
        or streamed, as the HTTP ingress marks a call whose client left: no answer went out.
        """
        try:
            yield self
        except BaseException as err:
            left = not isinstance(err, Exception)
            if left and self.span.is_recording():
                self.span.set_attribute(telemetry.INCOMPLETE_STREAM_ATTRIBUTE, True)
            if self.status is None:
                # Cancelled, or its stream closed by the consumer; an `Exception` here escaped `_fail`.
                status = grpc.StatusCode.CANCELLED if left else grpc.StatusCode.UNKNOWN
                self.record(status, f"{type(err).__name__}: {err}")
            raise
        finally:
            if self.status is None:
                self.record(grpc.StatusCode.OK)
            self.span.end()


def record_rpc_status(span: trace.Span, status: grpc.StatusCode, message: str = "") -> None:
    """An RPC's status on its server span, by OTel's RPC conventions.

    `rpc.grpc.status_code` goes on every span, OK (0) included, so a query by
    code sees every call, and so does `rpc.response.status_code` (the code's name,
    the newer conventions' spelling). Only the codes that say this service failed
    (`SERVER_ERROR_CODES`) mark the span ERROR, with that name as `error.type`
    (as the HTTP ingress marks a 5xx): NOT_FOUND, INVALID_ARGUMENT,
    UNAUTHENTICATED, RESOURCE_EXHAUSTED and the like are the caller's, and
    leave it UNSET.
    """
    if not span.is_recording():
        return
    span.set_attribute("rpc.grpc.status_code", status.value[0])
    span.set_attribute("rpc.response.status_code", status.name)
    if status in SERVER_ERROR_CODES:
        span.set_attribute("error.type", status.name)
        span.set_status(trace.Status(trace.StatusCode.ERROR, message[:200]))


def _string_metadata(grpc_context) -> list[tuple[str, str]]:
    return [(key, value) for key, value in grpc_context.invocation_metadata() if isinstance(value, str)]


def _metadata(grpc_context, name: str) -> str | None:
    return next((value for key, value in _string_metadata(grpc_context) if key.lower() == name), None)


def _session_of(request: inference_pb2.ChatCompletionRequest, grpc_context) -> str:
    """The call's routing session: its `session_id` field, else its session metadata, read as Serve reads the
    HTTP header (`x-session-id`, `x_session_id`, or the name `RAY_SERVE_SESSION_ID_HEADER_KEY` sets)."""
    return request.session_id or session_id_from_headers(_FirstValues(_string_metadata(grpc_context))) or ""


class _FirstValues:
    """Metadata pairs as the headers Serve's lookup reads (`items()`), every pair, repeated keys too: it takes
    the first match, as it does in HTTP's header list (a dict kept the last)."""

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        self._pairs = pairs

    def items(self) -> Iterator[tuple[str, str]]:
        return iter(self._pairs)


def _fail(grpc_context, rpc: _RpcSpan, method: str, err: Exception) -> RpcFailure:
    """Records a failed RPC: status onto the context and span, unexpected errors into the log and span."""
    failure = failure_from_exception(err, _get_serve_request_context().request_id)
    if failure is not err and not failure.is_logged:  # Ray's own errors and validation; the rest is logged already
        logger.warning("gRPC %s failed: %s: %s", method, type(err).__name__, err)
    if failure is not err:
        rpc.span.record_exception(err)
    failure.set_on(grpc_context)
    rpc.record(failure.status, failure.message)
    return failure
