"""The replicas' vLLM arguments, checked against the vLLM installed here before `up` starts anything, and
against a local model folder's context length (`up` refuses them; the renders warn).

Why: Ray Serve LLM sorts `replicas.engine_kwargs` into vLLM's engine and frontend arguments, and vLLM
looks `model.tool_call_parser` up, in each replica as it starts: a misspelt key or parser name failed
every replica minutes into `up` (after the model build, Redis and the Ray head), in the replicas' logs.
Read from the same dataclasses Ray Serve LLM reads (`VLLMEngineConfig.from_llm_config`); where vLLM is
not installed (a machine that only renders configs), the replicas are left to check for themselves.
"""
from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import get_args

from cluster.config import ClusterConfig
from cluster.engine_values import engine_value_problems, vllm_arguments


def replica_args_problems(cfg: ClusterConfig) -> list[str]:
    """What vLLM would refuse in `cfg`'s replica arguments (names, and the values `engine_value_problems` can
    judge), one line each; empty when nothing (without vLLM here, only the local model's window is checked)."""
    problems = []
    if (window := _local_model_window(cfg)) is not None and cfg.model.max_model_len_tokens > window:
        problems.append(
            f"model.max_model_len_tokens {cfg.model.max_model_len_tokens} is over the {window} tokens the model in "
            f"{cfg.model_source()} holds (max_position_embeddings in its config.json); vLLM refuses it"
        )
    try:
        from vllm.tool_parsers import ToolParserManager

        fields = {name: annotation for name, (_, annotation) in vllm_arguments().items()}
    except ImportError:
        return problems
    problems += [
        f"replicas.engine_kwargs.{key} is no argument of vLLM's engine or OpenAI frontend{_did_you_mean(key, fields)}"
        for key in sorted(set(cfg.replicas.engine_kwargs) - set(fields))
    ]
    problems += [  # YAML (a file, or a variable) reads `revision: 20240101` as a number; vLLM passes it on as is
        f"replicas.engine_kwargs.{key} is text to vLLM, not the {type(value).__name__} {value!r}: quote it "
        f"({key}: \"{value}\")"
        for key, value in sorted(cfg.replicas.engine_kwargs.items())
        if key in fields and _is_text_only(fields[key]) and isinstance(value, (bool, int, float))
    ]
    problems += engine_value_problems(cfg.replicas.engine_kwargs)
    parser = cfg.model.tool_call_parser
    parsers = ToolParserManager.list_registered()
    if "tool_parser_plugin" not in cfg.replicas.engine_kwargs and parser not in parsers:  # a plugin adds its own
        hint = _did_you_mean(parser, parsers) or f" (its parsers: {', '.join(sorted(parsers))})"
        problems.append(f"model.tool_call_parser {parser!r} is no tool-call parser of this vLLM{hint}")
    return problems


def _is_text_only(annotation) -> bool:
    """Whether a vLLM argument's type admits text and nothing else but None (`revision: str | None`)."""
    return annotation is str or (bool(get_args(annotation)) and set(get_args(annotation)) <= {str, type(None)})


def _did_you_mean(name: str, known) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _local_model_window(cfg: ClusterConfig) -> int | None:
    """The context length a local model folder's `config.json` states; None for a hub id, a folder not here,
    or a window vLLM may stretch (rope scaling, `hf_overrides`, `VLLM_ALLOW_LONG_MAX_MODEL_LEN`)."""
    folder = Path(cfg.model_source())
    if not folder.is_absolute() or "hf_overrides" in cfg.replicas.engine_kwargs \
            or os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        return None
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    window = text.get("max_position_embeddings")
    if "model_max_length" in text or "model_max_length" in config:  # vLLM's own override (Command R's is longer)
        return None
    for rope in (text.get("rope_scaling"), text.get("rope_parameters")):
        if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) not in (None, "default"):
            return None  # yarn, dynamic, ...: vLLM derives a longer window
    return window if isinstance(window, int) and window > 0 else None
