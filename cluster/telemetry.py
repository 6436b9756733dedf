"""OpenTelemetry bootstrap and W3C context propagation across Ray actor boundaries.

Why here: every deployment (ingress, orchestrator, replicas) runs in its own
Ray worker process, so each configures its own tracer provider from the same
`TelemetryConfig`, and trace context travels explicitly in a carrier dict
(`traceparent`/`tracestate`) alongside the request, since Ray handle calls do
not carry it.

Configuration: `TelemetryConfig.otlp_endpoint` (from the cluster config or
`OTEL_EXPORTER_OTLP_ENDPOINT`), `service_name`, and the standard `OTEL_*`
variables the SDK reads itself (sampler, resource attributes, headers). With
no endpoint, no provider is installed: the API's no-op tracer creates
non-recording spans, so tracing costs a few attribute checks per request.
"""

from __future__ import annotations

import threading
from typing import Mapping, MutableMapping, Optional

from opentelemetry import context, propagate, trace

from cluster.config import TelemetryConfig

TRACER_NAME = "warmpath"
_configured = threading.Lock()
_is_configured = False


def setup_tracing(config: TelemetryConfig, component: str) -> None:
    """Installs an OTLP/HTTP exporting tracer provider once per process (no-op without an endpoint)."""
    global _is_configured
    if config.otlp_endpoint is None:
        return
    with _configured:
        if _is_configured:
            return
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        resource = Resource.create({"service.name": config.service_name, "warmpath.component": component})
        provider = TracerProvider(resource=resource)
        endpoint = config.otlp_endpoint.rstrip("/")
        if not endpoint.endswith("/v1/traces"):
            endpoint += "/v1/traces"
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint), schedule_delay_millis=500))
        trace.set_tracer_provider(provider)
        _is_configured = True


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def inject(carrier: Optional[MutableMapping[str, str]] = None) -> dict[str, str]:
    """The current trace context as W3C headers."""
    carrier = dict(carrier or {})
    propagate.inject(carrier)
    return carrier


def extract(carrier: Optional[Mapping[str, str]]) -> context.Context:
    """The trace context a caller sent (case-insensitive header lookup)."""
    lowered = {k.lower(): v for k, v in (carrier or {}).items()}
    return propagate.extract(lowered)


def force_flush(timeout_ms: int = 5000) -> None:
    provider = trace.get_tracer_provider()
    flush = getattr(provider, "force_flush", None)
    if flush is not None:
        flush(timeout_ms)
