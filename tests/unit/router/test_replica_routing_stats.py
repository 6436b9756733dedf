"""What a replica tells the router in its routing stats: its KV cache usage and size, and how it renders chat
prompts (`serve_apps.vllm_replica`)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from vllm.v1.metrics.loggers import AggregateStatLoggerBase, StatLoggerManager
from vllm.v1.metrics.stats import SchedulerStats

from router.prompt_tokens import EngineRendering
from serve_apps.vllm_replica import (
    KvCacheUsageRecorder,
    WarmpathLLMServer,
    _attach_kv_cache_usage,
    engine_block_size,
    engine_kv_capacity_blocks,
    engine_rendering,
)

TEMPLATE = "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"


def engine_with_stat_loggers(stat_loggers: list | None) -> SimpleNamespace:
    """Ray Serve LLM's engine as far as the replica reads it: vLLM's client and its stat logger manager."""
    manager = None if stat_loggers is None else SimpleNamespace(stat_loggers=stat_loggers)
    return SimpleNamespace(_engine_client=SimpleNamespace(logger_manager=manager))


def test_the_recorder_answers_every_call_vllm_makes_on_its_stat_loggers():
    recorder = KvCacheUsageRecorder()
    manager = SimpleNamespace(stat_loggers=[recorder])
    # vLLM's own manager methods, run over the recorder.
    StatLoggerManager.record(manager, scheduler_stats=SchedulerStats(kv_cache_usage=0.25), iteration_stats=None,
                             engine_idx=0)
    StatLoggerManager.record(manager, scheduler_stats=SchedulerStats(kv_cache_usage=0.75), iteration_stats=None,
                             engine_idx=1)
    StatLoggerManager.record(manager, scheduler_stats=None, iteration_stats=None)
    StatLoggerManager.record_sleep_state(manager, 1, 1)
    if hasattr(StatLoggerManager, "record_admission_rejection"):  # vLLM 0.32; 0.29 (the `gpu` extra) has none
        StatLoggerManager.record_admission_rejection(manager, "full")
    StatLoggerManager.log(manager)
    StatLoggerManager.log_engine_initialized(manager)
    assert recorder.usage() == 0.75  # the fullest engine
    public = {name for name in dir(AggregateStatLoggerBase) if not name.startswith("_")}
    assert all(callable(getattr(recorder, name, None)) for name in public)


class _Replica(WarmpathLLMServer):
    """The replica without Serve's asynchronous shutdown hook, which a test never runs."""

    def __del__(self) -> None:
        pass


def test_the_engines_kv_cache_usage_reaches_the_routing_stats():
    stat_loggers: list = []
    server = object.__new__(_Replica)
    server.engine = None  # Ray Serve LLM's own stats: none before the engine runs
    server._advertised = {"kv_events_endpoint": "tcp://x:1", "kv_capacity_blocks": 900}
    server._rendering_stats = EngineRendering({}, renders_like_router=True).routing_stats()
    server._kv_cache_usage = _attach_kv_cache_usage(engine_with_stat_loggers(stat_loggers))
    assert stat_loggers == [server._kv_cache_usage]
    stats = asyncio.run(server.record_routing_stats())
    assert "kv_cache_usage" not in stats  # no engine step yet
    server._kv_cache_usage.record(SchedulerStats(kv_cache_usage=0.4), None)
    stats = asyncio.run(server.record_routing_stats())
    assert stats["kv_cache_usage"] == 0.4 and stats["kv_events_endpoint"] == "tcp://x:1"
    assert stats["kv_capacity_blocks"] == 900
    assert EngineRendering.from_routing_stats(stats).renders_like_router


@pytest.mark.parametrize("unfinished, expected", [(1, 0.9), (0, 0.0), (None, 0.9)])
def test_an_engine_left_without_requests_reports_no_usage(unfinished, expected):
    """The usage is the last engine step's: after its last request was aborted (a client leaving) no step ran to
    report the blocks freed, and the idle replica scored as full until its next request. An engine that cannot
    say (None) keeps the recorded usage."""
    server = object.__new__(_Replica)
    server._advertised, server._rendering_stats = {}, {}
    server._kv_cache_usage = KvCacheUsageRecorder()
    server._kv_cache_usage.record(SchedulerStats(kv_cache_usage=0.9), None)
    server.engine = engine_with_stat_loggers([])
    server.engine.routing_stats = lambda: {}  # Ray Serve LLM's own stats
    if unfinished is not None:
        server.engine._engine_client.get_num_unfinished_requests = lambda: unfinished
    assert asyncio.run(server.record_routing_stats())["kv_cache_usage"] == expected


def test_an_engine_that_keeps_no_stats_reports_no_usage():
    assert _attach_kv_cache_usage(engine_with_stat_loggers(None)) is None
    assert _attach_kv_cache_usage(SimpleNamespace()) is None


def test_the_engines_kv_cache_size_is_what_its_cores_reported_at_start_up():
    def engine(num_gpu_blocks):
        cache_config = SimpleNamespace(num_gpu_blocks=num_gpu_blocks)
        return SimpleNamespace(_engine_client=SimpleNamespace(vllm_config=SimpleNamespace(cache_config=cache_config)))

    assert engine_kv_capacity_blocks(engine(4096)) == 4096
    assert engine_kv_capacity_blocks(engine(None)) is None  # the handshake has not filled it in
    assert engine_kv_capacity_blocks(engine(0)) is None
    assert engine_kv_capacity_blocks(SimpleNamespace()) is None


def test_a_replica_advertises_the_block_size_its_engine_uses(monkeypatch):
    """vLLM may set another block size than the configured one (CPU MLA: 16): the router must hash in the engine's."""
    from ray.llm._internal.serve.core.server.llm_server import LLMServer

    async def started(self):
        return None

    monkeypatch.setattr(LLMServer, "_start_engine", started)
    cache_config = SimpleNamespace(block_size=32, num_gpu_blocks=512)
    server = object.__new__(_Replica)
    server.engine = SimpleNamespace(_engine_client=SimpleNamespace(vllm_config=SimpleNamespace(cache_config=cache_config)))
    server._advertised = {"kv_events_endpoint": "tcp://x:1", "block_size": 64}
    asyncio.run(server._start_engine())
    assert (server._advertised["block_size"], server._advertised["kv_capacity_blocks"]) == (32, 512)
    assert engine_block_size(SimpleNamespace()) is None


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.train_from_iterator(["hello world " * 20], trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=TEMPLATE).save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


class HfRenderer:
    """Stands in for vLLM's Hugging Face renderer (the replica tells renderers apart by class name)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer


class KimiK3Renderer(HfRenderer):
    pass


def engine_rendering_with(tokenizer, renderer_class=HfRenderer, **online_fields) -> SimpleNamespace:
    """Ray Serve LLM's engine with vLLM's `OnlineRenderer` in its app state, as a replica's frontend sets it up."""
    model_config = SimpleNamespace(
        model=tokenizer.name_or_path, tokenizer=tokenizer.name_or_path, enable_prompt_embeds=False, revision=None,
        code_revision=None, trust_remote_code=False, tokenizer_revision=None,
        hf_config=SimpleNamespace(model_type="llama"),
    )
    online = SimpleNamespace(
        renderer=renderer_class(tokenizer), model_config=model_config, use_harmony=False, chat_template=None,
        chat_template_content_format="auto", default_chat_template_kwargs={"enable_thinking": False},
        exclude_tools_when_tool_choice_none=True,
    )
    for name, value in online_fields.items():
        setattr(online, name, value)
    return SimpleNamespace(_app_state=SimpleNamespace(online_renderer=online))


def test_a_frontend_that_renders_as_the_router_says_so_with_its_template_defaults(tokenizer):
    rendering = engine_rendering(engine_rendering_with(tokenizer))
    assert rendering == EngineRendering({"enable_thinking": False}, exclude_tools_when_tool_choice_none=True,
                                        renders_like_router=True)


@pytest.mark.parametrize(
    ("renderer_class", "fields"),
    [
        (KimiK3Renderer, {}),  # reads tool_choice and response_format, which the router does not
        (HfRenderer, {"chat_template": "{{ messages }}"}),
        (HfRenderer, {"use_harmony": True}),
        (HfRenderer, {"chat_template_content_format": "openai"}),  # string content turned into parts
    ],
    ids=["other-renderer", "server-template", "harmony", "content-parts"],
)
def test_a_frontend_that_renders_otherwise_says_the_router_does_not_match(tokenizer, renderer_class, fields):
    rendering = engine_rendering(engine_rendering_with(tokenizer, renderer_class, **fields))
    assert rendering is not None and not rendering.renders_like_router
    assert rendering.default_chat_template_kwargs == {"enable_thinking": False}


def test_a_frontend_whose_renderer_cannot_be_read_advertises_nothing():
    assert engine_rendering(SimpleNamespace()) is None
    assert engine_rendering(SimpleNamespace(_app_state=SimpleNamespace(online_renderer=SimpleNamespace()))) is None
