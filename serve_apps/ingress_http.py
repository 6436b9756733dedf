"""HTTP ingress: Ray Serve LLM's OpenAI routes plus headers, tracing and the session API.

Why a subclass of `OpenAiIngress`: every response must say which replica
served it (`x-warmpath-replica`) and, once the prefix-aware router decided,
why (`x-warmpath-route`, `x-warmpath-predicted-cached-tokens`). The replica
names itself in the first item of its stream (`serve_apps.vllm_replica.ServedBy`);
this class strips that record and turns it into headers, a span and metrics.
The session routes (`/v1/sessions...`) forward to the orchestrator deployment
and map its envelopes to HTTP. Request parsing, model lookup (404 for unknown
models), error mapping and SSE framing of the OpenAI routes are Ray Serve LLM's;
this class adds the refusals the engine would fail on (`serve_apps.request_checks`),
and asks every stream for usage (the router counts it) while passing the
usage-only chunk on only to clients that asked for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, Optional

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from opentelemetry import trace
from pydantic import RootModel, ValidationError
from starlette.responses import JSONResponse, Response, StreamingResponse

from ray.llm._internal.serve.core.configs.openai_api_models import (
    ChatCompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    OpenAIHTTPException,
    TokenizeCompletionRequest,
)
from ray.llm._internal.common.utils.lora_utils import get_base_model_id
from ray.llm._internal.serve.core.ingress.ingress import (
    DEFAULT_ENDPOINTS,
    CallMethod,
    OpenAiIngress,
    _sanitize_chat_completion_request,
    router_request_timeout,
)
from ray.llm._internal.serve.core.protocol import RawRequestInfo
from ray.serve._private.http_util import session_id_from_headers
from ray.llm._internal.serve.constants import DEFAULT_LLM_ROUTER_HTTP_TIMEOUT
from ray.llm._internal.serve.core.ingress.utils import (
    NON_STREAMING_RESPONSE_TYPES,
    _openai_json_wrapper,
    _peek_at_generator,
)
from vllm.entrypoints.generate.base.protocol import StreamOptions

from cluster import telemetry
from cluster.config import TelemetryConfig
from router import decision_log
from serve_apps.access import Caller, retry_headers
from serve_apps.api_errors import (
    client_engine_error,
    engine_error,
    error_body,
    exception_body,
    exception_response,
    is_unavailable,
    refusal,
    unavailable_response,
    Utf8JSONResponse,
)
from serve_apps.handle_streams import cancelled_if_left
from serve_apps.metrics import record_model_usage
from serve_apps import openai_bodies
from serve_apps.request_checks import (
    chat_request_problem,
    completion_request_problem,
    detokenize_request_problem,
    tokenize_request_problem,
)
from serve_apps.orchestrator.models import (
    TURN_ERROR_STATUS,
    TURN_INTERRUPTED,
    CreateSessionRequest,
    ToolResultsSubmission,
    TurnRequest,
    outcome_checked,
)
from serve_apps.sse_frames import data_objects, frame_errors, has_done_line, sse_lines, stream_leading_error
from serve_apps.vllm_replica import ServedBy

logger = logging.getLogger("ray.serve")

REPLICA_HEADER = "x-warmpath-replica"
ROUTE_HEADER = "x-warmpath-route"
PREDICTED_CACHED_HEADER = "x-warmpath-predicted-cached-tokens"


def _route_headers(served_by: Optional[ServedBy]) -> tuple[Dict[str, str], Optional[decision_log.LoggedDecision]]:
    """Replica header, plus the router's reason and prediction when warmpath's router decided."""
    headers: Dict[str, str] = {}
    logged = decision_log.pop_current()
    decision_log.record_route_span(logged, served_by.replica_id if served_by else None)
    decision = logged.decision if logged is not None else None
    if served_by is not None:
        headers[REPLICA_HEADER] = served_by.replica_id
    if decision is not None:
        replica = served_by.replica_id if served_by is not None else decision.replica_id
        headers[ROUTE_HEADER] = decision_log.served_reason(decision, replica)
        predicted = decision.predicted_cached_tokens.get(replica, 0)
        headers[PREDICTED_CACHED_HEADER] = str(predicted)
    return headers, logged


def _refused_by(err: Exception, served_by: Optional[ServedBy]) -> Exception:
    """`err`, an engine's refusal, naming the replica that refused it (its response's `x-warmpath-replica`)."""
    if served_by is not None:
        err.replica_id = served_by.replica_id
    return err


def _withdraw_placement(refusing_replica: Optional[str]) -> None:
    """A call that failed before its response started: the router's placement for it is withdrawn, on the
    replica that refused it where known (Serve may have sent it to another than the chosen one).

    The decision is still in the log only when no headers were built, i.e. the
    engine refused the request (or it broke off) before its first token, so it
    cached nothing the router should count on.
    """
    decision_log.withdraw_placement(decision_log.pop_current(), refusing_replica)


def _record_usage(
    logged: Optional[decision_log.LoggedDecision], served_by: Optional[ServedBy], usage: Optional[dict]
) -> None:
    """Per-replica token counters, and the prediction against vLLM's own cached-token count.

    `usage` is the response's `usage` object as JSON (None when the response had none).
    """
    record_model_usage(logged, served_by.replica_id if served_by else "", usage)


def _recording_usage(
    frames: AsyncIterator[str],
    logged: Optional[decision_log.LoggedDecision],
    served_by: Optional[ServedBy],
    is_usage_asked: bool = True,
    span=None,
) -> AsyncIterator[str]:
    """`_usage_recorded` over `frames`; a stream dropped before it started (its client left before the body
    began, and Starlette never iterates it) records the call without usage when it is collected."""
    on_drop: list[weakref.finalize] = []  # filled before the stream can start; the stream detaches it
    stream = _usage_recorded(frames, logged, served_by, is_usage_asked, span, on_drop)
    on_drop.append(weakref.finalize(stream, _record_usage, logged, served_by, None))
    return stream


async def _usage_recorded(
    frames: AsyncIterator[str],
    logged: Optional[decision_log.LoggedDecision],
    served_by: Optional[ServedBy],
    is_usage_asked: bool,
    span,
    on_drop: list[weakref.finalize],
) -> AsyncIterator[str]:
    """Passes SSE frames through and records the last usage seen (vLLM sends it in the last data frame).

    Recorded before `[DONE]` goes out, so a client that reads the router's
    statistics after its stream ends sees this call counted. A client that did
    not ask for usage (`stream_options.include_usage`) does not get the
    usage-only chunk the ingress asked the engine for. An engine error frame
    and a stream that ends without `[DONE]` (the client hung up, the replica
    died) are noted on `span`: the response's 200 went out before either.
    """
    usage = None
    is_recorded = False
    # A frame that finishes a choice, kept back (only while the client did not ask for usage) until the
    # frame after it: vLLM puts the system fingerprint on the usage-only chunk that follows, which is dropped.
    held = ""
    on_drop[0].detach()  # started: the stream records its own usage below
    try:
        try:
            async for frame in frames:
                if '"usage"' in frame:  # a frame may hold several batched chunks, [DONE] included
                    usage = _frame_usage(frame) or usage
                    if not is_usage_asked:
                        fingerprint = usage_fingerprint(frame)
                        frame = without_usage_chunks(frame)
                        if fingerprint is not None:
                            held, frame = with_fingerprint(held, fingerprint), with_fingerprint(frame, fingerprint)
                if held:
                    yield held
                    held = ""
                if not frame:
                    continue
                if not is_usage_asked and FINISH_MARK in frame and not has_done_line(frame) and '"error"' not in frame:
                    held = frame
                    continue
                if '"error"' in frame:  # an engine error after the first chunk (a quote in text is escaped)
                    _record_error_frame(span, frame)
                    frame = readable_error_frame(frame)
                if has_done_line(frame):
                    _record_usage(logged, served_by, usage)
                    telemetry.annotate_usage(span, usage)
                    is_recorded = True
                yield frame
            if held:  # the stream ended without [DONE]
                yield held
        except Exception as err:
            # The replica died mid-stream, after the 200 went out: the stream ends as vLLM ends a failed one,
            # an error frame then [DONE] (a bare close reads as a transport error to OpenAI's clients).
            logger.warning("a streamed call failed after its first chunk", exc_info=True)
            status, body = exception_body(err, "")
            frame = f"data: {json.dumps(body)}\n\n"
            if span is not None:  # the status the client's frame says (503 for a replica gone), not the body's code
                telemetry.record_failure_status(span, str(status), status, body["error"]["message"])
            yield held + frame + "data: [DONE]\n\n"
    finally:
        if not is_recorded:  # the stream broke off or ended without [DONE]
            _record_usage(logged, served_by, usage)
            telemetry.annotate_usage(span, usage)
            if span is not None and span.is_recording():
                span.set_attribute(telemetry.INCOMPLETE_STREAM_ATTRIBUTE, True)  # no [DONE]


# A chunk that finishes a choice, as vLLM writes it (compact JSON; null is not a string).
FINISH_MARK = '"finish_reason":"'


# Longest model name kept on a span: a client's string, however long it sent it.
MAX_SPAN_MODEL_CHARS = 256


def _llm_span_attributes(call_method: str, model: str, raw_request: Optional[Request]) -> dict[str, Any]:
    """A chat or completion call's server span attributes: GenAI's, and HTTP's as the session routes have them."""
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": telemetry.gen_ai_operation(call_method),
        "gen_ai.request.model": model[:MAX_SPAN_MODEL_CHARS], "gen_ai.system": "vllm", "gen_ai.provider.name": "vllm",
    }
    if raw_request is not None:
        attributes.update({"http.request.method": raw_request.method, "http.route": raw_request.url.path,
                           "url.path": raw_request.url.path, "url.scheme": raw_request.url.scheme})
    return attributes


def _frame_usage(frame: str) -> Optional[dict]:
    """The `usage` of the last `data:` chunk in `frame` that has one."""
    usages = [chunk["usage"] for _, chunk in data_objects(sse_lines(frame)) if isinstance(chunk.get("usage"), dict)]
    return usages[-1] if usages else None


def asks_for_usage(body: Any) -> bool:
    """Whether a streamed request asked for the usage-only last chunk (a non-streamed answer always has usage)."""
    options = getattr(body, "stream_options", None)
    return bool(options is not None and options.include_usage)


def without_usage_chunks(frame: str) -> str:
    """`frame` without its usage-only `data:` chunks (no choices, only usage), each with its blank line."""
    lines = frame.split("\n")
    dropped = {position for position, chunk in data_objects(lines)
               if not chunk.get("choices") and isinstance(chunk.get("usage"), dict)}
    if not dropped:
        return frame
    kept = []
    skip_blank = False
    for position, line in enumerate(lines):
        if position in dropped:
            skip_blank = True
            continue
        if skip_blank and line == "":
            skip_blank = False
            continue
        skip_blank = False
        kept.append(line)
    return "\n".join(kept) if any(kept) else ""


def usage_fingerprint(frame: str) -> Optional[str]:
    """The `system_fingerprint` of `frame`'s usage-only chunk, if it has one."""
    for _, chunk in data_objects(sse_lines(frame)):
        if not chunk.get("choices") and isinstance(chunk.get("usage"), dict):
            fingerprint = chunk.get("system_fingerprint")
            return fingerprint if isinstance(fingerprint, str) else None
    return None


def with_fingerprint(frame: str, fingerprint: str) -> str:
    """`frame` with `fingerprint` on each chunk that finishes a choice and has none.

    Where vLLM puts it for a client that did not ask for usage; the ingress asked for
    usage on the client's behalf, so vLLM put it on the usage-only chunk instead.
    """
    if FINISH_MARK not in frame:
        return frame
    lines = frame.split("\n")
    for position, chunk in data_objects(lines):
        choices = chunk.get("choices")
        is_finishing = isinstance(choices, list) and any(
            isinstance(choice, dict) and choice.get("finish_reason") is not None for choice in choices
        )
        if is_finishing and chunk.get("system_fingerprint") is None:
            chunk["system_fingerprint"] = fingerprint
            # As vLLM writes its chunks: compact, text as it is.
            lines[position] = "data: " + json.dumps(chunk, separators=(",", ":"), ensure_ascii=False)
    return "\n".join(lines)


def _record_error_frame(span, frame: str) -> None:
    """Each engine error in `frame` on the call's span, with the status the engine gave it (500 without one)."""
    if span is None:
        return
    for error in frame_errors(frame):
        status, message = engine_error(error)
        telemetry.record_failure_status(span, str(status or 500), status or 500, message)


def readable_error_frame(frame: str) -> str:
    """`frame` with each `data:` chunk's `error` in the API's error shape (`serve_apps.api_errors`)."""
    lines = frame.split("\n")
    for position, chunk in data_objects(lines):
        error = chunk.get("error")
        if isinstance(error, dict):
            status, message = client_engine_error(error)  # the engine's own failure said as before the stream
            param = error.get("param")
            chunk["error"] = error_body(status or 500, message, param=param if isinstance(param, str) else None)["error"]
            lines[position] = "data: " + json.dumps(chunk)
    return "\n".join(lines)


# Where a create-session body is validated: its tool schemas' checks take seconds for a body of megabytes,
# which on the event loop would hold up every stream this ingress relays.
_BODY_CHECKS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="warmpath-body-checks")


class CreateSessionBody(RootModel[dict[str, Any]]):
    """A create-session body as parsed JSON, documented as `CreateSessionRequest` (`create_session` validates it
    off the event loop, answered as FastAPI answers a body that fails its model)."""

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler):
        return handler(CreateSessionRequest.__pydantic_core_schema__)


async def _validated_off_loop(body: CreateSessionBody) -> CreateSessionRequest:
    """`body` as a `CreateSessionRequest`, checked on `_BODY_CHECKS`; raises RequestValidationError as FastAPI would."""
    try:
        return await asyncio.get_running_loop().run_in_executor(
            _BODY_CHECKS, CreateSessionRequest.model_validate, body.root
        )
    except ValidationError as err:
        raise RequestValidationError([{**error, "loc": ("body", *error["loc"])} for error in err.errors()]) from None


INTERNAL_ERROR = error_body(500, "internal error in the session service; see the server logs", code="internal")
IDEMPOTENCY_HEADER = "idempotency-key"
REPLAY_HEADER = "x-warmpath-idempotent-replay"
# OpenAI's clients read it before retrying a 408, 409, 429 or 5xx by themselves.
NO_CLIENT_RETRY_HEADER = "x-should-retry"
# Refusals a prompt retry cannot change (a key at its session quota stays there until a session goes; a
# session's pending calls stay pending until their results come; a compression that would drop values would
# drop them again, after paying the turn's model calls again), and turns that may have committed, which only
# a retry under the same Idempotency-Key may send again.
NO_CLIENT_RETRY_CODES = frozenset({
    "session_quota_exceeded", "requires_action", "tool_results_mismatch", "compression_lost_values",
    "turn_interrupted", "chat_template_refused",
})


def _caller(request: Request) -> Caller:
    """Set by `serve_apps.access.AccessMiddleware` for every non-public path; without it, nobody gets in."""
    caller = request.scope.get("state", {}).get("caller")
    if caller is None:
        raise OpenAIHTTPException(status_code=401, message="no authenticated caller", type="AuthenticationError")
    return caller


def _unary(result: Dict[str, Any]) -> Response:
    """An orchestrator envelope as a response; a refusal that waiting can clear (Redis unavailable, the session
    busy) carries `Retry-After`."""
    if result["status"] == 204:
        return Response(status_code=204)
    body = result["body"]
    error = body.get("error") if isinstance(body, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return JSONResponse(body, status_code=result["status"], headers=_refusal_headers(code))


def _refusal_headers(code: Optional[str]) -> Dict[str, str]:
    """What a refusal with this error code tells the client's retry logic: `Retry-After` where waiting can clear
    it, `x-should-retry: false` where no prompt retry can (`NO_CLIENT_RETRY_CODES`)."""
    headers = retry_headers(code)
    if code in NO_CLIENT_RETRY_CODES:
        headers[NO_CLIENT_RETRY_HEADER] = "false"
    return headers


def _sse(
    first: Dict[str, Any], events: AsyncIterator[Dict[str, Any]], span: trace.Span = trace.INVALID_SPAN,
    stream: Any = None,
) -> AsyncIterator[str]:
    """A turn's events as SSE frames; a turn that fails after its 200 is noted on the route's `span`, and so
    is a stream its client left before `done` (as a chat stream's is). The turn's handle call `stream`
    is cancelled when the client leaves."""
    async def frames() -> AsyncIterator[str]:
        is_done = False
        try:
            try:
                with cancelled_if_left(stream):
                    async for event in events:
                        if event["kind"] == "error":  # after the 200: `error.type` carries the turn's own status
                            status = TURN_ERROR_STATUS.get(event.get("code"), 500)
                            telemetry.record_failure_status(
                                span, str(status), status, str(event.get("message") or "the turn failed")
                            )
                        yield f"event: {event['kind']}\ndata: {json.dumps(event)}\n\n"
            except Exception as err:
                logger.exception("turn stream broke off")
                telemetry.record_exception_failure(span, err)
                yield f"event: error\ndata: {json.dumps({'kind': 'error', **TURN_INTERRUPTED})}\n\n"
            yield "event: done\ndata: {}\n\n"
            is_done = True
        finally:
            if not is_done and span.is_recording():
                span.set_attribute(telemetry.INCOMPLETE_STREAM_ATTRIBUTE, True)

    return frames()


async def _call(remote, span: trace.Span = trace.INVALID_SPAN) -> Response:
    """A unary session call; failures inside the orchestrator become a clean 500 (the exception goes on `span`)."""
    try:
        return _unary(await remote)
    except Exception as err:
        logger.exception("session call failed")
        span.record_exception(err)
        return _session_failure(err)


def _session_failure(err: Exception) -> JSONResponse:
    """503 with `Retry-After` where no orchestrator could take the call (retry, as over gRPC); else a clean 500."""
    if is_unavailable(err):
        return unavailable_response()
    return JSONResponse(INTERNAL_ERROR, status_code=500)


def merged_deltas(events: list[Dict[str, Any]]) -> list[Dict[str, Any]]:
    """The events with each run of consecutive `delta`s (or `reasoning`s) as one (a whole answer is one event, not
    one per token).

    Only neighbours merge: a `model_retry` between two runs still tells the client to drop the first.
    """
    merged: list[Dict[str, Any]] = []
    for event in events:
        if event["kind"] in ("delta", "reasoning") and merged and merged[-1]["kind"] == event["kind"]:
            merged[-1] = {**merged[-1], "text": merged[-1]["text"] + event["text"]}
        else:
            merged.append(event)
    return merged


async def _turn_response(
    session_id: str, stream_events, is_streaming: bool, span: trace.Span = trace.INVALID_SPAN
) -> Response:
    """Maps the orchestrator's turn stream (envelope first, then events) to HTTP; exceptions go on `span`."""
    events = stream_events.__aiter__()
    try:
        with cancelled_if_left(stream_events):  # the client left, or the call failed: the turn stops with it
            first = await events.__anext__()
    except Exception as err:
        logger.exception("turn of session %s failed before it started", session_id)
        span.record_exception(err)
        return _session_failure(err)
    if first["status"] != 200:
        return _unary(first)
    events = outcome_checked(events)
    headers = {REPLAY_HEADER: "true"} if first.get("is_replay") else {}
    if is_streaming:
        return StreamingResponse(_sse(first, events, span, stream_events), media_type="text/event-stream",
                                 headers=headers)
    try:
        with cancelled_if_left(stream_events):
            collected = [event async for event in events]
    except Exception as err:
        logger.exception("turn of session %s broke off", session_id)
        span.record_exception(err)
        error = error_body(503, TURN_INTERRUPTED["message"], code=TURN_INTERRUPTED["code"])["error"]
        # The turn may have committed: only a retry under the same Idempotency-Key is safe, so OpenAI's
        # clients, which retry a 503 by themselves without one, are told not to.
        return JSONResponse({"session_id": session_id, "status": "failed", "error": error}, status_code=503,
                            headers={NO_CLIENT_RETRY_HEADER: "false"})
    collected = merged_deltas(collected)
    last = collected[-1] if collected else {"kind": "error", "code": "empty_turn", "message": "the turn produced nothing"}
    status_by_kind = {"final": "completed", "requires_action": "requires_action"}
    outcome = status_by_kind.get(last["kind"], "max_steps" if last.get("code") == "max_steps" else "failed")
    body = {"session_id": session_id, "status": outcome, "events": collected}
    if last["kind"] == "final":
        body["message"] = last["message"]
    if last["kind"] == "requires_action":
        body["required_action"] = {"tool_calls": last["tool_calls"]}
    status = TURN_ERROR_STATUS.get(last.get("code"), 500) if outcome == "failed" else 200
    if outcome == "failed":  # the API's error shape, beside the turn's events
        body["error"] = error_body(status, str(last.get("message") or "the turn failed"), code=last.get("code"))["error"]
        headers.update(_refusal_headers(last.get("code")))
    return JSONResponse(body, status_code=status, headers=headers)


async def _traced_session_call(
    request: Request,
    method: str,
    route: str,
    session_id: Optional[str],
    respond: Callable[[trace.Span], Awaitable[Response]],
) -> Response:
    """`respond(span)` under the route's server span, child of the caller's W3C context.

    Why every session route has one: the orchestrator's spans (a turn's model
    and tool calls) hang under it, and a failed create or delete is as worth
    finding as a failed turn (the gRPC ingress traces all of them too). Named
    `{method} {route}` with the template alone in `http.route`, as OTel's HTTP
    conventions ask. The span is current while `respond` runs, so the trace
    context it sends the orchestrator (`telemetry.inject`) is this span's; a
    streamed turn's span ends with its stream (`_finish_span`).
    """
    attributes = {"http.request.method": method, "http.route": route,
                  "url.path": request.url.path, "url.scheme": request.url.scheme}
    if session_id is not None:
        attributes["warmpath.session_id"] = session_id
    parent = telemetry.extract(request.headers.items())
    span = telemetry.tracer().start_span(f"{method} {route}", context=parent, kind=trace.SpanKind.SERVER,
                                         attributes=attributes)
    # On the caller's context, so its baggage goes on with the trace (`telemetry.inject`).
    with telemetry.current_context(trace.set_span_in_context(span, parent)):
        try:
            response = await respond(span)
        except OpenAIHTTPException as err:  # no caller (401), no session API (404): answered by `api_errors.install`
            span.record_exception(err)
            _record_http_status(span, err.status_code, err.message)
            span.end()
            raise
        except BaseException as err:
            if isinstance(err, Exception):
                telemetry.record_exception_failure(span, err)
            elif span.is_recording():  # the caller left (a cancellation): incomplete, as on the chat routes
                span.set_attribute(telemetry.INCOMPLETE_STREAM_ATTRIBUTE, True)
            span.end()
            raise
    return _finish_span(span, response)


def _forward_trace_context(raw_request: Request) -> None:
    """Replaces the request's W3C headers with the ingress span's, so the replica continues this trace."""
    carrier = telemetry.inject()
    names = {k.encode() for k in carrier}
    headers = [(k, v) for k, v in raw_request.scope["headers"] if k.lower() not in names]
    headers += [(k.encode(), v.encode()) for k, v in carrier.items()]
    raw_request.scope["headers"] = headers
    raw_request.__dict__.pop("_headers", None)


def _annotate(span, headers: Dict[str, str]) -> None:
    for header, attribute in ((REPLICA_HEADER, "warmpath.replica"), (ROUTE_HEADER, "warmpath.route.reason")):
        if header in headers:
            span.set_attribute(attribute, headers[header])
    if PREDICTED_CACHED_HEADER in headers:
        span.set_attribute("warmpath.route.predicted_cached_tokens", int(headers[PREDICTED_CACHED_HEADER]))


def _record_http_status(span, status: int, message: str = "") -> None:
    """A response's status on its server span, by OTel's HTTP server conventions (`error.type` is a 5xx's code)."""
    if span.is_recording():
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            telemetry.record_failure_status(span, str(status), status, message)


def _response_error_message(response: Response) -> str:
    """`error.message` of a response in the API's error shape; "" for any other body (or a stream)."""
    try:
        body = json.loads(getattr(response, "body", b"") or b"null")
    except ValueError:
        return ""
    error = body.get("error") if isinstance(body, dict) else None
    return str(error.get("message") or "") if isinstance(error, dict) else ""


def _finish_span(span, response: Response) -> Response:
    """`response`, its status recorded on `span`, which ends now or, for a stream, when the stream does.

    The one place a server span's status is set and its end decided, for the
    OpenAI routes and the session routes alike.
    """
    _record_http_status(span, response.status_code, _response_error_message(response))
    if isinstance(response, StreamingResponse):
        response.body_iterator = _ending_span(response.body_iterator, span)
    else:
        span.end()
    return response


def _ending_span(frames: AsyncIterator[str], span) -> AsyncIterator[str]:
    """`frames`, ending `span` once: when the stream ends, fails or is closed, or when it is dropped unstarted.

    Why a finalizer as well as `finally`: a generator's `finally` only runs if
    the generator started, and Starlette drops a response whose client left
    before its body began; the span would stay open, never exported. The inner
    stream is closed first, so what it records on the span at its end (usage,
    an incomplete stream) lands before the span ends; one dropped unstarted is
    incomplete too. A failure inside the stream came after its 200 went out, so
    it is recorded as the failure itself.
    """
    async def relay() -> AsyncIterator[str]:
        try:
            async for frame in frames:
                yield frame
        except Exception as err:
            telemetry.record_exception_failure(span, err)
            raise
        finally:
            try:
                aclose = getattr(frames, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                if end.detach() is not None:  # started: ended here, once, whatever the stream recorded
                    span.end()

    stream = relay()
    end = weakref.finalize(stream, _end_unstarted, span)
    return stream


def _end_unstarted(span) -> None:
    """Ends the span of a stream dropped before its body began: its client left, so it is incomplete."""
    if span.is_recording():
        span.set_attribute(telemetry.INCOMPLETE_STREAM_ATTRIBUTE, True)
    span.end()


def _bad_request(problem: tuple[str, Optional[str]]) -> JSONResponse:
    message, param = problem
    return JSONResponse(error_body(400, message, code="invalid_parameter", param=param), status_code=400)


async def _answered(response: Awaitable[Response], request: Request) -> Response:
    """`response`, or the API's error shape for an exception it raised (Ray's middleware would wrap it unreadably)."""
    try:
        return await response
    except OpenAIHTTPException:
        raise  # answered by `api_errors.install`'s handler
    except Exception as err:
        return exception_response(err, request)


class WarmpathIngress(OpenAiIngress):
    """OpenAI routes that report the serving replica in response headers, plus the session API."""

    def __init__(
        self, *args: Any, orchestrator=None, telemetry_config: Optional[dict] = None,
        window_tokens: Optional[int] = None, **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._orchestrator = orchestrator
        openai_bodies.limit_items(window_tokens)  # FastAPI validates the bodies, with no ingress at hand
        telemetry.setup_tracing(TelemetryConfig.model_validate(telemetry_config or {}), "ingress")

    def __del__(self) -> None:
        """Ray Serve's shutdown hook (then it kills the actor): the queued spans go out first, within a bound."""
        if telemetry is not None:  # None when the interpreter exits and has cleared module globals
            telemetry.flush_spans()

    async def chat(self, body: openai_bodies.ChatCompletionRequest, request: Request) -> Response:
        """A chat completion (`serve_apps.openai_bodies`: a field of the wrong type is a 400, not a 500)."""
        return await self._process_llm_request(body, call_method=CallMethod.CHAT.value, raw_request=request)

    async def completions(self, body: openai_bodies.CompletionRequest, request: Request) -> Response:
        """A completion (`serve_apps.openai_bodies`: a field of the wrong type is a 400, not a 500)."""
        return await self._process_llm_request(body, call_method=CallMethod.COMPLETIONS.value, raw_request=request)

    async def _get_model_id(self, model: Optional[str]) -> str:
        """Serve LLM's, refusing a served model's name with a LoRA suffix (`warmpath-tiny:x`) as unknown.

        Why: warmpath serves no LoRA adapters, and Serve LLM took the suffix for one: the call went out
        multiplexed, to a replica that fails it (a 500), and each distinct name kept a handle for good.
        """
        model_id = await super()._get_model_id(model)
        base_model_id = get_base_model_id(model_id)
        if model_id != base_model_id:
            raise OpenAIHTTPException(
                status_code=404, type="NotFoundError",
                message=f'model "{model_id}" is not served here: no LoRA adapters are (serving "{base_model_id}")',
            )
        return model_id

    async def _get_response(self, *, body, call_method: str, raw_request: Optional[Request] = None):
        """Ray Serve LLM's `_get_response` (Ray 2.60), with the engine call cancelled when its reader stops.

        Why: when Serve LLM's first-output timeout fires, the client is answered 408 and this request
        ends normally, so Ray cancels none of its calls: the engine kept the call queued or decoding for
        no one (and OpenAI's clients send a 408 twice more). `cancelled_if_left` cancels it as the
        cancellation or close reaches this generator, unless the call already gave a whole response.
        """
        model_id = await self._get_model_id(body.model)
        handle = self._get_configured_serve_handle(model_id)
        if raw_request is not None:
            session_id = session_id_from_headers(raw_request.headers)  # Serve's session affinity, one hop on
            if session_id:
                handle = handle.options(session_id=session_id)
            raw_request = RawRequestInfo.from_starlette_request(raw_request)
        if isinstance(body, ChatCompletionRequest):
            body = _sanitize_chat_completion_request(body)  # pickles (Serve LLM's own workaround)
        stream = getattr(handle, call_method).remote(body, raw_request)
        last: Any = None
        # A whole response (not a stream's text, nor the replica's tag) is all the call gives: its reader
        # stops there, and closing this generator then must not cancel a call that has answered.
        with cancelled_if_left(stream, is_answered=lambda: not isinstance(last, (str, list, ServedBy, type(None)))):
            async for last in stream:
                yield last

    async def _process_llm_request(self, body, call_method: str, raw_request: Optional[Request] = None) -> Response:
        parent = telemetry.extract(raw_request.headers.items()) if raw_request is not None else None
        span = telemetry.tracer().start_span(
            self._span_name(call_method, str(body.model)), context=parent, kind=trace.SpanKind.SERVER,
            attributes=_llm_span_attributes(call_method, str(body.model), raw_request),
        )
        with telemetry.current_context(trace.set_span_in_context(span, parent)):  # the caller's baggage kept
            try:
                problem = chat_request_problem(body) if call_method == "chat" else completion_request_problem(body)
                if problem is not None:
                    return _finish_span(span, _bad_request(problem))
                is_usage_asked = asks_for_usage(body)
                if getattr(body, "stream", False) and not is_usage_asked:
                    # The router's per-replica counters read the stream's usage; the client did not ask for it.
                    body.stream_options = StreamOptions(include_usage=True)
                # A valid context, sampled or not: a sampled-out call still tells the replica not to start a trace.
                if raw_request is not None and span.get_span_context().is_valid:
                    _forward_trace_context(raw_request)
                response = await self._traced_llm_request(body, call_method, raw_request, span, is_usage_asked)
            except BaseException as err:
                refusing_replica = getattr(err, "replica_id", None)  # an engine's refusal names its replica
                _withdraw_placement(refusing_replica)
                if not isinstance(err, Exception):  # the caller left (cancellation): no response goes out
                    if span.is_recording():  # incomplete, as a stream its caller left and a gRPC call: no error
                        span.set_attribute(telemetry.INCOMPLETE_STREAM_ATTRIBUTE, True)
                    span.end()
                    raise
                span.record_exception(err)
                # Answered here, in the API's one error shape, not by Ray's middleware (`serve_apps.api_errors`).
                response = exception_response(err, raw_request)
                if refusing_replica is not None:
                    response.headers[REPLICA_HEADER] = refusing_replica
        return _finish_span(span, response)

    def _span_name(self, call_method: str, model: str) -> str:
        """`{operation} {model}` (GenAI's span name) for a served model, else the operation alone: a name
        a client made up must not add a span name per request to the tracing backend."""
        base_model = get_base_model_id(model)
        return f"{call_method} {base_model}" if base_model in self._default_serve_handles else call_method

    async def _traced_llm_request(
        self, body, call_method: str, raw_request: Optional[Request], span, is_usage_asked: bool
    ) -> Response:
        async with router_request_timeout(DEFAULT_LLM_ROUTER_HTTP_TIMEOUT):
            gen = self._get_response(body=body, call_method=call_method, raw_request=raw_request)
            served_by: Optional[ServedBy] = None
            first, gen = await _peek_at_generator(gen)
            if isinstance(first, ServedBy):
                served_by = first
                await gen.__anext__()  # the peeked tag itself
                try:
                    first, gen = await _peek_at_generator(gen)
                except Exception as err:  # the replica failed after it named itself: the answer names it too
                    raise _refused_by(err, served_by)
            first_chunk = first[0] if isinstance(first, list) else first
            if isinstance(first_chunk, ErrorResponse):
                raise _refused_by(refusal(first_chunk.error.model_dump()), served_by)
            leading_error = stream_leading_error(first_chunk)
            if leading_error is not None:  # refused before any token: a status, not a 200 with an error frame
                raise _refused_by(refusal(leading_error), served_by)
            headers, logged = _route_headers(served_by)
            if span.is_recording():
                _annotate(span, headers)
            if isinstance(first_chunk, NON_STREAMING_RESPONSE_TYPES):
                usage = getattr(first_chunk, "usage", None)
                usage = usage.model_dump() if usage is not None else None
                telemetry.annotate_usage(span, usage)
                _record_usage(logged, served_by, usage)
                return Utf8JSONResponse(content=first_chunk.model_dump(), headers=headers)
            frames = _recording_usage(_openai_json_wrapper(gen), logged, served_by, is_usage_asked, span)
            return StreamingResponse(frames, media_type="text/event-stream", headers=headers)

    async def tokenize(self, body: TokenizeCompletionRequest, request: Request) -> Response:
        """Token ids of a prompt, as the engine's tokenizer gives them."""
        problem = tokenize_request_problem(body)
        if problem is not None:
            return _bad_request(problem)
        return await _answered(super().tokenize(body, request), request)

    async def detokenize(self, body: DetokenizeRequest, request: Request) -> Response:
        """Text of token ids, as the engine's tokenizer decodes them."""
        problem = detokenize_request_problem(body)
        if problem is not None:
            return _bad_request(problem)
        return await _answered(super().detokenize(body, request), request)

    def _sessions(self):
        if self._orchestrator is None:
            raise OpenAIHTTPException(status_code=404, message="the session API is not deployed", type="NotFoundError")
        return self._orchestrator

    async def create_session(self, body: CreateSessionBody, request: Request) -> Response:
        """Create an agent session (system prompt, tools, limits); returns its id and prefix fingerprint.

        The session belongs to the calling API key; a tool needing a permission the key lacks is refused (403),
        and so is a session beyond the key's quota of live sessions (429 `session_quota_exceeded`).
        """
        body = await _validated_off_loop(body)

        def respond(span: trace.Span) -> Awaitable[Response]:
            remote = self._sessions().create_session.remote(body.model_dump(mode="json"), _caller(request).to_dict())
            return _call(remote, span)

        return await _traced_session_call(request, "POST", "/v1/sessions", None, respond)

    async def get_session(self, session_id: str, request: Request) -> Response:
        """Transcript, token accounting and cache stats of a session (404 for another key's session)."""
        def respond(span: trace.Span) -> Awaitable[Response]:
            return _call(self._sessions().get_session.remote(session_id, _caller(request).to_dict()), span)

        return await _traced_session_call(request, "GET", "/v1/sessions/{session_id}", session_id, respond)

    async def delete_session(self, session_id: str, request: Request) -> Response:
        def respond(span: trace.Span) -> Awaitable[Response]:
            return _call(self._sessions().delete_session.remote(session_id, _caller(request).to_dict()), span)

        return await _traced_session_call(request, "DELETE", "/v1/sessions/{session_id}", session_id, respond)

    async def post_message(self, session_id: str, body: TurnRequest, request: Request) -> Response:
        """Append a user message and run the turn (SSE when `stream` is true).

        With an `Idempotency-Key` header, a retry of a turn that already committed
        gets the committed turn back (header `x-warmpath-idempotent-replay: true`) instead of a second turn.
        """
        idempotency_key = request.headers.get(IDEMPOTENCY_HEADER)  # checked by the orchestrator, for every ingress

        def respond(span: trace.Span) -> Awaitable[Response]:
            events = self._sessions().options(stream=True).send_message.remote(
                session_id, body.model_dump(mode="json"), _caller(request).to_dict(), telemetry.inject(), idempotency_key
            )
            return _turn_response(session_id, events, body.stream, span)

        return await _traced_session_call(request, "POST", "/v1/sessions/{session_id}/messages", session_id, respond)

    async def post_tool_results(self, session_id: str, body: ToolResultsSubmission, request: Request) -> Response:
        """Answer a `requires_action` pause with client tool results and continue the turn (same idempotency rule)."""
        idempotency_key = request.headers.get(IDEMPOTENCY_HEADER)  # checked by the orchestrator, for every ingress

        def respond(span: trace.Span) -> Awaitable[Response]:
            events = self._sessions().options(stream=True).submit_tool_results.remote(
                session_id, body.model_dump(mode="json"), _caller(request).to_dict(), telemetry.inject(), idempotency_key
            )
            return _turn_response(session_id, events, body.stream, span)

        route = "/v1/sessions/{session_id}/tool_results"
        return await _traced_session_call(request, "POST", route, session_id, respond)

    async def router_state(self) -> JSONResponse:
        """The prefix-aware routers of this ingress replica: replicas, index counts, decision statistics."""
        routers = [r.snapshot() for r in list(decision_log.LIVE_ROUTERS)]
        return JSONResponse({"routers": routers, "stats": decision_log.STATS.snapshot()})

    async def health(self) -> JSONResponse:
        """Liveness of the ingress and the models it routes to."""
        return JSONResponse({"status": "ok", "models": sorted(self._model_cards)})


ENDPOINTS = {
    **{name: DEFAULT_ENDPOINTS[name] for name in ("models", "model_data", "completions", "chat", "tokenize", "detokenize")},
    "health": lambda app: app.get("/health"),
    "router_state": lambda app: app.get("/v1/router"),
    "create_session": lambda app: app.post("/v1/sessions", status_code=201),
    "get_session": lambda app: app.get("/v1/sessions/{session_id}"),
    "delete_session": lambda app: app.delete("/v1/sessions/{session_id}", status_code=204),
    "post_message": lambda app: app.post("/v1/sessions/{session_id}/messages"),
    "post_tool_results": lambda app: app.post("/v1/sessions/{session_id}/tool_results"),
}
