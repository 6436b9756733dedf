"""The bodies of the OpenAI routes: vLLM's request models, with a field of the wrong type a validation error.

Why: vLLM's `mode="before"` validators read the raw body as they expect it (`messages` a list,
`structured_outputs` an object, an assistant's `tool_calls` a list, `tools` of objects), and a
value of another type raises TypeError, AttributeError or KeyError there, which pydantic lets
through: FastAPI answered 500 with Ray's wrapping and the Python error, which the OpenAI clients
retried twice. Here such a body is a validation error like any other (400 `invalid_parameter`,
`serve_apps.api_errors`), naming the field where the shape of the body says which.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

from pydantic import ModelWrapValidatorHandler, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError
from ray.llm._internal.serve.core.configs import openai_api_models as vllm_bodies

# Top-level fields vLLM's validators read as one JSON type (or one of a few), and the pydantic error for another.
_FIELD_TYPES: dict[str, tuple[type | tuple[type, ...], str | PydanticCustomError]] = {
    "messages": (list, "list_type"),
    "tools": (list, "list_type"),
    "structured_outputs": (dict, "dict_type"),
    "response_format": (dict, "dict_type"),
    "stream_options": (dict, "dict_type"),
    # Neither a word nor an object: vLLM's check said "tools must be set".
    "tool_choice": ((str, dict), PydanticCustomError(
        "tool_choice_type", "Input should be 'none', 'auto', 'required' or an object naming a function")),
}

# The most messages, and tools, one request may hold: the served model's window in tokens, since each renders to
# a token at least (`limit_items`; None: no limit). Why: validating a message costs a few microseconds on the
# ingress's event loop, which every other request of that ingress waits on: the 4 MiB a request may hold carry
# 100,000+ one-letter messages, and their validation held the loop for a second or more.
_ITEM_LIMIT: Optional[int] = None


def limit_items(window_tokens: Optional[int]) -> None:
    """Bounds the messages and the tools of each request this process validates by the served model's window."""
    global _ITEM_LIMIT
    _ITEM_LIMIT = window_tokens


def too_many_items(field: str, count: int, window_tokens: int) -> str:
    """The refusal of a request holding `count` messages or tools, over the model's window."""
    return (f"the request holds {count} {field}; the model's context window is {window_tokens} tokens, and each "
            f"of its {field} takes one at least")


@functools.cache
def _boolean_fields(cls: type) -> frozenset[str]:
    """The request's true/false fields (`stream`, `logprobs`, `echo`, `parallel_tool_calls`, ...)."""
    return frozenset(name for name, field in cls.model_fields.items() if field.annotation in (bool, Optional[bool]))


def _wrong_types(cls: type, data: Any) -> list[InitErrorDetails]:
    """A validation error for each field the validators would trip over: the top-level ones of `_FIELD_TYPES`,
    a tool that is not an object, and an assistant's `tool_calls` that is not a list; and for a true/false
    field given anything but true, false or null (pydantic's lax mode read `"yes"`, `"on"`, `1` as true:
    `"stream": "yes"` streamed, where OpenAI's API answers 400)."""
    if not isinstance(data, dict):
        return []
    errors: list[InitErrorDetails] = [{"type": "bool_type", "loc": (name,), "input": data[name]}
                                      for name in sorted(_boolean_fields(cls) & data.keys())
                                      if data[name] is not None and not isinstance(data[name], bool)]
    for name, (kind, error_type) in _FIELD_TYPES.items():
        value = data.get(name)
        if name in cls.model_fields and value is not None and not isinstance(value, kind):
            errors.append({"type": error_type, "loc": (name,), "input": value})
        elif name in cls.model_fields and kind is list and _ITEM_LIMIT is not None and isinstance(value, list) \
                and len(value) > _ITEM_LIMIT:
            message = too_many_items(name, len(value), _ITEM_LIMIT)
            return [{"type": PydanticCustomError("too_many_items", message), "loc": (name,), "input": len(value)}]
    tools = data.get("tools") if "tools" in cls.model_fields else None
    if isinstance(tools, list):
        errors += [{"type": "dict_type", "loc": ("tools", i), "input": t} for i, t in enumerate(tools)
                   if not isinstance(t, dict)]
    messages = data.get("messages") if "messages" in cls.model_fields else None
    if isinstance(messages, list):
        for i, message in enumerate(messages):
            calls = message.get("tool_calls") if isinstance(message, dict) else None
            if calls is not None and not isinstance(calls, list):
                errors.append({"type": "list_type", "loc": ("messages", i, "tool_calls"), "input": calls})
            elif calls:
                errors += _tool_call_errors(calls, ("messages", i, "tool_calls"))
    return errors


def _tool_call_errors(calls: list, where: tuple) -> list[InitErrorDetails]:
    """Errors of an assistant's `tool_calls` entries, located in the request (`messages[1].tool_calls[0].id`).

    Why here: vLLM validates the list lazily and materialises it inside the model's validation, where
    pydantic's locations start at the list (`[0].id`, param `[0]`), naming neither message nor field.
    """
    errors: list[InitErrorDetails] = []
    for j, call in enumerate(calls):
        if not isinstance(call, dict):
            errors.append({"type": "dict_type", "loc": (*where, j), "input": call})
            continue
        if call.get("type", "function") != "function":
            continue  # another kind of call (`custom`): vLLM's own validation names what it lacks
        function = call.get("function")
        fields = [(("id",), call, "id"), (("function",), call, "function")]
        if isinstance(function, dict):
            fields += [(("function", "name"), function, "name"), (("function", "arguments"), function, "arguments")]
        for path, holder, name in fields:
            kind = dict if name == "function" else str
            if name not in holder:
                errors.append({"type": "missing", "loc": (*where, j, *path), "input": holder})
            elif not isinstance(holder[name], kind):
                errors.append({"type": "dict_type" if kind is dict else "string_type", "loc": (*where, j, *path),
                               "input": holder[name]})
    return errors


def _validated(cls: type, data: Any, handler: ModelWrapValidatorHandler) -> Any:
    errors = _wrong_types(cls, data)
    if errors:
        raise ValidationError.from_exception_data(cls.__name__, errors)
    try:
        return handler(data)
    except (TypeError, AttributeError, KeyError) as err:  # a shape not foreseen above: still the body's fault
        raise ValueError(f"a field of the request has a type the server cannot read ({type(err).__name__}: "
                         f"{err})") from None


# Named as vLLM's (the OpenAPI schema's component names are the classes').


class ChatCompletionRequest(vllm_bodies.ChatCompletionRequest):
    """vLLM's chat completion request; a field of the wrong type is a validation error (module docstring)."""

    @model_validator(mode="wrap")
    @classmethod
    def _types_first(cls, data: Any, handler: ModelWrapValidatorHandler) -> Any:
        return _validated(cls, data, handler)


class CompletionRequest(vllm_bodies.CompletionRequest):
    """vLLM's completion request; a field of the wrong type is a validation error (module docstring)."""

    @model_validator(mode="wrap")
    @classmethod
    def _types_first(cls, data: Any, handler: ModelWrapValidatorHandler) -> Any:
        return _validated(cls, data, handler)


__all__ = ["ChatCompletionRequest", "CompletionRequest"]
