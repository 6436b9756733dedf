"""How the orchestrator classifies an engine error: the request's fault ends the turn, a replica's is retried."""

import json

import pytest

from serve_apps.orchestrator.deployment import ReplicaFailure, engine_failure
from serve_apps.orchestrator.turns import TurnFailed

GRAMMAR = "Failed to transform json schema into a grammar: [10:37:09] /project/cpp/json_schema_converter.cc:4950: Cannot find field nope"


@pytest.mark.parametrize("status", [400, 500, 503])
def test_a_grammar_failure_is_the_requests_fault_whatever_the_status(status):
    failure = engine_failure(GRAMMAR, status)
    assert isinstance(failure, TurnFailed) and failure.code == "invalid_tool_schema"
    assert str(failure).endswith("Failed to transform json schema into a grammar: Cannot find field nope")
    assert "json_schema_converter.cc" not in str(failure) and "10:37:09" not in str(failure)


@pytest.mark.parametrize(
    "status, expected_type, expected_code",
    [(500, ReplicaFailure, None), (503, ReplicaFailure, None), (400, TurnFailed, "model_refused")],
)
def test_other_engine_errors_keep_their_meaning(status, expected_type, expected_code):
    failure = engine_failure("the engine said no", status)
    assert isinstance(failure, expected_type)
    assert getattr(failure, "code", None) == expected_code


def test_a_turn_the_client_hangs_up_on_is_timed_as_cancelled(monkeypatch):
    import asyncio
    from types import SimpleNamespace

    from serve_apps import metrics
    from serve_apps.orchestrator.deployment import Orchestrator

    observed = []
    monkeypatch.setattr(metrics.WarmpathMetrics, "get", classmethod(lambda cls: SimpleNamespace(
        turn_latency=SimpleNamespace(observe=lambda value, tags: observed.append(tags["outcome"])))))

    async def turn(*args, **kwargs):
        yield {"status": 200}
        yield {"kind": "delta", "text": "Hel"}
        yield {"kind": "final", "message": {"role": "assistant", "content": "Hello"}}

    orchestrator = Orchestrator.__new__(Orchestrator)
    orchestrator._model_id = "m"
    orchestrator._turn = turn

    async def hang_up_after(num_items):
        stream = orchestrator._traced_turn("s1", None, "auto", None, None)
        for _ in range(num_items):
            await stream.__anext__()
        await stream.aclose()

    asyncio.run(hang_up_after(2))  # before the last event
    asyncio.run(hang_up_after(3))  # after it
    assert observed == ["cancelled", "final"]


@pytest.mark.parametrize(
    "items, outcome, error_type, is_error",
    [
        ([{"status": 200}, {"kind": "final", "message": {"role": "assistant", "content": "Hi"}}], "final", None, False),
        ([{"status": 200}, {"kind": "tool_result", "tool_call_id": "c1", "status": "error", "content": "no"},
          {"kind": "final", "message": {"role": "assistant", "content": "Hi"}}], "final", None, False),
        ([{"status": 200}, {"kind": "error", "code": "internal", "message": "boom"}], "internal", "internal", True),
        # Out of steps: the turn's messages are committed, an outcome (HTTP 200, gRPC OK), not a failure.
        ([{"status": 200}, {"kind": "error", "code": "max_steps", "message": "all 8 steps"}], "max_steps", None, False),
        ([{"status": 200}, {"kind": "error", "code": "model_error", "message": "bad"}], "model_error", "model_error", True),
        ([{"status": 200}, {"kind": "error", "code": "context_overflow", "message": "long"}], "context_overflow",
         "context_overflow", False),
        ([{"status": 503, "body": {"error": {"message": "store down", "code": "store_unavailable"}}}], "rejected",
         "store_unavailable", True),
        ([{"status": 404, "body": {"error": {"message": "no session", "code": "session_not_found"}}}], "rejected",
         "session_not_found", False),
    ],
)
def test_the_turn_span_is_an_error_only_for_the_services_own_failures(monkeypatch, items, outcome, error_type, is_error):
    import asyncio

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    from cluster import telemetry
    from serve_apps.orchestrator.deployment import Orchestrator

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(telemetry, "tracer", lambda: provider.get_tracer("test"))

    async def turn(*args, **kwargs):
        for item in items:
            yield item

    orchestrator = Orchestrator.__new__(Orchestrator)
    orchestrator._model_id = "m"
    orchestrator._turn = turn

    async def run():
        return [item async for item in orchestrator._traced_turn("s1", None, "auto", None, None)]

    assert asyncio.run(run()) == items
    (span,) = exporter.get_finished_spans()
    assert span.attributes["warmpath.turn.outcome"] == outcome
    assert span.attributes.get("error.type") == error_type
    assert (span.status.status_code == StatusCode.ERROR) == is_error


def test_a_failure_before_the_turn_starts_is_an_error_status_not_an_event():
    """The ingress reads the first item as the HTTP status: an event there was a bare 500 from the proxy."""
    import asyncio
    import contextlib
    from types import SimpleNamespace

    from serve_apps.orchestrator.deployment import Orchestrator

    class RefusingStore:
        async def get(self, session_id):
            return SimpleNamespace(owner_key_id="k")

        @contextlib.asynccontextmanager
        async def turn_lock(self, session_id, owner_key_id=None):
            raise RuntimeError("OOM command not allowed when used memory > 'maxmemory'")
            yield

    orchestrator = Orchestrator.__new__(Orchestrator)
    orchestrator._store = RefusingStore()

    async def run():
        caller = SimpleNamespace(key_id="k", permissions=("*",))
        return [item async for item in orchestrator._turn("s1", "auto", caller, None, "sha", user_content="hi")]

    (item,) = asyncio.run(run())
    assert item["status"] == 500 and item["body"]["error"]["code"] == "internal"


class _StreamingHandle:
    """A replica handle whose every call streams the same SSE frames."""

    def __init__(self, frames: list[dict]) -> None:
        self.frames = frames
        self.num_calls = 0

    def options(self, **kwargs):
        return self

    @property
    def chat(self):
        return self

    def remote(self, request, raw_request_info):
        self.num_calls += 1
        return self._stream()

    async def _stream(self):
        for frame in self.frames:
            yield f"data: {json.dumps(frame)}\n\n"
        yield "data: [DONE]\n\n"


def _call_frames(call_id: str, name: str) -> list[dict]:
    call = {"index": 0, "id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}
    return [
        {"choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 5}},
    ]


@pytest.mark.parametrize(
    "call_id, name, expected_id",
    [
        ("chatcmpl-tool-1", "lookup_" + "x" * 300, "chatcmpl-tool-1"),  # a name over what ToolCall holds
        ("i" * 200, "lookup_order", None),  # an id over what ToolCall holds: replaced
    ],
)
def test_an_oversized_name_or_id_from_the_model_is_no_replica_failure(monkeypatch, call_id, name, expected_id):
    """What the model wrote is no replica failure: one model call, and the call validates as usual."""
    import asyncio
    from types import SimpleNamespace

    from serve_apps.orchestrator import deployment
    from serve_apps.orchestrator.models import ToolCall, ToolSpec
    from serve_apps.orchestrator.tools import ToolCallError, validate_tool_call
    from serve_apps.orchestrator.turns import ModelReply

    retries = []
    monkeypatch.setattr("serve_apps.metrics.record_model_call", lambda *args: None)
    monkeypatch.setattr(deployment.WarmpathMetrics, "get", classmethod(lambda cls: SimpleNamespace(
        model_retries=SimpleNamespace(inc=lambda: retries.append(1)))))
    handle = _StreamingHandle(_call_frames(call_id, name))
    client = deployment.HandleModelClient(handle, "m")
    tools = [{"type": "function", "function": {"name": "lookup_order", "description": "", "parameters": {}}}]

    async def run():
        return [item async for item in client.chat("s1", [{"role": "user", "content": "hi"}], tools, "auto", 16)]

    (reply,) = asyncio.run(run())
    assert isinstance(reply, ModelReply) and handle.num_calls == 1 and retries == []
    (call,) = reply.tool_calls
    if expected_id is None:  # unique, and as Mistral's templates need it: alphanumeric, 9 characters at least
        assert call.id.startswith("call0") and call.id.isalnum() and len(call.id) >= 9
    else:
        assert call.id == expected_id
    assert name.startswith(call.name)
    spec = ToolSpec(name="lookup_order", execution={"kind": "client"})
    checked = validate_tool_call(call, [spec])
    if name == "lookup_order":
        assert isinstance(checked, ToolCall)
    else:
        assert isinstance(checked, ToolCallError) and checked.kind == "unknown_tool"


def test_calls_of_one_reply_that_share_an_id_get_ids_of_their_own(monkeypatch):
    """A parser that keeps the model's own ids (Mistral's) can hand one id to two calls: the pause then waited
    for results no client could post (a submission answers each pending call once, by id), and new messages
    got 409."""
    import asyncio

    from serve_apps.orchestrator import deployment

    monkeypatch.setattr("serve_apps.metrics.record_model_call", lambda *args: None)
    calls = [{"index": i, "id": "abcdefghi", "type": "function", "function": {"name": "lookup_order",
                                                                             "arguments": "{}"}} for i in range(3)]
    frames = [{"choices": [{"index": 0, "delta": {"tool_calls": calls}, "finish_reason": "tool_calls"}]},
              {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 5}}]
    client = deployment.HandleModelClient(_StreamingHandle(frames), "m")

    async def run():
        return [item async for item in client.chat("s1", [{"role": "user", "content": "hi"}], [], "auto", 16)]

    (reply,) = asyncio.run(run())
    ids = [call.id for call in reply.tool_calls]
    assert ids[0] == "abcdefghi" and len(set(ids)) == 3  # the first keeps the model's id
    assert ids[1].startswith("call1") and ids[2].startswith("call2")


def test_vllms_refusal_to_merge_the_tools_defs_is_the_requests_fault():
    failure = engine_failure("Tool definition 'Item' has multiple schemas, which is not supported.", 400)
    assert isinstance(failure, TurnFailed) and failure.code == "invalid_tool_schema"


def test_a_model_call_takes_its_own_routing_decision_when_another_turn_shares_its_request_id(monkeypatch):
    """Two turns in flight may share a client's `x-request-id`: each gets the decision made for it."""
    import asyncio
    from types import SimpleNamespace

    import ray.serve.context
    from router import decision_log
    from router.types import Decision
    from serve_apps.orchestrator import deployment

    def logged(reason, replica):
        decision = Decision(ranked_tiers=[[replica]], reason=reason, predicted_cached_tokens={replica: 32}, scores={})
        return decision_log.LoggedDecision(decision=decision, start_ns=0, end_ns=1)

    decision_log.DECISIONS.put("shared-id", "this-turn", logged("prefix-hit", "r1"))
    decision_log.DECISIONS.put("shared-id", "other-turn", logged("cold", "r2"))
    context = SimpleNamespace(request_id="shared-id", _internal_request_id="this-turn")
    monkeypatch.setattr(ray.serve.context, "_get_serve_request_context", lambda: context)
    recorded = []
    monkeypatch.setattr("serve_apps.metrics.record_model_call", lambda logged, *args: recorded.append(logged))
    client = deployment.HandleModelClient(_StreamingHandle(_call_frames("c1", "lookup_order")), "m")

    async def run():
        return [item async for item in client.chat("s1", [{"role": "user", "content": "hi"}], None, "auto", 16)]

    try:
        asyncio.run(run())
        assert [entry.decision.reason for entry in recorded] == ["prefix-hit"]
        assert decision_log.DECISIONS.pop("shared-id", "other-turn").decision.reason == "cold"
    finally:
        decision_log.DECISIONS.pop("shared-id", "this-turn")
        decision_log.DECISIONS.pop("shared-id", "other-turn")


def test_a_replicas_failure_reaches_the_client_as_its_kind_never_its_traceback(monkeypatch):
    """A handle call whose replica raised carries the replica's traceback, pid and address: the log keeps them."""
    import asyncio
    from types import SimpleNamespace

    from ray.exceptions import RayTaskError

    from serve_apps.orchestrator import deployment
    from serve_apps.orchestrator.turns import ModelRetry, TurnFailed

    monkeypatch.setattr(deployment.WarmpathMetrics, "get", classmethod(lambda cls: SimpleNamespace(
        model_retries=SimpleNamespace(inc=lambda: None))))
    remote = RayTaskError(
        "ServeReplica:llm:LLMServer.chat",
        'Traceback (most recent call last):\n  File "/app/serve_apps/vllm_replica.py", line 412, in chat\n'
        "KeyError: 'kv_transfer_params'\n(pid=4242, ip=10.12.0.7)",
        KeyError("kv_transfer_params"),
    ).as_instanceof_cause()

    class _FailingHandle(_StreamingHandle):
        def remote(self, request, raw_request_info):
            raise remote

    client = deployment.HandleModelClient(_FailingHandle([]), "m")

    async def run():
        return [item async for item in client.chat("s1", [{"role": "user", "content": "hi"}], [], "auto", 16)]

    with pytest.raises(TurnFailed) as failed:
        asyncio.run(run())
    retries = []

    async def first_retry():
        async for item in client.chat("s1", [{"role": "user", "content": "hi"}], [], "auto", 16):
            retries.append(item)
            return

    asyncio.run(first_retry())
    (retry,) = retries
    assert isinstance(retry, ModelRetry) and retry.reason == "RayTaskError(KeyError)"
    assert failed.value.code == "model_error"
    assert "RayTaskError(KeyError)" in str(failed.value)
    for text in (str(failed.value), retry.reason):
        assert "4242" not in text and "10.12.0.7" not in text and "Traceback" not in text


class _FailingOnceHandle(_StreamingHandle):
    """Its first call streams some text, then an engine error in the stream (vLLM's in-band shape); later calls
    stream `frames`."""

    def __init__(self, frames: list[dict], error: dict) -> None:
        super().__init__(frames)
        self.error = error

    async def _stream(self):
        if self.num_calls == 1:
            yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': 'Hel'}}]})}\n\n"
            yield f"data: {json.dumps({'error': self.error})}\n\n"
            yield "data: [DONE]\n\n"
            return
        async for frame in super()._stream():
            yield frame


@pytest.mark.parametrize("code, is_retried", [(500, True), (503, True), (400, False), (None, False)])
def test_an_engine_failure_inside_the_stream_is_retried_as_one_before_it(monkeypatch, code, is_retried):
    """vLLM reports an engine dying mid-stream as an in-stream error with `code` 500: read as a 400, the turn failed
    `model_error` where the same failure before the stream was retried once."""
    import asyncio
    from types import SimpleNamespace

    from serve_apps.orchestrator import deployment
    from serve_apps.orchestrator.turns import ModelReply, ModelRetry, TurnFailed

    monkeypatch.setattr("serve_apps.metrics.record_model_call", lambda *args: None)
    monkeypatch.setattr(deployment.WarmpathMetrics, "get", classmethod(lambda cls: SimpleNamespace(
        model_retries=SimpleNamespace(inc=lambda: None))))
    answer = [{"choices": [{"index": 0, "delta": {"content": "Hello"}, "finish_reason": "stop"}]}]
    error = {"message": "EngineCore encountered an issue.", "type": "InternalServerError", "code": code}
    handle = _FailingOnceHandle(answer, error)
    client = deployment.HandleModelClient(handle, "m")

    async def run():
        return [item async for item in client.chat("s1", [{"role": "user", "content": "hi"}], [], "auto", 16)]

    if is_retried:
        items = asyncio.run(run())
        assert handle.num_calls == 2 and isinstance(items[-1], ModelReply) and items[-1].content == "Hello"
        assert [type(item).__name__ for item in items] == ["str", "ModelRetry", "str", "ModelReply"]
        assert isinstance(items[1], ModelRetry)
    else:
        with pytest.raises(TurnFailed):
            asyncio.run(run())
        assert handle.num_calls == 1


def test_a_fault_recording_a_finished_model_call_does_not_call_the_model_again(monkeypatch):
    """`chat` retries a call that failed once; a fault in the figures after the stream ended was taken for
    one, and the model called again (its text streamed twice, a `model_retry` between)."""
    import asyncio

    from serve_apps.orchestrator import deployment
    from serve_apps.orchestrator.turns import ModelReply, ModelRetry

    def broken(*args):
        raise KeyError("a metric's tag")

    monkeypatch.setattr("serve_apps.metrics.record_model_call", broken)
    handle = _StreamingHandle(_call_frames("c1", "lookup_order"))
    client = deployment.HandleModelClient(handle, "m")

    async def run():
        return [item async for item in client.chat("s1", [{"role": "user", "content": "hi"}], None, "auto", 16)]

    items = asyncio.run(run())
    assert handle.num_calls == 1 and not any(isinstance(item, ModelRetry) for item in items)
    assert isinstance(items[-1], ModelReply) and items[-1].tool_calls


def test_a_model_call_served_elsewhere_than_chosen_says_fallback_on_its_span():
    """As the route span, the response headers and the decisions metric do."""
    from opentelemetry.sdk.trace import TracerProvider

    from router import decision_log
    from router.types import Decision
    from serve_apps.orchestrator import deployment
    from serve_apps.orchestrator.turns import ModelReply

    decision = Decision(ranked_tiers=[["r1"], ["r2"]], reason="prefix-hit", predicted_cached_tokens={"r1": 64},
                        scores={})
    span = TracerProvider().get_tracer("test").start_span("chat m")
    deployment._annotate_call(span, ModelReply(replica_id="r2"), decision_log.LoggedDecision(decision, 0, 1))
    assert span.attributes["warmpath.route.reason"] == "fallback"
    assert span.attributes["warmpath.route.predicted_cached_tokens"] == 0


def _model_call_spans(monkeypatch, frames, cancel_after=None):
    """The `chat <model>` spans and `record_model_call` calls of one turn's model call through `frames`."""
    import asyncio
    from types import SimpleNamespace

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from cluster import telemetry
    from serve_apps.orchestrator import deployment

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(telemetry, "tracer", lambda: provider.get_tracer("test"))
    monkeypatch.setattr(deployment.WarmpathMetrics, "get", classmethod(lambda cls: SimpleNamespace(
        model_retries=SimpleNamespace(inc=lambda: None))))
    recorded = []
    monkeypatch.setattr("serve_apps.metrics.record_model_call", lambda *args: recorded.append(args))
    monkeypatch.setattr(deployment.decision_log, "withdraw_placement",
                        lambda logged, replica: recorded.append(("withdrawn", replica)))
    client = deployment.HandleModelClient(_StreamingHandle(frames), "m")

    async def run():
        stream = client.chat("s1", [{"role": "user", "content": "hi"}], [], "auto", 16)
        try:
            async for _ in stream:
                if cancel_after is not None:
                    cancel_after.pop()
                    if not cancel_after:
                        break
        finally:
            await stream.aclose()

    try:
        asyncio.run(run())
    except TurnFailed:
        pass
    return exporter.get_finished_spans(), recorded


@pytest.mark.parametrize("status, error_type", [(400, "model_refused"), (500, "ReplicaFailure")])
def test_a_failed_model_call_of_a_turn_is_typed_on_its_span(monkeypatch, status, error_type):
    """OTel's own handling set ERROR and an exception event, no `error.type`: queries on it missed them."""
    spans, _ = _model_call_spans(monkeypatch, [{"error": {"message": "no", "code": status}}])
    assert spans and {span.attributes.get("error.type") for span in spans} == {error_type}


def test_a_model_call_cut_short_is_recorded_without_cached_tokens(monkeypatch):
    """A turn cancelled mid-stream left its call out of the decisions metric and the route spans, its decision in
    the log; recorded, it judges no prediction against cached tokens it never heard of."""
    frames = [{"choices": [{"index": 0, "delta": {"content": "He"}}]}] * 5
    _, recorded = _model_call_spans(monkeypatch, frames, cancel_after=[1, 1])
    assert len(recorded) == 1
    _logged, _replica, prompt_tokens, cached_tokens = recorded[0]
    assert (prompt_tokens, cached_tokens) == (0, None)


def test_a_replayed_turn_is_timed_apart_and_marked_on_its_span(monkeypatch):
    """A replay from Redis takes milliseconds: counted as `final`, client retries pulled turn latency down."""
    import asyncio
    from types import SimpleNamespace

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from cluster import telemetry
    from serve_apps import metrics
    from serve_apps.orchestrator.deployment import Orchestrator

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(telemetry, "tracer", lambda: provider.get_tracer("test"))
    observed = []
    monkeypatch.setattr(metrics.WarmpathMetrics, "get", classmethod(lambda cls: SimpleNamespace(
        turn_latency=SimpleNamespace(observe=lambda value, tags: observed.append(tags["outcome"])))))

    async def turn(*args, **kwargs):
        yield {"status": 200, "is_replay": True}
        yield {"kind": "final", "message": {"role": "assistant", "content": "hi"}}

    orchestrator = Orchestrator.__new__(Orchestrator)
    orchestrator._model_id = "m"
    orchestrator._turn = turn

    async def run():
        return [item async for item in orchestrator._traced_turn("s1", None, "auto", None, None)]

    asyncio.run(run())
    (span,) = exporter.get_finished_spans()
    assert observed == ["replayed"] and span.attributes["warmpath.turn.is_replay"] is True
    assert span.attributes["warmpath.turn.outcome"] == "final"


def test_a_model_call_refused_before_any_output_has_its_placement_withdrawn_not_counted(monkeypatch):
    """As the ingresses settle theirs: it cached nothing, so its placement must not credit the replica."""
    _, recorded = _model_call_spans(monkeypatch, [{"error": {"message": "prompt too long", "code": 400}}])
    assert recorded == [("withdrawn", None)]


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_a_reasoning_models_thought_streams_apart_from_its_answer(monkeypatch, field):
    """The engine's reasoning field (a `reasoning_parser`'s split; `reasoning_content` is its older name) is
    streamed as reasoning, kept whole on the reply, and never joins the answer's text."""
    import asyncio

    from serve_apps.orchestrator import deployment
    from serve_apps.orchestrator.turns import ModelReply, ReasoningDelta

    monkeypatch.setattr("serve_apps.metrics.record_model_call", lambda *args: None)
    frames = [{"choices": [{"index": 0, "delta": {"role": "assistant", field: "Two and "}}]},
              {"choices": [{"index": 0, "delta": {field: "two.\ud800"}}]},  # a lone surrogate no store takes
              {"choices": [{"index": 0, "delta": {"content": "4"}, "finish_reason": "stop"}]},
              {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 5}}]
    client = deployment.HandleModelClient(_StreamingHandle(frames), "m")

    async def run():
        return [item async for item in client.chat("s1", [{"role": "user", "content": "2+2?"}], [], "auto", 16)]

    *pieces, reply = asyncio.run(run())
    assert pieces == [ReasoningDelta("Two and "), ReasoningDelta("two.?"), "4"]
    assert isinstance(reply, ModelReply) and reply.content == "4" and reply.reasoning == "Two and two.?"
