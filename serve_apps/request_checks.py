"""Refusals of OpenAI requests the engine would otherwise fail on as internal errors.

Why here: Ray Serve LLM's request models type messages loosely, and vLLM
checks some inputs only deep in the replica, where a bad value surfaces as a
`KeyError`, a `TypeError` from the tokenizer or a `ValueError` that the error
mapping cannot tell from a bug, so the client got a 500 for its own mistake.
Each check returns `(message, param)` for a 400, or None.

- A message without a role, or with one that is not a string (vLLM's
  renderer indexes `message["role"]` and the template joins it into text).
  Any string is a role: vLLM takes custom ones (`ipython`, `observation`)
  and hands them to the chat template as written.
- Message content or tool calls that fail validation: pydantic validates an
  `Iterable` field lazily, so a content part of an unknown type raised only
  when Ray Serve LLM materialised the list. Materialising it here, with the
  message's index, names the field; Ray's own pass then finds lists.
- More than `MAX_CHOICES` choices (`n`), OpenAI's own limit: vLLM takes any
  number, and one request with n=1000 holds an engine for as long as a
  thousand would. A completion's batch of prompts multiplies them (each
  prompt gets `n`), so one request starts at most `MAX_SEQUENCES`.
- A `/detokenize` token id of 32 bits or more: the tokenizer raises an
  `OverflowError` on it.
- Text that cannot be encoded as UTF-8 (a lone surrogate, from a `\\ud800`
  escape or from invalid bytes JSON decoding let through), in any field:
  the tokenizer raises a `TypeError` on it, and the message that carries the
  request to the engine process a `UnicodeEncodeError` (`stop`).
"""

from __future__ import annotations

import json

from typing import Any, Optional

MAX_CHOICES = 128
# Sequences one request may start: a completion's prompts times `n` (vLLM takes 1,024 prompts, each `n` times).
MAX_SEQUENCES = 1024
MAX_TOKEN_ID_EXCLUSIVE = 2**32

Problem = tuple[str, Optional[str]]


def _kv_report_problem(body: Any) -> Optional[Problem]:
    """A request asking the engine to report its whole cached prefix again (`kv_cache_report_mode: full`).

    The router's KV index counts each `BlockStored` as one more copy of a block, and each
    `BlockRemoved` as one fewer: blocks a request re-announced would stay in the index after the
    engine evicted them, drawing that prefix's traffic to a replica that no longer holds it.
    """
    xargs = getattr(body, "vllm_xargs", None)
    mode = xargs.get("kv_cache_report_mode", "incremental") if isinstance(xargs, dict) else "incremental"
    if mode == "incremental":
        return None
    return (f"vllm_xargs.kv_cache_report_mode must be 'incremental' (the cluster's KV-cache routing reads the "
            f"engine's events as increments), got {mode!r}"), "vllm_xargs.kv_cache_report_mode"


def chat_request_problem(body: Any) -> Optional[Problem]:
    """The first thing wrong with a chat request's messages and tools, or None."""
    if (problem := _sampling_problem(body) or _kv_report_problem(body)) is not None:
        return problem
    messages = body.messages or []
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else getattr(message, "role", None)
        if not isinstance(role, str):
            return f"messages[{index}].role must be a string (user, assistant, system, tool, ...), got {role!r}", \
                f"messages[{index}].role"
        if isinstance(message, dict):
            for field in ("content", "tool_calls"):
                value = message.get(field)
                if value is None or isinstance(value, (str, list)):
                    continue
                try:
                    message[field] = list(value)
                except (TypeError, ValueError) as err:
                    return _invalid_part(f"messages[{index}].{field}", err)
    return (
        unencodable_text_problem(messages, "messages")
        or _arguments_problem(messages)
        or unencodable_text_problem(getattr(body, "tools", None), "tools")
        or _other_fields_problem(body, ("messages", "tools"))
    )


def _other_fields_problem(body: Any, checked: tuple[str, ...]) -> Optional[Problem]:
    """Text UTF-8 cannot encode in any other field of the request (`stop`, `bad_words`, `vllm_xargs`, ...):
    the tokenizer or the message to the engine process fails on it as an internal error."""
    for name, value in getattr(body, "__dict__", {}).items():
        if name not in checked and (problem := unencodable_text_problem(value, name)) is not None:
            return problem
    return None


def _arguments_problem(messages: list) -> Optional[Problem]:
    """Text UTF-8 cannot encode inside a tool call's `arguments` JSON (a `\\ud800` escape, ASCII as sent).

    vLLM parses the arguments before the template renders them, and the tokenizer then fails on the
    text as an internal error; only arguments with an escape can hold such text.
    """
    for index, message in enumerate(messages):
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        for position, call in enumerate(calls if isinstance(calls, list) else ()):
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if not isinstance(arguments, str) or "\\u" not in arguments:
                continue
            try:
                parsed = json.loads(arguments)
            except (ValueError, RecursionError):
                continue  # vLLM renders arguments that are not JSON as an empty object
            where = f"messages[{index}].tool_calls[{position}].function.arguments"
            if (problem := unencodable_text_problem(parsed, where)) is not None:
                return problem
    return None


def completion_request_problem(body: Any) -> Optional[Problem]:
    """The first thing wrong with a completion request's prompt or other text, or None."""
    return (
        _sampling_problem(body)
        or _kv_report_problem(body)
        or unencodable_text_problem(getattr(body, "prompt", None), "prompt")
        or _other_fields_problem(body, ("prompt",))
    )


def tokenize_request_problem(body: Any) -> Optional[Problem]:
    """The first thing wrong with a `/tokenize` request's prompt or other text (its `model` too: an
    unknown model's 404 echoes it), or None."""
    return unencodable_text_problem(getattr(body, "prompt", None), "prompt") or _other_fields_problem(body, ("prompt",))


def detokenize_request_problem(body: Any) -> Optional[Problem]:
    """A 400 for a `/detokenize` id no tokenizer has (the request model allows 63 bits, the tokenizer 32),
    or for text UTF-8 cannot encode (its `model`)."""
    for index, token in enumerate(body.tokens or ()):
        if not 0 <= token < MAX_TOKEN_ID_EXCLUSIVE:
            return f"tokens[{index}]: {token} is not a token id (token ids fit in 32 bits)", f"tokens[{index}]"
    return _other_fields_problem(body, ("tokens",))


def _sampling_problem(body: Any) -> Optional[Problem]:
    """What is wrong with how many choices, and tokens each, the request asks for (`n`, `best_of`,
    `max_completion_tokens`), or with `top_k`, or None."""
    top_k = getattr(body, "top_k", None)
    if isinstance(top_k, int) and top_k >= MAX_TOKEN_ID_EXCLUSIVE:
        # vLLM bounds it below only: past 64 bits the message to its engine process failed, a 500.
        return (f"top_k must be at most {MAX_TOKEN_ID_EXCLUSIVE - 1} (no vocabulary has more tokens), "
                f"got {top_k}"), "top_k"
    n = getattr(body, "n", None)
    if isinstance(n, int) and n > MAX_CHOICES:
        return f"n must be at most {MAX_CHOICES}, got {n}", "n"
    max_completion_tokens = getattr(body, "max_completion_tokens", None)
    if isinstance(max_completion_tokens, int) and max_completion_tokens < 1:
        # Named as sent: vLLM copies it into `max_tokens` first and refused it under that name.
        return f"max_completion_tokens must be at least 1, got {max_completion_tokens}", "max_completion_tokens"
    best_of = getattr(body, "best_of", None)
    if isinstance(best_of, int) and best_of != (n if isinstance(n, int) else 1):
        # vLLM's engine takes the field and ignores it: no extra candidates were sampled, none ranked.
        return (f"best_of={best_of} is not served: the engine samples n choices and ranks none (n={n or 1}); "
                "ask for n and pick on the client"), "best_of"
    num_prompts = _num_prompts(getattr(body, "prompt", None))
    if isinstance(n, int) and num_prompts * n > MAX_SEQUENCES:
        return (f"{num_prompts} prompts with n={n} would start {num_prompts * n} sequences; one request may start "
                f"at most {MAX_SEQUENCES}: send fewer prompts per request"), "prompt"
    return None


def _num_prompts(prompt: Any) -> int:
    """How many prompts a completion's `prompt` holds: a list of texts or of token lists is a batch."""
    if isinstance(prompt, list) and prompt and all(isinstance(item, (str, list)) for item in prompt):
        return len(prompt)
    return 1


def lone_surrogate_at(text: str) -> Optional[int]:
    """Where `text` holds a lone surrogate (the one thing a Python str has that UTF-8 cannot encode), or None."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return err.start
    return None


def utf8_text(text: str) -> str:
    """`text` with each lone surrogate replaced by '?', so that UTF-8 writers take it.

    Why: model output can hold one (a tool parser's `json.loads` of the model's `"\\ud800"`), and every
    writer the answer meets (a JSON response body, a protobuf string, the session store) raises on it.
    """
    if lone_surrogate_at(text) is None:
        return text
    return text.encode("utf-8", errors="replace").decode("utf-8")


# How deep a request's values may nest below a field. Ray pickles a handle call's arguments, which fails
# from about 490 levels, while JSON's parser takes about 970: a free-form field (`chat_template_kwargs`,
# a `response_format` schema) nested in between passed every check and failed the call, a 500.
MAX_NESTING_DEPTH = 128


class _TooDeep(Exception):
    """A value nests more than MAX_NESTING_DEPTH levels."""


def unencodable_text_problem(value: Any, path: str) -> Optional[Problem]:
    """A 400 for the first string under `value` that UTF-8 cannot encode, naming where it is; or for a value
    nested more than MAX_NESTING_DEPTH levels deep."""
    try:
        found = _first_unencodable(value, 0)
    except (_TooDeep, RecursionError):
        return f"{path}: nests arrays or objects more than {MAX_NESTING_DEPTH} levels deep", path
    if found is None:
        return None
    keys, position = found
    is_key = bool(keys) and keys[0] is _A_KEY
    where = path + "".join(f"[{key}]" if isinstance(key, int) else f".{key}" for key in reversed(keys[is_key:]))
    text = "a key" if is_key else "the text"
    return (f"{where}: {text} is not valid Unicode (a lone surrogate at character {position}); "
            "send UTF-8 text, with surrogate pairs only in pairs", where)


_A_KEY = object()  # `_first_unencodable`'s mark for a key that UTF-8 cannot encode


def _first_unencodable(value: Any, depth: int) -> Optional[tuple[list, int]]:
    """(keys from `value`, `depth` levels down, to the string, innermost first; position in it), or None.

    The keys are collected on the way back from a find only: every request walks
    its messages and tools here, and almost none holds a surrogate.

    Raises:
        _TooDeep: `value` nests more than MAX_NESTING_DEPTH levels below its field.
    """
    if isinstance(value, str):
        position = lone_surrogate_at(value)
        return None if position is None else ([], position)
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    elif hasattr(value, "__pydantic_fields__"):
        items = vars(value).items()
    else:
        return None
    if depth > MAX_NESTING_DEPTH:
        raise _TooDeep
    for key, item in items:
        # A key is text the template renders too (a tool schema's property names, through `tojson`);
        # it is named by where it is, never echoed (the answer could not be encoded either).
        if isinstance(key, str) and (position := lone_surrogate_at(key)) is not None:
            return [_A_KEY], position
        found = _first_unencodable(item, depth + 1)
        if found is not None:
            found[0].append(key)
            return found
    return None


def _invalid_part(where: str, err: Exception) -> Problem:
    from pydantic import ValidationError

    from serve_apps.api_errors import validation_problem

    if isinstance(err, ValidationError):
        return validation_problem(err.errors(), prefix=where)
    return f"{where}: {err}", where
