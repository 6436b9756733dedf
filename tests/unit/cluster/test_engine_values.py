"""engine_value_problems, and its refusals checked against vLLM itself.

The oracle is the replicas' own path, without a model or a device: Ray Serve LLM's `_get_vllm_engine_config`
(LLMConfig -> VLLMEngineConfig -> config-dict normalization -> `AsyncEngineArgs(**kwargs)
.create_engine_config()`) plus `FrontendArgs(**frontend_kwargs)`, on a config-only Llama folder; the sweep
uses `AsyncEngineArgs(**kwargs).create_engine_config()` directly (Ray passes scalars through unchanged), which
is ~100x faster. A vLLM upgrade that changes what it validates fails the sweep or the lists' checks here.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re

import pytest

from cluster import engine_values
from cluster.config import load_config
from cluster.engine_values import engine_value_problems
from cluster.replica_args import replica_args_problems

# warmpath's own keys (ReplicaConfig refuses them in engine_kwargs) and the oracle's fixed ones.
OWNED = {"model", "tensor_parallel_size", "block_size", "enable_prefix_caching", "kv_events_config",
         "served_model_name", "distributed_executor_backend", "max_model_len", "data_parallel_size",
         "decode_context_parallel_size", "prefill_context_parallel_size", "disable_log_stats",
         "enable_prompt_tokens_details", "enable_auto_tool_choice", "tool_call_parser", "api_key",
         "skip_tokenizer_init"}
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 8192, "hidden_size": 384,
              "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2,
              "intermediate_size": 1024, "max_position_embeddings": 8192, "rope_theta": 10000.0,
              "torch_dtype": "float32", "rms_norm_eps": 1e-6, "hidden_act": "silu"}


def one(kwargs: dict) -> list[str]:
    return engine_value_problems(kwargs)


# --- the brief's cases (no oracle) ------------------------------------------------------------------------

def test_kv_cache_dtype_fp9_refused_with_the_choices():
    [problem] = one({"kv_cache_dtype": "fp9"})
    assert problem.startswith("replicas.engine_kwargs.kv_cache_dtype='fp9' is none of vLLM's choices: 'auto'")
    assert "'fp8'" in problem and "'fp8_e4m3'" in problem


def test_kv_cache_dtype_fp8_accepted():
    assert one({"kv_cache_dtype": "fp8"}) == []


def test_enforce_eager_true_accepted():
    assert one({"enforce_eager": True}) == []


@pytest.mark.parametrize("text", ["yes", "true", "on", "1", "no", "false", "off", "0"])
def test_a_boolean_word_is_accepted_where_a_config_class_reads_it(text):
    assert one({"enforce_eager": text}) == []  # ModelConfig (pydantic, lax) reads them as vLLM means them


def test_text_not_a_boolean_refused():
    assert one({"enforce_eager": "maybe"}) == [
        "replicas.engine_kwargs.enforce_eager='maybe' is not a boolean to vLLM: write true or false, unquoted"]


def test_false_text_refused_where_vllm_tests_python_truth():
    assert one({"enable_lora": "false"}) == [  # `if self.enable_lora`: LoRA would be on
        "replicas.engine_kwargs.enable_lora='false' is text, which vLLM tests as Python truth here (true): "
        "write false, unquoted"]
    assert one({"enable_lora": "yes"}) == [] and one({"enable_lora": False}) == []


@pytest.mark.parametrize("value, hint", [
    (8.5, "vLLM wants a whole number or null here"),
    ("many", "vLLM wants a whole number or null here"),
    ("1e6", "vLLM wants a whole number or null here (YAML 1.1 reads 1e6 as text: write 1000000 or 1.0e+6)"),
    ("4k", "vLLM wants a whole number or null here (vLLM's command line reads 4k, its engine arguments do not: "
           "write 4000)"),
    (0, "vLLM refuses it (input should be greater than or equal to 1)"),
])
def test_int_field_given_a_float_or_text(value, hint):
    assert one({"max_num_batched_tokens": value}) == [f"replicas.engine_kwargs.max_num_batched_tokens={value!r}: {hint}"]


@pytest.mark.parametrize("value", [8, 8.0, "8", None])
def test_int_field_values_vllm_reads_as_written(value):
    assert one({"max_num_batched_tokens": value}) == []  # SchedulerConfig's lax int takes 8.0 and '8'


def test_boolean_for_a_number_refused():
    assert one({"seed": True}) == ["replicas.engine_kwargs.seed=True is YAML's boolean (yes, on, true...), which "
                                   "vLLM would take for 1: write a number"]


def test_max_model_len_4k_is_refused_by_vllm_through_kwargs():
    # Only the CLI parses '4k' (human_readable_int_or_auto); AsyncEngineArgs(**kwargs) hands it to ModelConfig's
    # int. warmpath owns max_model_len (model.max_model_len_tokens), so this is the oracle's word only.
    assert "(vLLM's command line reads 4k" in one({"max_model_len": "4k"})[0]


def test_bounds_of_the_config_field():
    assert one({"gpu_memory_utilization": 1.5}) == [
        "replicas.engine_kwargs.gpu_memory_utilization=1.5: vLLM refuses it (input should be less than or equal to 1)"]
    assert one({"gpu_memory_utilization": 0.5}) == [] and one({"gpu_memory_utilization": "0.5"}) == []


def test_unknown_and_untyped_fields_ignored():
    assert one({"max_num_seq": "x", "load_format": "whatever", "tokenizer_mode": "zz", "revision": 20240101,
                "attention_backend": "NOPE", "speculative_config": {"x": 1}}) == []


def test_fields_vllm_stores_unchecked_are_left_alone():
    assert one({"moe_backend": "zzz", "max_cudagraph_capture_size": "x"}) == []


def test_lora_fields_checked_only_with_lora_on():
    assert one({"max_lora_rank": 7}) == []  # LoRAConfig is never built: vLLM ignores it
    assert one({"enable_lora": True, "max_lora_rank": 7})[0].startswith(
        "replicas.engine_kwargs.max_lora_rank=7 is none of vLLM's choices: 1, 8, 16")


def test_frontend_fields_by_frontendargs():
    assert one({"chat_template_content_format": "json"}) == [
        "replicas.engine_kwargs.chat_template_content_format='json' is none of vLLM's choices: 'auto', 'string' "
        "or 'openai'"]
    assert one({"uvicorn_log_level": "info", "enable_log_outputs": "true"}) == []


def test_config_dicts_as_ray_serve_llm_validates_them():
    assert one({"structured_outputs_config": {"backend": "xgrammer"}}) == [
        "replicas.engine_kwargs.structured_outputs_config.backend='xgrammer' is none of vLLM's choices: 'auto', "
        "'xgrammar', 'guidance', 'outlines' or 'lm-format-enforcer'"]
    assert one({"structured_outputs_config": {"bakend": "xgrammar"}})[0].startswith(
        "replicas.engine_kwargs.structured_outputs_config.bakend is no field of vLLM's StructuredOutputsConfig")
    assert one({"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True},
                "compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"}}) == []
    assert one({"attention_config": {"backend": "NOPE"}}) == []  # vLLM's validator (value_error): not ours


def test_hf_overrides_scientific_text_refused():
    assert one({"hf_overrides": {"rope_theta": "1e6"}}) == [
        "replicas.engine_kwargs.hf_overrides.rope_theta='1e6' is text: YAML 1.1 reads 1e6 as a string, not a "
        "number, and vLLM passes it on as text; write 1000000 or 1.0e+6"]
    assert one({"hf_overrides": {"rope_parameters": {"rope_type": "yarn", "factor": "2.5e0"}}})[0].startswith(
        "replicas.engine_kwargs.hf_overrides.rope_parameters.factor='2.5e0' is text")
    assert one({"hf_overrides": {"rope_theta": 1000000.0, "architectures": ["LlamaForCausalLM"],
                                 "name": "v1e6", "rev": "20240101"}}) == []


def test_text_numbers_a_typed_field_reads_are_accepted():
    """YAML 1.1 reads histogram buckets written `1e-3` as text; vLLM's ObservabilityConfig reads them as
    numbers: refused as text, a working config was turned away."""
    assert one({"custom_histogram_buckets": {"inter_token_latency": ["1e-3", "5e-3", "1e-1"]}}) == []
    assert one({"enforce_eager": 1.0}) == [] and one({"enforce_eager": 0.0}) == []  # pydantic's lax bool


def test_without_vllm_nothing(monkeypatch):
    monkeypatch.setattr(engine_values, "vllm_arguments", lambda: (_ for _ in ()).throw(ImportError()))
    assert one({"kv_cache_dtype": "fp9"}) == []


# --- against vLLM itself -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    offline = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    logging.disable(logging.WARNING)  # vLLM logs each config it builds: thousands of lines
    yield str(folder)
    logging.disable(logging.NOTSET)
    if offline is None:
        os.environ.pop("HF_HUB_OFFLINE", None)
    else:
        os.environ["HF_HUB_OFFLINE"] = offline


@pytest.fixture(scope="module")
def vllm_reads(tiny_model):
    """`AsyncEngineArgs(**kwargs).create_engine_config()`: 'refused: ...' or the config it built, as text."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    base = {"model": tiny_model, "skip_tokenizer_init": True, "max_model_len": 2048, "block_size": 32,
            "enable_prefix_caching": True, "distributed_executor_backend": "mp"}

    def read(extra: dict) -> str:
        try:
            config = AsyncEngineArgs(**{**base, **extra}).create_engine_config(UsageContext.OPENAI_API_SERVER)
        except Exception as err:  # noqa: BLE001 - whatever vLLM raises is its refusal
            return f"refused: {type(err).__name__}: {err}"
        return re.sub(r"instance_id='\d+'", "", repr(config))

    return read


@pytest.fixture(scope="module")
def replica_reads(tiny_model):
    """The replica's path: Ray Serve LLM's `_get_vllm_engine_config` and `FrontendArgs(**frontend_kwargs)`."""
    from ray.llm._internal.serve.engines.vllm.vllm_engine import _get_vllm_engine_config
    from ray.serve.llm import LLMConfig
    from vllm.entrypoints.launchers.cli_args import FrontendArgs

    def read(extra: dict):
        llm_config = LLMConfig(
            model_loading_config={"model_id": "m", "model_source": tiny_model},
            engine_kwargs={"max_model_len": 2048, "block_size": 32, "enable_prefix_caching": True,
                           "skip_tokenizer_init": True, **extra},
            placement_group_config={"bundles": [{"CPU": 1}]})
        try:
            FrontendArgs(**llm_config.get_engine_config().frontend_kwargs)
            return _get_vllm_engine_config(llm_config)[1]
        except Exception as err:  # noqa: BLE001
            return f"refused: {type(err).__name__}: {err}"

    return read


def _closed_engine_fields():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import FrontendArgs

    frontend = {f.name for f in dataclasses.fields(FrontendArgs)}
    return [f for f in dataclasses.fields(AsyncEngineArgs)
            if f.name not in OWNED | frontend and not f.name.startswith("_")
            and engine_values._is_closed_scalar(f.type)]


def _probes(annotation) -> list:
    leaves = {leaf for kind, leaf in engine_values._leaves(annotation) if kind == "type"}
    probes = [None, "zzz"]
    if int in leaves and bool not in leaves:
        probes += [8.5, "1e6", "4k", True, -5, 0, "8"]
    if float in leaves:
        probes += ["4k", True, 1.5, -1.0, "0.5", "1e6"]
    if bool in leaves:
        probes += ["false", "no", "maybe", 2, "yes", 0]
    return probes


def test_every_refusal_is_vllms(vllm_reads):
    """No value the check refuses is one vLLM takes as written: vLLM refuses it, or (the two deliberate
    cases) reads a boolean for a number, or text for a boolean it tests as Python truth."""
    wrong, missed = [], []
    for field in _closed_engine_fields():
        context = {"enable_lora": True} if field.name in engine_values._LORA_ONLY else {}
        for value in _probes(field.type):
            refused_here = bool(engine_value_problems({**context, field.name: value}))
            verdict = vllm_reads({**context, field.name: value})
            if refused_here and not verdict.startswith("refused"):
                deliberate = (isinstance(value, bool)) or (
                    field.name in engine_values._READ_AS_PYTHON_TRUTH and isinstance(value, (str, int)))
                if not deliberate:
                    wrong.append((field.name, value))
            elif not refused_here and verdict.startswith("refused"):
                missed.append((field.name, value, verdict[:90]))
    assert wrong == [], "\n".join(map(repr, wrong))
    print(f"\n{len(missed)} values vLLM refuses that the check lets through (it is conservative), e.g.:")
    for row in missed[:12]:
        print("  ", row)


def test_boolean_lists_match_vllm(vllm_reads):
    """The booleans vLLM tests as Python truth or never validates are exactly the module's lists: 'maybe' gets
    through vLLM's config step, or 'false' builds another config than false does."""
    unvalidated = set()
    for field in _closed_engine_fields():
        leaves = {leaf for kind, leaf in engine_values._leaves(field.type) if kind == "type"}
        if bool not in leaves or field.name in engine_values._LORA_ONLY:
            continue
        if not vllm_reads({field.name: "maybe"}).startswith("refused") \
                or vllm_reads({field.name: "false"}) != vllm_reads({field.name: False}):
            unvalidated.add(field.name)
    stored = {name for name in engine_values._STORED_UNCHECKED if name in unvalidated}
    assert unvalidated == engine_values._READ_AS_PYTHON_TRUTH | stored


def test_stored_unchecked_list_matches_vllm(vllm_reads):
    """The non-boolean closed arguments whose wrong text vLLM's config step accepts are the module's list."""
    unchecked = set()
    for field in _closed_engine_fields():
        leaves = {leaf for kind, leaf in engine_values._leaves(field.type) if kind == "type"}
        if bool in leaves or field.name in engine_values._LORA_ONLY:
            continue
        if not vllm_reads({field.name: "zzz"}).startswith("refused"):
            unchecked.add(field.name)
    closed_non_bool = {f.name for f in _closed_engine_fields()
                       if bool not in {leaf for kind, leaf in engine_values._leaves(f.type) if kind == "type"}}
    assert unchecked == engine_values._STORED_UNCHECKED & closed_non_bool


@pytest.mark.parametrize("kwargs", [
    {"kv_cache_dtype": "fp9"},
    {"structured_outputs_config": {"backend": "xgrammer"}},
    {"chat_template_content_format": "json"},
    {"compilation_config": {"mode": 7}},
    {"gpu_memory_utilization": 1.5},
    {"max_num_batched_tokens": "4k"},
])
def test_replica_path_refuses_what_the_check_refuses(replica_reads, kwargs):
    assert one(kwargs) and str(replica_reads(kwargs)).startswith("refused")


@pytest.mark.parametrize("kwargs", [
    {"kv_cache_dtype": "fp8"}, {"enforce_eager": "false"}, {"seed": "8"}, {"gpu_memory_utilization": "0.5"},
    {"tokens_only": "false"},  # a frontend argument too: Ray Serve LLM gives it to FrontendArgs
    {"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}},
    {"enable_log_outputs": "yes"},
])
def test_replica_path_accepts_what_the_check_accepts(replica_reads, kwargs):
    assert one(kwargs) == [] and not str(replica_reads(kwargs)).startswith("refused")


def test_text_number_vllm_refuses_and_the_check_lets_through(replica_reads):
    """Conservative: pydantic reads '8' as 8, but vLLM compares max_num_seqs before any config class sees it."""
    assert one({"max_num_seqs": "8"}) == [] and str(replica_reads({"max_num_seqs": "8"})).startswith("refused")


def test_enable_lora_false_text_turns_lora_on(replica_reads):
    config = replica_reads({"enable_lora": "false"})
    assert config.lora_config is not None  # the misreading the check refuses


def test_enforce_eager_false_text_reads_false(replica_reads):
    assert replica_reads({"enforce_eager": "false"}).model_config.enforce_eager is False
def test_hf_overrides_text_number_reaches_the_model_as_text(replica_reads):
    """vLLM accepts it at start and hands it to the model as text (where the rotary embedding's math on it fails
    as the worker builds the model, minutes in)."""
    config = replica_reads({"hf_overrides": {"rope_parameters": {"rope_type": "default", "rope_theta": "1e6"}}})
    assert config.model_config.hf_config.rope_parameters["rope_theta"] == "1e6"
    assert one({"hf_overrides": {"rope_parameters": {"rope_type": "default", "rope_theta": "1e6"}}})


def test_up_refuses_a_value_every_replica_would_fail_on():
    cfg = load_config(environ={}, overrides={"replicas": {"engine_kwargs": {"kv_cache_dtype": "fp9"}}})
    assert any(problem.startswith("replicas.engine_kwargs.kv_cache_dtype='fp9' is none of vLLM's choices")
               for problem in replica_args_problems(cfg))
