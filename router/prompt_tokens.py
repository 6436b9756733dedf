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
`tests/integration/test_router.py` checks parity against the engine's own
`/tokenize` for chat requests with tools.

The tokenizer loads lazily on first use (once per process) from the same
folder or hub id the engines load.
"""

from __future__ import annotations

import copy
import json
import threading
from typing import Any, Optional

from router.types import RoutingRequest

SESSION_BODY_FIELD = "session_id"


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
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            with self._lock:
                if self._tokenizer is None:
                    from transformers import AutoTokenizer

                    self._tokenizer = AutoTokenizer.from_pretrained(self._model_source)
        return self._tokenizer

    def chat_token_ids(self, request: Any) -> list[int]:
        """Token ids of a chat completion request as vLLM renders it."""
        tools = None if not getattr(request, "tools", None) else [t.model_dump() for t in request.tools]
        messages = template_messages(list(request.messages))
        text = self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=getattr(request, "add_generation_prompt", True),
            continue_final_message=getattr(request, "continue_final_message", False),
            tokenize=False,
            **(getattr(request, "chat_template_kwargs", None) or {}),
        )
        return self.tokenizer.encode(text, add_special_tokens=getattr(request, "add_special_tokens", False))

    def completion_token_ids(self, request: Any) -> Optional[list[int]]:
        prompt = request.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=getattr(request, "add_special_tokens", True))
        return None  # batched prompts: no single prefix to route on

    def routing_request(self, pending_request: Any, model_id: str) -> Optional[RoutingRequest]:
        """The `RoutingRequest` for a Serve pending request, or None if it carries no prompt."""
        if not pending_request.args:
            return None
        request = pending_request.args[0]
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
        if not token_ids:
            return None
        session_id = pending_request.metadata.session_id or getattr(request, SESSION_BODY_FIELD, None) or None
        return RoutingRequest(
            token_ids=token_ids,
            model_id=model_id,
            session_id=str(session_id) if session_id else None,
            cache_salt=getattr(request, "cache_salt", None),
        )
