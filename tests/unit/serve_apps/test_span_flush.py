"""Queued spans leave a deployment before Ray Serve kills it, and a dead collector cannot hold up the stop."""

from __future__ import annotations

import asyncio
import threading
import time

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cluster import telemetry
from serve_apps.ingress_grpc import GrpcIngress
from serve_apps.ingress_http import WarmpathIngress
from serve_apps.orchestrator.deployment import Orchestrator
from serve_apps.vllm_replica import WarmpathLLMServer


def test_flush_spans_exports_what_the_batch_processor_still_holds(monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=60_000))
    monkeypatch.setattr(telemetry.trace, "get_tracer_provider", lambda: provider)
    with provider.get_tracer("test").start_as_current_span("invoke_agent warmpath"):
        pass
    assert exporter.get_finished_spans() == ()  # queued: a kill now would lose it
    assert telemetry.flush_spans() is True
    assert [s.name for s in exporter.get_finished_spans()] == ["invoke_agent warmpath"]
    provider.shutdown()


class _HangingProvider:
    """A provider whose flush waits on an exporter retrying an unreachable collector, past its own timeout."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        self.release.wait(30)
        return True


def test_flush_spans_gives_up_after_its_timeout(monkeypatch):
    provider = _HangingProvider()
    monkeypatch.setattr(telemetry.trace, "get_tracer_provider", lambda: provider)
    start = time.monotonic()
    try:
        assert telemetry.flush_spans(0.2) is False
        assert asyncio.run(telemetry.flush_spans_async(0.2)) is False
    finally:
        provider.release.set()
    # Each call gives up after 0.2 s; one that waited for the exporter would take its 30 s.
    assert time.monotonic() - start < 15


class _Replica(WarmpathLLMServer):
    def __del__(self) -> None:
        """Python's own collection of a test object: the hook under test is called explicitly."""


def test_every_deployment_flushes_its_spans_when_serve_stops_it(monkeypatch):
    calls = []
    monkeypatch.setattr(telemetry, "flush_spans", lambda timeout_s=2.0: calls.append("sync") or True)

    async def flush_async(timeout_s=2.0):
        calls.append("async")
        return True

    monkeypatch.setattr(telemetry, "flush_spans_async", flush_async)
    # Kept alive until the end: Python calls `__del__` again when an object is collected.
    http, grpc_ingress, replica = (object.__new__(cls) for cls in (WarmpathIngress, GrpcIngress, _Replica))
    http.__del__()
    grpc_ingress.__del__()
    asyncio.run(WarmpathLLMServer.__del__(replica))  # no engine started: only the flush
    orchestrator = object.__new__(Orchestrator)
    orchestrator.__del__()
    assert calls == ["sync", "sync", "async", "sync"]
