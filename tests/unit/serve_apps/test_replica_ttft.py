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
