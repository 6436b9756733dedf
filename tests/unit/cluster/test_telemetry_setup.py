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
    ("http://c:4318", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4318/custom/spans",
                       "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, "http://t:4318/custom/spans"),
    # ... not where the process's protocol variable names another protocol (a shell set up for gRPC, inherited by
    # Ray's workers): every span went over OTLP/HTTP to the collector's gRPC port.
    ("http://c:4318", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4317",
                       "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "http://c:4318/v1/traces"),
    ("http://c:4318", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4317",
                       "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}, "http://c:4318/v1/traces"),
])
def test_spans_go_to_the_traces_endpoint_as_otlp_names_it(monkeypatch, configured, environ, expected):
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        monkeypatch.delenv(name, raising=False)
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


def test_a_header_sent_on_several_lines_is_joined_as_http_joins_them():
    """W3C lets `tracestate` and `baggage` be split over several header lines: the second line was dropped
    (a mapping of the request's headers keeps one line per name)."""
    from opentelemetry import baggage, trace

    from cluster import telemetry

    trace_id = "0af7651916cd43dd8448eb211c80319c"
    pairs = [("traceparent", f"00-{trace_id}-b7ad6b7169203331-01"), ("TraceState", "vendor1=a"),
             ("tracestate", "vendor2=b"), ("baggage", "user=alice"), ("Baggage", "tenant=acme")]
    extracted = telemetry.extract(pairs)
    span_context = trace.get_current_span(extracted).get_span_context()
    assert format(span_context.trace_id, "032x") == trace_id
    assert dict(span_context.trace_state) == {"vendor1": "a", "vendor2": "b"}
    assert baggage.get_all(extracted) == {"user": "alice", "tenant": "acme"}
    # A mapping still works, one line per name.
    assert dict(trace.get_current_span(telemetry.extract({"traceparent": pairs[0][1], "tracestate": "v=1"}))
                .get_span_context().trace_state) == {"v": "1"}


@pytest.mark.parametrize("otlp_endpoint, expected", [(None, ""), ("http://collector:4318", "http://collector:4318")])
def test_the_replicas_environment_always_says_where_spans_go(otlp_endpoint, expected):
    """Unset with tracing off, a replica read the endpoint its Ray worker inherited (the shell's, when `up` started
    the head): it traced with tracing off, and a gRPC-style value (`collector:4317`) stopped it starting."""
    from cluster.config import load_config
    from serve_apps.builders import llm_config

    cfg = load_config(environ={}, overrides={"telemetry": {"otlp_endpoint": otlp_endpoint}})
    env_vars = llm_config(cfg).runtime_env["env_vars"]
    assert env_vars["OTEL_EXPORTER_OTLP_ENDPOINT"] == expected


def test_a_bad_otel_setting_leaves_tracing_off_instead_of_failing_the_process(monkeypatch, caplog):
    """OTel's own arguments (`OTEL_BSP_MAX_QUEUE_SIZE=0`) raised in every deployment's constructor."""
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "0")
    monkeypatch.setattr(telemetry, "_is_configured", False)
    installed = []
    monkeypatch.setattr(telemetry.trace, "set_tracer_provider", installed.append)
    with caplog.at_level("WARNING"):
        telemetry.setup_tracing(TelemetryConfig(otlp_endpoint="http://127.0.0.1:4318"), "test")
    assert installed == [] and "tracing is off in this test process" in caplog.text


@pytest.mark.parametrize("traces_endpoint", ["collector:4318/v1/traces", "grpc://collector:4317", "http:///v1/traces",
                                             "http://collector:43l8/v1/traces", "http://collector:70000/v1/traces"])
def test_a_traces_endpoint_that_is_no_http_url_leaves_tracing_off(monkeypatch, caplog, traces_endpoint):
    """The exporter took `collector:4318/v1/traces` and failed every export: tracing stayed on for nothing, and
    each process logged an error twice a second."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", traces_endpoint)
    monkeypatch.setattr(telemetry, "_is_configured", False)
    installed = []
    monkeypatch.setattr(telemetry.trace, "set_tracer_provider", installed.append)
    with caplog.at_level("WARNING"):
        telemetry.setup_tracing(TelemetryConfig(otlp_endpoint="http://127.0.0.1:4318"), "test")
    assert installed == [] and f"traces endpoint {traces_endpoint!r} is not an http://" in caplog.text


@pytest.mark.parametrize("environ, kept_chars", [({}, telemetry.MAX_ATTRIBUTE_CHARS),
                                                 ({"OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "100000"}, 100000)])
def test_an_attribute_of_megabytes_is_cut_unless_otel_says_otherwise(monkeypatch, environ, kept_chars):
    """A client's text of megabytes on a span (a session id over gRPC) stayed whole in the export queue, and made
    batches the collector refused whole, every tenant's spans with them."""
    for name in ("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    installed = []
    monkeypatch.setattr(telemetry.trace, "set_tracer_provider", installed.append)
    monkeypatch.setattr(telemetry, "_is_configured", False)
    telemetry.setup_tracing(TelemetryConfig(otlp_endpoint="http://127.0.0.1:4318"), "test")
    (provider,) = installed
    with provider.get_tracer("t").start_as_current_span("s") as span:
        span.set_attribute("warmpath.session_id", "x" * 1_000_000)
    assert len(span.attributes["warmpath.session_id"]) == kept_chars
    provider.shutdown()
