"""The token ids an engine will see for a request, computed in the router.

Why: the index is keyed by hashes of token blocks, so the router must render
and tokenize exactly as vLLM's OpenAI layer does, or every prediction is off by
whatever the difference shifts. This mirrors vLLM's renderer for the two
request kinds the ingress forwards:
- chat: assistant tool-call arguments parsed from JSON text into objects
  (invalid, empty or non-object arguments become `{}`, as vLLM's
  `_postprocess_messages` does), then `apply_chat_template(messages,
  **template_arguments(request, rendering))` as text, then
  `encode(text, add_special_tokens=request.add_special_tokens)`. The template
  arguments are merged as vLLM's `OnlineRenderer.preprocess_chat` merges them:
  the server's `default_chat_template_kwargs`, the tools (left out for
  `tool_choice: "none"` when the server excludes them then), the request's
  `chat_template_kwargs`, then its own `add_generation_prompt`,
  `continue_final_message`, `documents`, `reasoning_effort` and the
  `enable_thinking` vLLM derives from it. `tool_choice` and `response_format`
  reach only other renderers than Hugging Face's, which the router does not
  reproduce;
- completions: token-id prompts as given, text prompts encoded with
  `add_special_tokens`.
`tests/integration/test_router.py` checks parity against the ids the engine
renders itself for chat requests with tools.

The server-wide settings come from the replicas: each advertises how its
frontend renders (`EngineRendering`) in its routing stats.

Forwarding: a chat request whose rendering the router reproduces exactly
(`is_forwardable`: replicas that render as the router does, text-only
messages, the served chat template, no `echo` or `documents`) carries the
router's ids to the engine in `kv_transfer_params["prompt_token_ids"]`, the
field vLLM's renderer reads to skip templating and tokenization (added for
disaggregated prefill; Ray's own KV-aware router uses it too). The engine then
prefills exactly the tokens the router hashed, and a replica no longer spends
CPU on rendering what the router already rendered. Where the router cannot be
sure, it does not forward, and the engine renders the request itself.

Chat prompts are encoded piece by piece between added tokens, with pieces
seen before (earlier turns, the system prompt and tools) taken from a cache
(`router.piece_encoder`), when the tokenizer allows it.

The tokenizer loads on a thread of its own (`start_loading`) from the same
folder or hub id the engines load, retrying after a failure with a growing
wait; until it is loaded the router has no token ids, and routes by load.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import threading
import weakref
from typing import Any, Callable, Mapping, Optional

from router.piece_encoder import PieceEncoder

logger = logging.getLogger("ray.serve")

SESSION_BODY_FIELD = "session_id"
MAX_SESSION_ID_CHARS = 256
FORWARDED_IDS_KEY = "prompt_token_ids"
# The routing stats entry in which a replica advertises its `EngineRendering`.
RENDERING_STATS_KEY = "chat_rendering"
# Values vLLM's `merge_kwargs` treats as not set: an override holding one keeps the value below it.
_UNSET_VALUES = (None, "auto")
# Template arguments the router sets itself; a merged value for them is not passed on as is.
_SET_BY_ROUTER = frozenset({"tools", "tokenize", "chat_template", "return_dict", "conversation"})
# Template arguments that, once set, make vLLM render differently than the router can: a template other
# than the served one, and a conversation vLLM refuses. (`tokenize` is checked apart: vLLM sets it False.)
_UNREPRODUCED_ARGUMENTS = frozenset({"chat_template", "conversation"})
# Waits between tries to load the tokenizer: doubling from the first, up to the last.
FIRST_LOAD_RETRY_S = 1.0
MAX_LOAD_RETRY_S = 300.0


@dataclasses.dataclass(frozen=True)
class EngineRendering:
    """How the replicas' vLLM frontend renders chat prompts, as each replica advertises it.

    Why: vLLM renders with server-wide settings the router is not configured
    with (`default_chat_template_kwargs`, which `replicas.engine_kwargs` may
    set; `exclude_tools_when_tool_choice_none`), and some set-ups render in
    ways the router does not reproduce at all (another renderer than Hugging
    Face's, a server-side template, string content turned into content parts).
    `renders_like_router` is False for those; the replica decides it
    (`serve_apps.vllm_replica`).
    """

    default_chat_template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    exclude_tools_when_tool_choice_none: bool = False
    renders_like_router: bool = False

    def routing_stats(self) -> dict[str, Any]:
        """The routing stats entry a replica advertises this in."""
        return {RENDERING_STATS_KEY: {**dataclasses.asdict(self),
                                      "default_chat_template_kwargs": dict(self.default_chat_template_kwargs)}}

    @classmethod
    def from_routing_stats(cls, stats: Any) -> Optional["EngineRendering"]:
        """What a replica's routing stats advertise, or None where they advertise nothing usable."""
        advertised = stats.get(RENDERING_STATS_KEY) if isinstance(stats, Mapping) else None
        if not isinstance(advertised, Mapping):
            return None
        defaults = advertised.get("default_chat_template_kwargs")
        if not isinstance(defaults, Mapping):
            return None
        return cls(dict(defaults), advertised.get("exclude_tools_when_tool_choice_none") is True,
                   advertised.get("renders_like_router") is True)


def _merged(defaults: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's `merge_kwargs`: the defaults, with every override that is set put over them."""
    return {**defaults, **{k: v for k, v in overrides.items() if v not in _UNSET_VALUES}}


def _tool_dicts(request: Any, rendering: Optional[EngineRendering]) -> Optional[list]:
    """The request's tools as vLLM hands them to the template (None when it leaves them out)."""
    tools = getattr(request, "tools", None)
    if tools is None:
        return None
    is_choice_none = getattr(request, "tool_choice", None) == "none"
    if is_choice_none and rendering is not None and rendering.exclude_tools_when_tool_choice_none:
        return None
    return [tool if isinstance(tool, dict) else tool.model_dump() for tool in tools]


def template_arguments(request: Any, rendering: Optional[EngineRendering]) -> dict[str, Any]:
    """Every keyword argument vLLM's renderer passes `apply_chat_template` for a chat request, `tools` included.

    Merged as `OnlineRenderer.preprocess_chat` does (module docstring): each
    layer's set values over the one below. Without `rendering` the server
    defaults count as empty.
    """
    return _template_arguments(request, rendering, _tool_dicts(request, rendering))


def _template_arguments(request: Any, rendering: Optional[EngineRendering], tools: Optional[list]) -> dict[str, Any]:
    """`template_arguments` with the tools as given (None: none, or the server default's)."""
    server = rendering.default_chat_template_kwargs if rendering is not None else {}
    engine_level = _merged(server, {"tools": tools, "tokenize": False})
    requested = getattr(request, "chat_template_kwargs", None) or {}
    effort = getattr(request, "reasoning_effort", None)
    own = {
        "add_generation_prompt": getattr(request, "add_generation_prompt", True),
        "continue_final_message": getattr(request, "continue_final_message", False),
        "documents": getattr(request, "documents", None),
        "reasoning_effort": effort,
    }
    if effort is not None and "enable_thinking" not in requested:
        own["enable_thinking"] = effort != "none"
    return _merged(engine_level, _merged(requested, own))


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


# vLLM drops this first line of system text (Claude Code's attribution; its value changes every request).
_BILLING_HEADER = "x-anthropic-billing-header"


def template_messages(messages: list, is_string_content: bool = False) -> list[dict]:
    """Messages as vLLM's chat parsing hands them to the template.

    vLLM builds each message anew (`parse_chat_messages`) with only: the role;
    the content (None as ""; a system text's billing-header line dropped); an
    assistant's tool calls (arguments as objects, an empty list as none) and its
    reasoning, also as `reasoning_content`; a tool message's call id; a string
    `name` and `task`. Any other key a client sent never reaches the template.
    With `is_string_content` (the replicas pass content as strings, as those
    that render like the router do), text parts are joined with newlines, as
    vLLM joins them (a system prompt sent as parts by an Anthropic gateway);
    other content parts, and every part otherwise, are passed as they are (a
    request the router only routes). Copies; the request is untouched.
    """
    out = []
    for message in messages:
        message = message if isinstance(message, dict) else message.model_dump()
        role, content = message.get("role"), message.get("content")
        content = "" if content is None else content
        is_text = isinstance(content, str)
        texts = _texts([content] if is_text else content, role == "system") if is_text or is_string_content else None
        if texts is not None:
            content = "\n".join(texts)
        item: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            calls = message.get("tool_calls")
            if isinstance(calls, list) and calls:
                item["tool_calls"] = [_template_call(call) for call in calls]
            if message.get("reasoning") is not None:
                item["reasoning"] = item["reasoning_content"] = message["reasoning"]
        elif role == "tool" and "tool_call_id" in message:
            item["tool_call_id"] = message["tool_call_id"]
        for key in ("name", "task"):
            if isinstance(message.get(key), str):
                item[key] = message[key]
        out.append(item)
    return out


def developer_as_system(messages: list[dict], chat_template: str) -> list[dict]:
    """`messages` as vLLM hands them to a template that never names the `developer` role.

    vLLM (`vllm/renderers/hf.py`) makes each developer message a system one, then
    merges the system messages into one in front, their texts joined by a blank line,
    when one is not first or there are several. A template that names the role
    gets the messages as they are.
    """
    if '"developer"' in chat_template or "'developer'" in chat_template:
        return messages
    converted = [{**message, "role": "system"} if message["role"] == "developer" else message for message in messages]
    system_texts: list[str] = []
    others: list[dict] = []
    needs_merging = False
    for position, message in enumerate(converted):
        if message["role"] != "system":
            others.append(message)
            continue
        needs_merging = needs_merging or position > 0 or bool(system_texts)
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(part["text"] if isinstance(part, dict) else part for part in content
                                if (isinstance(part, dict) and "text" in part) or isinstance(part, str))
        if content:
            system_texts.append(content)
    if not needs_merging:
        return converted
    return [{"role": "system", "content": "\n\n".join(system_texts)}, *others]


def _texts(parts: Any, is_system: bool = False) -> Optional[list[str]]:
    """The texts of content parts that are all text, as vLLM reads them for string content, else None.

    Strings and the parts vLLM takes as text (`_TEXT_PART_KEYS`); a part whose text is
    empty or null is dropped, as vLLM drops it. A part with a `uuid` vLLM reads as media.
    In a system message, a string or `text` part (those only, as vLLM) loses Claude
    Code's attribution line (`_without_billing_header`).
    """
    if not isinstance(parts, list):
        return None
    texts = []
    for part in parts:
        is_plain = isinstance(part, str)
        if isinstance(part, dict):
            part_type = part.get("type")
            key = _TEXT_PART_KEYS.get(part_type) if isinstance(part_type, str) and part.get("uuid") is None else None
            if key is None:
                return None
            is_plain = part_type == "text"
            part = part.get(key)
            if part is None:
                continue
        if not isinstance(part, str):
            return None
        if is_system and is_plain:
            part = _without_billing_header(part) or ""
        if part:
            texts.append(part)
    return texts


# Content part types vLLM renders as text in string content, and the key that holds each one's text
# (`vllm/renderers/chat_utils.py`: MM_PARSER_MAP's text types, and a tool reference's name).
_TEXT_PART_KEYS = {
    "text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking",
    "tool_reference": "name",
}


def _without_billing_header(text: str) -> Optional[str]:
    """A system text without Claude Code's attribution line, as vLLM drops it; None for a text that was only it."""
    if not text.startswith(_BILLING_HEADER):
        return text
    return text.partition("\n")[2] or None


def _template_call(call: Any) -> Any:
    """A tool call with its arguments as an object, as vLLM hands it to the template (a copy)."""
    call = copy.deepcopy(call)
    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict):
        function["arguments"] = _arguments_object(function.get("arguments"))
    return call


def load_retry_wait_s(num_failures: int) -> float:
    """How long to wait before the next try to load the tokenizer, after `num_failures` failed tries."""
    return min(FIRST_LOAD_RETRY_S * 2 ** (num_failures - 1), MAX_LOAD_RETRY_S)


def load_pretrained(model_source: str, **kwargs: Any) -> Any:
    """The `transformers` tokenizer of `model_source`, loaded with `from_pretrained`'s `kwargs`."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_source, **kwargs)


class PromptTokenizer:
    """Renders and tokenizes OpenAI requests the way the engines do."""

    def __init__(self, model_source: str, load: Callable[[str], Any] = load_pretrained) -> None:
        """Args:
        model_source: folder or hub id of the engines' tokenizer.
        load: loads a tokenizer from `model_source` (a `transformers` one by default).
        """
        self._model_source = model_source
        self._load = load
        self._tokenizer = None
        self._piece_encoder: Optional[PieceEncoder] = None
        self._lock = threading.Lock()

    def start_loading(self) -> threading.Thread:
        """Loads the tokenizer on a daemon thread, retrying until it loads; `token_ids` has none until then.

        Why a thread: loading reads files or downloads from a hub, seconds that
        would otherwise block Serve's routing loop, for every request while a
        load keeps failing.
        """
        never_set = threading.Event()  # each wait lasts its full time; the daemon thread ends with the process
        thread = threading.Thread(
            target=self.load_until_loaded, args=(never_set.wait,), name="warmpath-tokenizer", daemon=True
        )
        thread.start()
        return thread

    def load_until_loaded(self, wait: Callable[[float], bool]) -> None:
        """Tries to load the tokenizer until it loads, calling `wait(seconds)` between tries (True: give up)."""
        num_failures = 0
        while self._tokenizer is None:
            try:
                self._install(self._load(self._model_source))
                return
            except Exception:
                num_failures += 1
                wait_s = load_retry_wait_s(num_failures)
                logger.warning("router: loading the tokenizer of %s failed (try %d); routing by load, trying again "
                               "in %.0f s", self._model_source, num_failures, wait_s, exc_info=True)
                if wait(wait_s):
                    return

    @property
    def is_loaded(self) -> bool:
        return self._tokenizer is not None

    @property
    def tokenizer(self):
        """The tokenizer, loaded here and now if no thread loaded it yet (for callers that may wait)."""
        if self._tokenizer is None:
            tokenizer = self._load(self._model_source)
            self._install(tokenizer)
        return self._tokenizer

    def _install(self, tokenizer: Any) -> None:
        with self._lock:
            if self._tokenizer is None:
                self._piece_encoder = PieceEncoder.for_tokenizer(tokenizer)
                self._tokenizer = tokenizer

    def chat_token_ids(self, request: Any, rendering: Optional[EngineRendering] = None) -> list[int]:
        """Token ids of a chat completion request as vLLM renders it, with the replicas' `rendering` settings."""
        is_string_content = rendering is not None and rendering.renders_like_router
        messages = template_messages(list(request.messages), is_string_content)
        arguments = template_arguments(request, rendering)
        tools = arguments.get("tools")
        if any(message["role"] == "developer" for message in messages):
            messages = developer_as_system(messages, self.tokenizer.get_chat_template(None, tools=tools))
        text = self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            **{k: v for k, v in arguments.items() if k not in _SET_BY_ROUTER},
        )
        add_special_tokens = getattr(request, "add_special_tokens", False)
        if self._piece_encoder is not None and not add_special_tokens:
            # Earlier turns' messages come from the piece cache (router.piece_encoder).
            return self._piece_encoder.encode(text)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def completion_token_ids(self, request: Any) -> Optional[list[int]]:
        prompt = _single_prompt(request.prompt)
        if _is_token_ids(prompt):
            return list(prompt)
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=getattr(request, "add_special_tokens", True))
        return None  # batched prompts: no single prefix to route on

    def token_ids(self, request: Any, rendering: Optional[EngineRendering] = None) -> Optional[list[int]]:
        """The prompt's token ids, or None if it has no single prompt, does not render, or skips the cache,
        or while the tokenizer is not loaded yet (this never waits for it).

        vLLM computes a request that asks for prompt logprobs (`prompt_logprobs`; a
        completion's `echo` with `logprobs`; a chat `echo`, whose prompt logprobs vLLM
        sets) without reading the prefix cache, so no replica's cache is worth routing it to.
        """
        if getattr(request, "prompt_logprobs", None) is not None:
            return None
        if getattr(request, "echo", False) and (hasattr(request, "messages") or getattr(request, "logprobs", None) is not None):
            return None
        if not self.is_loaded and not (hasattr(request, "prompt") and _is_token_ids(_single_prompt(request.prompt))):
            return None
        try:
            if hasattr(request, "messages"):
                token_ids = self.chat_token_ids(request, rendering)
            elif hasattr(request, "prompt"):
                token_ids = self.completion_token_ids(request)
            else:
                return None
        except Exception:
            # A request the template cannot render fails in the engine with a
            # proper 400; the router just has nothing to match on.
            return None
        return token_ids or None


# How deep `prompt_chars` looks into a message or tool for strings: a count that stops there is still a
# lower bound, and the walk stays cheap for any request.
MAX_COUNTED_DEPTH = 32


def prompt_chars(request: Any) -> int:
    """Characters of every string a request's prompt is rendered from (chat: each message's fields, tool
    calls' arguments, the tools' schemas; completions: the text prompt, a batch of one unwrapped as it is
    rendered), read without rendering it; token ids need no rendering: 0.

    A bound the router checks before rendering, so that a prompt far past the window is never rendered on
    the routing loop: the text is counted wherever the template reads it from (arguments or schemas left
    out let a megabyte through uncounted). Only string values count, not keys; the few a template may not
    write (ids, roles) are a few characters each, far inside the bound's margin.
    """
    messages = getattr(request, "messages", None)
    if messages is None:
        prompt = _single_prompt(getattr(request, "prompt", None))
        return len(prompt) if isinstance(prompt, str) else 0
    return _string_chars(messages) + _string_chars(getattr(request, "tools", None))


def _string_chars(value: Any) -> int:
    """Characters of the string values in `value` (dicts, lists, pydantic models), to `MAX_COUNTED_DEPTH`.

    A loop over a stack, not recursion: it runs for every routed request, and three times faster so.
    """
    total = 0
    stack = [(value, 0)]
    pop, push = stack.pop, stack.append
    while stack:
        item, depth = pop()
        if isinstance(item, str):
            total += len(item)
            continue
        if depth >= MAX_COUNTED_DEPTH or item is None:
            continue
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        elif (fields := getattr(item, "__pydantic_fields__", None)) is not None:  # a pydantic message or tool
            children = [getattr(item, name, None) for name in fields]
        else:
            continue
        for child in children:
            if isinstance(child, str):
                total += len(child)
            elif child is not None:
                push((child, depth + 1))
    return total


def _single_prompt(prompt: Any) -> Any:
    """A completion request's prompt, unwrapped from a batch of one."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return prompt[0]
    return prompt


def _is_token_ids(prompt: Any) -> bool:
    """Whether a completion prompt is token ids (which need no tokenizer)."""
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int) for t in prompt)


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


def is_forwardable(request: Any, rendering: Optional[EngineRendering]) -> bool:
    """Whether the engine would render `request` exactly as `chat_token_ids` does with `rendering`.

    Only chat requests, to replicas that advertised they render as the router
    does, whose messages are plain text with no `developer` role (vLLM turns it
    into `system` for templates without one) and whose tool calls are function
    calls (`_calls_are_functions`), rendered with the served chat
    template and no argument that has vLLM render otherwise
    (`_UNREPRODUCED_ARGUMENTS`, or `tokenize`), without `echo` (vLLM
    re-renders for it anyway), `documents` or `truncate_prompt_tokens`.
    """
    if rendering is None or not rendering.renders_like_router or not hasattr(request, "messages"):
        return False
    if getattr(request, "echo", False) or getattr(request, "chat_template", None) or getattr(request, "documents", None):
        return False
    if getattr(request, "truncate_prompt_tokens", None) is not None:
        return False
    # No tools: they decide neither check, and dumping them costs about 0.5 ms a request with 40 tools.
    arguments = _template_arguments(request, rendering, tools=None)
    if arguments.get("tokenize") is not False or not _UNREPRODUCED_ARGUMENTS.isdisjoint(arguments):
        return False
    return all(_is_plain_text(message) and _calls_are_functions(message) for message in request.messages)


def _field(message: Any, name: str) -> Any:
    """A field of a chat message as a request carries it: a dict, or a pydantic message."""
    return message.get(name) if isinstance(message, dict) else getattr(message, name, None)


def _is_plain_text(message: Any) -> bool:
    """Whether a message's content is text (or none) and its role one every template knows as written."""
    content = _field(message, "content")
    return (content is None or isinstance(content, str)) and _field(message, "role") != "developer"


def _calls_are_functions(message: Any) -> bool:
    """Whether a message's tool calls are all function calls, which is all vLLM takes.

    vLLM checks them while it renders (another `type`, or no `function` object, is a 400);
    forwarded ids skip that rendering, so such a request is not forwarded and vLLM refuses it.
    """
    calls = _field(message, "tool_calls")
    if not calls:
        return True
    if not isinstance(calls, list):
        return False
    for call in calls:
        call = call if isinstance(call, dict) else getattr(call, "model_dump", lambda: None)()
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            return False
        if not isinstance(call.get("function"), dict):
            return False
    return True


def forward_token_ids(request: Any, token_ids: list[int]) -> None:
    """Hands the engine the prompt ids through `kv_transfer_params` (module docstring); keeps other keys."""
    params = getattr(request, "kv_transfer_params", None)
    request.kv_transfer_params = {**(params if isinstance(params, dict) else {}), FORWARDED_IDS_KEY: token_ids}


class ForwardedTokenIds:
    """The requests a router handed token ids (`forward_token_ids`), so that a later attempt to place one takes
    them back before it decides again.

    Why: Serve asks the router again with the same request object (every replica full, one refusing it), and
    so does the orchestrator's retry of a call whose replica died. A later attempt may find candidates that do
    not all render alike (a rolling update), and then hands none: the first attempt's ids stayed on the request
    and reached a replica that renders the prompt otherwise. Ids a client set itself are not the router's.
    """

    def __init__(self) -> None:
        # id(request) -> (the request, weakly: the entry goes with it; the ids handed to it)
        self._by_request: dict[int, tuple[weakref.ref, list[int]]] = {}

    def forward(self, request: Any, token_ids: list[int]) -> None:
        forward_token_ids(request, token_ids)
        key = id(request)
        self._by_request[key] = (weakref.ref(request, lambda _ref, key=key: self._by_request.pop(key, None)),
                                 token_ids)

    def take_back(self, request: Any) -> None:
        """Removes the ids this router handed `request`, if it still carries them; other keys stay."""
        entry = self._by_request.pop(id(request), None)
        if entry is None or entry[0]() is not request:
            return
        params = getattr(request, "kv_transfer_params", None)
        if isinstance(params, dict) and params.get(FORWARDED_IDS_KEY) is entry[1]:
            rest = {key: value for key, value in params.items() if key != FORWARDED_IDS_KEY}
            request.kv_transfer_params = rest or None  # None, as it was where the router added the only key

    def __len__(self) -> int:
        return len(self._by_request)
