"""The orchestrator Ray Serve deployment: owns agent sessions, calls the replicas.

Why a deployment of its own (not part of the ingress): session turns are long,
stateful work (model calls, tool calls, Redis commits); keeping them in their
own replicas lets the ingress stay thin and lets Serve restart or scale the
orchestrator independently. All session state lives in Redis, so any
orchestrator replica can continue any session.

Model calls go through a `DeploymentHandle` to the vLLM replicas with the
session id attached, so the configured request router (warmpath's prefix-aware
router by default) picks the replica for every step.

Every public method answers with plain data: `{"status": <http status>, "body": ...}`
for unary calls, and for turns an async stream whose first item is either
`{"status": 200}` or an error envelope, followed by session events. The
ingress maps them to HTTP; no exception crosses the actor boundary for an
expected outcome.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator

import jinja2
from opentelemetry import trace
from pydantic import ValidationError

from cluster import telemetry
from cluster.config import validate_config
from router import decision_log
from cluster.api_keys import missing_permissions
from cluster.redis_pool import refuse_unsuitable_redis, serving_redis_url
from serve_apps.access import Caller
from serve_apps.api_errors import error_body, readable_message, validation_problem
from serve_apps.handle_streams import cancelled_if_left
from serve_apps.metrics import WarmpathMetrics, settle_model_call
from serve_apps.orchestrator.models import (
    CHAT_TEMPLATE_REFUSED,
    CreateSessionRequest,
    CreateSessionResponse,
    Message,
    StepStats,
    TOOL_CALL_ID_MAX_CHARS,
    TOOL_NAME_MAX_CHARS,
    TURN_ERROR_STATUS,
    TURN_INTERRUPTED,
    ToolCall,
    ToolResultsSubmission,
    TurnRequest,
    is_session_id,
)
from serve_apps.orchestrator.prompt import (
    SessionState,
    TemplateCannotRender,
    build_chat_request,
    control_tokens_of,
    count_tokens,
    effective_window_tokens,
    prefix_overflow,
    prefix_token_ids,
    session_window_tokens,
    smallest_prompt_tokens,
    token_ids_fingerprint,
)
from serve_apps.orchestrator.owner_sessions import SessionQuotaExceeded, session_quota
from serve_apps.orchestrator.served_template import served_tokenizer
from serve_apps.orchestrator.store import (
    CommitOutcomeUnknown,
    RememberedTurn,
    SessionBusy,
    SessionNotFound,
    SessionRecord,
    SessionStore,
    StaleTurn,
    StoreUnavailable,
    TurnLockTaken,
    idempotency_key_problem,
    request_fingerprint,
)
from serve_apps.orchestrator.tool_network import ToolNetworkPolicy
from serve_apps.orchestrator.tool_schema import grammar_failure_message
from serve_apps.orchestrator.tools import conflicting_defs
from serve_apps.orchestrator.turns import (
    ModelReply,
    ModelRefusal,
    ModelRetry,
    ReasoningDelta,
    TurnFailed,
    TurnRunner,
    count_memo,
    forced_grammar_problem,
    pending_client_calls,
    tool_choice_problem,
)
from serve_apps.request_checks import utf8_text
from serve_apps.sse_frames import sse_payloads
from serve_apps.vllm_replica import ServedBy

logger = logging.getLogger("ray.serve")
# A failed model call is retried once (on another replica: the router drops a dead one).
MODEL_CALL_ATTEMPTS = 2


def _error(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    return {"status": status, "body": error_body(status, message, code=code, param=param)}


def _template_refusal(err: jinja2.TemplateError) -> str:
    """What a client reads when the model's chat template refuses its session's messages (`CHAT_TEMPLATE_REFUSED`)."""
    return f"the model's chat template refuses this session's messages: {err}"


def _invalid(err: ValidationError) -> dict[str, Any]:
    """The 400 of a body that fails its model, naming the field at fault (as the HTTP ingress refuses it)."""
    message, param = validation_problem(err.errors())
    return _error(400, message, "invalid_parameter", param)


def _missing_permission(caller: Caller, tools, http_tools_permission: str | None) -> dict[str, Any] | None:
    """A 403 naming the first permission a tool needs and the caller's key lacks, or None.

    A tool's own `required_permissions`, and for a server-side HTTP tool the operator's
    `http_tools_permission` (`tool_network`): the cluster itself sends its requests.
    """
    for tool in tools:
        missing = missing_permissions(caller.permissions, tool.required_permissions)
        if missing:
            return _error(
                403, f"tool '{tool.name}' requires permission '{missing[0]}', which API key {caller.key_id} lacks",
                "missing_permission",
            )
        if http_tools_permission and tool.execution.kind == "http" and missing_permissions(
            caller.permissions, [http_tools_permission]
        ):
            return _error(
                403, f"tool '{tool.name}' is a server-side HTTP tool, which needs permission '{http_tools_permission}' "
                f"(tool_network.http_tools_permission); API key {caller.key_id} lacks it", "missing_permission",
            )
    return None


def _bad_idempotency_key(key: str | None) -> dict[str, Any] | None:
    """The 400 of an idempotency key out of bounds, checked here so every ingress refuses alike."""
    problem = None if key is None else idempotency_key_problem(key)
    return None if problem is None else _error(400, problem, "invalid_parameter", "idempotency-key")


def _not_found(session_id: str) -> dict[str, Any]:
    # Another key's session answers exactly like a missing one: its existence is not the caller's business.
    if not is_session_id(session_id):  # not echoed: it may be megabytes of anything
        return _error(404, "no such session: that is not a session id this service issues", "session_not_found")
    return _error(404, f"no session {session_id}", "session_not_found")


def _owned_by(record: SessionRecord, caller: Caller) -> SessionRecord:
    """`record`; SessionNotFound when another key owns it (it answers like a missing one)."""
    if record.owner_key_id != caller.key_id:
        raise SessionNotFound(record.session_id)
    return record


class ReplicaFailure(RuntimeError):
    """The replica answered with a server-side error (its engine died); worth one retry elsewhere."""


class HandleModelClient:
    """Streams chat completions from the replica deployment through its handle."""

    def __init__(self, handle, model_id: str) -> None:
        self._handle = handle
        self._model_id = model_id

    async def chat(
        self, session_id, messages, tools, tool_choice, max_tokens
    ) -> AsyncIterator[str | ReasoningDelta | ModelReply | ModelRetry]:
        from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest

        request = ChatCompletionRequest(
            model=self._model_id,
            messages=messages,
            tools=tools or None,
            tool_choice=tool_choice if tools else None,
            # One call per step keeps each step's results next to its call and
            # bounds what a forced (`required`) step may emit.
            parallel_tool_calls=False if tools else None,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
        )
        reply = ModelReply()
        for attempt in range(MODEL_CALL_ATTEMPTS):
            calls: dict[int, dict[str, str]] = {}
            try:
                async for item in self._attempt(session_id, request, max_tokens, calls):
                    if isinstance(item, ModelReply):
                        reply = item
                    else:
                        yield item
                break
            except TurnFailed:
                raise
            except Exception as err:  # the replica died mid-call (RayActorError and kin) or Serve lost it
                # The client reads the failure's kind only: a remote error's text holds the replica's
                # traceback, pid and address, which the log keeps.
                kind = type(err).__name__  # a replica's own exception: "RayTaskError(KeyError)"
                if attempt + 1 == MODEL_CALL_ATTEMPTS:
                    logger.warning("model call of session %s failed again", session_id, exc_info=True)
                    raise TurnFailed("model_error", f"the model call failed twice ({kind}); see the orchestrator's log") from None
                logger.warning("model call of session %s failed; retrying once", session_id, exc_info=True)
                WarmpathMetrics.get().model_retries.inc()
                yield ModelRetry(reason=kind)
        # Outside the retry: whatever the model wrote as a call is the model's doing, not a replica's failure.
        reply.tool_calls = _tool_calls(calls)
        yield reply

    async def _attempt(
        self, session_id: str, request, max_tokens: int, calls: dict[int, dict[str, str]]
    ) -> AsyncIterator[str | ReasoningDelta | ModelReply]:
        """One streamed call through the handle.

        Serve's router has dropped a replica that died, so a retry lands elsewhere. The
        reply's tool calls are left as streamed in `calls`, for `chat` to build once the
        call has succeeded.
        """
        from ray.llm._internal.serve.core.configs.openai_api_models import ErrorResponse
        from ray.llm._internal.serve.core.protocol import RawRequestInfo

        reply = ModelReply()
        with telemetry.tracer().start_as_current_span(
            f"chat {self._model_id}", kind=trace.SpanKind.CLIENT,
            attributes={"gen_ai.operation.name": "chat", "gen_ai.request.model": self._model_id,
                        "gen_ai.request.max_tokens": max_tokens, "warmpath.session_id": session_id},
        ) as span:
            # Ray handle calls carry no trace context: it travels in the request headers.
            raw_request_info = RawRequestInfo(headers=telemetry.inject())
            stream = self._handle.options(stream=True, session_id=session_id).chat.remote(request, raw_request_info)
            is_answered = False
            try:
                with cancelled_if_left(stream):  # a turn cancelled or failing mid-stream stops its engine's decoding
                    async for item in stream:
                        if isinstance(item, ServedBy):
                            reply.replica_id = item.replica_id
                            continue
                        for chunk in item if isinstance(item, list) else [item]:
                            if isinstance(chunk, ErrorResponse):
                                raise engine_failure(chunk.error.message, int(chunk.error.code or 500))
                            for data in sse_payloads(chunk):
                                pieces = _apply_chunk(data, reply, calls)
                                is_answered = True
                                for piece in pieces:
                                    yield piece
            except Exception as err:  # typed as every other failure is (OTel's own handling sets ERROR only)
                if span.is_recording():
                    span.set_attribute("error.type", err.code if isinstance(err, TurnFailed) else type(err).__qualname__)
                raise
            finally:
                # Settled as the ingresses settle theirs (`settle_model_call`): answered, even cut short, it is
                # recorded; refused or failed before any output, its placement is withdrawn. A call cut short
                # before its usage came counts no cached tokens, so no prediction is judged against them.
                try:
                    has_usage = reply.prompt_tokens > 0
                    logged = settle_model_call(reply.replica_id, is_answered, reply.prompt_tokens,
                                               reply.cached_tokens if has_usage else None)
                    if is_answered:
                        _annotate_call(span, reply, logged)
                except Exception:  # a fault in the figures must not call the model again (`chat` retries failures)
                    logger.exception("could not record the model call of session %s", session_id)
        yield reply


def _annotate_call(span: trace.Span, reply: ModelReply, logged: decision_log.LoggedDecision | None) -> None:
    """The answered call's replica, usage, cache figures and routing decision on its span."""
    if span.is_recording():
        span.set_attribute("warmpath.replica", reply.replica_id)
        if reply.prompt_tokens:  # none when the call was cut short before its usage came (as the ingresses leave it)
            span.set_attribute("gen_ai.usage.input_tokens", reply.prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", reply.completion_tokens)
            span.set_attribute("warmpath.cached_tokens", reply.cached_tokens)
        if logged is not None:
            span.set_attribute("warmpath.route.reason", decision_log.served_reason(logged.decision, reply.replica_id))
            span.set_attribute(
                "warmpath.route.predicted_cached_tokens",
                logged.decision.predicted_cached_tokens.get(reply.replica_id, 0),
            )


def engine_failure(message: str, status: int) -> Exception:
    """What an engine error means for the turn: the request's fault, or a replica's (worth one retry).

    A tool schema the grammar compiler refuses fails the same way on every replica,
    whatever status the engine gives it, so it ends the turn as `invalid_tool_schema`.
    `message` is the engine's, as sent; the failure carries its readable text.
    """
    message = readable_message(message)
    grammar_problem = grammar_failure_message(message)
    if grammar_problem is not None:
        return TurnFailed(
            "invalid_tool_schema",
            f"the tools' parameter schemas cannot be compiled into the grammar of a forced tool call: {grammar_problem}",
        )
    if status >= 500:  # the engine failed, not the request
        return ReplicaFailure(message)
    return ModelRefusal(message)


def _apply_chunk(data: dict, reply: ModelReply, calls: dict[int, dict[str, str]]) -> list[str | ReasoningDelta]:
    """The chunk's reasoning and text, in the order the model wrote them; `reply` and `calls` take them too."""
    if "error" in data:
        error = data["error"]
        # vLLM puts the HTTP status in an in-stream error's `code`: an engine that failed mid-stream (500, 503)
        # is a replica's failure, retried once as before the stream; a refusal (or no status) ends the turn.
        code = error.get("code") if isinstance(error, dict) else None
        status = code if isinstance(code, int) and not isinstance(code, bool) else 400
        raise engine_failure(str(error.get("message", error) if isinstance(error, dict) else error), status)
    usage = data.get("usage")
    if usage:
        reply.prompt_tokens = usage.get("prompt_tokens", 0)
        reply.completion_tokens = usage.get("completion_tokens", 0)
        reply.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    text = reasoning = ""
    for choice in data.get("choices") or ():
        reply.finish_reason = choice.get("finish_reason") or reply.finish_reason
        delta = choice.get("delta") or {}
        # `reasoning`, or `reasoning_content`, its older name; each as text a stored message takes
        reasoning += utf8_text(delta.get("reasoning") or delta.get("reasoning_content") or "")
        if delta.get("content"):
            text += utf8_text(delta["content"])
        for call in delta.get("tool_calls") or ():
            slot = calls.setdefault(call.get("index", 0), {"id": "", "name": "", "arguments": ""})
            slot["id"] = call.get("id") or slot["id"]
            function = call.get("function") or {}
            slot["name"] += function.get("name") or ""
            slot["arguments"] += function.get("arguments") or ""
    reply.reasoning += reasoning
    reply.content += text
    return [piece for piece in (ReasoningDelta(reasoning) if reasoning else None, text) if piece]


def _tool_calls(calls: dict[int, dict[str, str]]) -> list[ToolCall]:
    """The streamed calls in their order, each id unique among them: a model that wrote one id twice (a
    parser that keeps the model's own ids, Mistral's) left a pause whose results no client could post (a
    submission answers each pending call once, by its id) while new messages got 409."""
    made: list[ToolCall] = []
    for index, call in sorted(calls.items()):
        tool_call = _tool_call(index, call)
        if any(earlier.id == tool_call.id for earlier in made):
            tool_call = _tool_call(index, {**call, "id": ""})  # replaced as a missing one is
        made.append(tool_call)
    return made


def _tool_call(index: int, call: dict[str, str]) -> ToolCall:
    """The streamed call as a `ToolCall`, whatever the model wrote.

    A name or id beyond what `ToolCall` holds would fail its validation; cut
    to its bound, an overlong name still names no tool (tool names are far
    shorter), so validation answers `unknown_tool` and the model may repair
    the call. An overlong id is replaced as a missing one is: by one unique in
    the session and alphanumeric past 9 characters (Mistral's templates refuse
    a history whose call ids are shorter, `call_0` among them).
    """
    call_id = utf8_text(call["id"])
    if not 0 < len(call_id) <= TOOL_CALL_ID_MAX_CHARS:
        call_id = f"call{index}{secrets.token_hex(6)}"
    name = utf8_text(call["name"])[:TOOL_NAME_MAX_CHARS] or "unnamed"
    return ToolCall(id=call_id, name=name, arguments=utf8_text(call["arguments"]) or "{}")


# Where a new session's checks run (its validation, tool schemas, and the tokenization of its prompt): a
# body of megabytes takes seconds of CPU there, which on the event loop would stall every session's turns.
# One thread: it alone uses the orchestrator's second tokenizer (`_session_tokenizer`).
_SESSION_CHECKS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="warmpath-session-checks")


class Orchestrator:
    """Session API behind the ingress; one instance per replica, state in Redis."""

    # Whether forced calls are checked against vLLM's xgrammar backend before a turn (`forced_grammar_problem`):
    # the replicas' backend, which another backend's settings (`replicas.engine_kwargs`) turn off.
    _checks_xgrammar_features = True

    def __init__(self, llm_handle, args: dict[str, Any]) -> None:
        from transformers import AutoTokenizer

        cfg = validate_config(args)
        redis_url = serving_redis_url(cfg.redis_url, "the orchestrator")
        self._model_id = cfg.model.model_id
        self._max_model_len_tokens = cfg.model.max_model_len_tokens
        self._max_sessions_per_key = cfg.access.max_sessions_per_key
        refuse_unsuitable_redis(redis_url)
        self._store = SessionStore.from_url(redis_url, ttl_s=cfg.session_ttl_s)
        # Rendering as the replicas do: with their server-side template and default template arguments.
        self._tokenizer = served_tokenizer(
            AutoTokenizer.from_pretrained(cfg.tokenizer_source(), **cfg.tokenizer_kwargs()), cfg.replicas.engine_kwargs)
        self._session_tokenizer = copy.deepcopy(self._tokenizer)  # `_SESSION_CHECKS`'s own
        self._model = HandleModelClient(llm_handle, cfg.model.model_id)
        self._tool_network = ToolNetworkPolicy(cfg.tool_network)
        self._checks_xgrammar_features = cfg.replicas.grammar_backend() == "xgrammar"
        telemetry.setup_tracing(cfg.telemetry, "orchestrator")

    async def check_health(self) -> None:
        return None

    def __del__(self) -> None:
        """Ray Serve's shutdown hook (then it kills the actor): the queued spans go out first, within a bound."""
        if telemetry is not None:  # None when the interpreter exits and has cleared module globals
            telemetry.flush_spans()

    async def _owned_record(self, session_id: str, caller: Caller) -> SessionRecord:
        """The session's record; SessionNotFound also when another key owns it (it answers like a missing one)."""
        return _owned_by(await self._store.get(session_id), caller)

    async def create_session(self, body: dict[str, Any], caller: dict[str, Any]) -> dict[str, Any]:
        who = Caller.from_dict(caller)
        checked = await asyncio.get_running_loop().run_in_executor(_SESSION_CHECKS, self._checked_session, body, who)
        if isinstance(checked, dict):
            return checked
        request, fingerprint = checked
        try:
            record = await self._store.create(
                request, who.key_id, fingerprint, session_quota(who, self._max_sessions_per_key)
            )
        except SessionQuotaExceeded as err:
            return _error(429, str(err), "session_quota_exceeded")
        except StoreUnavailable as err:
            return _error(503, f"session store unavailable: {err}", "store_unavailable")
        response = CreateSessionResponse(session_id=record.session_id, prefix_fingerprint=fingerprint)
        return {"status": 201, "body": response.model_dump()}

    def _checked_session(self, body: dict[str, Any], who: Caller) -> dict[str, Any] | tuple[CreateSessionRequest, str]:
        """The session `body` asks for and its prefix's fingerprint, or the refusal (on `_SESSION_CHECKS`)."""
        try:
            request = CreateSessionRequest.model_validate(body)
        except ValidationError as err:
            return _invalid(err)
        denied = _missing_permission(who, request.tools, self._tool_network.http_tools_permission)
        if denied is not None:
            return denied
        for tool in request.tools:
            refusal = self._tool_network.check_url(tool.execution.url) if tool.execution.kind == "http" else None
            if refusal is not None:
                return _error(403, f"tool {tool.name!r}: {refusal}", "tool_url_not_allowed")
        clash = conflicting_defs(request.tools)
        if clash is not None:
            return _error(400, clash, "invalid_parameter", "tools")
        if request.model != self._model_id:
            return _error(404, f'model "{request.model}" is not served here (serving "{self._model_id}")', "model_not_found")
        try:
            window = effective_window_tokens(request.limits, self._max_model_len_tokens)
        except ValueError as err:
            return _error(400, str(err), "invalid_limits")
        try:
            smallest = smallest_prompt_tokens(self._session_tokenizer, request.system_prompt, request.tools)
            overflow = prefix_overflow(smallest, window, request.limits.output_reserve_tokens)
            if overflow is not None:
                # Every turn of such a session would fail with context_overflow: refuse it now, before the
                # prefix's three renderings (for 4 MiB of tools, 6.5 s of this thread's time ahead of every tenant).
                return _error(400, overflow, "context_overflow")
            prefix_ids = prefix_token_ids(self._session_tokenizer, request.system_prompt, request.tools)
        except TemplateCannotRender as err:
            return _error(500, str(err), CHAT_TEMPLATE_REFUSED)
        return request, token_ids_fingerprint(prefix_ids)

    async def get_session(self, session_id: str, caller: dict[str, Any]) -> dict[str, Any]:
        if not is_session_id(session_id):
            return _not_found(session_id)
        try:
            view = await self._store.view(session_id)
            _owned_by(view.record, Caller.from_dict(caller))
        except SessionNotFound:
            return _not_found(session_id)
        except StoreUnavailable as err:
            return _error(503, f"session store unavailable: {err}", "store_unavailable")
        record, snapshot, steps, totals = view.record, view.transcript, view.steps, view.totals
        request = record.request
        messages, tools = build_chat_request(
            SessionState(request.system_prompt, request.tools, snapshot.messages), control_tokens_of(self._tokenizer)
        )
        window = session_window_tokens(request.limits, self._max_model_len_tokens)
        try:
            account = count_tokens(
                self._tokenizer, messages, tools, context_window_tokens=window,
                output_reserve_tokens=request.limits.output_reserve_tokens, memo=count_memo(session_id),
            )
        except jinja2.TemplateError as err:  # the session's turns are refused alike; its view says why
            return _error(500, _template_refusal(err), CHAT_TEMPLATE_REFUSED)
        body = {
            "session_id": record.session_id,
            "model": request.model,
            "prefix_fingerprint": record.prefix_fingerprint,
            "transcript": [m.model_dump(exclude_none=True) for m in snapshot.messages],
            "num_messages_total": snapshot.length,
            "pending_tool_calls": [c.model_dump() for c in pending_client_calls(snapshot.messages)],
            "tokens": {
                "prefix_tokens": account.prefix_tokens,
                "message_tokens": list(account.message_tokens),
                "total_tokens": account.total_tokens,
                "context_window_tokens": window,
                "output_reserve_tokens": request.limits.output_reserve_tokens,
                "remaining_tokens": account.remaining_tokens,
            },
            "cache": {
                "cacheable_prefix_tokens": account.prefix_tokens,
                "prompt_tokens": totals.prompt_tokens,
                "cached_tokens": totals.cached_tokens,
                "hit_ratio": totals.cached_tokens / totals.prompt_tokens if totals.prompt_tokens else 0.0,
                "num_compressions": totals.num_compressions,
                "num_steps": totals.num_steps,
                "steps": [s.model_dump() for s in steps],  # the last `max_step_stats` (1,024)
            },
        }
        return {"status": 200, "body": body}

    async def delete_session(self, session_id: str, caller: dict[str, Any]) -> dict[str, Any]:
        if not is_session_id(session_id):
            return _not_found(session_id)
        try:
            owner_key_id = await self._store.owner_of(session_id)
            if owner_key_id != Caller.from_dict(caller).key_id:
                raise SessionNotFound(session_id)  # answered like a missing one
            existed = await self._store.delete(session_id, owner_key_id)
        except SessionNotFound:
            return _not_found(session_id)
        except StoreUnavailable as err:
            return _error(503, f"session store unavailable: {err}", "store_unavailable")
        if not existed:
            return _not_found(session_id)
        return {"status": 204, "body": None}

    async def send_message(
        self,
        session_id: str,
        body: dict[str, Any],
        caller: dict[str, Any],
        trace_carrier: dict[str, str] | None = None,
        idempotency_key: str | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """Runs a user turn. With an idempotency key, a turn that already committed is replayed, not rerun.

        The key's record keeps a fingerprint of the request (`store.request_fingerprint`):
        the same key with a different request answers 422 `idempotency_key_reused`.
        """
        refusal = _bad_idempotency_key(idempotency_key)
        if refusal is not None:
            yield refusal
            return
        try:
            turn = TurnRequest.model_validate(body)
        except ValidationError as err:
            yield _invalid(err)
            return
        async for item in self._traced_turn(
            session_id, trace_carrier, turn.tool_choice, Caller.from_dict(caller), idempotency_key,
            request_sha256=request_fingerprint("messages", turn), user_content=turn.content,
        ):
            yield item

    async def submit_tool_results(
        self,
        session_id: str,
        body: dict[str, Any],
        caller: dict[str, Any],
        trace_carrier: dict[str, str] | None = None,
        idempotency_key: str | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """Resumes a turn with client tool results; idempotency keys behave as in `send_message`."""
        refusal = _bad_idempotency_key(idempotency_key)
        if refusal is not None:
            yield refusal
            return
        try:
            submission = ToolResultsSubmission.model_validate(body)
        except ValidationError as err:
            yield _invalid(err)
            return
        async for item in self._traced_turn(
            session_id, trace_carrier, "auto", Caller.from_dict(caller), idempotency_key,
            request_sha256=request_fingerprint("tool_results", submission.by_call_id()), results=submission,
            # Records written before fingerprints were taken in call-id order hold the body as it was sent.
            sent_sha256=request_fingerprint("tool_results", submission),
        ):
            yield item

    async def _traced_turn(
        self, session_id: str, trace_carrier, tool_choice: str, caller: Caller, idempotency_key: str | None, **kwargs
    ) -> AsyncIterator[dict[str, Any]]:
        """One `invoke_agent` span per turn (or resumption), child of the caller's trace; none for what is no
        session id (`is_session_id`)."""
        if not is_session_id(session_id):
            yield _not_found(session_id)
            return
        # The caller's context made current first: the span joins it, baggage and all, for the model and tool calls.
        with telemetry.current_context(telemetry.extract(trace_carrier)), telemetry.tracer().start_as_current_span(
            "invoke_agent warmpath", kind=trace.SpanKind.SERVER,
            attributes={"gen_ai.operation.name": "invoke_agent", "warmpath.session_id": session_id,
                        "gen_ai.request.model": self._model_id},
        ) as span:
            start = time.monotonic()
            outcome = None
            is_finished = is_replay = False
            try:
                async for item in self._turn(session_id, tool_choice, caller, idempotency_key, **kwargs):
                    if item.get("is_replay"):  # the envelope of a turn answered again from Redis (Idempotency-Key)
                        is_replay = True
                        span.set_attribute("warmpath.turn.is_replay", True)
                    if item.get("kind") in ("final", "requires_action"):
                        outcome = item["kind"]
                    elif item.get("kind") == "error":
                        outcome = item["code"]
                        telemetry.record_failure_status(
                            span, outcome, TURN_ERROR_STATUS.get(outcome, 500), item["message"]
                        )
                    elif "kind" not in item and item["status"] >= 400:  # an envelope (a tool result has a status too)
                        error = item["body"]["error"]
                        telemetry.record_failure_status(
                            span, error.get("code") or "rejected", item["status"], error["message"]
                        )
                    elif span.is_recording() and item.get("kind") == "compression":
                        span.add_event("compression", {k: v for k, v in item["report"].items() if v is not None})
                    yield item
                is_finished = True
            finally:
                # A turn the client hung up on before its last event still counts, as "cancelled".
                outcome = outcome or ("rejected" if is_finished else "cancelled")
                span.set_attribute("warmpath.turn.outcome", outcome)
                # A replay takes milliseconds: counted with the turns it answers again, retries pulled their
                # latency percentiles down.
                WarmpathMetrics.get().turn_latency.observe(
                    time.monotonic() - start, tags={"outcome": "replayed" if is_replay else outcome}
                )

    async def _turn(
        self,
        session_id: str,
        tool_choice: str,
        caller: Caller,
        idempotency_key: str | None,
        request_sha256: str,
        user_content: str | None = None,
        results: ToolResultsSubmission | None = None,
        sent_sha256: str | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        # Before the 200 envelope a failure is an envelope of its own (an HTTP status);
        # after it, the stream has begun and a failure can only be its last event.
        has_started = False
        try:
            # Ownership before the lock: another key's request answers 404 like a missing session (not 409
            # while the owner's turn runs), and never holds the lock the owner's next request needs. The
            # record cannot change after; taking the lock fails as not found if the session is gone by then.
            record = await self._owned_record(session_id, caller)
            is_counted = session_quota(caller, self._max_sessions_per_key) is not None
            async with self._store.turn_lock(session_id, record.owner_key_id if is_counted else None) as lock_token:
                denied = _missing_permission(caller, record.request.tools, self._tool_network.http_tools_permission)
                if denied is not None:
                    yield denied
                    return
                bad_choice = tool_choice_problem(tool_choice, [tool.name for tool in record.request.tools]) or (
                    forced_grammar_problem(tool_choice, record.request.tools) if self._checks_xgrammar_features
                    else None)
                if bad_choice is not None:
                    yield _error(400, bad_choice, "invalid_parameter", "tool_choice")
                    return
                if idempotency_key is not None:
                    stored = await self._store.lookup_turn_result(session_id, idempotency_key)
                    if stored is not None:
                        remembered = RememberedTurn.from_stored(stored)
                        if remembered.request_sha256 not in (None, request_sha256, sent_sha256):
                            yield _error(
                                422, "this Idempotency-Key was already used with a different request on this "
                                "session; send a new key for a new request", "idempotency_key_reused",
                            )
                            return
                        has_started = True
                        yield {"status": 200, "is_replay": True}
                        for event in remembered.events:
                            yield event
                        return
                snapshot = await self._store.transcript(session_id)
                pending = pending_client_calls(snapshot.messages)
                if user_content is not None:
                    if pending:
                        yield _error(409, f"answer the pending tool calls {[c.id for c in pending]} first", "requires_action")
                        return
                    steps_taken = 0
                else:
                    problem = _results_problem(pending, results)
                    if problem:
                        yield _error(409 if not pending else 400, problem, "tool_results_mismatch")
                        return
                    steps_taken = _steps_taken(await self._store.step_stats(session_id))
                try:
                    effective_window_tokens(record.request.limits, self._max_model_len_tokens)
                except ValueError as err:
                    yield _error(400, f"{err}: the model serves {self._max_model_len_tokens} tokens now, fewer than "
                                 "when this session was created; create a new session", "context_overflow")
                    return
                runner = TurnRunner(
                    record, snapshot.messages, snapshot.length, self._store, self._model, self._tokenizer,
                    self._max_model_len_tokens, idempotency_key=idempotency_key, tool_network=self._tool_network,
                    request_sha256=request_sha256 if idempotency_key is not None else None, lock_token=lock_token,
                )
                has_started = True
                yield {"status": 200}
                if user_content is not None:
                    events = runner.run([Message(role="user", content=user_content)], tool_choice)
                else:
                    events = runner.resume(results.results, steps_taken)
                async for event in events:
                    yield event.model_dump(exclude_none=True)
        except SessionNotFound:
            if has_started:  # deleted (or expired) while the turn ran: nothing of it was committed
                yield {"kind": "error", "code": "session_not_found",
                       "message": f"session {session_id} was deleted while the turn ran; nothing of the turn was saved"}
            else:
                yield _not_found(session_id)
        except SessionBusy as err:
            yield _error(409, str(err), "session_busy")
        except CommitOutcomeUnknown as err:  # it may have committed: as a stream that broke off, retry under its key
            yield {"kind": "error", "code": TURN_INTERRUPTED["code"], "message": f"session store unavailable: {err}"}
        except StoreUnavailable as err:
            message = f"session store unavailable: {err}"
            yield {"kind": "error", "code": "store_unavailable", "message": message} if has_started else _error(
                503, message, "store_unavailable"
            )
        except (StaleTurn, TurnLockTaken) as err:
            yield {"kind": "error", "code": "stale_turn", "message": str(err)}
        except TurnFailed as err:
            yield {"kind": "error", "code": err.code, "message": str(err)}
        except jinja2.TemplateError as err:  # the model's template refuses the session's messages: nothing committed
            message = _template_refusal(err)
            logger.warning("turn of session %s: %s", session_id, message)
            yield {"kind": "error", "code": CHAT_TEMPLATE_REFUSED, "message": message} if has_started else _error(
                500, message, CHAT_TEMPLATE_REFUSED
            )
        except Exception:
            # Nothing was committed (commits are the last step of each outcome);
            # the client gets a clean error, the log gets the traceback.
            logger.exception("turn of session %s failed", session_id)
            message = "the turn failed inside the orchestrator; nothing was committed"
            yield {"kind": "error", "code": "internal", "message": message} if has_started else _error(
                500, message, "internal"
            )


def _results_problem(pending, results: ToolResultsSubmission) -> str | None:
    """Why `results` cannot answer the pending calls, or None when they answer exactly those."""
    if not pending:
        return "the session has no pending tool calls"
    expected = {c.id for c in pending}
    answered = {r.tool_call_id for r in results.results}
    if answered != expected:
        return f"results must answer exactly the pending calls {sorted(expected)}, got {sorted(answered)}"
    return None


def _steps_taken(stats: list[StepStats]) -> int:
    """Model calls the paused turn has made: its steps are numbered from 0, and its last one was stored last."""
    return stats[-1].step_index + 1 if stats else 0
