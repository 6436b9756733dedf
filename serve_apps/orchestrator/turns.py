"""The agent turn loop: model -> tool calls -> results -> model, until an answer.

Why separate from the deployment: the loop is the session logic (ordering,
validation, compression, what gets committed); the deployment only supplies a
model client, a tokenizer and a store. A turn commits all of its messages in
one `SessionStore.commit_turn` call, or none:
- final answer or `max_steps`: the whole turn is committed, then `final`;
- a client-side tool call: everything up to and including the server-side
  results is committed, then `requires_action`; `resume` continues the same
  turn once the client posts results (the pending calls are derived from the
  transcript, never stored separately);
- an error (model failure, repeated invalid tool calls, context overflow):
  nothing is committed and the turn ends with an `error` event.

A step under a forced `tool_choice` (`required` or a tool name) that ends
without a call is never a final answer: it counts as an invalid call (the step
runs again, at most MAX_REPAIRS_PER_TURN times per turn, then the turn fails
with `invalid_tool_call`; a turn resumed after client tool results counts its
repairs afresh, and `max_steps_per_turn` bounds all its steps together). Steps
that run out while the forced call is still owed fail the turn the same way:
nothing is committed.

Ordering of one step: account tokens -> compress if under the threshold (only
messages committed by earlier turns are ever compressed; the system prompt and
tools are never touched) -> call the model with the cache-first prompt ->
validate tool calls (errors go back to the model, bounded) -> run server-side
tools (timeouts and size limits; failures become results the model sees).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol, Sequence

from opentelemetry import trace

from cluster import telemetry
from serve_apps.metrics import WarmpathMetrics
from serve_apps.orchestrator.compression import (
    CompressionPlan,
    apply_compression,
    is_summary,
    plan_compression,
    plan_dropping_prose,
    plan_keeping,
    prescan,
    round_starts,
)
from serve_apps.orchestrator.models import (
    CompressionEvent,
    CompressionReport,
    ErrorEvent,
    FinalEvent,
    ModelRetryEvent,
    Message,
    ReasoningEvent,
    RequiresActionEvent,
    SessionEvent,
    StepStats,
    TOOL_CHOICE_KEYWORDS,
    ToolCall,
    ToolCallEvent,
    ToolResult,
    ToolResultEvent,
    ToolSpec,
    UsageEvent,
    DeltaEvent,
)
from serve_apps.orchestrator.prompt import (
    CountMemo,
    SessionState,
    TokenAccount,
    build_chat_request,
    control_tokens_of,
    count_tokens,
    effective_window_tokens,
)
from serve_apps.orchestrator.store import Compaction, RememberedTurn, SessionRecord, SessionStore, TurnLockTaken
from serve_apps.orchestrator.tool_network import ToolNetworkPolicy
from serve_apps.orchestrator.tool_schema import unsupported_grammar_features
from serve_apps.orchestrator.tools import (
    ToolCallError,
    parse_arguments,
    run_http_tool,
    truncate_text,
    validate_tool_call,
)

logger = logging.getLogger("ray.serve")

MAX_REPAIRS_PER_TURN = 2
MIN_SUMMARY_TOKENS = 8
# A compression that would free less than this share of the window waits while the prompt still fits: a
# summarising call and a rewritten history (its cached prefix lost after the summary) for a few tokens cost
# more than they save, and in a session near its threshold one was made at every turn for one round each.
MIN_COMPRESSION_SAVING_FRACTION = 0.05
# What the summarising call asks, after the messages it summarises.
SUMMARISE_INSTRUCTION = (
    "Summarise the conversation so far in a few sentences: what was asked, what was done and found, what is "
    "still open. Do not call tools."
)
# Sessions whose last token count this replica keeps (`count_memo`); each holds about its prompt's text and tokens.
MAX_COUNT_MEMOS = 32

_COUNT_MEMOS: OrderedDict[str, CountMemo] = OrderedDict()


def count_memo(session_id: str) -> CountMemo:
    """The memo of the session's last token count on this replica, so its next count renders only new messages.

    Why per replica and not stored: it is a cache of what the stored transcript
    determines, checked against the prompt before any of it is used, so a memo
    that is missing or out of date costs time, never correctness.
    """
    memo = _COUNT_MEMOS.pop(session_id, None) or CountMemo()
    _COUNT_MEMOS[session_id] = memo
    while len(_COUNT_MEMOS) > MAX_COUNT_MEMOS:
        _COUNT_MEMOS.popitem(last=False)
    return memo


@dataclass
class ModelReply:
    """What one model call produced."""

    content: str = ""
    reasoning: str = ""  # the engine's reasoning field (a `reasoning_parser`'s split), kept on the assistant message
    tool_calls: list[ToolCall] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    replica_id: str = ""
    finish_reason: str | None = None  # "length": the answer stopped at max_tokens


# `ModelRetryEvent.reason` of a forced step (`tool_choice` required or a tool's name) that answered without a call.
FORCED_CALL_MISSING = "forced_call_missing"


@dataclass(frozen=True)
class ReasoningDelta:
    """A piece of the model's reasoning, streamed apart from its answer's text."""

    text: str


@dataclass(frozen=True)
class ModelRetry:
    """The model call failed (its replica died) and starts over; text streamed so far is void."""

    reason: str


class ModelClient(Protocol):
    """Streams one chat completion: text deltas (and reasoning ones) as they come, then the whole reply.

    A client may retry a failed call; it then yields a `ModelRetry` before the
    new attempt's deltas.
    """

    def chat(
        self, session_id: str, messages: list, tools: list, tool_choice: object, max_tokens: int
    ) -> AsyncIterator[str | ReasoningDelta | ModelReply | ModelRetry]: ...


class TurnFailed(Exception):
    """The turn cannot complete; `code` is machine-readable."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class ModelRefusal(TurnFailed):
    """The engine refused the request itself (a 4xx: a prompt over its window, say), not a replica failing.

    Its own code (`model_refused`, a 422), not `model_error`'s 502: every replica would refuse the same
    step again, so it is not worth the retry a client's policy gives a 502.
    """

    def __init__(self, message: str) -> None:
        super().__init__("model_refused", message)


def tool_choice_problem(tool_choice: str, tool_names: Sequence[str]) -> str | None:
    """Why `tool_choice` cannot apply to a session with these tools, or None when it can.

    Checked before a turn starts, so a bad value is refused with its own status
    instead of being downgraded or failing the turn after it began.
    """
    if tool_choice in ("auto", "none"):
        return None
    if not tool_names:
        return (f"tool_choice {tool_choice!r} asks for a tool call, but the session has no tools (it takes 'auto' "
                "or 'none')")
    if tool_choice == "required" or tool_choice in tool_names:
        return None
    return (f"tool_choice names {tool_choice!r}, which is not one of {sorted(tool_names)} (nor 'auto', 'none' or "
            "'required')")


def forced_grammar_problem(tool_choice: str, tools: Sequence[ToolSpec]) -> str | None:
    """Why vLLM would refuse the grammar of the calls `tool_choice` forces (`unsupported_grammar_features`), or
    None: refused before the turn with the keyword and where it is, where the turn failed after it began
    with the engine's message, which names neither."""
    if tool_choice in ("auto", "none"):
        return None
    for tool in tools:
        if tool_choice in ("required", tool.name) and (found := unsupported_grammar_features(tool.parameters)):
            return (f"tool_choice {tool_choice!r} forces a call to {tool.name!r}, whose parameters vLLM's grammar "
                    f"of forced calls (xgrammar) does not take: {found}; let the model choose (tool_choice: auto), "
                    "or drop that keyword from the schema")
    return None


def _wire_tool_choice(tool_choice: str, tool_names: Sequence[str]) -> object:
    problem = tool_choice_problem(tool_choice, tool_names)
    if problem is not None:
        raise TurnFailed("unknown_tool", problem)
    if tool_choice in TOOL_CHOICE_KEYWORDS:
        return tool_choice if tool_names else "none"
    return {"type": "function", "function": {"name": tool_choice}}


def _is_forced(wire_choice: object) -> bool:
    """True when the step must call a tool: `required`, or a named tool."""
    return wire_choice == "required" or isinstance(wire_choice, dict)


def _renderable(call: ToolCall) -> ToolCall:
    """The call as vLLM renders it into the prompt: arguments that are not a JSON object become `{}`.

    Text the strict parser of validation refuses (not JSON, NaN, nested too deep)
    and JSON that is not an object are both coerced by vLLM, so keeping them as
    written would make local token counts differ from what the engine prefills.
    """
    try:
        arguments = parse_arguments(call.arguments)
    except ValueError:
        arguments = None
    return call if isinstance(arguments, dict) else call.model_copy(update={"arguments": "{}"})


def pending_client_calls(history: Sequence[Message]) -> list[ToolCall]:
    """Calls of the last assistant message that have no tool result yet."""
    for index in range(len(history) - 1, -1, -1):
        message = history[index]
        if message.role == "assistant":
            answered = {m.tool_call_id for m in history[index + 1:] if m.role == "tool"}
            return [c for c in message.tool_calls or () if c.id not in answered]
        if message.role == "user":
            return []
    return []


async def _chain(first: Sequence[SessionEvent], rest: AsyncIterator[SessionEvent]) -> AsyncIterator[SessionEvent]:
    for event in first:
        yield event
    async for event in rest:
        yield event


class TurnRunner:
    """Runs one turn of one session; create one per turn."""

    def __init__(
        self,
        record: SessionRecord,
        stored: Sequence[Message],
        stored_len: int,
        store: SessionStore,
        model: ModelClient,
        tokenizer,
        max_model_len_tokens: int,
        idempotency_key: str | None = None,
        tool_network: ToolNetworkPolicy | None = None,
        request_sha256: str | None = None,
        lock_token: str | None = None,
    ) -> None:
        if (idempotency_key is None) != (request_sha256 is None):
            raise ValueError("idempotency_key and request_sha256 go together")
        self._record = record
        self._lock_token = lock_token  # the session's turn lock held for this turn; the commit checks it
        self._tool_network = tool_network
        self._idempotency_key = idempotency_key
        self._request_sha256 = request_sha256
        # What a replay under the idempotency key shows: every event, each run of text deltas (or of
        # reasoning) joined into one (as the unstreamed HTTP body shows them; a `model_retry` between runs stays).
        self._replayable: list[SessionEvent] = []
        self._request = record.request
        self._limits = record.request.limits
        self._stored = list(stored)
        self._stored_len = stored_len
        self._store = store
        self._model = model
        self._tokenizer = tokenizer
        self._control_tokens = control_tokens_of(tokenizer)
        self._window = effective_window_tokens(self._limits, max_model_len_tokens)
        self._new: list[Message] = []
        self._stats: list[StepStats] = []
        self._compaction: Compaction | None = None
        # A compression this turn made and did not keep (its cut, its report, whether it lost a value):
        # not summarised again.
        self._declined: tuple[int, CompressionReport, bool] | None = None
        self._deferred_cut: int | None = None  # a cut whose compression frees too little while the prompt fits
        self._tools_by_name = {t.name: t for t in self._request.tools}

    @property
    def history(self) -> list[Message]:
        return self._stored + self._new

    def _check_lock(self) -> None:
        """Raises TurnLockTaken when a renewal found this turn's lock taken (`SessionStore.lock_lost`).

        Such a turn can never commit, and the turn holding the lock now may be running the same tools:
        it stops before its next model call or server-side tool instead of running on to a refused commit.
        """
        if self._lock_token is not None and self._store.lock_lost(self._lock_token):
            raise TurnLockTaken(f"session {self._record.session_id}: this turn's lock expired and another turn "
                                "took it; the turn stopped and nothing of it was saved")

    def _chat_request(self, history: Sequence[Message]) -> tuple[list, list]:
        """Messages and tools the model gets for `history`; token counts are taken over exactly these."""
        state = SessionState(self._request.system_prompt, self._request.tools, tuple(history))
        return build_chat_request(state, self._control_tokens)

    def _account(self, history: Sequence[Message]) -> TokenAccount:
        return self._count(*self._chat_request(history))

    def _count(self, messages: list, tools: list) -> TokenAccount:
        """The token account of a request already built (`_chat_request`)."""
        return count_tokens(
            self._tokenizer, messages, tools,
            context_window_tokens=self._window, output_reserve_tokens=self._limits.output_reserve_tokens,
            memo=count_memo(self._record.session_id),
        )

    async def run(self, new_messages: Sequence[Message], tool_choice: str) -> AsyncIterator[SessionEvent]:
        """Appends `new_messages` (a user message) and runs the turn's steps."""
        async for event in self._run(new_messages, tool_choice, [], first_step=0):
            yield event

    async def resume(self, results: Sequence[ToolResult], steps_taken: int) -> AsyncIterator[SessionEvent]:
        """Answers the pending client calls with `results` and runs the turn's remaining steps.

        Client results are cut to `max_tool_result_bytes` like server-side ones
        (a `tool_result` event each, with `is_truncated`). The turn's steps go on
        from `steps_taken`, the model calls it made before it paused, so one user
        turn takes at most `max_steps_per_turn` model calls however often it pauses.
        `results` answer exactly the pending calls (the caller has checked).
        """
        pending = pending_client_calls(self._stored)
        names = {call.id: call.name for call in pending}
        order = {call.id: index for index, call in enumerate(pending)}
        messages, events = [], []
        # In the calls' order, whatever the client's: a template that does not print call ids pairs each
        # result with the call in its place.
        for result in sorted(results, key=lambda r: order[r.tool_call_id]):
            content, is_truncated = truncate_text(result.content, self._limits.max_tool_result_bytes)
            content = ("error: " + content) if result.is_error else content
            messages.append(Message(role="tool", tool_call_id=result.tool_call_id, name=names[result.tool_call_id],
                                    content=content))
            events.append(ToolResultEvent(tool_call_id=result.tool_call_id, status="error" if result.is_error else "ok",
                                          content=content, is_truncated=is_truncated))
        async for event in self._run(messages, "auto", events, first_step=steps_taken):
            if isinstance(event, ErrorEvent) and event.code == "context_overflow" and self._new == messages:
                event = ErrorEvent(code=event.code, message=event.message + self._results_hint())
            yield event

    def _results_hint(self) -> str:
        """What a resume that does not fit can do: its results take room the window lacks, and the calls stay
        pending (new messages get 409 until they are answered), so shorter results are the way on."""
        added = self._account(self.history).total_tokens - self._account(self._stored).total_tokens
        return (f"; the tool results take {added} tokens of it: the calls stay pending, answer them again with "
                f"shorter results (each is cut to limits.max_tool_result_bytes, {self._limits.max_tool_result_bytes} "
                "bytes)")

    async def _run(
        self, new_messages: Sequence[Message], tool_choice: str, opening: Sequence[SessionEvent], first_step: int
    ) -> AsyncIterator[SessionEvent]:
        """Appends `new_messages`, yields `opening`, then runs steps from `first_step`; every event is replayable."""
        self._new.extend(new_messages)
        try:
            async for event in _chain(opening, self._steps(tool_choice, first_step)):
                previous = self._replayable[-1] if self._replayable else None
                if isinstance(event, (DeltaEvent, ReasoningEvent)) and type(previous) is type(event):
                    self._replayable[-1] = type(event)(text=previous.text + event.text)
                else:
                    self._replayable.append(event)
                yield event
        except TurnFailed as err:
            yield ErrorEvent(code=err.code, message=str(err))

    async def _steps(self, tool_choice: str, first_step: int) -> AsyncIterator[SessionEvent]:
        choice = _wire_tool_choice(tool_choice, list(self._tools_by_name))
        num_repairs = 0
        for step in range(first_step, self._limits.max_steps_per_turn):
            self._check_lock()
            report = None
            async for event in self._maybe_compress(headroom=self._limits.output_reserve_tokens):
                report = event.report
                yield event
            messages, tools = self._chat_request(self.history)
            account = self._fitting_account()
            # The output reserve is the step's answer budget.
            max_tokens = min(self._limits.output_reserve_tokens, self._window - account.total_tokens)
            reply = ModelReply()
            has_streamed = False
            async for item in self._model.chat(self._record.session_id, messages, tools or [], choice, max_tokens):
                if isinstance(item, ModelReply):
                    reply = item
                elif isinstance(item, ModelRetry):
                    yield ModelRetryEvent(step_index=step, reason=item.reason)
                elif isinstance(item, ReasoningDelta):
                    has_streamed = True
                    yield ReasoningEvent(text=item.text)
                else:
                    has_streamed = True
                    yield DeltaEvent(text=item)
            stats = StepStats(
                step_index=step, prefix_fingerprint=account.prefix_fingerprint, prompt_tokens=reply.prompt_tokens,
                cached_tokens=reply.cached_tokens, completion_tokens=reply.completion_tokens, compression=report,
            )
            self._stats.append(stats)
            yield UsageEvent(stats=stats)
            cut_off = "" if reply.finish_reason != "length" else (
                f" (the answer stopped at the step's {max_tokens}-token budget, limits.output_reserve_tokens)")
            if not reply.tool_calls and _is_forced(choice):
                # A forced step that produced no call (cut off by the budget, say) is not an answer:
                # the call is still owed. Nothing of it enters the history; the step runs again
                # (sampled again: a retry may fit the budget).
                num_repairs += 1
                if num_repairs > MAX_REPAIRS_PER_TURN:
                    raise TurnFailed(
                        "invalid_tool_call",
                        f"tool_choice {tool_choice!r} requires a tool call, but the model answered without one" + cut_off,
                    )
                if has_streamed:  # the text it streamed is no part of the turn
                    yield ModelRetryEvent(step_index=step, reason=FORCED_CALL_MISSING)
                continue
            if not reply.tool_calls:
                # An empty answer (the model stopped at once) is still an answer: commit it as "".
                self._new.append(Message(role="assistant", content=reply.content or "", reasoning=reply.reasoning or None))
                final = FinalEvent(message=self._new[-1], is_truncated=True if reply.finish_reason == "length" else None)
                await self._commit(final)
                yield final
                return
            # Off the event loop, as compression's scans are: a tool's first call compiles its patterns, which for
            # thousands of elements takes about a second, before the check's deadline applies to the matching.
            checked = await asyncio.to_thread(
                lambda: [validate_tool_call(c, self._request.tools) for c in reply.tool_calls])
            errors = [e for e in checked if isinstance(e, ToolCallError)]
            if errors:
                num_repairs += 1
                if num_repairs > MAX_REPAIRS_PER_TURN:
                    raise TurnFailed(
                        "invalid_tool_call", "the model kept emitting invalid tool calls: " + errors[0].message + cut_off)
                # Tell the model what was wrong; its next step may repair the call.
                # Arguments that are not JSON are kept as `{}` in the history, as
                # vLLM renders them; the error text quotes what the model wrote.
                made = [c if isinstance(c, ToolCall) else _renderable(raw) for raw, c in zip(reply.tool_calls, checked)]
                self._new.append(Message(role="assistant", content=reply.content or None, tool_calls=made,
                                         reasoning=reply.reasoning or None))
                # Cut as a tool's result is: the message quotes what the model wrote.
                rejected = {e.call_id: truncate_text(e.message + cut_off, self._limits.max_tool_result_bytes)[0]
                            for e in errors}
                for call in made:
                    content = rejected.get(call.id, "not run: another call in this step was invalid")
                    self._new.append(Message(role="tool", tool_call_id=call.id, name=call.name, content=content))
                    # Announced as the history holds it, so that no result names a call the client never saw.
                    yield ToolCallEvent(call=call)
                    yield ToolResultEvent(tool_call_id=call.id, status="error", content=content)
                # The repair step decodes under the same tool choice: a required call is still owed.
                continue
            choice = "auto" if self._tools_by_name else "none"
            # Server-side calls first: their results enter the history now, the client's after a pause, and
            # templates that print no call ids pair each result with the call in its place.
            checked.sort(key=lambda call: self._tools_by_name[call.name].execution.kind == "client")
            self._new.append(Message(role="assistant", content=reply.content or None, tool_calls=checked,
                                     reasoning=reply.reasoning or None))
            client_calls = []
            for call in checked:
                yield ToolCallEvent(call=call)
                spec = self._tools_by_name[call.name]
                if spec.execution.kind == "client":
                    client_calls.append(call)
                    continue
                self._check_lock()  # a tool's side effects must not happen twice, under two turns
                with telemetry.tracer().start_as_current_span(
                    f"execute_tool {call.name}",
                    attributes={"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": call.name,
                                "gen_ai.tool.call.id": call.id},
                ) as span:
                    outcome = await run_http_tool(
                        spec, call.arguments, spec.execution.timeout_s, self._limits.max_tool_result_bytes,
                        network=self._tool_network,
                    )
                    span.set_attribute("warmpath.tool.status", outcome.status)
                    span.set_attribute("warmpath.tool.is_truncated", outcome.is_truncated)
                    if outcome.status != "ok":
                        span.set_attribute("error.type", outcome.status)
                        span.set_status(trace.Status(trace.StatusCode.ERROR, outcome.reason or outcome.status))
                WarmpathMetrics.get().tool_calls.inc(tags={"status": outcome.status})
                self._new.append(Message(role="tool", tool_call_id=call.id, name=call.name, content=outcome.content))
                yield ToolResultEvent(
                    tool_call_id=call.id, status=outcome.status, content=outcome.content, is_truncated=outcome.is_truncated
                )
            if client_calls:
                async for event in self._fitted_for_resume(client_calls):
                    yield event
                pause = RequiresActionEvent(tool_calls=client_calls)
                await self._commit(pause)
                yield pause
                return
        if _is_forced(choice):
            # The steps ran out before the forced call came: the turn failed, it did not merely stop.
            raise TurnFailed(
                "invalid_tool_call",
                f"tool_choice {tool_choice!r} requires a tool call, but the model made no valid one in the turn's "
                f"{self._limits.max_steps_per_turn} steps (limits.max_steps_per_turn)",
            )
        async for event in self._fitted_for_resume():
            yield event
        exhausted = ErrorEvent(
            code="max_steps", message=f"the turn used all {self._limits.max_steps_per_turn} steps; its messages are kept"
        )
        await self._commit(exhausted)
        yield exhausted

    async def _fitted_for_resume(self, pending: Sequence[ToolCall] = ()) -> AsyncIterator[CompressionEvent]:
        """Raises TurnFailed (`context_overflow`) unless the history fits a next step, compressed if it must be.

        For a turn about to commit what its last step added, unmeasured (its tools' results, its
        calls): the session's next step (a new turn, or the resume after client results) starts
        from it, and that round is too recent to compress then. Committed over the window, it would
        fail every later step (and a pause, every resume, with new messages refused while calls
        are pending) until the session expired; failed now, nothing is kept. The `pending` client
        calls are counted with empty results, the least their answers add.
        """
        empty_results = [Message(role="tool", tool_call_id=c.id, name=c.name, content="") for c in pending]
        if self._account([*self.history, *empty_results]).remaining_tokens >= 0:
            return  # it fits: compressing can wait for the next step, which may not need it yet
        async for event in self._maybe_compress(empty_results):
            if self._stats and self._stats[-1].compression is None:  # the turn's last step: GET counts it there
                self._stats[-1] = self._stats[-1].model_copy(update={"compression": event.report})
            yield event
        self._fitting_account(empty_results)

    def _fitting_account(self, to_come: Sequence[Message] = ()) -> TokenAccount:
        """The token account of the history (and messages `to_come`) as the next step's prompt, which must leave
        the output reserve free.

        Raises:
            TurnFailed: `context_overflow`: it does not fit the window (nothing is committed).
        """
        history = self.history
        account = self._account([*history, *to_come])
        if account.remaining_tokens < 0:
            raise TurnFailed(
                "context_overflow",
                f"the prompt needs {account.total_tokens} tokens plus {self._limits.output_reserve_tokens} "
                f"for the answer, over the session's {self._window}-token window" + self._overflow_hint(history, account),
            )
        return account

    @staticmethod
    def _overflow_hint(history: Sequence[Message], account: TokenAccount) -> str:
        """What the earlier messages' summary, or the session's prefix, takes of a prompt over the window, where
        that is most of it: the summary's facts ledger keeps every exact value and is never cut, so a session
        whose values outgrow its window goes on in a new one; the prefix (system prompt and tools) is never
        compressed, so a window it mostly fills leaves every turn little room, whatever compression does."""
        if 2 * account.prefix_tokens >= account.context_window_tokens:
            return (f"; the system prompt and tools take {account.prefix_tokens} of them and are never compressed "
                    "(a larger limits.context_budget_tokens, or fewer or shorter tools, leave turns more room)")
        if not history or not is_summary(history[0]) or 2 * account.message_tokens[0] < account.context_window_tokens:
            return ""
        return (f"; the summary of earlier messages takes {account.message_tokens[0]} of them (its facts ledger "
                "keeps every exact value, whole: to go on, start a new session with what it needs of this one's "
                "transcript)")

    async def _maybe_compress(self, to_come: Sequence[Message] = (), headroom: int = 0
                              ) -> AsyncIterator[CompressionEvent]:
        """Compresses the stored history when the plan says so and the result keeps every value and is shorter.

        `headroom`: tokens a compression should leave free beyond the output reserve where it can, for a step
        of this turn to follow (its answer, a tool call, stays in the history, and the turn may pause after
        it with only the summary left to compress). The facts ledger may take it; the optional summary may not.

        A compression not kept is not tried again in this turn (its cut stays the same while the
        turn runs): the messages stay as they are, and the turn fails only if they do not fit,
        with `compression_lost_values` where the compression would have dropped a value. One that
        would free little waits while the history and the messages `to_come` fit. A turn that has
        compressed compresses again only where the prompt is over the window (the step's tool
        results, say): the rounds it kept then, and its summary, are what is left to compress; with
        no round left, the summary's prose goes and its ledger stays (`plan_dropping_prose`).
        """
        history = self.history
        account = self._account(history)
        fitting = self._account([*history, *to_come]) if to_come else account
        if fitting.remaining_tokens < self._limits.compress_below_fraction * account.context_window_tokens:
            await asyncio.to_thread(prescan, history)  # the scans a compression needs, off the event loop
        plan = plan_compression(history, account, self._limits)
        if fitting.remaining_tokens < 0:
            plan = self._plan_that_fits(history, account, fitting, to_come, headroom) or plan
        elif self._compaction is not None:
            return
        if plan is None or plan.num_messages_compressed > len(self._stored):
            if fitting.remaining_tokens < 0 and (event := self._drop_summary_prose(history, account)) is not None:
                yield event
            return
        cut, fits = plan.num_messages_compressed, fitting.remaining_tokens >= 0
        if fits and self._deferred_cut == cut:
            return  # the same cut frees as little as it did at the turn's last step
        if self._declined is None or self._declined[0] != cut:
            ledger_only, floor = apply_compression(history, plan, "", recount=self._account)
            if fits and 0 < floor.tokens_before - floor.tokens_after < MIN_COMPRESSION_SAVING_FRACTION * self._window:
                self._deferred_cut = cut  # later rounds will give it more to free, or the prompt will not fit
                return
            report = await self._compress(history, plan, ledger_only, floor, to_come, headroom)
            if report is not None:
                yield CompressionEvent(report=report)
                return
        _cut, report, loses_values = self._declined
        if loses_values and fitting.remaining_tokens < 0:
            raise TurnFailed("compression_lost_values",
                             f"the prompt does not fit, and compression would drop exact values: {report}")

    def _plan_that_fits(self, history: list[Message], account: TokenAccount, fitting: TokenAccount,
                        to_come: Sequence[Message], headroom: int) -> CompressionPlan | None:
        """For a prompt over the window: the plan keeping the most rounds, at most `keep_last_rounds`, whose
        facts ledger alone makes the prompt (with the messages `to_come`) fit with `headroom` tokens to spare;
        else the one keeping the newest round only; None when no round lies before the newest among the
        stored messages.

        Why: a turn may leave its history at the window's edge (a long answer, a turn out of steps, results a
        client is yet to post), and the rounds that filled it are the recent ones `keep_last_rounds` keeps:
        with the next message over the window, every later turn failed `context_overflow`. Only counts whose
        kept rounds fit beside the prefix, the messages to come, the output reserve and the headroom are
        tried: each try applies the ledger and counts the prompt. `fitting` is the account of the history and
        `to_come`.
        """
        room = account.context_window_tokens - account.output_reserve_tokens - headroom - (
            fitting.total_tokens - account.total_tokens) - (
            account.total_tokens - sum(account.message_tokens))  # the prefix and the generation prompt
        starts = round_starts(history)
        for num_rounds in range(min(self._limits.keep_last_rounds, len(starts) - 1), 0, -1):
            cut = starts[-num_rounds]
            if cut > len(self._stored) or (num_rounds > 1 and sum(account.message_tokens[cut:]) > room):
                continue  # a round of the running turn; or what it keeps cannot fit, whatever the ledger takes
            plan = plan_keeping(history, account, num_rounds)
            if num_rounds == 1:
                return plan  # the most there is to compress
            compressed, _ = apply_compression(history, plan, "", recount=self._account)
            if self._account([*compressed, *to_come]).remaining_tokens >= headroom:
                return plan
        return None

    def _drop_summary_prose(self, history: list[Message], account: TokenAccount) -> CompressionEvent | None:
        """The leading summary without its prose, kept where that is shorter and every value stays; None where
        there is no prose to drop (the summary is stored first: a compression replaces its own message).

        Why: a summary may take the room the ledger leaves, and with only the running round kept no round is
        left to compress: a pause whose call took the rest, or results posted to it, failed at every try.
        """
        plan = plan_dropping_prose(history, account)
        if plan is None or not self._stored:
            return None
        compressed, report = apply_compression(history, plan, "", recount=self._account)
        if report.ledger_retained_fraction < 1.0 or report.tokens_after >= report.tokens_before:
            return None
        self._keep(plan, compressed)
        return CompressionEvent(report=report)

    async def _compress(self, history: list[Message], plan: CompressionPlan, ledger_only: list[Message],
                        floor: CompressionReport, to_come: Sequence[Message] = (), headroom: int = 0
                        ) -> CompressionReport | None:
        """Summarises and applies `plan`; the report if the result was kept, else None (`_declined` says why).

        `ledger_only` and `floor` are `plan` applied with no summary: when the facts ledger alone already
        makes the prompt no shorter, no summary can, and the model is not asked for one (a session of dense
        values would pay a summarising call at every turn and every resume, each declined). The summary
        gets at most the room the ledger leaves in the window (with the messages `to_come`) beyond `headroom`,
        and one that would not fit there is dropped for the ledger alone: kept, it failed the turn
        `context_overflow` with a fitting compression at hand, and every turn after it the same way (taking
        the headroom, at the pause after the step's tool call).
        """
        if floor.tokens_after >= floor.tokens_before:
            self._declined = (plan.num_messages_compressed, floor, False)  # not shorter: no value was judged
            return None
        summary = ModelReply()
        # The session's own prompt up to the cut, then the instruction: the prefix the engine holds from
        # the session's last step (system prompt, tools, the messages compressed), so the summarising call
        # prefills only the instruction. A transcript under a prompt of its own was all prefilled again.
        asking = [*history[: plan.num_messages_compressed], Message(role="user", content=SUMMARISE_INSTRUCTION)]
        prompt, tools = self._chat_request(asking)
        # A summary longer than a quarter of what it replaces would defeat the compression; it must also fit
        # the window beside its prompt (else the engine refuses the call, and the ledger stands alone).
        max_tokens = min(max(MIN_SUMMARY_TOKENS, min(self._limits.output_reserve_tokens, plan.tokens_compressed // 4)),
                         self._window - self._count(prompt, tools).total_tokens)
        # What a summary's text can take with the prompt still fitting and the headroom free: the room a
        # one-character one leaves (its header counted), plus that character.
        with_one_character, _ = apply_compression(history, plan, "x", recount=self._account)
        room = self._account([*with_one_character, *to_come]).remaining_tokens + 1 - headroom
        try:
            if max_tokens < MIN_SUMMARY_TOKENS:
                raise ModelRefusal(f"no room in the {self._window}-token window for a summary after its prompt")
            if room < MIN_SUMMARY_TOKENS:
                raise ModelRefusal(f"no room in the {self._window}-token window for a summary beside the facts ledger "
                                   "and the next step")
            max_tokens = min(max_tokens, room)
            async for item in self._model.chat(self._record.session_id, prompt, tools or [], "none", max_tokens):
                if isinstance(item, ModelReply):
                    summary = item
        except ModelRefusal as err:
            # The summary is prose beside the ledger, which holds every value: without it the compression
            # still stands (the engine refused a transcript longer than its window, say). A replica that
            # failed is not that: the turn fails, and the next one summarises.
            logger.warning("session %s: the summarising call failed (%s); the facts ledger stands alone",
                           self._record.session_id, err)
            summary = ModelReply()
        compressed, report = apply_compression(history, plan, summary.content, recount=self._account)
        is_over = self._account([*compressed, *to_come]).remaining_tokens < headroom and room >= 0
        if ((report.tokens_after >= report.tokens_before or is_over) and floor.ledger_retained_fraction == 1.0
                and report.ledger_retained_fraction == 1.0):
            # The summary took more than the ledger saved, or more than the window had room for: the ledger,
            # which holds every value, stands alone (a session of dense values was otherwise refused
            # `context_overflow` with a fitting one at hand).
            compressed, report = ledger_only, floor
        if report.ledger_retained_fraction < 1.0 or report.tokens_after >= report.tokens_before:
            # Values dense enough that their ledger is no shorter than the messages, or a value the
            # ledger would miss: keep the messages.
            if report.ledger_retained_fraction < 1.0:
                logger.warning("session %s: compression would drop exact values; its messages are kept: %s",
                               self._record.session_id, report)
            self._declined = (plan.num_messages_compressed, report, report.ledger_retained_fraction < 1.0)
            return None
        self._keep(plan, compressed)
        return report

    def _keep(self, plan: CompressionPlan, compressed: list[Message]) -> None:
        """Makes `compressed`, `plan` applied to the history, the turn's history and its compaction of the log."""
        # A second compression in the turn replaces the first one's summary too: one compaction of the log.
        earlier = self._compaction
        replaced = plan.num_messages_compressed + (earlier.num_messages_replaced - 1 if earlier else 0)
        self._compaction = Compaction(num_messages_replaced=replaced, summary=compressed[0],
                                      num_compressions=(earlier.num_compressions if earlier else 0) + 1)
        self._stored = compressed[: len(compressed) - len(self._new)]
        self._declined = self._deferred_cut = None  # cuts into the history before it
        WarmpathMetrics.get().compressions.inc()

    async def _commit(self, outcome: SessionEvent) -> None:
        """Commits the turn; under an idempotency key, with the events a replay shows, in the same write."""
        result_json = None
        if self._idempotency_key is not None:
            events = [*self._replayable, outcome]
            remembered = RememberedTurn(
                request_sha256=self._request_sha256,
                events=[e.model_dump(mode="json", exclude_none=True) for e in events],
            )
            result_json = remembered.model_dump_json()
        await self._store.commit_turn(
            self._record.session_id, self._stored_len, self._new, self._stats, compaction=self._compaction,
            idem_key=self._idempotency_key, result_json=result_json, lock_token=self._lock_token,
        )
