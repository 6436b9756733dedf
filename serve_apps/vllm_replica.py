"""The vLLM replica: Ray Serve LLM's `LLMServer` plus what the router needs.

Why a subclass rather than plain `LLMServer`:
- Each replica binds its own vLLM KV-cache event publisher (ZMQ PUB + replay
  ROUTER socket) on free ports and advertises them through
  `record_routing_stats`, so every router process can subscribe to every
  replica. Ray's own per-replica port assignment is tied to its Dynamo-based
  KV router, which this project does not use.
- Every response stream starts with a `ServedBy` record naming the replica, so
  the ingress can put `x-warmpath-replica` on the HTTP response without the
  caller having to trust the body.
- It counts which chat prompts arrived with the router's token ids
  (`router.prompt_tokens`, forwarding) and which the engine rendered itself,
  and advertises how its frontend renders chat prompts
  (`router.prompt_tokens.EngineRendering`: the server's template defaults,
  and whether the router's rendering matches it), so the router renders with
  the same arguments and forwards its ids only where they match.
- It reports the engine's KV cache usage (a fraction) in its routing stats,
  which the router's "load" scorer weighs; vLLM hands it to its stat
  loggers after every engine step, and Ray Serve LLM reports none. Beside it
  goes the cache's size in blocks, which the engine decides at start-up
  (from free GPU memory, or `kv_cache_space_gib` on CPU): `warmpath status`
  shows it and `warmpath bench` bounds each run with it.
- A stream's first chunk leaves as soon as it exists instead of at the end of
  Ray's first batching interval (`serve_apps.stream_batches`).

Everything else (engine start, OpenAI serving layer, placement groups, health
checks) is Ray Serve LLM's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Awaitable, Dict, Optional, TypeVar

from opentelemetry import trace

from cluster import telemetry
from cluster.config import TelemetryConfig
from ray import serve
from router.prompt_tokens import FORWARDED_IDS_KEY, EngineRendering
from serve_apps.api_errors import engine_error
from serve_apps.kv_event_ports import kv_event_endpoints
from serve_apps.metrics import WarmpathMetrics
from serve_apps.sse_frames import frame_errors
from serve_apps.stream_batches import eager_first_batches
from ray.llm._internal.serve.core.server.llm_server import LLMServer
from ray.serve.llm import LLMConfig


T = TypeVar("T")

logger = logging.getLogger("ray.serve")

# A tool list for checking which template and content format vLLM picks for requests with tools.
_PROBE_TOOLS = [{"type": "function", "function": {"name": "probe", "description": "", "parameters": {}}}]


@dataclass(frozen=True)
class ServedBy:
    """First item of every replica response stream; never sent to clients."""

    replica_id: str


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


async def _ending_span_on_failure(call: Awaitable[T], span: trace.Span) -> T:
    """What `call` returns; if it raises, `span` records the error and ends before the error goes on.

    Why: the engine span ends in `_tagged`'s `finally`, which only runs for a
    stream that exists; a request the engine refuses before streaming (a bad
    LoRA name, a validation error) would leave it open and never exported.
    """
    try:
        return await call
    except BaseException as err:
        telemetry.record_exception_failure(span, err)
        span.end()
        raise


# What vLLM answers (a 400) to a call that is not streamed when its caller leaves: it catches the cancellation.
CLIENT_DISCONNECTED = "Client disconnected"


def engine_failures(item: Any) -> list[tuple[Optional[int], str]]:
    """(status, message) of each error in one item of an engine stream: an `ErrorResponse`, or error chunks.

    A streamed call's items are lists of server-sent-event text; a call that is not
    streamed yields its response, or Ray Serve LLM's `ErrorResponse`, as one item.
    """
    failures = []
    for output in item if isinstance(item, list) else [item]:
        error = getattr(output, "error", None)
        if error is not None and hasattr(error, "model_dump"):
            failures.append(engine_error(error.model_dump()))
        elif isinstance(output, str):
            failures.extend(map(engine_error, frame_errors(output)))
    return failures


def _attach_tokenization(engine: Any) -> None:
    """Gives Ray Serve LLM's engine vLLM's tokenization service, so `/tokenize` and `/detokenize` work.

    Ray Serve LLM reads it from vLLM's app state as `openai_serving_tokenization`;
    this vLLM names it `serving_tokenization`, so Ray found none and answered
    every call with "This model does not support the 'tokenization' task".
    """
    if engine is None or getattr(engine, "_oai_serving_tokenization", True) is not None:
        return
    engine._oai_serving_tokenization = getattr(getattr(engine, "_app_state", None), "serving_tokenization", None)


class KvCacheUsageRecorder:
    """One of vLLM's stat loggers that keeps only the latest KV cache usage of each engine it serves.

    Why: vLLM hands every stat logger its scheduler's stats after each engine
    step, the one place the usage is; neither Ray Serve LLM nor vLLM report it
    to a request router. Duck-typed as vLLM's aggregate stat loggers (the
    methods `StatLoggerManager` calls), so importing this module needs no vLLM.
    """

    def __init__(self) -> None:
        self._usage_by_engine: dict[int, float] = {}

    def record(
        self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
    ) -> None:
        usage = getattr(scheduler_stats, "kv_cache_usage", None)
        if isinstance(usage, (int, float)):
            self._usage_by_engine[engine_idx or 0] = float(usage)

    def usage(self) -> Optional[float]:
        """The fullest engine's KV cache usage (0 to 1); None before the first engine step."""
        return max(self._usage_by_engine.values()) if self._usage_by_engine else None

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_admission_rejection(self, reason: str) -> None:
        pass


def _attach_kv_cache_usage(engine: Any) -> Optional[KvCacheUsageRecorder]:
    """Adds a `KvCacheUsageRecorder` to the stat loggers of Ray Serve LLM's vLLM engine; None when the engine
    keeps none (`disable_log_stats`)."""
    manager = getattr(getattr(engine, "_engine_client", None), "logger_manager", None)
    stat_loggers = getattr(manager, "stat_loggers", None)
    if not isinstance(stat_loggers, list):
        logger.info("the engine keeps no stats (disable_log_stats?): KV cache usage is not reported to the router")
        return None
    recorder = KvCacheUsageRecorder()
    stat_loggers.append(recorder)
    return recorder


def engine_is_dead(engine: Any) -> bool:
    """Whether the core of Ray Serve LLM's vLLM engine is gone (vLLM's `errored`: every request from now on fails
    with `EngineDeadError`); False where the engine cannot say."""
    try:
        return getattr(getattr(engine, "_engine_client", None), "errored", False) is True
    except Exception:
        return False


def _exit_replica() -> None:
    os._exit(1)  # the process, engine and all, at once (a module function: tests stand one in)


def _has_no_requests(engine: Any) -> bool:
    """Whether Ray Serve LLM's vLLM engine holds no unfinished request (False where it cannot say)."""
    count = getattr(getattr(engine, "_engine_client", None), "get_num_unfinished_requests", None)
    try:
        return callable(count) and count() == 0
    except Exception:  # an engine shutting down: say nothing new
        return False


def _engine_cache_config(engine: Any) -> Any:
    """The frontend's `CacheConfig` of Ray Serve LLM's vLLM engine, or None where it is not."""
    return getattr(getattr(getattr(engine, "_engine_client", None), "vllm_config", None), "cache_config", None)


def engine_block_size(engine: Any) -> Optional[int]:
    """The tokens per KV block the engine uses, which vLLM may have set over the configured one; None if unknown.

    The router hashes prompts in blocks of the size a replica advertises: with another size than
    the engine's, every KV event of the replica would be skipped, and the router blind to it.
    """
    block_size = getattr(_engine_cache_config(engine), "block_size", None)
    return block_size if isinstance(block_size, int) and block_size > 0 else None


def engine_kv_capacity_blocks(engine: Any) -> Optional[int]:
    """The KV blocks of Ray Serve LLM's vLLM engine, as its cores reported them at start-up; None if unknown.

    vLLM's frontend keeps the sum over its engine cores (data parallel) in
    `cache_config.num_gpu_blocks`, filled in by the start-up handshake.
    """
    num_blocks = getattr(_engine_cache_config(engine), "num_gpu_blocks", None)
    if isinstance(num_blocks, int) and num_blocks > 0:
        return num_blocks
    logger.info("the engine's KV cache size is not where expected: it is not reported to the router")
    return None


def engine_rendering(engine: Any) -> Optional[EngineRendering]:
    """How this replica's vLLM frontend renders chat prompts; None when its renderer cannot be read."""
    online = getattr(getattr(engine, "_app_state", None), "online_renderer", None)
    if online is None:
        logger.warning("the engine's chat renderer is not where expected: the router will not forward token ids")
        return None
    try:
        difference = _rendering_difference(online)
        rendering = EngineRendering(
            dict(online.default_chat_template_kwargs or {}), bool(online.exclude_tools_when_tool_choice_none),
            difference is None,
        )
    except Exception:
        logger.warning("reading the engine's chat renderer failed: the router will not forward token ids",
                       exc_info=True)
        return None
    if difference is not None:
        logger.info("the router renders chat prompts differently (%s): the engine renders them itself", difference)
    return rendering


def _rendering_difference(online: Any) -> Optional[str]:
    """Why the router's rendering (the model's tokenizer and its own template, string content, Hugging Face's
    renderer) differs from this frontend's, or None where it does not."""
    model_config = online.model_config
    if type(online.renderer).__name__ != "HfRenderer":
        return f"vLLM renders with {type(online.renderer).__name__}"
    if online.use_harmony:
        return "harmony prompts"
    if online.chat_template is not None:
        return "a server-side chat template"
    if getattr(model_config, "enable_prompt_embeds", False):
        return "prompt embeddings enabled"
    if model_config.tokenizer != model_config.model:
        return "a tokenizer other than the model's"
    return _template_difference(online)


def _template_difference(online: Any) -> Optional[str]:
    """Whether vLLM picks the tokenizer's own template, and passes string content as strings, with tools and
    without (vLLM may take a processor's template instead, and turn content into parts)."""
    from vllm.renderers.hf import resolve_chat_template, resolve_chat_template_content_format

    tokenizer, model_config = online.renderer.tokenizer, online.model_config
    for tools in (None, _PROBE_TOOLS):
        template = resolve_chat_template(tokenizer, None, tools, model_config=model_config)
        if template != tokenizer.get_chat_template(None, tools=tools):
            return "a chat template other than the tokenizer's"
        content_format = resolve_chat_template_content_format(
            None, tools, online.chat_template_content_format, tokenizer, model_config=model_config
        )
        if content_format != "string":
            return f"message content passed as {content_format!r}"
    return None


class WarmpathLLMServer(LLMServer):
    """LLMServer that publishes KV events on its own ports and tags its responses."""

    _is_stopping = False  # set as Serve stops the replica: an engine stopping then is no engine that died

    def _exit_if_engine_died(self) -> None:
        """Ends this replica's process where its engine died, so Serve routes around it and replaces it at once.

        Why: a replica whose engine core died (killed, out of memory) stays alive and answers every call at once
        with a failure, so it looked idle, and the router sent it more; the orchestrator's retry of a failed
        model call went back to it; and Serve noticed only after three failed health checks, 20-30 s of failed
        turns. A replica that is gone is one Serve's routers drop at the first call that finds it gone (503
        `unavailable` to a caller, a retry that lands on another replica), and one the controller replaces.
        """
        if not self._is_stopping and engine_is_dead(getattr(self, "engine", None)):
            logger.error("replica %s: its vLLM engine died; the replica exits so that Serve replaces it",
                         self._replica_id)
            _exit_replica()

    async def check_health(self) -> None:
        try:
            await super().check_health()
        except Exception:
            self._exit_if_engine_died()
            raise

    async def __init__(self, llm_config: LLMConfig, **kwargs: Any):
        self._replica_id = serve.get_replica_context().replica_id.unique_id
        bound, advertised = kv_event_endpoints(self._replica_id, node_ip=_node_ip())
        llm_config.update_engine_kwargs(
            kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq", **bound, "topic": ""}
        )
        self._advertised = {
            "replica_id": self._replica_id,
            **advertised,
            "block_size": llm_config.engine_kwargs.get("block_size"),
        }
        self._rendering_stats: Dict[str, Any] = {}
        self._kv_cache_usage: Optional[KvCacheUsageRecorder] = None
        # The builders set it in the replicas' environment from the config, empty where tracing is off.
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        if endpoint:
            # service.name as the other processes have it: OTEL_SERVICE_NAME (the config's, which the builders
            # put in the replicas' environment), else OTEL_RESOURCE_ATTRIBUTES, else warmpath (`setup_tracing`).
            try:
                config = TelemetryConfig(otlp_endpoint=endpoint)
            except ValueError as err:  # tracing fails open, as `setup_tracing` does
                logger.warning("tracing is off in this replica: OTEL_EXPORTER_OTLP_ENDPOINT %r: %s", endpoint, err)
            else:
                telemetry.setup_tracing(config, "replica")
        await super().__init__(llm_config, **kwargs)

    async def _start_engine(self):
        await super()._start_engine()
        _attach_tokenization(self.engine)
        rendering = engine_rendering(self.engine)
        self._rendering_stats = rendering.routing_stats() if rendering is not None else {}
        self._kv_cache_usage = _attach_kv_cache_usage(self.engine)
        self._advertised["kv_capacity_blocks"] = engine_kv_capacity_blocks(self.engine)
        block_size = engine_block_size(self.engine)
        if block_size is not None and block_size != self._advertised["block_size"]:
            logger.warning("vLLM set the KV block size to %d (configured: %s); the router hashes in %d-token blocks",
                           block_size, self._advertised["block_size"], block_size)
            self._advertised["block_size"] = block_size

    async def _tagged(self, stream: AsyncGenerator, span, is_streaming: bool) -> AsyncGenerator:
        """Tags the stream with this replica and times it: a streamed call's first item is its first token.

        A call that is not streamed yields its whole response as one item, which says nothing
        about its first token: it is not timed.
        """
        start = time.monotonic()
        is_first = is_streaming
        try:
            yield ServedBy(self._replica_id)
            async for item in stream:
                failures = engine_failures(item)  # answered in the stream, as Ray Serve LLM reports them
                for status, message in failures if span.is_recording() else ():
                    if message == CLIENT_DISCONNECTED:  # a caller that left, not a request it got wrong
                        span.set_attribute(telemetry.INCOMPLETE_STREAM_ATTRIBUTE, True)
                    else:
                        telemetry.record_failure_status(span, str(status or 500), status or 500, message)
                if failures:
                    self._exit_if_engine_died()
                if is_first and not failures:
                    ttft_s = time.monotonic() - start
                    WarmpathMetrics.get().ttft.observe(ttft_s, tags={"replica": self._replica_id})
                    if span.is_recording():
                        span.set_attribute("gen_ai.server.time_to_first_token", ttft_s)
                is_first = False
                yield item
        except Exception as err:  # the engine failed mid-stream (a caller leaving is no failure)
            telemetry.record_exception_failure(span, err)
            self._exit_if_engine_died()
            raise
        except (GeneratorExit, asyncio.CancelledError):  # the caller left: vLLM aborts the engine's request
            if span.is_recording():
                span.set_attribute(telemetry.INCOMPLETE_STREAM_ATTRIBUTE, True)
            raise
        finally:
            try:
                close = getattr(stream, "aclose", None)
                if close is not None:  # now, not when the collector finds it: the engine hears of the abort first
                    await close()
            finally:
                span.end()  # also where closing failed (an engine core that died refuses the abort)

    def _span(self, operation: str, request, raw_request_info):
        headers = raw_request_info.headers if raw_request_info is not None else None
        span = telemetry.tracer().start_span(
            f"vllm.{operation}", context=telemetry.extract(headers), kind=trace.SpanKind.SERVER,
            attributes={"gen_ai.operation.name": telemetry.gen_ai_operation(operation),
                        "gen_ai.request.model": str(request.model),
                        "warmpath.replica": self._replica_id},
        )
        if span.is_recording() and getattr(request, "max_tokens", None):
            span.set_attribute("gen_ai.request.max_tokens", request.max_tokens)
        return span

    async def chat(self, request, raw_request_info=None):
        span = self._span("chat", request, raw_request_info)
        params = getattr(request, "kv_transfer_params", None)
        is_forwarded = isinstance(params, dict) and params.get(FORWARDED_IDS_KEY) is not None
        WarmpathMetrics.get().prompts_rendered.inc(
            tags={"replica": self._replica_id, "renderer": "router" if is_forwarded else "engine"}
        )
        if span.is_recording():
            span.set_attribute("warmpath.prompt_ids_forwarded", is_forwarded)
        return self._tagged(
            await self._refused_or_died(super().chat(request, raw_request_info), span), span, bool(request.stream)
        )

    def _batch_output_stream(self, generator: AsyncGenerator) -> AsyncGenerator[list, None]:
        return eager_first_batches(generator, self._get_batch_interval_ms() / 1000)

    async def completions(self, request, raw_request_info=None):
        span = self._span("completions", request, raw_request_info)
        return self._tagged(
            await self._refused_or_died(super().completions(request, raw_request_info), span), span,
            bool(request.stream),
        )

    async def _refused_or_died(self, call: Awaitable[T], span: trace.Span) -> T:
        """`_ending_span_on_failure`, this replica exiting where the failure is its engine's death."""
        try:
            return await _ending_span_on_failure(call, span)
        except Exception:
            self._exit_if_engine_died()
            raise

    async def __del__(self) -> None:
        """Ray Serve's shutdown hook: the engine stops (Ray's), then the queued spans go out before Ray kills the actor."""
        self._is_stopping = True
        try:
            await super().__del__()
        finally:
            await telemetry.flush_spans_async()

    async def record_routing_stats(self) -> Dict[str, Any]:
        stats = dict(await super().record_routing_stats())
        stats.update(self._advertised)
        stats.update(self._rendering_stats)
        usage = self._kv_cache_usage.usage() if self._kv_cache_usage is not None else None
        if usage is not None:
            # The usage is the last engine step's: a request aborted (its client left) frees its blocks with no
            # step after it to say so, and the idle replica went on reporting them until its next request.
            stats["kv_cache_usage"] = 0.0 if _has_no_requests(self.engine) else usage
        return stats

    async def replica_info(self) -> Dict[str, Any]:
        """Identity, event endpoints and KV cache size, for tests."""
        return dict(self._advertised)
