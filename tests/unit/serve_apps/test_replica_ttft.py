"""The replica's time-to-first-token histogram times a streamed call's first chunk, and never a call that is
not streamed: its one item is the whole response, and timing it would record the whole generation."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.trace import NonRecordingSpan, INVALID_SPAN_CONTEXT

from serve_apps import vllm_replica
from serve_apps.vllm_replica import ServedBy, WarmpathLLMServer


class _Histogram:
    def __init__(self) -> None:
        self.observed: list[float] = []

    def observe(self, value, tags=None) -> None:
        self.observed.append(value)


@pytest.fixture
def ttft(monkeypatch) -> _Histogram:
    histogram = _Histogram()
    metrics = type("Metrics", (), {"ttft": histogram})()
    monkeypatch.setattr(vllm_replica.WarmpathMetrics, "get", classmethod(lambda cls: metrics))
    return histogram


async def _engine(*items):
    for item in items:
        yield item


@pytest.mark.parametrize("is_streaming, num_observed", [(True, 1), (False, 0)])
def test_only_a_streamed_calls_first_item_is_its_first_token(ttft, is_streaming, num_observed):
    server = object.__new__(WarmpathLLMServer)
    server._replica_id = "r1"

    async def read():
        tagged = server._tagged(_engine("first", "second"), NonRecordingSpan(INVALID_SPAN_CONTEXT), is_streaming)
        return [item async for item in tagged]

    assert asyncio.run(read()) == [ServedBy("r1"), "first", "second"]
    assert len(ttft.observed) == num_observed


def _recording_span():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test").start_span("vllm.chat"), exporter


def _error_response(code: int, message: str):
    from ray.llm._internal.serve.core.configs.openai_api_models import ErrorInfo, ErrorResponse

    return ErrorResponse(error=ErrorInfo(message=message, type="ServiceUnavailableError", code=code))


@pytest.mark.parametrize(
    "items, is_streaming, status, error_type",
    [
        ([_error_response(503, "engine is overloaded")], False, "ERROR", "503"),
        ([['data: {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}\n\n']],
         True, "ERROR", "500"),
        ([_error_response(400, "bad grammar")], False, "UNSET", "400"),  # the caller's mistake: not an outage
        # vLLM's answer to a call whose caller left: no mistake of the caller's (the span says incomplete).
        ([_error_response(400, "Client disconnected")], False, "UNSET", None),
        ([["data: {\"choices\": []}\n\n"]], True, "UNSET", None),
    ],
    ids=["unary-503", "stream-500", "unary-400", "unary-left", "no-error"],
)
def test_an_engine_failure_answered_in_the_stream_is_on_the_replica_span(ttft, items, is_streaming, status, error_type):
    server = object.__new__(WarmpathLLMServer)
    server._replica_id = "r1"
    span, exporter = _recording_span()

    async def read():
        return [item async for item in server._tagged(_engine(*items), span, is_streaming)]

    asyncio.run(read())
    (finished,) = exporter.get_finished_spans()
    assert finished.status.status_code.name == status
    assert finished.attributes.get("error.type") == error_type
    assert ("gen_ai.server.time_to_first_token" in finished.attributes) is (is_streaming and error_type is None)
    is_left = items[0] == _error_response(400, "Client disconnected")
    assert finished.attributes.get("warmpath.stream.incomplete", False) is is_left


def test_an_engine_that_fails_mid_stream_leaves_the_exception_on_the_replica_span(ttft):
    server = object.__new__(WarmpathLLMServer)
    server._replica_id = "r1"
    span, exporter = _recording_span()

    async def failing():
        yield ["data: {\"choices\": []}\n\n"]
        raise RuntimeError("engine core died")

    async def read():
        return [item async for item in server._tagged(failing(), span, True)]

    with pytest.raises(RuntimeError):
        asyncio.run(read())
    (finished,) = exporter.get_finished_spans()
    assert finished.status.status_code.name == "ERROR" and finished.attributes["error.type"] == "RuntimeError"
    assert [event.name for event in finished.events] == ["exception"]


def test_the_replica_span_ends_where_closing_the_engine_stream_fails(ttft):
    """vLLM's stream awaits its abort as it closes, which an engine core that died refuses: the span was never
    ended, and the failure worth tracing never exported."""
    server = object.__new__(WarmpathLLMServer)
    server._replica_id = "r1"
    span, exporter = _recording_span()

    class DeadEngineStream:
        def __aiter__(self):
            return self

        async def __anext__(self):
            return ["data: {\"choices\": []}\n\n"]

        async def aclose(self):
            raise RuntimeError("engine core died")

    async def read_one_then_leave():
        tagged = server._tagged(DeadEngineStream(), span, True)
        await anext(tagged)
        await tagged.aclose()

    with pytest.raises(RuntimeError, match="engine core died"):
        asyncio.run(read_one_then_leave())
    (finished,) = exporter.get_finished_spans()
    assert finished.attributes.get("warmpath.stream.incomplete") is True


@pytest.mark.parametrize("is_traced", [False, True])
def test_a_refusal_as_the_first_item_is_no_first_token_traced_or_not(ttft, is_traced):
    """The histogram must not change with the tracing configuration."""
    server = object.__new__(WarmpathLLMServer)
    server._replica_id = "r1"
    span = _recording_span()[0] if is_traced else NonRecordingSpan(INVALID_SPAN_CONTEXT)
    refusal = ['data: {"error": {"message": "overloaded", "type": "ServiceUnavailableError", "code": 503}}\n\n']

    async def read():
        return [item async for item in server._tagged(_engine(refusal), span, True)]

    asyncio.run(read())
    assert ttft.observed == []


@pytest.mark.parametrize("how", ["closed", "cancelled"])
def test_a_caller_leaving_mid_stream_marks_the_replica_span_incomplete_not_failed(ttft, how):
    """Closed (the consumer stopped reading) or cancelled (Serve cancels a request whose caller left) while
    the engine streams: the engine's request is abandoned with it, which its span says; no error."""
    server = object.__new__(WarmpathLLMServer)
    server._replica_id = "r1"
    span, exporter = _recording_span()
    engine_waits = asyncio.Event()

    async def endless():
        yield ["data: {\"choices\": []}\n\n"]
        engine_waits.set()
        await asyncio.Event().wait()  # the engine still decoding
        yield ["never"]

    async def leave():
        tagged = server._tagged(endless(), span, True)
        assert await anext(tagged) == ServedBy("r1")
        await anext(tagged)
        if how == "closed":
            await tagged.aclose()
            return
        reading = asyncio.ensure_future(anext(tagged))
        await engine_waits.wait()
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading

    asyncio.run(leave())
    (finished,) = exporter.get_finished_spans()
    assert finished.attributes["warmpath.stream.incomplete"] is True
    assert finished.status.status_code.name == "UNSET" and "error.type" not in finished.attributes


def test_a_stream_read_to_its_end_is_not_marked_incomplete(ttft):
    server = object.__new__(WarmpathLLMServer)
    server._replica_id = "r1"
    span, exporter = _recording_span()

    async def read():
        return [item async for item in server._tagged(_engine(["data: {\"choices\": []}\n\n"]), span, True)]

    asyncio.run(read())
    (finished,) = exporter.get_finished_spans()
    assert "warmpath.stream.incomplete" not in finished.attributes


def test_closing_the_replica_stream_aborts_the_engine_stream_before_the_close_returns(ttft):
    """The batching generator's reader was cancelled only when the collector found the generator: the engine
    went on decoding for a caller that had left, and the span ended before the abort."""
    from serve_apps.stream_batches import eager_first_batches

    server = object.__new__(WarmpathLLMServer)
    server._replica_id = "r1"
    seen = []

    async def engine():
        try:
            while True:
                yield ["data: {\"choices\": []}\n\n"]
                await asyncio.sleep(0.01)
        except BaseException as err:
            seen.append(type(err).__name__)
            raise

    async def leave():
        tagged = server._tagged(eager_first_batches(engine(), 0.05), NonRecordingSpan(INVALID_SPAN_CONTEXT), True)
        await anext(tagged)
        await anext(tagged)
        await tagged.aclose()
        return list(seen)

    assert asyncio.run(leave()) == ["CancelledError"]


def test_an_engine_failure_after_its_reader_left_is_not_logged_as_never_retrieved(caplog):
    from serve_apps.stream_batches import eager_first_batches

    async def engine():
        yield 1
        await asyncio.sleep(0.01)
        raise RuntimeError("engine died")

    async def leave():
        batches = eager_first_batches(engine(), 0.05)
        await anext(batches)
        await asyncio.sleep(0.03)  # the engine fails meanwhile; the caller then leaves
        await batches.aclose()

    with caplog.at_level("ERROR", logger="asyncio"):
        asyncio.run(leave())
        import gc
        gc.collect()
    assert "never retrieved" not in caplog.text


class _DeadEngineCore(RuntimeError):
    """Stands in for vLLM's EngineDeadError."""


def _server_with_engine(monkeypatch, is_dead: bool, exits: list) -> WarmpathLLMServer:
    from types import SimpleNamespace

    server = object.__new__(WarmpathLLMServer)
    server._replica_id = "r1"
    server.engine = SimpleNamespace(_engine_client=SimpleNamespace(errored=is_dead))
    monkeypatch.setattr(vllm_replica, "_exit_replica", lambda: exits.append("exit"))
    return server


async def _dying_engine():
    yield "first"
    raise _DeadEngineCore("EngineCore encountered an issue")


@pytest.mark.parametrize("is_dead, expected_exits", [(True, ["exit"]), (False, [])])
def test_a_replica_whose_engine_died_mid_stream_exits(ttft, monkeypatch, is_dead, expected_exits):
    """Alive with a dead engine, the replica failed every call at once and looked idle: the router sent it more,
    the orchestrator's retry went back to it, and Serve noticed after three health checks (20-30 s of failed turns)."""
    exits: list = []
    server = _server_with_engine(monkeypatch, is_dead, exits)

    async def read():
        return [item async for item in server._tagged(_dying_engine(), NonRecordingSpan(INVALID_SPAN_CONTEXT), True)]

    with pytest.raises(_DeadEngineCore):
        asyncio.run(read())
    assert exits == expected_exits


def test_a_replica_whose_engine_answers_a_failure_in_the_stream_exits_where_the_engine_died(ttft, monkeypatch):
    exits: list = []
    server = _server_with_engine(monkeypatch, True, exits)
    frame = ['data: {"error": {"message": "EngineDeadError", "type": "InternalServerError", "code": 500}}\n\n']

    async def read():
        return [item async for item in server._tagged(_engine(frame), NonRecordingSpan(INVALID_SPAN_CONTEXT), True)]

    asyncio.run(read())
    assert exits == ["exit"]


@pytest.mark.parametrize("is_stopping, expected_exits", [(False, ["exit"]), (True, [])])
def test_a_failed_health_check_of_a_dead_engine_ends_the_replica_unless_serve_stops_it(monkeypatch, is_stopping,
                                                                                        expected_exits):
    """An idle replica whose engine died: found at Serve's next health check, not after the third."""
    exits: list = []
    server = _server_with_engine(monkeypatch, True, exits)
    server._is_stopping = is_stopping

    async def failing_check(self):
        raise _DeadEngineCore("EngineCore encountered an issue")

    monkeypatch.setattr(vllm_replica.LLMServer, "check_health", failing_check)
    with pytest.raises(_DeadEngineCore):
        asyncio.run(server.check_health())
    assert exits == expected_exits


def test_a_call_refused_before_its_stream_by_a_dead_engine_ends_the_replica(monkeypatch):
    exits: list = []
    server = _server_with_engine(monkeypatch, True, exits)

    async def refused():
        raise _DeadEngineCore("EngineCore encountered an issue")

    with pytest.raises(_DeadEngineCore):
        asyncio.run(server._refused_or_died(refused(), NonRecordingSpan(INVALID_SPAN_CONTEXT)))
    assert exits == ["exit"]
