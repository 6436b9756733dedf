"""The token ids an engine will see for a request, computed in the router.

Why: the index is keyed by hashes of token blocks, so the router must render
and tokenize exactly as vLLM's OpenAI layer does, or every prediction is off by
whatever the difference shifts. This mirrors vLLM's renderer for the two
request kinds the ingress forwards:
- chat: assistant tool-call arguments parsed from JSON text into objects
  (invalid, empty or non-object arguments become `{}`, as vLLM's
  `_postprocess_messages` does), then
  `apply_chat_template(messages, tools=[tool.model_dump() ...],
  add_generation_prompt, continue_final_message, **chat_template_kwargs)` as
  text, then `encode(text, add_special_tokens=request.add_special_tokens)`;
- completions: token-id prompts as given, text prompts encoded with
  `add_special_tokens`.
`tests/integration/test_router.py` checks parity against the ids the engine
renders itself for chat requests with tools.

Forwarding: a chat request whose rendering the router reproduces exactly
(text-only messages, the served chat template, no `echo` or `documents`)
carries the router's ids to the engine in `kv_transfer_params
["prompt_token_ids"]`, the field vLLM's renderer reads to skip templating and
tokenization (added for disaggregated prefill; Ray's own KV-aware router uses
it too). The engine then prefills exactly the tokens the router hashed, and a
replica no longer spends CPU on rendering what the router already rendered.

Chat prompts are encoded piece by piece between added tokens, with pieces
seen before (earlier turns, the system prompt and tools) taken from a cache
(`router.piece_encoder`), when the tokenizer allows it.

The tokenizer loads lazily on first use (once per process) from the same
folder or hub id the engines load.
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
from typing import Any, Optional

from router.piece_encoder import PieceEncoder

SESSION_BODY_FIELD = "session_id"
MAX_SESSION_ID_CHARS = 256
# Set by the renderer itself; a request's `chat_template_kwargs` cannot override them (vLLM drops them too).
_RENDERER_ARGUMENTS = frozenset({"tokenize", "tools", "add_generation_prompt", "continue_final_message", "conversation"})
FORWARDED_IDS_KEY = "prompt_token_ids"


def _arguments_object(arguments: Any) -> dict:
    if isinstance(arguments, dict):
        return arguments
    if not arguments:
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return {}
    return arguments if isinstance(arguments, dict) else {}


def template_messages(messages: list) -> list[dict]:
    """Messages as vLLM hands them to the chat template (copies; the request is untouched)."""
    out = []
    for message in messages:
        message = copy.deepcopy(message if isinstance(message, dict) else message.model_dump())
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list):
            if not calls:
                message.pop("tool_calls")
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict):
                    function["arguments"] = _arguments_object(function.get("arguments"))
        out.append(message)
    return out


class PromptTokenizer:
    """Renders and tokenizes OpenAI requests the way the engines do."""

    def __init__(self, model_source: str) -> None:
        self._model_source = model_source
        self._tokenizer = None
        self._piece_encoder: Optional[PieceEncoder] = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            with self._lock:
                if self._tokenizer is None:
                    from transformers import AutoTokenizer

                    tokenizer = AutoTokenizer.from_pretrained(self._model_source)
                    self._piece_encoder = PieceEncoder.for_tokenizer(tokenizer)
                    self._tokenizer = tokenizer
        return self._tokenizer

    def chat_token_ids(self, request: Any) -> list[int]:
        """Token ids of a chat completion request as vLLM renders it."""
        tools = None if not getattr(request, "tools", None) else [t.model_dump() for t in request.tools]
        messages = template_messages(list(request.messages))
        # Arguments the renderer sets itself win over the request's `chat_template_kwargs`, as in vLLM.
        extra = {k: v for k, v in (getattr(request, "chat_template_kwargs", None) or {}).items()
                 if k not in _RENDERER_ARGUMENTS}
        text = self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=getattr(request, "add_generation_prompt", True),
            continue_final_message=getattr(request, "continue_final_message", False),
            tokenize=False,
            **extra,
        )
        add_special_tokens = getattr(request, "add_special_tokens", False)
        if self._piece_encoder is not None and not add_special_tokens:
            # Earlier turns' messages come from the piece cache (router.piece_encoder).
            return self._piece_encoder.encode(text)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def completion_token_ids(self, request: Any) -> Optional[list[int]]:
        prompt = request.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a batch of one
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=getattr(request, "add_special_tokens", True))
        return None  # batched prompts: no single prefix to route on

    def token_ids(self, request: Any) -> Optional[list[int]]:
        """The prompt's token ids, or None if it has no single prompt, does not render, or skips the cache.

        vLLM computes a request that asks for prompt logprobs (`prompt_logprobs`,
        or `echo` with logprobs) without reading the prefix cache, so no replica's
        cache is worth routing it to.
        """
        if getattr(request, "prompt_logprobs", None) is not None or getattr(request, "echo", False):
            return None
        try:
            if hasattr(request, "messages"):
                token_ids = self.chat_token_ids(request)
            elif hasattr(request, "prompt"):
                token_ids = self.completion_token_ids(request)
            else:
                return None
        except Exception:
            # A request the template cannot render fails in the engine with a
            # proper 400; the router just has nothing to match on.
            return None
        return token_ids or None


def session_of(pending_request: Any, request: Any) -> Optional[str]:
    """The session id from the handle's options (`x-session-id`) or the request body.

    An id longer than `MAX_SESSION_ID_CHARS` is kept as its sha256: the router
    remembers up to `adapter.MAX_SESSIONS` sessions, so a client's id length must
    not set how much memory that takes.
    """
    session_id = pending_request.metadata.session_id or getattr(request, SESSION_BODY_FIELD, None) or None
    if not session_id:
        return None
    session_id = str(session_id)
    if len(session_id) > MAX_SESSION_ID_CHARS:
        return "sha256:" + hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest()
    return session_id


def is_forwardable(request: Any) -> bool:
    """Whether the engine would render `request` exactly as `chat_token_ids` does.

    Only chat requests whose messages are plain text, rendered with the served
    chat template, without `echo` (vLLM re-renders for it anyway) or
    `documents` (the router does not pass them to the template).
    """
    if not hasattr(request, "messages"):
        return False
    if getattr(request, "echo", False) or getattr(request, "chat_template", None) or getattr(request, "documents", None):
        return False
    for message in request.messages:
        content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
        if content is not None and not isinstance(content, str):
            return False
    return True


def forward_token_ids(request: Any, token_ids: list[int]) -> None:
    """Hands the engine the prompt ids through `kv_transfer_params` (module docstring); keeps other keys."""
    params = getattr(request, "kv_transfer_params", None)
    request.kv_transfer_params = {**(params if isinstance(params, dict) else {}), FORWARDED_IDS_KEY: token_ids}
