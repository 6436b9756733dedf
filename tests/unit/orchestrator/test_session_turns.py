"""Session requests through the orchestrator's public methods, with an in-memory store and a scripted model.

What is checked here happens in the deployment around the turn loop: what is
refused before a turn's stream begins, and what a resumed turn carries over
from the part that ran before it paused.
"""

from __future__ import annotations

import asyncio
import json
import contextlib
import secrets
from types import SimpleNamespace

import jinja2
import pytest

from serve_apps import ingress_http, metrics
from cluster import telemetry
from cluster.config import ToolNetworkConfig
from serve_apps.orchestrator.deployment import Orchestrator
from serve_apps.orchestrator.owner_sessions import SessionQuota, SessionQuotaExceeded
from serve_apps.orchestrator.tool_network import ToolNetworkPolicy
from serve_apps.orchestrator.models import Message, ToolCall
from serve_apps.orchestrator.models import ToolResultsSubmission
from serve_apps.orchestrator.store import (
    RememberedTurn, SessionNotFound, SessionRecord, SessionView, StaleTurn, StepTotals, TranscriptSnapshot, request_fingerprint,
)
from serve_apps.orchestrator.turns import ModelReply, TurnRunner
from tests.unit.loop_ticks import with_loop_ticks
from tests.unit.orchestrator.test_turns import CharTokenizer

CALLER = {"key_id": "key_1", "permissions": ["*"]}
CLIENT_TOOL = {"name": "fetch", "execution": {"kind": "client"}}


class MemoryStore:
    """The part of SessionStore the orchestrator uses, in memory; messages round-trip through JSON as in Redis."""

    def __init__(self) -> None:
        self.records: dict[str, SessionRecord] = {}
        self.logs: dict[str, list[str]] = {}
        self.stats: dict[str, list] = {}
        self.quotas: list = []  # the quota each creation counted against
        self.remembered: dict[tuple[str, str], str] = {}  # (session, idempotency key) -> RememberedTurn JSON
        self.commit_locks: list = []  # the lock token each commit was made under
        self.lost_locks: set[str] = set()  # tokens a renewal found taken (`SessionStore.lock_lost`)
        self.max_step_stats = 1024  # stats kept per session, as the store keeps them

    async def create(self, request, owner, fingerprint, quota=None):
        self.quotas.append(quota)
        session_id = secrets.token_urlsafe(24)
        self.records[session_id] = SessionRecord(session_id=session_id, owner_key_id=owner, request=request,
                                                 prefix_fingerprint=fingerprint, created_at_s=0.0)
        self.logs[session_id], self.stats[session_id] = [], []
        return self.records[session_id]

    async def get(self, session_id):
        if session_id not in self.records:
            raise SessionNotFound(session_id)
        return self.records[session_id]

    async def transcript(self, session_id):
        log = self.logs[session_id]
        return TranscriptSnapshot(messages=tuple(Message.model_validate_json(m) for m in log), length=len(log))

    @contextlib.asynccontextmanager
    async def turn_lock(self, session_id, owner_key_id=None):
        await self.get(session_id)
        yield f"lock-of-{session_id}"

    def lock_lost(self, token):
        return token in self.lost_locks

    async def lookup_turn_result(self, session_id, key):
        return self.remembered.get((session_id, key))

    async def commit_turn(self, session_id, expected_len, new, stats, *, compaction=None, idem_key=None,
                          result_json=None, lock_token=None):
        log = self.logs[session_id]
        if len(log) != expected_len:
            raise StaleTurn(session_id, expected_len, len(log))
        if idem_key is not None:
            self.remembered[(session_id, idem_key)] = result_json
        self.commit_locks.append(lock_token)
        log.extend(m.model_dump_json(exclude_none=True) for m in new)
        self.stats[session_id].extend(stats)
        return len(log)

    async def step_stats(self, session_id):
        return list(self.stats[session_id][-self.max_step_stats:])

    async def view(self, session_id):
        record = await self.get(session_id)
        steps = await self.step_stats(session_id)
        return SessionView(record, await self.transcript(session_id), steps, StepTotals.of(self.stats[session_id]))


class ScriptedModel:
    """Answers each call with the next reply of its script."""

    def __init__(self, replies) -> None:
        self.replies = list(replies)
        self.calls: list[dict] = []

    async def chat(self, session_id, messages, tools, tool_choice, max_tokens):
        self.calls.append({"messages": messages, "tool_choice": tool_choice, "sent_context": telemetry.inject()})
        yield self.replies.pop(0)


@pytest.fixture(autouse=True)
def _no_metrics(monkeypatch):
    counter = SimpleNamespace(inc=lambda *args, **kwargs: None, observe=lambda *args, **kwargs: None)
    monkeypatch.setattr(metrics.WarmpathMetrics, "get", classmethod(lambda cls: SimpleNamespace(
        turn_latency=counter, tool_calls=counter, compressions=counter, model_retries=counter)))


def _orchestrator(replies=()) -> Orchestrator:
    orchestrator = Orchestrator.__new__(Orchestrator)
    orchestrator._model_id = "m"
    orchestrator._max_model_len_tokens = 8192
    orchestrator._max_sessions_per_key = 1000
    orchestrator._store = MemoryStore()
    orchestrator._tokenizer = orchestrator._session_tokenizer = CharTokenizer()
    orchestrator._model = ScriptedModel(replies)
    orchestrator._tool_network = ToolNetworkPolicy(ToolNetworkConfig())
    return orchestrator


def _session(orchestrator: Orchestrator, tools=(), **limits) -> str:
    body = {"model": "m", "tools": list(tools), "limits": {"context_budget_tokens": 100_000, **limits}}
    created = asyncio.run(orchestrator.create_session(body, CALLER))
    assert created["status"] == 201, created
    return created["body"]["session_id"]


def _collect(stream) -> list[dict]:
    async def main():
        return [item async for item in stream]

    return asyncio.run(main())


def _fetch(call_id: str) -> ModelReply:
    return ModelReply(tool_calls=[ToolCall(id=call_id, name="fetch", arguments="{}")])


def _tool_with_item(name: str, item: dict) -> dict:
    return {"name": name, "execution": {"kind": "client"}, "parameters": {
        "type": "object", "$defs": {"Item": item},
        "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}}}}}


SKU_ITEM = {"type": "object", "properties": {"sku": {"type": "string"}}}


def test_tools_defining_one_def_differently_are_refused_at_creation():
    refund_item = {"type": "object", "properties": {"order_id": {"type": "string"}}}
    body = {"model": "m", "tools": [_tool_with_item("add_to_cart", SKU_ITEM), _tool_with_item("refund", refund_item)]}
    created = asyncio.run(_orchestrator().create_session(body, CALLER))
    assert created["status"] == 400
    error = created["body"]["error"]
    assert (error["code"], error["param"]) == ("invalid_parameter", "tools")
    assert "'add_to_cart' and 'refund'" in error["message"] and "$defs/Item" in error["message"]


def test_tools_defining_one_def_identically_are_accepted():
    _session(_orchestrator(), [_tool_with_item("add_to_cart", SKU_ITEM), _tool_with_item("remove", SKU_ITEM)])


@pytest.mark.parametrize(
    "tools, tool_choice, fragment",
    [
        ((), "required", "the session has no tools"),
        ((), "fetch", "the session has no tools (it takes 'auto' or 'none')"),
        ((CLIENT_TOOL,), "fecth", "names 'fecth', which is not one of ['fetch'] (nor 'auto', 'none' or 'required')"),
    ],
)
def test_a_tool_choice_the_session_cannot_honour_is_refused_before_the_turn(tools, tool_choice, fragment):
    orchestrator = _orchestrator([ModelReply(content="an answer without a tool")])
    session_id = _session(orchestrator, tools)
    items = _collect(orchestrator.send_message(session_id, {"content": "hi", "tool_choice": tool_choice}, CALLER))
    (envelope,) = items
    assert envelope["status"] == 400
    error = envelope["body"]["error"]
    assert (error["code"], error["param"]) == ("invalid_parameter", "tool_choice") and fragment in error["message"]
    assert orchestrator._model.calls == [] and orchestrator._store.logs[session_id] == []


REGEX_TOOL = {"name": "find", "execution": {"kind": "client"},
              "parameters": {"type": "object", "properties": {"expr": {"type": "string", "format": "regex"}}}}


@pytest.mark.parametrize("tool_choice", ["find", "required"])
def test_a_forced_call_whose_schema_vllms_grammar_refuses_is_refused_before_the_turn_naming_the_keyword(tool_choice):
    """vLLM's grammar of forced calls refuses some keywords (a `format` outside its list, `multipleOf`, ...): the
    turn failed after it began, `invalid_tool_schema`, with a message naming neither keyword nor tool."""
    orchestrator = _orchestrator([ModelReply(content="never")])
    session_id = _session(orchestrator, [CLIENT_TOOL, REGEX_TOOL])  # a session fine for `auto` turns
    items = _collect(orchestrator.send_message(session_id, {"content": "hi", "tool_choice": tool_choice}, CALLER))
    (envelope,) = items
    error = envelope["body"]["error"]
    assert (envelope["status"], error["code"], error["param"]) == (400, "invalid_parameter", "tool_choice")
    assert "'find'" in error["message"] and 'format: "regex" at /properties/expr' in error["message"]
    assert orchestrator._model.calls == [] and orchestrator._store.logs[session_id] == []
    items = _collect(orchestrator.send_message(session_id, {"content": "hi", "tool_choice": "fetch"}, CALLER))
    assert items[0] == {"status": 200}  # another tool's forced call is fine
    orchestrator._checks_xgrammar_features = False  # replicas set to another backend: theirs to judge
    orchestrator._model.replies = [ModelReply(content="never")]
    items = _collect(orchestrator.send_message(session_id, {"content": "hi", "tool_choice": tool_choice}, CALLER))
    assert items[0] == {"status": 200}


@pytest.mark.parametrize("tools, tool_choice", [((), "auto"), ((), "none"), ((CLIENT_TOOL,), "fetch")])
def test_a_tool_choice_the_session_can_honour_runs(tools, tool_choice):
    reply = _fetch("c1") if tool_choice == "fetch" else ModelReply(content="Hi")
    orchestrator = _orchestrator([reply])
    session_id = _session(orchestrator, tools)
    items = _collect(orchestrator.send_message(session_id, {"content": "hi", "tool_choice": tool_choice}, CALLER))
    assert items[0] == {"status": 200} and items[-1]["kind"] in ("final", "requires_action")


def test_one_user_turn_takes_at_most_max_steps_model_calls_however_often_it_pauses():
    orchestrator = _orchestrator([_fetch(f"c{i}") for i in range(5)])
    session_id = _session(orchestrator, [CLIENT_TOOL], max_steps_per_turn=2)
    turn = _collect(orchestrator.send_message(session_id, {"content": "go"}, CALLER))
    assert turn[-1]["kind"] == "requires_action"
    first = _collect(orchestrator.submit_tool_results(
        session_id, {"results": [{"tool_call_id": "c0", "content": "{}"}]}, CALLER))
    assert [e["stats"]["step_index"] for e in first if e.get("kind") == "usage"] == [1]
    assert first[-1]["kind"] == "requires_action"
    second = _collect(orchestrator.submit_tool_results(
        session_id, {"results": [{"tool_call_id": "c1", "content": "{}"}]}, CALLER))
    assert [e.get("kind") for e in second[1:]] == ["tool_result", "error"] and second[-1]["code"] == "max_steps"
    assert len(orchestrator._model.calls) == 2
    # The results are kept, and the next user turn has its own steps again.
    assert Message.model_validate_json(orchestrator._store.logs[session_id][-1]).role == "tool"
    orchestrator._model.replies = [ModelReply(content="Done.")]
    again = _collect(orchestrator.send_message(session_id, {"content": "and now?"}, CALLER))
    assert [e["stats"]["step_index"] for e in again if e.get("kind") == "usage"] == [0]


def test_a_client_result_over_the_limit_is_truncated_and_reported():
    orchestrator = _orchestrator([_fetch("c0"), ModelReply(content="Got it.")])
    session_id = _session(orchestrator, [CLIENT_TOOL], max_tool_result_bytes=256)
    _collect(orchestrator.send_message(session_id, {"content": "go"}, CALLER))
    resumed = _collect(orchestrator.submit_tool_results(
        session_id, {"results": [{"tool_call_id": "c0", "content": "y" * 40_000}]}, CALLER))
    result = resumed[1]
    assert (result["kind"], result["status"], result["is_truncated"]) == ("tool_result", "ok", True)
    assert result["content"] == "y" * 256 + "…[truncated 39744 bytes]"
    assert orchestrator._model.calls[-1]["messages"][-1]["content"] == result["content"]
    assert resumed[-1]["kind"] == "final"


def test_a_session_whose_limits_no_longer_fit_a_redeployed_model_is_refused_with_a_message():
    """Created against an 8192-token model; the model now serves 1024, under the session's output reserve."""
    orchestrator = _orchestrator([ModelReply(content="never")])
    session_id = _session(orchestrator, output_reserve_tokens=2048)
    orchestrator._max_model_len_tokens = 1024
    (refused,) = _collect(orchestrator.send_message(session_id, {"content": "hi"}, CALLER, None, None))
    assert refused["status"] == 400 and refused["body"]["error"]["code"] == "context_overflow"
    assert "the model serves 1024 tokens now" in refused["body"]["error"]["message"]
    shown = asyncio.run(orchestrator.get_session(session_id, CALLER))  # still readable, its transcript whole
    assert shown["status"] == 200 and shown["body"]["tokens"]["context_window_tokens"] == 1024
    assert shown["body"]["tokens"]["remaining_tokens"] < 0


class _SlowTokenizer(CharTokenizer):
    """Takes the time a prompt of megabytes takes to tokenize, holding its thread."""

    def apply_chat_template(self, *args, **kwargs):
        import time

        time.sleep(0.3)
        return super().apply_chat_template(*args, **kwargs)


def test_creating_a_session_does_not_stall_the_turns_of_others():
    """The orchestrator is one event loop for every session: a session's checks (validation, schemas, tokenizing
    its prompt) run beside it, so turns, streams and turn-lock renewals go on meanwhile."""
    orchestrator = _orchestrator()
    orchestrator._tokenizer = orchestrator._session_tokenizer = _SlowTokenizer()

    created, ticks = asyncio.run(with_loop_ticks(
        orchestrator.create_session({"model": "m", "system_prompt": "x" * 1000}, CALLER)))
    assert created["status"] == 201
    assert ticks >= 20  # the loop ran through the 0.6 s of tokenizing, not after it


class _CountingTokenizer(CharTokenizer):
    """Counts the renderings a creation takes."""

    renders = 0

    def apply_chat_template(self, *args, **kwargs):
        self.renders += 1
        return super().apply_chat_template(*args, **kwargs)


def test_a_session_that_cannot_fit_its_window_is_refused_after_one_rendering():
    """Counting the prefix first took three renderings and tokenizings more: for 4 MiB of tools, 6.5 s of the one
    thread that checks every tenant's new sessions, for a session refused anyway."""
    orchestrator = _orchestrator()
    orchestrator._tokenizer = orchestrator._session_tokenizer = tokenizer = _CountingTokenizer()
    refused = asyncio.run(orchestrator.create_session(
        {"model": "m", "system_prompt": "x" * 9000, "limits": {"output_reserve_tokens": 16}}, CALLER))
    assert refused["status"] == 400 and refused["body"]["error"]["code"] == "context_overflow"
    assert "with the shortest message" in refused["body"]["error"]["message"]
    assert tokenizer.renders == 1
    tokenizer.renders = 0
    fits = asyncio.run(orchestrator.create_session({"model": "m", "system_prompt": "x" * 4000}, CALLER))
    assert fits["status"] == 201 and tokenizer.renders > 1  # and the prefix is counted where it fits


HTTP_TOOL = {"name": "lookup", "parameters": {"type": "object"},
             "execution": {"kind": "http", "url": "http://tools.internal/lookup"}}
ASK_TOOL = {"name": "ask", "parameters": {"type": "object"}, "execution": {"kind": "client"}}


@pytest.mark.parametrize("permissions, tools, status", [
    (["orders:read"], [HTTP_TOOL], 403),  # the cluster would send requests where this key says
    (["orders:read", "tools:http"], [HTTP_TOOL], 201),
    (["*"], [HTTP_TOOL], 201),
    (["orders:read"], [ASK_TOOL], 201),  # the client runs it: nothing is sent from the cluster
])
def test_only_a_key_holding_the_http_tools_permission_gives_a_session_http_tools(permissions, tools, status):
    caller = {"key_id": "key_2", "permissions": permissions}
    created = asyncio.run(_orchestrator().create_session({"model": "m", "tools": tools}, caller))
    assert created["status"] == status, created
    if status == 403:
        error = created["body"]["error"]
        assert error["code"] == "missing_permission" and "'tools:http'" in error["message"]


def test_the_http_tools_permission_can_be_lifted():
    orchestrator = _orchestrator()
    orchestrator._tool_network = ToolNetworkPolicy(ToolNetworkConfig(http_tools_permission=None))
    created = asyncio.run(orchestrator.create_session(
        {"model": "m", "tools": [HTTP_TOOL]}, {"key_id": "key_2", "permissions": ["orders:read"]}))
    assert created["status"] == 201, created


@pytest.mark.parametrize("caller, quota", [
    ({"key_id": "key_2", "permissions": ["orders:read"]}, SessionQuota(limit=1000)),  # the cluster's default
    ({"key_id": "key_2", "permissions": [], "max_sessions": 3}, SessionQuota(limit=3)),  # the key's own
    ({"key_id": "key_2", "permissions": ["*"], "max_sessions": 3}, None),  # an admin key is not counted
])
def test_a_session_counts_against_its_keys_quota(caller, quota):
    orchestrator = _orchestrator()
    created = asyncio.run(orchestrator.create_session({"model": "m"}, caller))
    assert created["status"] == 201 and orchestrator._store.quotas == [quota]


def test_a_key_at_its_session_quota_is_refused_with_429_which_clients_do_not_retry():
    orchestrator = _orchestrator()

    async def full(request, owner, fingerprint, quota=None):
        raise SessionQuotaExceeded(owner, quota.limit)

    orchestrator._store.create = full
    created = asyncio.run(orchestrator.create_session({"model": "m"}, {"key_id": "key_2", "permissions": []}))
    error = created["body"]["error"]
    assert created["status"] == 429 and error["code"] == "session_quota_exceeded"
    assert "API key key_2 holds 1000 live sessions" in error["message"]
    response = ingress_http._unary(created)
    assert response.headers["x-should-retry"] == "false" and "retry-after" not in response.headers


def test_a_sessions_cache_figures_count_every_step_though_only_the_last_are_listed():
    orchestrator = _orchestrator([ModelReply(content=f"a{i}", prompt_tokens=100, cached_tokens=60) for i in range(3)])
    orchestrator._store.max_step_stats = 2
    sid = _session(orchestrator)
    for i in range(3):
        _collect(orchestrator.send_message(sid, {"content": f"q{i}"}, CALLER))
    cache = asyncio.run(orchestrator.get_session(sid, CALLER))["body"]["cache"]
    assert (cache["num_steps"], len(cache["steps"])) == (3, 2)
    assert (cache["prompt_tokens"], cache["cached_tokens"], cache["hit_ratio"]) == (300, 180, 0.6)


def _two_pending_calls(orchestrator: Orchestrator) -> str:
    sid = _session(orchestrator, [CLIENT_TOOL])
    paused = _collect(orchestrator.send_message(sid, {"content": "go"}, CALLER))
    assert [call["id"] for call in paused[-1]["tool_calls"]] == ["c1", "c0"]
    return sid


TWO_RESULTS = [{"tool_call_id": "c0", "content": "zero"}, {"tool_call_id": "c1", "content": "one"}]


def test_a_tool_results_retry_listing_them_in_another_order_is_the_same_request():
    orchestrator = _orchestrator([ModelReply(tool_calls=[ToolCall(id="c1", name="fetch", arguments="{}"),
                                                         ToolCall(id="c0", name="fetch", arguments="{}")]),
                                  ModelReply(content="Both fetched.")])
    sid = _two_pending_calls(orchestrator)
    first = _collect(orchestrator.submit_tool_results(sid, {"results": TWO_RESULTS}, CALLER, idempotency_key="k"))
    assert first[-1]["kind"] == "final" and "is_replay" not in first[0]
    again = _collect(orchestrator.submit_tool_results(
        sid, {"results": TWO_RESULTS[::-1]}, CALLER, idempotency_key="k"))
    assert again[0] == {"status": 200, "is_replay": True} and again[1:] == first[1:]
    changed = [dict(TWO_RESULTS[0], content="ZERO"), TWO_RESULTS[1]]
    other = _collect(orchestrator.submit_tool_results(sid, {"results": changed}, CALLER, idempotency_key="k"))
    assert other[0]["status"] == 422 and other[0]["body"]["error"]["code"] == "idempotency_key_reused"
    assert len(orchestrator._model.calls) == 2


def test_a_tool_results_record_fingerprinted_as_sent_still_answers_its_retry():
    orchestrator = _orchestrator([ModelReply(tool_calls=[ToolCall(id="c1", name="fetch", arguments="{}"),
                                                         ToolCall(id="c0", name="fetch", arguments="{}")])])
    sid = _two_pending_calls(orchestrator)
    as_sent = ToolResultsSubmission.model_validate({"results": TWO_RESULTS[::-1]})
    events = [{"kind": "final", "message": {"role": "assistant", "content": "Both fetched."}}]
    orchestrator._store.remembered[(sid, "k")] = RememberedTurn(
        request_sha256=request_fingerprint("tool_results", as_sent), events=events).model_dump_json()
    again = _collect(orchestrator.submit_tool_results(
        sid, {"results": TWO_RESULTS[::-1]}, CALLER, idempotency_key="k"))
    assert again == [{"status": 200, "is_replay": True}, *events]


def test_a_turn_commits_under_the_lock_it_holds():
    orchestrator = _orchestrator([_fetch("c0"), ModelReply(content="Fetched.")])
    sid = _session(orchestrator, [CLIENT_TOOL])
    _collect(orchestrator.send_message(sid, {"content": "go"}, CALLER))
    _collect(orchestrator.submit_tool_results(sid, {"results": [{"tool_call_id": "c0", "content": "{}"}]}, CALLER))
    assert orchestrator._store.commit_locks == [f"lock-of-{sid}"] * 2


def test_a_turn_whose_lock_was_taken_stops_before_running_a_server_tool(monkeypatch):
    """Its commit would be refused, and the turn holding the lock now may run the same tool: the tool's side
    effects would happen twice. It stops at once, saving nothing."""
    from serve_apps.orchestrator import turns

    ran = []

    async def run_http_tool(*args, **kwargs):
        ran.append(args)

    monkeypatch.setattr(turns, "run_http_tool", run_http_tool)
    lookup = ToolCall(id="c0", name="lookup", arguments="{}")
    orchestrator = _orchestrator([ModelReply(tool_calls=[lookup]), ModelReply(content="Found.")])
    sid = _session(orchestrator, [{"name": "lookup", "execution": {"kind": "http", "url": "http://tools.internal/x"}}])
    store, model_chat = orchestrator._store, orchestrator._model.chat

    async def chat_while_the_lock_expires(*args):
        store.lost_locks.add(f"lock-of-{sid}")  # a renewal found another turn holding it
        async for item in model_chat(*args):
            yield item

    orchestrator._model.chat = chat_while_the_lock_expires
    events = _collect(orchestrator.send_message(sid, {"content": "go"}, CALLER))
    assert events[-1]["kind"] == "error" and events[-1]["code"] == "stale_turn", events[-1]
    assert ran == [] and store.commit_locks == [] and store.logs[sid] == []


def test_a_turn_sends_the_callers_baggage_on_to_the_model():
    orchestrator = _orchestrator([ModelReply(content="Done.")])
    sid = _session(orchestrator)
    carrier = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "baggage": "tenant=acme"}
    _collect(orchestrator.send_message(sid, {"content": "go"}, CALLER, trace_carrier=carrier))
    assert orchestrator._model.calls[0]["sent_context"]["baggage"] == "tenant=acme"


def test_a_turn_whose_commit_may_have_landed_is_interrupted_and_not_offered_for_automatic_retry():
    """Redis went away while the turn committed and before the store could learn whether it ran: answered as
    `store_unavailable` (503 with Retry-After), OpenAI's clients resent it by themselves, without a key,
    and the turn ran twice."""
    from serve_apps import ingress_http
    from serve_apps.orchestrator.store import CommitOutcomeUnknown

    orchestrator = _orchestrator([ModelReply(content="Answer.")])
    session_id = _session(orchestrator)

    async def lost(*args, **kwargs):
        raise CommitOutcomeUnknown("the session store went away while saving the turn; whether it was saved is unknown")

    orchestrator._store.commit_turn = lost
    response = asyncio.run(ingress_http._turn_response(
        session_id, orchestrator.send_message(session_id, {"content": "hi"}, CALLER), False))
    error = json.loads(response.body)["error"]
    assert (response.status_code, error["code"]) == (503, "turn_interrupted")
    assert "whether it was saved is unknown" in error["message"]
    assert response.headers.get("x-should-retry") == "false" and "retry-after" not in response.headers


class ToolsInFirstUserTokenizer(CharTokenizer):
    """Tools rendered into the first user message, and no conversation with tools but without one (Llama 3's
    templates by default); a message reading "forbidden" is refused as a template refuses what it cannot render."""

    def apply_chat_template(self, conversation, tools=None, tokenize=False, add_generation_prompt=False):
        if any(message.get("content") == "forbidden" for message in conversation):
            raise jinja2.TemplateError("this template cannot render a forbidden message")
        if tools:
            if len(conversation) < 2 or conversation[1]["role"] != "user":
                raise jinja2.TemplateError("Cannot put tools in the first user message when there's no first user "
                                           "message!")
            first = dict(conversation[1], content=json.dumps(tools, sort_keys=True) + conversation[1]["content"])
            conversation = [conversation[0], first, *conversation[2:]]
        return super().apply_chat_template(conversation, None, tokenize, add_generation_prompt)


def test_a_template_that_puts_the_tools_into_the_first_user_message_serves_sessions():
    """Llama 3's templates refuse the system message and tools rendered alone: every session with tools was
    refused with a 500, and its view and turns could not be counted."""
    orchestrator = _orchestrator([_fetch("c1"), ModelReply(content="Done.")])
    orchestrator._tokenizer = orchestrator._session_tokenizer = ToolsInFirstUserTokenizer()
    created = asyncio.run(orchestrator.create_session(
        {"model": "m", "system_prompt": "Be brief.", "tools": [CLIENT_TOOL]}, CALLER))
    assert created["status"] == 201, created
    session_id, fingerprint = created["body"]["session_id"], created["body"]["prefix_fingerprint"]
    items = _collect(orchestrator.send_message(session_id, {"content": "go"}, CALLER))
    assert items[-1]["kind"] == "requires_action"
    results = {"results": [{"tool_call_id": "c1", "content": "ok"}]}
    items = _collect(orchestrator.submit_tool_results(session_id, results, CALLER))
    assert items[-1]["kind"] == "final"
    shown = asyncio.run(orchestrator.get_session(session_id, CALLER))["body"]
    assert shown["prefix_fingerprint"] == fingerprint
    tokens = shown["tokens"]
    # The shared prefix runs into the first user message, up to where its own text starts: the tools.
    assert tokens["prefix_tokens"] > len("<system>Be brief.</><user>")
    assert all(count > 0 for count in tokens["message_tokens"])
    steps = shown["cache"]["steps"]
    assert len(steps) == 2 and {step["prefix_fingerprint"] for step in steps} == {fingerprint}


def test_a_template_that_refuses_a_session_is_named_at_creation_and_in_a_turn():
    orchestrator = _orchestrator([ModelReply(content="never")])
    orchestrator._tokenizer = orchestrator._session_tokenizer = ToolsInFirstUserTokenizer()
    created = asyncio.run(orchestrator.create_session({"model": "m", "system_prompt": "forbidden"}, CALLER))
    error = created["body"]["error"]
    assert (created["status"], error["code"]) == (500, "chat_template_refused")
    assert "cannot render a forbidden message" in error["message"]

    session_id = _session(orchestrator)
    orchestrator._store.logs[session_id].append(Message(role="user", content="forbidden").model_dump_json())
    shown = asyncio.run(orchestrator.get_session(session_id, CALLER))  # a history the template refuses
    assert (shown["status"], shown["body"]["error"]["code"]) == (500, "chat_template_refused")
    orchestrator._store.logs[session_id].clear()
    items = _collect(orchestrator.send_message(session_id, {"content": "forbidden"}, CALLER))
    assert items[0] == {"status": 200}
    assert items[-1]["kind"] == "error" and items[-1]["code"] == "chat_template_refused"
    assert "cannot render a forbidden message" in items[-1]["message"]
    assert orchestrator._model.replies and orchestrator._store.logs[session_id] == []


def test_a_call_cut_short_before_its_usage_records_no_usage():
    """A cut-short call's span said `gen_ai.usage.input_tokens: 0`; the ingresses leave usage out then."""
    from serve_apps.orchestrator.deployment import _annotate_call

    recorded: dict = {}
    span = SimpleNamespace(is_recording=lambda: True, set_attribute=recorded.__setitem__)
    _annotate_call(span, ModelReply(content="", replica_id="r1"), None)
    assert recorded == {"warmpath.replica": "r1"}
    _annotate_call(span, ModelReply(content="x", replica_id="r1", prompt_tokens=12, completion_tokens=3), None)
    assert recorded["gen_ai.usage.input_tokens"] == 12 and recorded["gen_ai.usage.output_tokens"] == 3


def test_a_session_whose_last_turn_filled_its_window_compresses_that_turn_at_the_next_one():
    """A long answer can leave the history at the window's edge; the next message put the prompt over it, and
    the round that filled it was too recent to compress (`keep_last_rounds`): every later turn failed
    `context_overflow`, whatever its length, and the session could only be deleted."""
    window, reserve = 2000, 200
    orchestrator = _orchestrator()
    session_id = _session(orchestrator, context_budget_tokens=window, output_reserve_tokens=reserve)
    runner = TurnRunner(orchestrator._store.records[session_id], (), 0, orchestrator._store, None,
                        orchestrator._tokenizer, orchestrator._max_model_len_tokens)
    fitting = window - reserve - runner._account([Message(role="user", content="")]).total_tokens
    orchestrator._model.replies = [ModelReply(content="A" * reserve)]
    first = _collect(orchestrator.send_message(session_id, {"content": "x" * fitting}, CALLER))
    assert first[-1]["kind"] == "final"

    # The history to summarise is over the window itself: the engine is not asked, the facts ledger stands alone.
    orchestrator._model.replies = [ModelReply(content="Hello.")]
    second = _collect(orchestrator.send_message(session_id, {"content": "hi"}, CALLER))
    kinds = [e.get("kind") for e in second]
    assert "compression" in kinds and kinds[-1] == "final", second
    sent = orchestrator._model.calls[-1]["messages"]  # the summary, its acknowledgement, the new round
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "user"]
    assert sent[1]["name"] == "warmpath-context-summary" and sent[-1]["content"] == "hi"


def _turn_kinds(orchestrator, session_id, content, replies):
    orchestrator._model.replies = list(replies)
    events = _collect(orchestrator.send_message(session_id, {"content": content}, CALLER))
    return [e.get("kind") for e in events], events[-1]


def test_a_window_filled_by_the_latest_round_keeps_fewer_rounds_than_keep_last_rounds():
    """Two short rounds, then one whose long answer fills the window: compressing the short ones (all that
    `keep_last_rounds` allows) freed less than their summary costs, and every later turn failed."""
    window, reserve = 2000, 200
    orchestrator = _orchestrator()
    session_id = _session(orchestrator, context_budget_tokens=window, output_reserve_tokens=reserve)
    _turn_kinds(orchestrator, session_id, "hello there, I have a question", [ModelReply(content="How can I help?")])
    _turn_kinds(orchestrator, session_id, "about my order", [ModelReply(content="Sure, which one?")])
    runner = TurnRunner(orchestrator._store.records[session_id], (), 0, orchestrator._store, None,
                        orchestrator._tokenizer, orchestrator._max_model_len_tokens)
    stored = [Message.model_validate_json(m) for m in orchestrator._store.logs[session_id]]
    question = Message(role="user", content="write me the full report")
    room = runner._account([*stored, question, Message(role="assistant", content="")]).remaining_tokens
    kinds, last = _turn_kinds(orchestrator, session_id, question.content, [ModelReply(content="A" * room)])
    assert last["kind"] == "final"
    for text in ("thanks", "ok"):  # a summary (where there is room to ask for one), then the answer
        kinds, last = _turn_kinds(orchestrator, session_id, text, [ModelReply(content="fine")] * 2)
        assert last["kind"] == "final", last
    assert "compression" in kinds or orchestrator._model.calls[-1]["messages"][1]["name"] == "warmpath-context-summary"


def test_a_pause_whose_pending_results_put_the_prompt_over_the_window_compresses_instead_of_failing():
    """The plan was made without the results to come: under `compress_below_fraction` of the window free but
    not over it, with the kept rounds all there were, the turn failed `context_overflow` at every try."""
    window, reserve = 2000, 200
    orchestrator = _orchestrator()
    tool = {"name": "fetch", "execution": {"kind": "client"}, "parameters": {"type": "object", "properties": {}}}
    session_id = _session(orchestrator, tools=[tool], context_budget_tokens=window, output_reserve_tokens=reserve)
    runner = TurnRunner(orchestrator._store.records[session_id], (), 0, orchestrator._store, None,
                        orchestrator._tokenizer, orchestrator._max_model_len_tokens)
    call = ToolCall(id="c1", name="fetch", arguments="{}")

    def history(size: int) -> list[Message]:
        return [Message(role="user", content="x" * size), Message(role="assistant", content="A" * reserve),
                Message(role="user", content="hi"), Message(role="assistant", content=None, tool_calls=[call])]

    size = max(n for n in range(1, window) if runner._account(history(n)).remaining_tokens >= 0)
    kinds, last = _turn_kinds(orchestrator, session_id, "x" * size, [ModelReply(content="A" * reserve)])
    assert last["kind"] == "final"
    kinds, last = _turn_kinds(orchestrator, session_id, "hi", [_fetch("c1"), ModelReply(content="fine")])
    assert last["kind"] == "requires_action" and "compression" in kinds, last


@pytest.mark.parametrize("session_id", ["x" * 4_000_000, "a/b", "", "no such id", "é" * 8])
def test_what_is_no_session_id_is_not_found_without_a_span_a_lookup_or_an_echo(monkeypatch, session_id):
    """Over gRPC a session id is any text up to the request's 4 MiB: it went onto the turn's span (held in the export
    queue, and making batches the collector refuses whole), into Redis lookups, and back in the 404's message."""
    orchestrator = _orchestrator()

    def no_span():
        raise AssertionError("a span was started for what is no session id")

    class NoStore:
        def __getattr__(self, name):
            raise AssertionError(f"the store was asked ({name}) about what is no session id")

    monkeypatch.setattr(telemetry, "tracer", no_span)
    orchestrator._store = NoStore()
    answers = [
        asyncio.run(orchestrator.get_session(session_id, CALLER)),
        asyncio.run(orchestrator.delete_session(session_id, CALLER)),
        *_collect(orchestrator.send_message(session_id, {"content": "hi"}, CALLER)),
        *_collect(orchestrator.submit_tool_results(session_id, {"results": [{"tool_call_id": "c", "content": "x"}]},
                                                   CALLER)),
    ]
    assert len(answers) == 4
    for answer in answers:
        assert answer["status"] == 404 and answer["body"]["error"]["code"] == "session_not_found"
        assert len(answer["body"]["error"]["message"]) < 100


def test_a_session_id_the_store_issued_is_one():
    from serve_apps.orchestrator.models import is_session_id

    assert all(is_session_id(secrets.token_urlsafe(24)) for _ in range(1000))
