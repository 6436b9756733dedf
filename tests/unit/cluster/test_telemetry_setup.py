"""The tracer provider warmpath installs takes OTel's own batch-delay variable over its half-second default."""

from __future__ import annotations

import pytest

from cluster import telemetry
from cluster.config import TelemetryConfig


@pytest.mark.parametrize("environ, delay_ms", [({}, 500), ({"OTEL_BSP_SCHEDULE_DELAY": "2000"}, None)])
def test_the_batch_delay_is_otels_variable_when_set(monkeypatch, environ, delay_ms):
    import opentelemetry.sdk.trace.export as export

    made = []

    class Recording:
        def __init__(self, exporter, **options):
            made.append(options)

        def __getattr__(self, name):  # what the provider calls on a span processor
            return lambda *args, **kwargs: None

    monkeypatch.delenv("OTEL_BSP_SCHEDULE_DELAY", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(export, "BatchSpanProcessor", Recording)
    monkeypatch.setattr(telemetry.trace, "set_tracer_provider", lambda provider: None)
    monkeypatch.setattr(telemetry, "_is_configured", False)
    telemetry.setup_tracing(TelemetryConfig(otlp_endpoint="http://127.0.0.1:4318"), "test")
    assert made == [{"schedule_delay_millis": delay_ms}]  # None: the SDK reads the variable itself


@pytest.mark.parametrize("configured, environ, expected", [
    ("http://c:4318", {}, "http://c:4318/v1/traces"),
    ("http://c:4318/v1/traces", {}, "http://c:4318/v1/traces"),
    # OTLP's signal-specific variable is a whole URL, used as written.
    ("http://c:4318", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4318/custom/spans"}, "http://t:4318/custom/spans"),
])
def test_spans_go_to_the_traces_endpoint_as_otlp_names_it(monkeypatch, configured, environ, expected):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert telemetry.traces_endpoint(TelemetryConfig(otlp_endpoint=configured)) == expected


@pytest.mark.parametrize("configured, environ, expected", [
    (None, {}, "warmpath"),
    (None, {"OTEL_RESOURCE_ATTRIBUTES": "service.name=billing-llm,deployment.environment=prod"}, "billing-llm"),
    (None, {"OTEL_SERVICE_NAME": "agents", "OTEL_RESOURCE_ATTRIBUTES": "service.name=billing-llm"}, "agents"),
    ("from-config", {"OTEL_RESOURCE_ATTRIBUTES": "service.name=billing-llm"}, "from-config"),
])
def test_the_service_name_is_the_configs_else_otels_variables_else_warmpath(monkeypatch, configured, environ, expected):
    installed = []
    for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(telemetry.trace, "set_tracer_provider", installed.append)
    monkeypatch.setattr(telemetry, "_is_configured", False)
    telemetry.setup_tracing(TelemetryConfig(otlp_endpoint="http://127.0.0.1:4318", service_name=configured), "test")
    attributes = installed[0].resource.attributes
    assert attributes["service.name"] == expected and attributes["warmpath.component"] == "test"
    installed[0].shutdown()
