"""The replicas' vLLM arguments, checked against the vLLM installed here before `up` starts anything.

Why: Ray Serve LLM sorts `replicas.engine_kwargs` into vLLM's engine and frontend arguments, and vLLM
looks `model.tool_call_parser` up, in each replica as it starts: a misspelt key or parser name failed
every replica minutes into `up` (after the model build, Redis and the Ray head), in the replicas' logs.
Read from the same dataclasses Ray Serve LLM reads (`VLLMEngineConfig.from_llm_config`); where vLLM is
not installed (a machine that only renders configs), the replicas are left to check for themselves.
"""
from __future__ import annotations

import dataclasses
import difflib

from cluster.config import ClusterConfig


def replica_args_problems(cfg: ClusterConfig) -> list[str]:
    """What vLLM would refuse in `cfg`'s replica arguments, one line each; empty when nothing or no vLLM."""
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.cli_args import FrontendArgs
        from vllm.tool_parsers import ToolParserManager
    except ImportError:
        return []
    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)} | {f.name for f in dataclasses.fields(FrontendArgs)}
    problems = [
        f"replicas.engine_kwargs.{key} is no argument of vLLM's engine or OpenAI frontend{_did_you_mean(key, known)}"
        for key in sorted(set(cfg.replicas.engine_kwargs) - known)
    ]
    parser = cfg.model.tool_call_parser
    parsers = ToolParserManager.list_registered()
    if "tool_parser_plugin" not in cfg.replicas.engine_kwargs and parser not in parsers:  # a plugin adds its own
        hint = _did_you_mean(parser, parsers) or f" (its parsers: {', '.join(sorted(parsers))})"
        problems.append(f"model.tool_call_parser {parser!r} is no tool-call parser of this vLLM{hint}")
    return problems


def _did_you_mean(name: str, known) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
