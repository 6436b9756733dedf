"""Cache-first prompt layout, canonical tool rendering and exact token accounting.

Ordering: system prompt, then tool schemas (the chat template renders both into
the system block), then the history oldest first. The first two never change
during a session, so their KV blocks are shared by every step of every turn.

Invariants:
- `render_tools` is a pure function of the set of tools: sorted by name, schema
  keys sorted, wrapper keys in vLLM's order, so equal tools give equal bytes,
  equal token ids and an equal fingerprint on every replica and after every
  restart, and the engine renders the same prefix that is fingerprinted here.
- Between compressions the history is append-only, so where the chat template
  renders each message as the whole prompt has it, the prompt of step N+1
  extends the prompt of step N token for token. `count_tokens` counts a message
  the template renders only with what follows it (Llama 3's tools in the first
  user message, Qwen's runs of tool results) with the next one; a template that
  rewrites earlier messages costs cache hits there, never a turn.
- Local rendering mimics vLLM's: tool-call arguments (JSON strings on the wire)
  are parsed into objects before the template sees them, and arguments that are
  JSON but not an object render as `{}`, so local token counts equal what the
  engine prefills. History must therefore hold only calls whose arguments parse
  (vLLM would silently render bad ones as `{}`).
- A user message never follows a user message or a tool result with nothing between:
  `build_chat_request` puts a fixed assistant message there (`ACKNOWLEDGEMENTS`),
  after a compression's summary and after a turn that ended at its step limit.
  Templates that check roles alternate (Mistral's) refuse the conversation
  otherwise. Token counts fold it into the message before it.
- Text of the history never spells a control token: `build_chat_request`
  neutralises the tokenizer's control-token strings (`ControlTokens`) in what it
  sends, and token counts are taken over the same messages, so a tool result
  cannot close its turn and open a forged one. The stored transcript stays verbatim.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import weakref
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, Required, TypedDict

import jinja2
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
    reasoning: str  # the engine's field: a reasoning model's thought before this assistant message


class WireToolFunction(TypedDict):
    """What the model sees of one tool."""

    name: str
    description: str
    parameters: dict[str, JsonValue]


class WireTool(TypedDict):
    """One OpenAI `tools` entry."""

    type: Literal["function"]
    function: WireToolFunction


# Inserted after the first character of a control-token string: the text reads the same, the token is gone.
ZERO_WIDTH_SPACE = "\u200b"


class ControlTokens:
    """The strings a tokenizer reads as control tokens, and text kept from spelling them.

    Why: the tokenizer turns an added token's text into that token wherever it
    occurs, so a tool result holding `<|eot_id|><|start_header_id|>system...`
    would end its turn and open a forged system turn. Neutralising happens where
    the prompt is built, never where text is stored: the transcript stays
    verbatim, and a message renders the same bytes at every step.
    """

    def __init__(self, texts: Iterable[str] = ()) -> None:
        # A one-character token cannot be broken inside; whitespace tokens are ordinary text.
        self.texts = frozenset(text for text in texts if len(text) > 1 and not text.isspace())
        alternatives = sorted(self.texts, key=len, reverse=True)  # the longest of overlapping tokens first
        self._pattern = re.compile("|".join(map(re.escape, alternatives))) if alternatives else None

    @classmethod
    def of(cls, tokenizer: object) -> "ControlTokens":
        """The tokenizer's special tokens, and its other added tokens that the chat template writes (`<tool_call>`)."""
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        template = getattr(tokenizer, "chat_template", None) or ""
        if isinstance(template, Mapping):  # named templates
            template = "\n".join(template.values())
        return cls(token.content for token in added.values() if token.special or token.content in template)

    def neutralize(self, text: str) -> str:
        """`text` with ZERO_WIDTH_SPACE after the first character of every control-token string in it."""
        if self._pattern is None:
            return text
        while True:  # a break inside one token may leave another one (`<s>` holds `s>`): repeat until none is left
            broken = self._pattern.sub(lambda match: match[0][0] + ZERO_WIDTH_SPACE + match[0][1:], text)
            if broken == text:
                return text
            text = broken

    def neutralize_arguments(self, arguments: str) -> str:
        """Tool-call arguments whose strings (keys and values, as the template prints them) spell no control token.

        The template prints parsed arguments, where `"\\u003c|eot_id|>"` is `<|eot_id|>`, so the
        strings are neutralised after parsing. Unchanged arguments keep their text as written.
        """
        if self._pattern is None:
            return arguments
        try:
            value = json.loads(arguments)
        except (ValueError, RecursionError):  # vLLM renders such arguments as `{}`: none of the text is shown
            return arguments
        neutralized = self._neutralize_value(value)
        return arguments if neutralized == value else json.dumps(neutralized, ensure_ascii=False)

    def _neutralize_value(self, value: JsonValue) -> JsonValue:
        if isinstance(value, str):
            return self.neutralize(value)
        if isinstance(value, list):
            return [self._neutralize_value(item) for item in value]
        if isinstance(value, dict):
            return {self.neutralize(key): self._neutralize_value(item) for key, item in value.items()}
        return value


NO_CONTROL_TOKENS = ControlTokens()
_CONTROL_TOKENS_BY_TOKENIZER: "weakref.WeakKeyDictionary[object, ControlTokens]" = weakref.WeakKeyDictionary()


def control_tokens_of(tokenizer: object) -> ControlTokens:
    """`ControlTokens.of(tokenizer)`, found once per tokenizer: every turn asks, and a vocabulary may add thousands."""
    found = _CONTROL_TOKENS_BY_TOKENIZER.get(tokenizer)
    if found is None:
        found = _CONTROL_TOKENS_BY_TOKENIZER[tokenizer] = ControlTokens.of(tokenizer)
    return found


class TemplateCannotRender(ValueError):
    """The model's chat template refuses the simplest conversation a session sends (a system and a user message)."""


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
    if message.reasoning is not None:
        wire["reasoning"] = message.reasoning
    return wire


# The assistant message between a user message and the message before it, by that message's role: a
# compression's summary (a user message), or a tool result a turn that ran out of steps ended with.
ACKNOWLEDGEMENTS: Mapping[str, str] = {
    "user": "Understood.",
    "tool": "(The turn ended here: it used all its steps before an answer.)",
}
ACKNOWLEDGEMENT_NAME = "warmpath-acknowledgement"


def build_chat_request(
    state: SessionState, control_tokens: ControlTokens = NO_CONTROL_TOKENS
) -> tuple[list[WireMessage], list[WireTool]]:
    """Messages and tools of one chat completion: system prompt first, then the history.

    The system message is always present, even when empty, so the prompt shape
    never depends on its content. Every text of the history (user, assistant,
    tool, summaries) is neutralised against `control_tokens`; the system prompt
    and tools, which the session's creator wrote, are the cached prefix and stay as written.
    A user message after a user message or a tool result has an acknowledgement before it
    (`ACKNOWLEDGEMENTS`, named `ACKNOWLEDGEMENT_NAME`): the history stays as stored.
    """
    messages: list[WireMessage] = [{"role": "system", "content": state.system_prompt}]
    previous_role = None
    for message in state.history:
        if message.role == "user" and previous_role in ACKNOWLEDGEMENTS:
            messages.append({"role": "assistant", "content": ACKNOWLEDGEMENTS[previous_role],
                             "name": ACKNOWLEDGEMENT_NAME})
        messages.append(_neutralized(to_wire_message(message), control_tokens))
        previous_role = message.role
    return messages, render_tools(state.tools)


def _is_acknowledgement(message: WireMessage) -> bool:
    return message["role"] == "assistant" and message.get("name") == ACKNOWLEDGEMENT_NAME


def _neutralized(message: WireMessage, control_tokens: ControlTokens) -> WireMessage:
    """`message` with its content, reasoning, names, call ids and call arguments neutralised against `control_tokens`.

    Call ids too: some parsers keep the ids the model wrote (Kimi K2's), and some templates print them
    (Mistral's, Kimi's), in the call and in the result that answers it (neutralised alike, so they still pair).
    """
    out: WireMessage = dict(message)  # type: ignore[assignment]
    if out.get("content") is not None:
        out["content"] = control_tokens.neutralize(out["content"])
    if "reasoning" in out:
        out["reasoning"] = control_tokens.neutralize(out["reasoning"])
    if "name" in out:
        out["name"] = control_tokens.neutralize(out["name"])
    if "tool_call_id" in out:
        out["tool_call_id"] = control_tokens.neutralize(out["tool_call_id"])
    if "tool_calls" in out:
        out["tool_calls"] = [
            {**call, "id": control_tokens.neutralize(call["id"]),
             "function": {"name": control_tokens.neutralize(call["function"]["name"]),
                          "arguments": control_tokens.neutralize_arguments(call["function"]["arguments"])}}
            for call in out["tool_calls"]
        ]
    return out


def session_window_tokens(limits: SessionLimits, model_max_len_tokens: int) -> int:
    """The window a session may fill: its budget, capped by the model's context length."""
    if limits.context_budget_tokens is not None:
        return min(model_max_len_tokens, limits.context_budget_tokens)
    return model_max_len_tokens


def effective_window_tokens(limits: SessionLimits, model_max_len_tokens: int) -> int:
    """`session_window_tokens`, refused (ValueError) where the output reserve leaves no room in it.

    A session's limits are checked against the model when it is created; a model
    redeployed with a shorter context can make an older session's limits fail this.
    """
    window = session_window_tokens(limits, model_max_len_tokens)
    if limits.output_reserve_tokens >= window:
        raise ValueError(f"output_reserve_tokens={limits.output_reserve_tokens} leaves no room in a {window}-token window")
    return window


def _template_messages(messages: Sequence[WireMessage]) -> list[dict]:
    """Wire messages as vLLM hands them to the template: arguments parsed into objects, no None content,
    reasoning also as `reasoning_content` (Qwen3's and DeepSeek's templates read that name), and each tool
    call's keys in the order its request validation leaves them (OpenAI's types: `id`, `function` with
    `arguments` then `name`, `type`), which a template printing `tool_call.function | tojson` (Mistral's)
    writes out."""
    out: list[dict] = []
    for message in messages:
        item = dict(message)
        if item.get("content") is None:
            item["content"] = ""  # vLLM turns a missing content into an empty text
        if "reasoning" in item:
            item["reasoning_content"] = item["reasoning"]
        if "tool_calls" in message:
            calls = []
            for call in message["tool_calls"]:
                try:
                    arguments = json.loads(call["function"]["arguments"] or "{}")
                except json.JSONDecodeError as err:
                    raise ValueError(f"tool call {call['id']} has arguments that are not JSON: {err}") from None
                if not isinstance(arguments, dict):
                    arguments = {}  # vLLM coerces arguments that are not an object, and templates need a mapping
                calls.append({"id": call["id"], "function": {"arguments": arguments, "name": call["function"]["name"]},
                              "type": call["type"]})
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
    """The template's text; whatever it raises is its refusal (`jinja2.TemplateError`), as vLLM takes it.

    Why: a template fails in plain Python too (DeepSeek V3's adds a string to the parsed arguments: a
    TypeError), and the caller must tell that from a fault of its own.
    """
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except jinja2.TemplateError:
        raise
    except Exception as err:
        raise jinja2.TemplateError(f"{type(err).__name__}: {err}") from err


def _render_or_none(
    tokenizer: ChatTokenizer, messages: list[dict], tools: list[WireTool], add_generation_prompt: bool
) -> str | None:
    """`_render`, or None where the template refuses the conversation (`raise_exception`, a missing field)."""
    try:
        return _render(tokenizer, messages, tools, add_generation_prompt)
    except jinja2.TemplateError:
        return None


def _rendered_prefix(tokenizer: ChatTokenizer, text: str | None, whole: str) -> str | None:
    """`text`, a conversation rendered without a generation prompt, as it starts `whole`: less the end-of-text
    token a template writes where no generation prompt follows (Phi-3's and Phi-4-mini's), where only that
    keeps it from doing so; None where it does not.

    Why: counted as not starting the prompt, every message of such a template was counted with the next,
    each counting 0, and the session's prefix was empty.
    """
    if text is None or whole.startswith(text):
        return text
    shorter = _without_end_of_text(tokenizer, text)
    return shorter if shorter is not None and whole.startswith(shorter) else None


def _without_end_of_text(tokenizer: ChatTokenizer, text: str) -> str | None:
    """`text` less the tokenizer's end-of-text token it ends with, or None where it does not end with one."""
    end = getattr(tokenizer, "eos_token", None)
    return text[: -len(end)] if isinstance(end, str) and end and text.endswith(end) else None


def _encode(tokenizer: ChatTokenizer, text: str) -> list[int]:
    return _token_ids(tokenizer(text, add_special_tokens=False))


def _digest(token_ids: Sequence[int]) -> PrefixFingerprint:
    packed = struct.pack(f"<{len(token_ids)}I", *token_ids)
    return PrefixFingerprint(hashlib.sha256(packed).hexdigest())


def prefix_token_ids(tokenizer: ChatTokenizer, system_prompt: str, tools: Sequence[ToolSpec]) -> list[int]:
    """Token ids of the cacheable prefix: what every prompt of a session with this system prompt and these tools
    starts with (`_prefix_ids`)."""
    return _prefix_ids(tokenizer, {"role": "system", "content": system_prompt}, render_tools(tools))


def _prefix_ids(tokenizer: ChatTokenizer, system: WireMessage, tools: list[WireTool]) -> list[int]:
    """The system message and tools rendered alone where that starts every prompt and shows the system text and
    tool names; else the tokens two prompts with different first user messages share.

    Why two ways: most templates (ChatML, Qwen, Hermes) render the system block and tools before the
    history, so the system message rendered alone is the prefix. Llama 3's templates put the tools into
    the first user message and refuse a conversation without one: their shared prefix ends inside the
    first user message, and only a rendering with one shows where.

    Raises:
        TemplateCannotRender: the template renders no conversation of a system and a user message.
    """
    probes = []
    for text in _PROBE_TEXTS:
        try:
            rendered = _render(tokenizer, [system, {"role": "user", "content": text}], tools, False)
        except jinja2.TemplateError as err:
            raise TemplateCannotRender(f"the model's chat template renders no conversation of this system prompt, "
                                       f"these tools and a user message: {err}") from None
        probes.append(_encode(tokenizer, rendered))
    alone = _render_or_none(tokenizer, [system], tools, False)
    # Only where it shows what the session shares: Gemma's renders `<bos>` alone, the system text and
    # tools going into the first user turn.
    shown = [system.get("content") or "", *(tool["function"]["name"] for tool in tools)]
    if alone is not None and all(text in alone for text in shown):
        for text in (alone, _without_end_of_text(tokenizer, alone)):  # Phi's end-of-text trailer (`_rendered_prefix`)
            ids = _encode(tokenizer, text) if text is not None else None
            if ids is not None and all(probe[: len(ids)] == ids for probe in probes):
                return ids
    return probes[0][: _common_length(*probes)]


_PROBE_TEXTS = ("A", "B")  # two first user messages that differ from their first character


def _common_length(first: Sequence[int], second: Sequence[int]) -> int:
    """How many leading token ids two sequences share."""
    for at, (a, b) in enumerate(zip(first, second)):
        if a != b:
            return at
    return min(len(first), len(second))


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
    messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": "?"}]
    try:
        text = _render(tokenizer, messages, render_tools(tools), add_generation_prompt=True)
    except jinja2.TemplateError as err:
        raise TemplateCannotRender(f"the model's chat template renders no conversation of this system prompt, "
                                   f"these tools and a user message: {err}") from None
    return len(_encode(tokenizer, text))


def prefix_overflow(num_smallest_prompt_tokens: int, context_window_tokens: int, output_reserve_tokens: int) -> str | None:
    """Why no turn of a session with this prefix can fit its window, or None when one can.

    The shortest turn (`smallest_prompt_tokens`) plus `output_reserve_tokens` kept for the answer
    must fit; a session where it does not would fail every turn with `context_overflow`. Asked before
    the prefix's own tokens are counted (three renderings more): a body of megabytes of tools is refused
    after one.
    """
    if num_smallest_prompt_tokens + output_reserve_tokens <= context_window_tokens:
        return None
    return (
        f"the system prompt and tools take {num_smallest_prompt_tokens} tokens with the shortest message; with "
        f"output_reserve_tokens={output_reserve_tokens} kept for the answer, no message "
        f"fits the session's {context_window_tokens}-token window"
    )


def prompt_token_ids(tokenizer: ChatTokenizer, messages: Sequence[WireMessage], tools: list[WireTool]) -> list[int]:
    """Token ids the engine prefills for these messages, generation prompt included."""
    result = tokenizer.apply_chat_template(
        _template_messages(messages), tools=tools or None, tokenize=True, add_generation_prompt=True
    )
    return _token_ids(result)


@dataclass
class CountMemo:
    """What `count_tokens` learnt from the last prompt it counted, so the next one renders only its new messages.

    Why: telling each message's tokens apart renders the template once per message
    prefix, which is quadratic in the history. Steps and turns of a session mostly
    append to the prompt counted before, whose prefix texts and tokens are kept here.
    A count reuses them only for leading messages identical to the ones counted
    (same tokenizer, same tools), and only while their text still starts the new
    prompt, so its result is the one a count from scratch gives.
    """

    tokenizer: object = None
    tools_key: str = ""
    message_keys: list[str] = field(default_factory=list)  # each message as the template gets it, as JSON
    boundaries: list[int] = field(default_factory=lambda: [0])  # boundaries[k]: length of the first k messages' text
    text: str = ""  # the text of all counted messages, without the generation prompt
    segments: list[array] = field(default_factory=list)  # segments[k]: token ids of message k (0: the prefix)
    prefix_ids: list[int] | None = None  # `_prefix_ids` of these messages' system message and tools

    def num_reusable(self, tokenizer: ChatTokenizer, tools_key: str, message_keys: list[str], full_text: str) -> int:
        """How many leading messages of a prompt (`full_text`, described by the keys) this memo already counted.

        Of the identical leading messages, those whose text still starts the prompt: the last one counted
        may have been rendered as the last (Qwen closes a run of tool results after its last one only).
        """
        if tokenizer is not self.tokenizer or tools_key != self.tools_key:
            return 0
        num_shared = 0
        for known, key in zip(self.message_keys, message_keys):
            if known != key:
                break
            num_shared += 1
        # None when the template renders them differently now (a date in the system block, say): count afresh.
        while num_shared and not full_text.startswith(self.text[: self.boundaries[num_shared]]):
            num_shared -= 1
        # Nor a message counted with the next (its segment empty): its boundary is the one before it, which
        # says nothing of how it renders now (Llama 3.2's system block, whose date changed at midnight).
        while num_shared and not self.segments[num_shared - 1]:
            num_shared -= 1
        return num_shared


def count_tokens(
    tokenizer: ChatTokenizer,
    messages: Sequence[WireMessage],
    tools: list[WireTool],
    *,
    context_window_tokens: int,
    output_reserve_tokens: int,
    memo: CountMemo | None = None,
) -> TokenAccount:
    """Exact token accounting of one prompt, split into prefix, messages and generation prompt.

    Renders every message prefix of the conversation (n+1 template renders, fewer
    with a `memo` of an earlier count) and tokenizes each segment once; the
    concatenation equals the tokens of the whole prompt.

    A message whose rendering is not where the whole prompt has it (the template
    refuses the conversation that ends with it, or renders it differently once
    later messages follow) is counted with the messages after it, up to the next
    that is: Llama 3 puts the tools into the first user message and refuses a
    system message alone, Qwen closes a run of tool results after the last one.
    So is a message whose text ends inside a token. The joined messages count
    0; the total stays exact. Where the template re-renders earlier messages for
    good (a history it rewrites), steps miss the cache there, and the prompt is
    still counted and sent: the cache statistics show it.

    Args:
        tokenizer: the served model's tokenizer, chat template included.
        messages: output of `build_chat_request`; the system message first.
        tools: output of `build_chat_request`.
        context_window_tokens: window the session may fill.
        output_reserve_tokens: tokens kept for the answer.
        memo: what an earlier count of the session learnt; reused where it still holds, then updated.

    Returns:
        The account; `message_tokens` aligns with the history (`messages[1:]` less the acknowledgements
        `build_chat_request` adds, each counted with the message before it).
    """
    if not messages or messages[0]["role"] != "system":
        raise ValueError("messages must start with the system message (see build_chat_request)")
    rendered = _template_messages(messages)
    full_text = _render(tokenizer, rendered, tools, add_generation_prompt=True)
    tools_key = json.dumps(tools, ensure_ascii=False)
    # Key order counts: a template may print a message or its arguments as JSON.
    message_keys = [json.dumps(message, ensure_ascii=False) for message in rendered]
    num_reused = memo.num_reusable(tokenizer, tools_key, message_keys, full_text) if memo is not None else 0
    boundaries = memo.boundaries[: num_reused + 1] if num_reused else [0]
    segments = memo.segments[:num_reused] if num_reused else []
    for end in range(num_reused + 1, len(rendered) + 1):
        text = _rendered_prefix(tokenizer, _render_or_none(tokenizer, rendered[:end], tools, False), full_text)
        if text is None or len(text) < boundaries[-1]:
            boundaries.append(boundaries[-1])  # counted with the next message
            segments.append(array("I"))
            continue
        boundaries.append(len(text))
        segments.append(array("I", _encode(tokenizer, full_text[boundaries[-2] : boundaries[-1]])))
    full_ids = _encode(tokenizer, full_text)
    generation = _encode(tokenizer, full_text[boundaries[-1] :])
    while (split := _split_boundary(boundaries, segments, generation, full_ids)) is not None:
        generation = _join_at(tokenizer, full_text, boundaries, segments, split)
    shared = memo.prefix_ids if memo is not None and num_reused else None
    if shared is None:
        shared = _prefix_ids(tokenizer, rendered[0], tools)
    # The session's prefix as this prompt starts with it (`_prefix_ids`: it may end inside the first user
    # message, as Llama 3's and Gemma's templates render the system text and tools), and at least the system
    # message's own segment; each message counts its tokens after it.
    num_counted = sum(map(len, segments))  # the generation prompt's tokens are never the prefix's
    num_prefix = max(min(_common_length(full_ids, shared), num_counted), len(segments[0]))
    message_tokens, start = [], len(segments[0])
    for message, segment in zip(messages[1:], segments[1:]):
        end = start + len(segment)
        count = max(0, end - max(start, num_prefix))
        if _is_acknowledgement(message):  # counted with the message it follows (`build_chat_request`)
            message_tokens[-1] += count
        else:
            message_tokens.append(count)
        start = end
    if memo is not None:
        memo.tokenizer, memo.tools_key, memo.message_keys = tokenizer, tools_key, message_keys
        memo.boundaries, memo.text, memo.segments = boundaries, full_text[: boundaries[-1]], segments
        memo.prefix_ids = shared
    return TokenAccount(
        prefix_tokens=num_prefix,
        message_tokens=tuple(message_tokens),
        generation_prompt_tokens=len(generation),
        context_window_tokens=context_window_tokens,
        output_reserve_tokens=output_reserve_tokens,
        prefix_fingerprint=_digest(full_ids[:num_prefix]),
    )


def _split_boundary(boundaries: Sequence[int], segments: Sequence[array], generation: list[int],
                    full_ids: list[int]) -> int | None:
    """A boundary (text offset) whose two sides tokenize differently apart than together, or None when the
    segments' tokens are the prompt's."""
    at = 0
    for index, segment in enumerate(segments):
        end = at + len(segment)
        if list(segment) != full_ids[at:end]:
            # A first token that differs is decided by the text before it; a later one by the text after.
            is_first_different = at >= len(full_ids) or segment[0] != full_ids[at]
            return boundaries[index] if is_first_different and boundaries[index] else boundaries[index + 1]
        at = end
    return boundaries[-1] if generation != full_ids[at:] else None


def _join_at(
    tokenizer: ChatTokenizer, full_text: str, boundaries: list[int], segments: list[array], offset: int
) -> list[int]:
    """Counts the message that ends at text `offset` with the ones after it; returns the generation prompt's
    tokens. Re-encodes only the segment (or the generation prompt) that takes its text."""
    start = max(b for b in boundaries if b < offset)
    after = boundaries.index(offset)
    while after < len(boundaries) and boundaries[after] == offset:
        boundaries[after] = start
        segments[after - 1] = array("I")
        after += 1
    if after < len(boundaries):
        segments[after - 1] = array("I", _encode(tokenizer, full_text[start : boundaries[after]]))
    return _encode(tokenizer, full_text[boundaries[-1] :])
