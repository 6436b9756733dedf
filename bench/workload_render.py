"""How a workload's steps reach an engine: OpenAI chat bodies and the token ids prefilled.

Apart from the workloads themselves because a workload is only sizes, keys and
times, and the same one is rendered two ways: `openai_request` gives the OpenAI
chat body (messages, tools); `TokenizerRenderer` turns it into token ids
through the model's tokenizer and chat template exactly as the router and vLLM
do (`router.prompt_tokens.template_messages` + `apply_chat_template`), for live
runs; `SyntheticRenderer` gives token ids of the same prefix structure without
a tokenizer, for simulations with thousands of sessions.
"""

from __future__ import annotations

import hashlib
import json
import random
from array import array
from functools import lru_cache
from typing import Protocol

from bench.workloads import Message, Part, Session, TextStyle, ToolSpec, context_tokens


# --- content text ---------------------------------------------------------------------------------

_PROSE = (
    "the", "agent", "checks", "order", "status", "before", "it", "answers", "and", "every", "refund", "needs",
    "a", "valid", "receipt", "customer", "account", "is", "verified", "when", "request", "arrives", "from",
    "support", "team", "with", "priority", "high", "or", "low", "depending", "on", "contract", "terms", "tool",
    "results", "must", "be", "quoted", "exactly", "never", "guess", "values", "report", "shows", "latency",
    "budget", "for", "each", "region", "service", "owner", "escalates", "incident", "after", "two", "failures",
    "cache", "warm", "prefix", "replica", "routes", "document", "section", "summary", "plan", "review", "test",
)
_CODE_NAMES = ("value", "items", "config", "result", "index", "count", "buffer", "request", "handler", "path",
               "total", "state", "cache", "node", "parent", "offset", "limit", "record", "token", "block")


def _chars_per_token(style: TextStyle) -> float:
    # Measured with the built model's byte-level BPE (trained on Python sources):
    # code is dense for it, prose and JSON less so.
    return {"prose": 4.0, "json": 1.95, "code": 3.35}[style]


def _seeded(key: str) -> random.Random:
    return random.Random(int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "little"))


@lru_cache(maxsize=16384)
def part_text(part: Part) -> str:
    """The text of `part`: a pure function of its key, size and style (about `num_tokens` tokens)."""
    rng = _seeded(part.key)
    target_chars = int(part.num_tokens * _chars_per_token(part.style))
    pieces: list[str] = []
    length = 0
    counter = 0
    while length < target_chars:
        counter += 1
        if part.style == "json":
            piece = (f'{{"{rng.choice(_CODE_NAMES)}_{counter}": "{rng.choice(_PROSE)} {rng.choice(_PROSE)}", '
                     f'"id": "ID-{rng.randrange(10**6):06d}", "n": {rng.randrange(10**4)}}}\n')
        elif part.style == "code":
            a, b = rng.choice(_CODE_NAMES), rng.choice(_CODE_NAMES)
            piece = (f"def {a}_{counter}({b}, limit={rng.randrange(100)}):\n"
                     f"    return [{b}.{a} for {a} in {b} if {a}.{rng.choice(_CODE_NAMES)} > limit]\n")
        else:
            words = [rng.choice(_PROSE) for _ in range(rng.randint(6, 14))]
            piece = " ".join(words) + (".\n" if rng.random() < 0.3 else ". ")
        pieces.append(piece)
        length += len(piece)
    return "".join(pieces)


def tool_dict(tool: ToolSpec) -> dict:
    """OpenAI function tool."""
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": part_text(tool.description),
            "parameters": {
                "type": "object",
                "properties": {name: {"type": "string", "description": f"the {name}"} for name in tool.param_names},
                "required": list(tool.param_names[:1]),
            },
        },
    }


def message_dict(message: Message) -> dict:
    """OpenAI chat message (tool-call arguments as a JSON string, as clients send them)."""
    text = "".join(part_text(part) for part in message.parts)
    if message.role == "assistant" and message.tool_name is not None:
        return {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": message.call_id, "type": "function",
                            "function": {"name": message.tool_name, "arguments": json.dumps({"input": text})}}],
        }
    if message.role == "tool":
        return {"role": "tool", "tool_call_id": message.call_id, "content": text}
    out = {"role": message.role, "content": text}
    if message.name is not None:
        out["name"] = message.name
    return out


def openai_request(session: Session, step_index: int) -> tuple[list[dict], list[dict]]:
    """(messages, tools) of one step's chat completion request."""
    return [message_dict(m) for m in session.prompt(step_index)], [tool_dict(t) for t in session.tools]


# --- token ids ------------------------------------------------------------------------------------


class PromptRenderer(Protocol):
    """Turns a session's step into the token ids an engine prefills."""

    def token_ids(self, session: Session, step_index: int) -> array:
        """Token ids of the step's prompt, as an `array("I")`."""
        ...


class TokenizerRenderer:
    """Token ids through the model's tokenizer and chat template, exactly as the router and vLLM compute them."""

    def __init__(self, model_source: str) -> None:
        from transformers import AutoTokenizer

        from router.prompt_tokens import template_messages

        self._tokenizer = AutoTokenizer.from_pretrained(model_source)
        self._template_messages = template_messages

    def chat_token_ids(self, messages: list[dict], tools: list[dict]) -> array:
        text = self._tokenizer.apply_chat_template(
            self._template_messages(messages), tools=tools or None, add_generation_prompt=True, tokenize=False
        )
        return array("I", self._tokenizer.encode(text, add_special_tokens=False))

    def token_ids(self, session: Session, step_index: int) -> array:
        messages, tools = openai_request(session, step_index)
        return self.chat_token_ids(messages, tools)


class SyntheticRenderer:
    """Token ids with the prefix structure of the chat template, without a tokenizer.

    Layout (mirrors `cluster.model_builder.CHAT_TEMPLATE`): BOS, then per message
    a role header id, its parts, an end-of-turn id; the tool schemas follow the
    system message's text; the prompt ends with the assistant header (the
    generation prompt), so step k's prompt is a prefix of step k+1's.
    Part ids are pseudo-random 32-bit values drawn from the part's key, exactly
    `num_tokens` of them.
    """

    _BOS, _EOT = 1, 4
    _HEADER = {"system": 10, "user": 11, "assistant": 12, "tool": 13}

    def __init__(self, max_cached_parts: int = 65536) -> None:
        self._parts: dict[Part, bytes] = {}
        self._max_cached_parts = max_cached_parts
        self._tools: dict[tuple[ToolSpec, ...], bytes] = {}

    def _part_bytes(self, part: Part) -> bytes:
        data = self._parts.get(part)
        if data is None:
            data = _seeded(part.key).randbytes(4 * part.num_tokens)
            if len(self._parts) >= self._max_cached_parts:
                self._parts.clear()  # cheap bound; parts are re-derived from their keys
            self._parts[part] = data
        return data

    def _ids(self, *ids: int) -> bytes:
        return array("I", ids).tobytes()

    def token_ids(self, session: Session, step_index: int) -> array:
        chunks: list[bytes] = [self._ids(self._BOS)]
        for message in session.prompt(step_index):
            chunks.append(self._ids(self._HEADER[message.role]))
            if message.tool_name is not None:
                chunks.append(self._ids(_name_id(message.tool_name)))
            chunks.extend(self._part_bytes(part) for part in message.parts)
            if message.role == "system":
                chunks.append(self._tool_bytes(session.tools))
            chunks.append(self._ids(self._EOT))
        chunks.append(self._ids(self._HEADER["assistant"]))
        tokens = array("I")
        tokens.frombytes(b"".join(chunks))
        return tokens

    def _tool_bytes(self, tools: tuple[ToolSpec, ...]) -> bytes:
        data = self._tools.get(tools)
        if data is None:
            data = b"".join(self._part_bytes(Part(f"{t.description.key}/schema", t.num_tokens)) for t in tools)
            self._tools[tools] = data
        return data


def _name_id(name: str) -> int:
    return 100 + int.from_bytes(hashlib.blake2b(name.encode(), digest_size=2).digest(), "little")


def nominal_prompt_tokens(session: Session, step_index: int) -> int:
    """Prompt size in nominal tokens (what `SyntheticRenderer` produces, minus template ids)."""
    return context_tokens(session.prompt(step_index), session.tools)


__all__ = [
    "PromptRenderer", "SyntheticRenderer", "TokenizerRenderer", "message_dict", "nominal_prompt_tokens",
    "openai_request", "part_text", "tool_dict",
]
