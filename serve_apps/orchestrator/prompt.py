"""Cache-first prompt layout, canonical tool rendering and exact token accounting.

Ordering: system prompt, then tool schemas (the chat template renders both into
the system block), then the history oldest first. The first two never change
during a session, so their KV blocks are shared by every step of every turn.

Invariants:
- `render_tools` is a pure function of the set of tools: sorted by name, schema
  keys sorted, wrapper keys in vLLM's order, so equal tools give equal bytes,
  equal token ids and an equal fingerprint on every replica and after every
  restart, and the engine renders the same prefix that is fingerprinted here.
- Between compressions the history is append-only, and the prompt of step N+1
  extends the prompt of step N token for token. `count_tokens` checks this at
  every message boundary and raises `TemplateNotAppendOnly` if the chat
  template or tokenizer breaks it, because then every step would miss the cache.
- Local rendering mimics vLLM's: tool-call arguments (JSON strings on the wire)
  are parsed into objects before the template sees them, so local token counts
  equal what the engine prefills. History must therefore hold only calls whose
  arguments parse (vLLM would silently render bad ones as `{}`).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, Required, TypedDict

from pydantic import JsonValue

from serve_apps.orchestrator.models import Message, PrefixFingerprint, SessionLimits, ToolSpec


class ChatTokenizer(Protocol):
    """The part of a Hugging Face tokenizer used here."""

    def apply_chat_template(self, conversation, **kwargs): ...

    def __call__(self, text, **kwargs): ...


class WireFunction(TypedDict):
    """The called function of a wire tool call; arguments are JSON text."""

    name: str
    arguments: str


class WireToolCall(TypedDict):
    """One assistant tool call in OpenAI wire form."""

    id: str
    type: Literal["function"]
    function: WireFunction


class WireMessage(TypedDict, total=False):
    """One OpenAI chat message as sent to the engine."""

    role: Required[str]
    content: str | None
    tool_calls: list[WireToolCall]
    tool_call_id: str
    name: str


class WireToolFunction(TypedDict):
    """What the model sees of one tool."""

    name: str
    description: str
    parameters: dict[str, JsonValue]


class WireTool(TypedDict):
    """One OpenAI `tools` entry."""

    type: Literal["function"]
    function: WireToolFunction


class TemplateNotAppendOnly(ValueError):
    """The chat template or tokenizer re-renders earlier messages when later ones are added."""


@dataclass(frozen=True)
class SessionState:
    """What one model call is built from: the session's fixed prefix plus its current history."""

    system_prompt: str
    tools: tuple[ToolSpec, ...]
    history: tuple[Message, ...]


@dataclass(frozen=True)
class TokenAccount:
    """Exact token counts of one prompt. `message_tokens[i]` belongs to history message i.

    `remaining_tokens` is negative when the prompt plus the output reserve no
    longer fits the window.
    """

    prefix_tokens: int
    message_tokens: tuple[int, ...]
    generation_prompt_tokens: int
    context_window_tokens: int
    output_reserve_tokens: int
    prefix_fingerprint: PrefixFingerprint

    @property
    def total_tokens(self) -> int:
        return self.prefix_tokens + sum(self.message_tokens) + self.generation_prompt_tokens

    @property
    def remaining_tokens(self) -> int:
        return self.context_window_tokens - self.total_tokens - self.output_reserve_tokens


def canonical_json(value: JsonValue) -> str:
    """The one serialization used for hashing and rendering: sorted keys, no spaces, UTF-8 kept."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def render_tools(tools: Sequence[ToolSpec]) -> list[WireTool]:
    """OpenAI-style tool list, sorted by name, with every key of `parameters` sorted.

    The wrapper keys keep the order vLLM's request models dump them in (`type`,
    `function`; `name`, `description`, `parameters`), and `parameters` keeps the
    order it is sent in, so the engine's template sees these exact dicts and its
    prefix tokens equal the ones fingerprinted here. Only name, description and
    parameters are shown to the model; permissions and execution stay
    server-side and therefore never change the cached prefix.
    """
    return [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description,
                # Round-tripping through the canonical text fixes key order for the template's `tojson`.
                "parameters": json.loads(canonical_json(tool.parameters)),
            },
        }
        for tool in sorted(tools, key=lambda t: t.name)
    ]


def to_wire_message(message: Message) -> WireMessage:
    """A stored message in OpenAI wire form (arguments stay JSON strings)."""
    wire: WireMessage = {"role": message.role, "content": message.content}
    if message.tool_calls is not None:
        wire["tool_calls"] = [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        wire["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        wire["name"] = message.name
    return wire


def build_chat_request(state: SessionState) -> tuple[list[WireMessage], list[WireTool]]:
    """Messages and tools of one chat completion: system prompt first, then the history.

    The system message is always present, even when empty, so the prompt shape
    never depends on its content.
    """
    messages: list[WireMessage] = [{"role": "system", "content": state.system_prompt}]
    messages.extend(to_wire_message(message) for message in state.history)
    return messages, render_tools(state.tools)


def effective_window_tokens(limits: SessionLimits, model_max_len_tokens: int) -> int:
    """The window a session may fill: its budget, capped by the model's context length."""
    window = model_max_len_tokens
    if limits.context_budget_tokens is not None:
        window = min(window, limits.context_budget_tokens)
    if limits.output_reserve_tokens >= window:
        raise ValueError(f"output_reserve_tokens={limits.output_reserve_tokens} leaves no room in a {window}-token window")
    return window


def _template_messages(messages: Sequence[WireMessage]) -> list[dict]:
    """Wire messages as vLLM hands them to the template: arguments parsed into objects, no None content."""
    out: list[dict] = []
    for message in messages:
        item = dict(message)
        if item.get("content") is None:
            item["content"] = ""  # vLLM turns a missing content into an empty text
        if "tool_calls" in message:
            calls = []
            for call in message["tool_calls"]:
                try:
                    arguments = json.loads(call["function"]["arguments"] or "{}")
                except json.JSONDecodeError as err:
                    raise ValueError(f"tool call {call['id']} has arguments that are not JSON: {err}") from None
                calls.append({**call, "function": {**call["function"], "arguments": arguments}})
            item["tool_calls"] = calls
        out.append(item)
    return out


def _token_ids(result: object) -> list[int]:
    """apply_chat_template(tokenize=True) returns ids or, in transformers 5, a BatchEncoding."""
    ids = result["input_ids"] if isinstance(result, Mapping) else result
    if not isinstance(ids, list) or (ids and not isinstance(ids[0], int)):
        raise TypeError(f"expected one sequence of token ids, got {type(ids).__name__}")
    return ids


def _render(tokenizer: ChatTokenizer, messages: list[dict], tools: list[WireTool], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def _encode(tokenizer: ChatTokenizer, text: str) -> list[int]:
    return _token_ids(tokenizer(text, add_special_tokens=False))


def _digest(token_ids: Sequence[int]) -> PrefixFingerprint:
    packed = struct.pack(f"<{len(token_ids)}I", *token_ids)
    return PrefixFingerprint(hashlib.sha256(packed).hexdigest())


def prefix_token_ids(tokenizer: ChatTokenizer, system_prompt: str, tools: Sequence[ToolSpec]) -> list[int]:
    """Token ids of the cacheable prefix: the template rendered with the system message and tools only."""
    result = tokenizer.apply_chat_template(
        [{"role": "system", "content": system_prompt}],
        tools=render_tools(tools) or None,
        tokenize=True,
        add_generation_prompt=False,
    )
    return _token_ids(result)


def prefix_fingerprint(tokenizer: ChatTokenizer, system_prompt: str, tools: Sequence[ToolSpec]) -> PrefixFingerprint:
    """sha256 over the little-endian uint32 token ids of the cacheable prefix.

    Any change to the system prompt or to what the model sees of the tools
    changes it; reordering tools or changing permissions/execution does not.
    """
    return _digest(prefix_token_ids(tokenizer, system_prompt, tools))


def token_ids_fingerprint(token_ids: Sequence[int]) -> PrefixFingerprint:
    """The fingerprint of already computed prefix token ids (as `prefix_fingerprint`)."""
    return _digest(token_ids)


def smallest_prompt_tokens(tokenizer: ChatTokenizer, system_prompt: str, tools: Sequence[ToolSpec]) -> int:
    """Tokens of the shortest prompt a turn can send: the prefix, a one-character user message, and
    the generation prompt (the template's tokens around a message count as much as its text)."""
    result = tokenizer.apply_chat_template(
        [{"role": "system", "content": system_prompt}, {"role": "user", "content": "?"}],
        tools=render_tools(tools) or None,
        tokenize=True,
        add_generation_prompt=True,
    )
    return len(_token_ids(result))


def prefix_overflow(
    num_prefix_tokens: int, num_smallest_prompt_tokens: int, context_window_tokens: int, output_reserve_tokens: int
) -> str | None:
    """Why no turn of a session with this prefix can fit its window, or None when one can.

    The shortest turn (`smallest_prompt_tokens`) plus `output_reserve_tokens` kept for the answer
    must fit; a session where it does not would fail every turn with `context_overflow`.
    """
    if num_smallest_prompt_tokens + output_reserve_tokens <= context_window_tokens:
        return None
    return (
        f"the system prompt and tools take {num_prefix_tokens} tokens ({num_smallest_prompt_tokens} with the "
        f"shortest message); with output_reserve_tokens={output_reserve_tokens} kept for the answer, no message "
        f"fits the session's {context_window_tokens}-token window"
    )


def prompt_token_ids(tokenizer: ChatTokenizer, messages: Sequence[WireMessage], tools: list[WireTool]) -> list[int]:
    """Token ids the engine prefills for these messages, generation prompt included."""
    result = tokenizer.apply_chat_template(
        _template_messages(messages), tools=tools or None, tokenize=True, add_generation_prompt=True
    )
    return _token_ids(result)


def count_tokens(
    tokenizer: ChatTokenizer,
    messages: Sequence[WireMessage],
    tools: list[WireTool],
    *,
    context_window_tokens: int,
    output_reserve_tokens: int,
) -> TokenAccount:
    """Exact token accounting of one prompt, split into prefix, messages and generation prompt.

    Renders every message prefix of the conversation (n+1 template renders) and
    tokenizes each segment once; the concatenation must equal the tokens of the
    whole prompt, which is the append-only property the cache depends on.

    Args:
        tokenizer: the served model's tokenizer, chat template included.
        messages: output of `build_chat_request`; the system message first.
        tools: output of `build_chat_request`.
        context_window_tokens: window the session may fill.
        output_reserve_tokens: tokens kept for the answer.

    Returns:
        The account; `message_tokens` aligns with `messages[1:]`.

    Raises:
        TemplateNotAppendOnly: a message boundary is not a token boundary, or
            rendering a prefix of the conversation is not a prefix of the full text.
    """
    if not messages or messages[0]["role"] != "system":
        raise ValueError("messages must start with the system message (see build_chat_request)")
    rendered = _template_messages(messages)
    full_text = _render(tokenizer, rendered, tools, add_generation_prompt=True)
    boundaries = [0]
    for end in range(1, len(rendered) + 1):
        text = _render(tokenizer, rendered[:end], tools, add_generation_prompt=False)
        if not full_text.startswith(text) or len(text) < boundaries[-1]:
            raise TemplateNotAppendOnly(f"the first {end} messages render differently once later ones are added")
        boundaries.append(len(text))
    boundaries.append(len(full_text))
    segments = [_encode(tokenizer, full_text[a:b]) for a, b in zip(boundaries, boundaries[1:])]
    if [i for segment in segments for i in segment] != _encode(tokenizer, full_text):
        raise TemplateNotAppendOnly("a message boundary falls inside a token; later steps would miss the cache")
    return TokenAccount(
        prefix_tokens=len(segments[0]),
        message_tokens=tuple(len(segment) for segment in segments[1:-1]),
        generation_prompt_tokens=len(segments[-1]),
        context_window_tokens=context_window_tokens,
        output_reserve_tokens=output_reserve_tokens,
        prefix_fingerprint=_digest(segments[0]),
    )
