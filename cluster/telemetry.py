"""OpenTelemetry bootstrap and W3C context propagation across Ray actor boundaries.

Why here: every deployment (ingress, orchestrator, replicas) runs in its own
Ray worker process, so each configures its own tracer provider from the same
`TelemetryConfig`, and trace context travels explicitly in a carrier dict
(`traceparent`/`tracestate`) alongside the request, since Ray handle calls do
not carry it.

Configuration: `TelemetryConfig.otlp_endpoint` (from the cluster config,
`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, which,
when set, is where spans go as written), `service_name`, and the standard `OTEL_*`
variables the SDK reads itself (sampler, resource attributes, headers, batch
delay: half a second unless `OTEL_BSP_SCHEDULE_DELAY` is set). With
no endpoint, no provider is installed: the API's no-op tracer creates
non-recording spans, so tracing costs a few attribute checks per request.

Shutdown: spans wait in the `BatchSpanProcessor` queue for up to the batch
delay. Ray Serve stops a replica by calling its deployment's `__del__` and
then killing the actor (no `atexit`), so every deployment's `__del__` calls
`flush_spans` (bounded: it must not hold up the stop when the collector is down).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Iterable, Mapping, MutableMapping, Optional, Union

from opentelemetry import context, propagate, trace

from cluster.config import TelemetryConfig, otlp_http_url_problem, speaks_otlp_protocol

logger = logging.getLogger(__name__)

TRACER_NAME = "warmpath"
# How long finished spans wait to be batched out, unless OTEL_BSP_SCHEDULE_DELAY says.
DEFAULT_SCHEDULE_DELAY_MS = 500
# Longest a stopping replica waits for its queued spans to be exported.
SHUTDOWN_FLUSH_TIMEOUT_S = 2.0
# Longest text an attribute keeps unless OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT says (the SDK's default: no bound).
MAX_ATTRIBUTE_CHARS = 4096
_configured = threading.Lock()
_is_configured = False


# `service.name` when neither the config nor OTel's environment variables name one.
DEFAULT_SERVICE_NAME = "warmpath"
# On a span whose response stream ended before its last item: the client hung up (or, at the ingress,
# the stream broke off). On the replica's span it says the engine's request was abandoned with it.
INCOMPLETE_STREAM_ATTRIBUTE = "warmpath.stream.incomplete"


def setup_tracing(config: TelemetryConfig, component: str) -> None:
    """Installs an OTLP/HTTP exporting tracer provider once per process (no-op without an endpoint)."""
    global _is_configured
    if config.otlp_endpoint is None:
        return
    with _configured:
        if _is_configured:
            return
        try:
            _install_provider(config, component)
        except Exception as err:  # tracing fails open: a bad OTEL_* setting must not stop a deployment starting
            logger.warning("tracing is off in this %s process: %s: %s", component, type(err).__name__, err)
        _is_configured = True


def _install_provider(config: TelemetryConfig, component: str) -> None:
    """The OTLP/HTTP exporting tracer provider of this process (`setup_tracing`)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    endpoint = traces_endpoint(config)
    if otlp_http_url_problem(endpoint) is not None:  # as the config checks its own; this may be the environment's
        # The exporter takes it and fails every export, logging an error twice a second in each process.
        raise ValueError(f"traces endpoint {endpoint!r} is not an http:// or https:// URL with a host and a "
                         "port from 0 to 65535 (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else telemetry.otlp_endpoint)")
    attributes = {"warmpath.component": component}
    if config.service_name is not None:
        attributes["service.name"] = config.service_name
    # Unset, the SDK reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, else says "unknown_service".
    resource = Resource.create(attributes)
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": DEFAULT_SERVICE_NAME}))
    # A bound on each attribute's text unless the operator set OTel's own: a span carrying a value of megabytes
    # (a client's text) held that much in the export queue, and made a batch the collector refuses whole.
    limits = SpanLimits(max_attribute_length=None if os.environ.get("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT")
                        or os.environ.get("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT") else MAX_ATTRIBUTE_CHARS)
    provider = TracerProvider(resource=resource, span_limits=limits)
    # Half a second unless the operator set OTel's own variable (the SDK's default is 5 s).
    delay_ms = None if os.environ.get("OTEL_BSP_SCHEDULE_DELAY") else DEFAULT_SCHEDULE_DELAY_MS
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint), schedule_delay_millis=delay_ms))
    trace.set_tracer_provider(provider)


def traces_endpoint(config: TelemetryConfig) -> str:
    """Where spans are sent: `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` as written (OTLP's signal-specific
    variable, a whole URL), else the configured endpoint with `/v1/traces` (OTLP/HTTP's path).

    The variable is not taken where the process's OTLP protocol variable names another protocol than the one
    this exporter speaks (`speaks_otlp_protocol`, as the config reads the shell's): a worker that inherited a
    shell set up for a collector's gRPC port sent every span there over OTLP/HTTP, and lost them all.
    """
    explicit = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if explicit and speaks_otlp_protocol(os.environ):
        return explicit
    if explicit:
        logger.warning("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is left out: its protocol variable names another "
                       "protocol than OTLP/HTTP protobuf, which warmpath's exporter speaks")
    endpoint = (config.otlp_endpoint or "").rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def inject(carrier: Optional[MutableMapping[str, str]] = None) -> dict[str, str]:
    """The current trace context as W3C headers."""
    carrier = dict(carrier or {})
    propagate.inject(carrier)
    return carrier


@contextmanager
def current_context(ctx: context.Context) -> Iterator[None]:
    """`ctx` as the current context for the block: a span set in the caller's extracted context keeps its
    baggage for what the block sends on (`trace.use_span` would set it in the current one instead)."""
    token = context.attach(ctx)
    try:
        yield
    finally:
        context.detach(token)


def extract(carrier: Union[Mapping[str, str], Iterable[tuple[str, str]], None]) -> context.Context:
    """The trace context a caller sent: headers as a mapping or as (name, value) pairs, names in any case.

    A header sent on several lines (W3C allows it for `tracestate` and `baggage`) is joined with commas,
    as HTTP combines repeated fields; a mapping of a request's headers keeps one line only.
    """
    pairs = carrier.items() if isinstance(carrier, Mapping) else (carrier or ())
    joined: dict[str, str] = {}
    for name, value in pairs:
        name = name.lower()
        joined[name] = f"{joined[name]},{value}" if name in joined else value
    return propagate.extract(joined)


# GenAI's operation names for Ray Serve LLM's call methods (`completions` is `text_completion` there).
_GEN_AI_OPERATIONS = {"completions": "text_completion"}


def gen_ai_operation(call_method: str) -> str:
    """`gen_ai.operation.name` of a model call made through Ray Serve LLM's `call_method` (chat, completions)."""
    return _GEN_AI_OPERATIONS.get(call_method, call_method)


def annotate_usage(span: Optional[trace.Span], usage: Optional[Mapping]) -> None:
    """Token counts on a model call's span, from the response's OpenAI `usage` as JSON (a stream's last usage)."""
    if span is None or not usage or not span.is_recording():
        return
    span.set_attribute("gen_ai.usage.input_tokens", usage.get("prompt_tokens") or 0)
    span.set_attribute("gen_ai.usage.output_tokens", usage.get("completion_tokens") or 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is not None:
        span.set_attribute("warmpath.cached_tokens", cached)


def record_failure_status(span: trace.Span, error_type: str, status: int, message: str) -> None:
    """A failure with an HTTP-style status on its span, by OTel's conventions.

    `error.type` names it; only a failure of this service (5xx) makes the span ERROR, since a 4xx
    is the caller's mistake and marking it would hide outages among typos. A status under 400
    (a turn that ran out of steps is a 200 outcome) records nothing.
    """
    if status < 400 or not span.is_recording():
        return
    span.set_attribute("error.type", error_type)
    if status >= 500:
        span.set_status(trace.Status(trace.StatusCode.ERROR, message[:200]))


def record_exception_failure(span: trace.Span, err: BaseException) -> None:
    """A failure no status describes (an exception, a cancelled request): recorded, typed, and ERROR."""
    if not span.is_recording():
        return
    span.record_exception(err)
    span.set_attribute("error.type", type(err).__qualname__)
    span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(err).__name__}: {err}"[:200]))


def force_flush(timeout_ms: int = 5000) -> None:
    provider = trace.get_tracer_provider()
    flush = getattr(provider, "force_flush", None)
    if flush is not None:
        flush(timeout_ms)


def flush_spans(timeout_s: float = SHUTDOWN_FLUSH_TIMEOUT_S) -> bool:
    """Exports the spans still queued in this process, waiting at most `timeout_s`; for a deployment's `__del__`.

    Why a thread: the SDK's `force_flush(timeout)` waits for an export already
    under way, and the OTLP exporter retries an unreachable collector far past
    that timeout (31 s for `force_flush(2000)` against a refused port). The
    flush runs in a daemon thread that is abandoned, not joined, when the wait
    ends, so stopping a replica never waits on the collector longer than `timeout_s`.

    Returns:
        Whether every queued span was exported in time (True without a provider that buffers).
    """
    flush = getattr(trace.get_tracer_provider(), "force_flush", None)
    if flush is None:
        return True
    outcome: list[bool] = []

    def run() -> None:
        try:
            outcome.append(bool(flush(int(timeout_s * 1000))))
        except Exception:  # noqa: BLE001 - a failed export must not fail the replica's stop
            logger.warning("flushing spans at shutdown failed", exc_info=True)

    worker = threading.Thread(target=run, name="otel-shutdown-flush", daemon=True)
    worker.start()
    worker.join(timeout_s)
    return outcome == [True]


async def flush_spans_async(timeout_s: float = SHUTDOWN_FLUSH_TIMEOUT_S) -> bool:
    """`flush_spans` for an `async def __del__`: the event loop keeps running while spans are exported."""
    return await asyncio.to_thread(flush_spans, timeout_s)
