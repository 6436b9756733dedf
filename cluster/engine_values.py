"""Values of `replicas.engine_kwargs` that vLLM would refuse or misread, found when the config loads.

Why: vLLM reads them only in each replica as it starts: `kv_cache_dtype: fp9` failed every replica minutes
into `up`. `cluster.replica_args` checks the names, and calls this for the values.

How the kwargs reach vLLM (Ray Serve LLM 2.60, vLLM 0.32): `LLMConfig.engine_kwargs` is split by name into
`FrontendArgs` (a pydantic dataclass: `FrontendArgs(**frontend_kwargs)` validates it) and `AsyncEngineArgs`
(a plain dataclass: no validation on construction). Ray first validates every dict given for a field typed
as a vLLM config class (`TypeAdapter(config_cls).validate_python`), then runs `AsyncEngineArgs(**kwargs)
.create_engine_config()`, which hands most scalar arguments to vLLM's config classes (pydantic dataclasses,
lax mode) and tests some itself in plain Python. This module repeats only vLLM's own, platform-independent
type checks:

- engine arguments typed with `Literal`, `bool`, `int`, `float` (or `| None` of them): pydantic's lax
  validation of the field's annotation (what the config class does with it), plus the `ge/gt/le/lt` bounds
  of the config field of the same name; arguments vLLM stores without that validation are left alone
  (`_STORED_UNCHECKED`), LoRA ones unless `enable_lora` is on;
- frontend arguments: `FrontendArgs`' own validation of the one field;
- dicts for config-class fields (`structured_outputs_config`, `compilation_config`, ...): the validation Ray
  Serve LLM runs, counting only pydantic's own type errors (not the config's validators and `__post_init__`,
  which may consult the platform: this machine is not the replicas');
- text in free-form dicts (`hf_overrides`, ...) that is a number in scientific notation, which YAML 1.1
  reads as text (`rope_theta: 1e6` is the string '1e6').

Two readings are stricter than "vLLM refuses it" because vLLM misreads them (see `engine_value_problems`):
booleans given for numbers, and the text 'false' (etc.) for the boolean arguments vLLM tests as Python truth.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from typing import Any

# Boolean arguments vLLM tests as Python truth before (or instead of) any validation, so any text, 'false'
# included, is true (`enable_lora: "false"` turns LoRA on). Derived for vLLM 0.32 with vLLM's own
# `create_engine_config` (tests/unit/cluster/test_engine_values.py::test_boolean_lists_match_vllm); the remaining boolean
# arguments reach a config class, which reads 'false', 'no', 'off', '0' as false.
_READ_AS_PYTHON_TRUTH = frozenset({
    "aggregate_engine_logging", "data_parallel_external_lb", "data_parallel_hybrid_lb", "enable_fault_tolerance",
    "enable_flashinfer_autotune", "enable_log_requests", "enable_lora", "enable_mamba_cache_stochastic_rounding",
    "enable_return_routed_experts", "fail_on_environ_validation",
})
# Arguments vLLM stores without validation at start (`kernel_config.moe_backend = self.moe_backend`), or that
# Ray Serve LLM's path never reads (`disable_cascade_attn` only warns; `data_parallel_multi_port_external_lb` is
# `vllm serve`'s): a wrong value there may never be read (a dense model has no MoE kernel), so it is not refused.
_STORED_UNCHECKED = frozenset({
    "data_parallel_multi_port_external_lb", "data_parallel_start_rank", "disable_cascade_attn", "gdn_prefill_backend",
    "kda_decode_backend", "kda_prefill_backend", "linear_backend", "mamba_cache_philox_rounds",
    "max_cudagraph_capture_size", "moe_backend", "sparse_indexer_topk_backend",
})
# Read only into LoRAConfig, which vLLM builds when `enable_lora` is on (`max_cpu_loras` also passes `> 0`).
_LORA_ONLY = frozenset({
    "default_mm_loras", "enable_mixed_moe_lora_format", "enable_moe_shared_loras", "enable_tower_connector_lora",
    "fully_sharded_loras", "lora_dtype", "lora_target_modules", "max_cpu_loras", "max_lora_cls_labels",
    "max_lora_rank", "max_loras", "specialize_active_lora",
})
# Engine arguments vLLM transforms before a config class sees them: the bounds of the class field do not apply.
_NO_BOUNDS = frozenset({"data_parallel_rank", "max_cpu_loras", "cp_kv_cache_interleave_size"})
# vLLM's command line reads these with `human_readable_int` ('4k'); its Python arguments do not.
_HUMAN_READABLE_ON_CLI = frozenset({
    "max_model_len", "max_num_batched_tokens", "max_num_scheduled_tokens", "kv_cache_memory_bytes",
    "safetensors_prefetch_block_size", "max_num_queued_tokens",
})
# The config classes `create_engine_config` always builds from arguments of the same name (bounds come from
# these; MultiModalConfig and LoRAConfig exist only for some models and settings).
_BOUND_SOURCES = ("ModelConfig", "CacheConfig", "ParallelConfig", "SchedulerConfig", "LoadConfig",
                  "ObservabilityConfig", "UVAOffloadConfig", "PrefetchOffloadConfig")
# pydantic's own errors of type and shape. Not 'value_error'/'assertion_error': those come from vLLM's
# validators, which may depend on the platform (`current_platform`) of the machine that runs the check.
_TYPE_ERRORS_EXCLUDED = frozenset({"value_error", "assertion_error"})
# Free-form arguments vLLM hands on as written, with no type of their own to read text as a number by: into the
# Hugging Face config (`config.update`). Others are validated by a class that reads '1e-3' as 0.001
# (`custom_histogram_buckets`: ObservabilityConfig).
_PASSED_ON_AS_WRITTEN = frozenset({"hf_overrides"})
# Scientific notation that YAML 1.2 and JSON read as a number and PyYAML (YAML 1.1) keeps as text: PyYAML
# wants a dot and a signed exponent (`1.0e+6`), so `1e6`, `1E-5`, `2.5e6` and `1e+6` stay strings.
_SCIENTIFIC = re.compile(r"[-+]?(?:\d[\d_]*(?:\.\d*)?|\.\d+)[eE][-+]?\d+")
_FALSE_WORDS = frozenset({"0", "off", "f", "false", "n", "no"})  # pydantic's false texts
_TRUE_WORDS = frozenset({"1", "on", "t", "true", "y", "yes"})


def engine_value_problems(engine_kwargs: dict[str, Any], where: str = "replicas.engine_kwargs") -> list[str]:
    """What vLLM would refuse or misread among `engine_kwargs`' values, one line each (empty without vLLM).

    Never a value vLLM reads as written, with two deliberate exceptions, both misreadings:
    - a boolean for a number (`max_num_seqs: yes` is YAML's true, which vLLM takes for 1), as warmpath's
      own number fields refuse;
    - the text 'false', 'no', 'off', '0', 'f', 'n' for a boolean vLLM tests as Python truth (true there).
    Names vLLM does not know are `cluster.replica_args`' to report.
    """
    try:
        fields = vllm_arguments()
    except ImportError:
        return []
    lora_on = _truthy(engine_kwargs.get("enable_lora"))
    problems: list[str] = []
    for key, value in sorted(engine_kwargs.items()):
        if key not in fields:
            continue
        kind, annotation = fields[key]
        name = f"{where}.{key}"
        if kind == "frontend":
            problems += _frontend_problems(name, key, value)
        elif key in _LORA_ONLY and not lora_on:
            continue
        elif (config_cls := _config_class(annotation)) is not None and isinstance(value, dict):
            problems += _config_dict_problems(name, config_cls, value)
        elif _is_closed_scalar(annotation):
            if value is None:  # vLLM's "unset" almost everywhere, even where EngineArgs' annotation omits it
                continue
            if problem := _scalar_problem(name, key, annotation, value):
                problems.append(problem)
        elif key in _PASSED_ON_AS_WRITTEN and isinstance(value, (dict, list)):
            problems += _scientific_text(name, value)
    return problems


@functools.cache
def vllm_arguments() -> dict[str, tuple[str, Any]]:
    """Every argument Ray Serve LLM passes to vLLM, by name: whose it is as Ray sorts them (`"frontend"` first,
    else `"engine"`) and its type annotation. Raises ImportError without vLLM."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import FrontendArgs

    found = {f.name: ("engine", f.type) for f in dataclasses.fields(AsyncEngineArgs)}
    found.update({f.name: ("frontend", f.type) for f in dataclasses.fields(FrontendArgs)})
    return found


def _leaves(annotation: Any) -> list[tuple[str, Any]]:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return [("literal", choice) for choice in typing.get_args(annotation)]
    if origin in (typing.Union, types.UnionType):
        return [leaf for arg in typing.get_args(annotation) for leaf in _leaves(arg)]
    return [("type", annotation)]


def _is_closed_scalar(annotation: Any) -> bool:
    """Literal choices, bool, int, float, None, and unions of them (not `str`, enums, classes, or a string
    annotation vLLM leaves unresolved)."""
    if isinstance(annotation, str):
        return False
    return all(kind == "literal" or leaf in (bool, int, float, type(None)) for kind, leaf in _leaves(annotation))


def _config_class(annotation: Any) -> type | None:
    """The vLLM config dataclass of a field (`StructuredOutputsConfig`, `KVTransferConfig | None`), as Ray
    Serve LLM finds it (`_get_vllm_config_type`)."""
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            if isinstance(arg, type) and dataclasses.is_dataclass(arg):
                return arg
    return None


@functools.cache
def _bounds(key: str) -> tuple:
    """The `annotated_types` bounds (Ge, Gt, Le, Lt) of the one config field named `key`."""
    import annotated_types
    import vllm.config as vllm_config

    if key in _NO_BOUNDS:
        return ()
    found = []
    for cls_name in _BOUND_SOURCES:
        cls = getattr(vllm_config, cls_name, None)
        field = getattr(cls, "__pydantic_fields__", {}).get(key)
        if field is not None:
            found.append(tuple(m for m in field.metadata if isinstance(
                m, (annotated_types.Ge, annotated_types.Gt, annotated_types.Le, annotated_types.Lt))))
    return found[0] if len(set(found)) == 1 else ()  # a name two classes share with different bounds: none


@functools.cache
def _adapter(key: str, annotation: Any):
    from pydantic import TypeAdapter

    bounds = _bounds(key)
    return TypeAdapter(typing.Annotated[annotation, *bounds] if bounds else annotation)


def _scalar_problem(name: str, key: str, annotation: Any, value: Any) -> str | None:
    from pydantic import ValidationError

    leaves = _leaves(annotation)
    types_ = {leaf for kind, leaf in leaves if kind == "type"}
    choices = [leaf for kind, leaf in leaves if kind == "literal"]
    if key in _STORED_UNCHECKED:
        return None
    if bool in types_:
        return _bool_problem(name, key, value)
    if isinstance(value, bool) and types_ & {int, float}:
        return (f"{name}={value!r} is YAML's boolean (yes, on, true...), which vLLM would take for "
                f"{int(value)}: write a number")
    try:
        _adapter(key, annotation).validate_python(value)
    except ValidationError as err:
        errors = [e for e in err.errors() if e["type"] not in _TYPE_ERRORS_EXCLUDED]
        if not errors:
            return None
        if choices:
            accepted = ", ".join(repr(choice) for choice in choices)
            if type(None) in types_:
                accepted += " (or null)"
            return f"{name}={value!r} is none of vLLM's choices: {accepted}"
        return f"{name}={value!r}: {_expected(key, types_, value, errors)}"
    return None


def _expected(key: str, types_: set, value: Any, errors: list[dict]) -> str:
    """What vLLM takes instead, in words, with the fix for the text YAML or vLLM's command line lead to."""
    bound = next((e for e in errors if e["type"] in ("greater_than", "greater_than_equal", "less_than",
                                                       "less_than_equal")), None)
    if bound is not None:
        return f"vLLM refuses it ({bound['msg'][0].lower()}{bound['msg'][1:]})"
    wanted = "a whole number" if int in types_ else "a number"
    if type(None) in types_:
        wanted += " or null"
    hint = ""
    if isinstance(value, str) and _SCIENTIFIC.fullmatch(value.strip()):
        hint = f" (YAML 1.1 reads {value} as text: write {_plain_number(value)})"
    elif isinstance(value, str) and key in _HUMAN_READABLE_ON_CLI and re.fullmatch(r"\d+(\.\d+)?[kKmMgGtT]", value):
        hint = f" (vLLM's command line reads {value}, its engine arguments do not: write {_human_readable(value)})"
    return f"vLLM wants {wanted} here{hint}"


def _bool_problem(name: str, key: str, value: Any) -> str | None:
    """Booleans: a real one, 0 or 1, or a text every reading takes alike."""
    if isinstance(value, bool) or (type(value) in (int, float) and value in (0, 1)):
        return None  # pydantic's lax bool reads 0, 1, 0.0 and 1.0
    if isinstance(value, str) and value.strip().lower() in _TRUE_WORDS:
        return None  # true both to a config class and to Python truth
    if isinstance(value, str) and value.strip().lower() in _FALSE_WORDS:
        if key not in _READ_AS_PYTHON_TRUTH:
            return None  # the config class reads it as false
        return f"{name}={value!r} is text, which vLLM tests as Python truth here (true): write false, unquoted"
    return f"{name}={value!r} is not a boolean to vLLM: write true or false, unquoted"


def _frontend_problems(name: str, key: str, value: Any) -> list[str]:
    """`FrontendArgs(**{key: value})`: the validation Ray Serve LLM runs on every frontend argument."""
    from pydantic import ValidationError
    from vllm.entrypoints.launchers.cli_args import FrontendArgs

    try:
        FrontendArgs(**{key: value})
    except ValidationError as err:
        return [_describe(name, value, e) for e in err.errors() if e["type"] not in _TYPE_ERRORS_EXCLUDED]
    except Exception:  # noqa: BLE001 - not a type error of the value: the replica decides
        return []
    return []


def _config_dict_problems(name: str, config_cls: type, value: dict) -> list[str]:
    """Ray Serve LLM's `TypeAdapter(config_cls).validate_python(value)`, pydantic's own type errors only."""
    from pydantic import TypeAdapter, ValidationError

    try:
        TypeAdapter(config_cls).validate_python(value)
    except ValidationError as err:
        problems = []
        for e in err.errors():
            if e["type"] in _TYPE_ERRORS_EXCLUDED:
                continue
            path = ".".join(str(part) for part in e["loc"])
            if e["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
                known = ", ".join(sorted(f.name for f in dataclasses.fields(config_cls) if not f.name.startswith("_")))
                problems.append(f"{name}.{path} is no field of vLLM's {config_cls.__name__} (its fields: {known})")
            else:
                problems.append(_describe(f"{name}.{path}", e.get("input"), e))
        return problems
    except Exception:  # noqa: BLE001 - __post_init__ on this machine's platform: the replica decides
        return []
    return []


def _describe(name: str, value: Any, error: dict) -> str:
    """One of pydantic's errors in warmpath's words (`Input should be 'auto', 'string' or 'openai'`)."""
    if error["type"] in ("literal_error", "enum"):
        return f"{name}={value!r} is none of vLLM's choices: {error['ctx']['expected']}"
    if error["type"] == "bool_parsing":
        return f"{name}={value!r} is not a boolean to vLLM: write true or false, unquoted"
    return f"{name}={value!r}: vLLM refuses it ({error['msg'][0].lower()}{error['msg'][1:]})"


def _scientific_text(name: str, value: Any) -> list[str]:
    """Text in scientific notation inside a free-form mapping or list (`hf_overrides: {rope_theta: 1e6}`):
    vLLM passes it on as text (into the Hugging Face config, where math on it fails or a typed field refuses
    it)."""
    if isinstance(value, str):
        if _SCIENTIFIC.fullmatch(value.strip()):
            return [f"{name}={value!r} is text: YAML 1.1 reads {value} as a string, not a number, and vLLM "
                    f"passes it on as text; write {_plain_number(value)}"]
        return []
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _scientific_text(f"{name}.{k}", v)]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _scientific_text(f"{name}[{i}]", v)]
    return []


def _plain_number(text: str) -> str:
    number = float(text.replace("_", ""))
    if number.is_integer() and abs(number) < 1e16:
        return f"{int(number)} or {_yaml11_float(number)}"
    return _yaml11_float(number)


def _yaml11_float(number: float) -> str:
    """The form PyYAML reads as a float: a dot and a signed exponent (1.0e+6)."""
    mantissa, exponent = f"{number:e}".split("e")
    mantissa = mantissa.rstrip("0")
    mantissa = mantissa + "0" if mantissa.endswith(".") else mantissa
    return f"{mantissa}e{'+' if int(exponent) >= 0 else '-'}{abs(int(exponent))}"


def _human_readable(text: str) -> str:
    try:
        from vllm.utils.argparse_utils import human_readable_int
    except ImportError:  # moved between versions: the hint is optional
        return "the whole number"
    return str(human_readable_int(text))


def _truthy(value: Any) -> bool:
    return bool(value) and not (isinstance(value, str) and value.strip().lower() in _FALSE_WORDS)
