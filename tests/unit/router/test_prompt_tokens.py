"""Which chat requests carry the router's token ids to the engine, and how."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from router.prompt_tokens import (
    FORWARDED_IDS_KEY,
    EngineRendering,
    ForwardedTokenIds,
    PromptTokenizer,
    forward_token_ids,
    is_forwardable,
    load_pretrained,
    load_retry_wait_s,
    prompt_chars,
)

TEXT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
CALL = {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                             "function": {"name": "f", "arguments": "{}"}}]}
ALIKE = EngineRendering({}, renders_like_router=True)


def _chat(messages=TEXT, **fields):
    return SimpleNamespace(messages=messages, **fields)


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        (_chat(), True),
        (_chat(TEXT + [CALL, {"role": "tool", "tool_call_id": "c", "content": "{}"}]), True),
        (_chat([SimpleNamespace(role="user", content="pydantic message")]), True),
        (_chat([{"role": "user", "content": [{"type": "text", "text": "hi"}]}]), False),
        (_chat(echo=True), False),
        (_chat(chat_template="{{ messages }}"), False),
        (_chat(documents=[{"title": "a", "text": "b"}]), False),
        (SimpleNamespace(prompt="completions are tokenized without a template"), False),
        (_chat([{"role": "developer", "content": "vLLM may turn this role into system"}]), False),
        (_chat(truncate_prompt_tokens=8), False),
        (_chat(chat_template_kwargs={"tokenize": True}), False),
        (_chat(chat_template_kwargs={"chat_template": "{{ messages }}"}), False),
        (_chat(chat_template_kwargs={"conversation": []}), False),
        (_chat(chat_template_kwargs={"enable_thinking": False, "tokenize": None}), True),
        (_chat(reasoning_effort="none"), True),
        # vLLM refuses a call that is not a function call while it renders, which forwarded ids skip.
        (_chat(TEXT + [{**CALL, "tool_calls": [{**CALL["tool_calls"][0], "type": "custom"}]}]), False),
        (_chat(TEXT + [{**CALL, "tool_calls": [{"id": "c", "type": "function"}]}]), False),
        (_chat(TEXT + [{**CALL, "tool_calls": ["not an object"]}]), False),
    ],
)
def test_only_requests_the_router_renders_exactly_are_forwarded(request_, expected):
    assert is_forwardable(request_, ALIKE) is expected


@pytest.mark.parametrize("rendering", [None, EngineRendering({}, renders_like_router=False)])
def test_nothing_is_forwarded_to_replicas_that_render_otherwise_or_did_not_say(rendering):
    assert not is_forwardable(_chat(), rendering)


def test_server_defaults_that_change_how_vllm_renders_stop_forwarding():
    assert not is_forwardable(_chat(), EngineRendering({"chat_template": "{{ messages }}"}, renders_like_router=True))
    assert is_forwardable(_chat(), EngineRendering({"enable_thinking": False}, renders_like_router=True))


def test_a_replicas_rendering_travels_in_its_routing_stats():
    rendering = EngineRendering({"enable_thinking": False}, exclude_tools_when_tool_choice_none=True,
                                renders_like_router=True)
    stats = {"kv_events_endpoint": "tcp://x:1", **rendering.routing_stats()}
    assert EngineRendering.from_routing_stats(stats) == rendering
    assert EngineRendering.from_routing_stats({}) is None
    assert EngineRendering.from_routing_stats(None) is None
    assert EngineRendering.from_routing_stats({"chat_rendering": {"default_chat_template_kwargs": "no"}}) is None


def test_forwarding_keeps_other_transfer_params():
    request = _chat(kv_transfer_params={"do_remote_prefill": True})
    forward_token_ids(request, [1, 2, 3])
    assert request.kv_transfer_params == {"do_remote_prefill": True, FORWARDED_IDS_KEY: [1, 2, 3]}
    bare = _chat(kv_transfer_params=None)
    forward_token_ids(bare, [4])
    assert bare.kv_transfer_params == {FORWARDED_IDS_KEY: [4]}


class _Tokenizer:
    """Stands in for the HF tokenizer: renders by joining, records what the template was given."""

    def __init__(self):
        self.template_calls = []

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, continue_final_message=False,
                            tokenize=True, **kwargs):
        self.template_calls.append({"add_generation_prompt": add_generation_prompt, "tokenize": tokenize, **kwargs})
        return "|".join(m["content"] for m in messages)

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def _prompt_tokenizer():
    prompt_tokenizer = PromptTokenizer("unused", load=lambda source: _Tokenizer())
    prompt_tokenizer.load_until_loaded(wait=lambda s: pytest.fail("the stand-in tokenizer loads at once"))
    return prompt_tokenizer


@pytest.mark.parametrize("fields", [{"prompt_logprobs": 1}, {"prompt_logprobs": 0}, {"echo": True, "logprobs": 0}])
def test_requests_that_skip_the_prefix_cache_have_nothing_to_route_on(fields):
    assert _prompt_tokenizer().token_ids(_chat(**fields)) is None
    assert _prompt_tokenizer().token_ids(SimpleNamespace(prompt="abc", **fields)) is None


def test_a_completion_echoed_without_logprobs_reads_the_cache_so_it_is_routed():
    """vLLM asks prompt logprobs of an echoed completion only with `logprobs`; a chat `echo` always."""
    assert _prompt_tokenizer().token_ids(SimpleNamespace(prompt="abc", echo=True, logprobs=None)) == [97, 98, 99]
    assert _prompt_tokenizer().token_ids(_chat(echo=True)) is None


def test_the_renderers_own_arguments_win_over_chat_template_kwargs():
    """vLLM drops `tokenize` and lets the request's fields override the kwargs; rendering must not fail on them."""
    prompt_tokenizer = _prompt_tokenizer()
    request = _chat(chat_template_kwargs={"tokenize": True, "add_generation_prompt": False, "enable_thinking": True},
                    add_generation_prompt=True)
    assert prompt_tokenizer.token_ids(request) == [ord(c) for c in "Be brief.|hi"]
    call = prompt_tokenizer._tokenizer.template_calls[-1]
    assert call["tokenize"] is False and call["add_generation_prompt"] is True and call["enable_thinking"] is True


@pytest.mark.parametrize("prompt, ids", [([[5, 6, 7]], [5, 6, 7]), ([5, 6, 7], [5, 6, 7]), (["ab"], [97, 98]),
                                         ([[5], [6]], None)])
def test_a_batch_of_one_prompt_is_that_prompt(prompt, ids):
    assert _prompt_tokenizer().token_ids(SimpleNamespace(prompt=prompt)) == ids


def test_a_long_session_id_is_kept_as_its_digest():
    from router.prompt_tokens import MAX_SESSION_ID_CHARS, session_of

    def pending(session_id):
        return SimpleNamespace(metadata=SimpleNamespace(session_id=session_id))

    assert session_of(pending("s-1"), None) == "s-1"
    long_id = "x" * (MAX_SESSION_ID_CHARS + 1)
    kept = session_of(pending(long_id), None)
    assert kept.startswith("sha256:") and len(kept) == len("sha256:") + 64
    assert kept == session_of(pending(long_id), None) != session_of(pending(long_id + "y"), None)


def test_reasoning_effort_and_server_defaults_reach_the_template():
    prompt_tokenizer = _prompt_tokenizer()
    server = EngineRendering({"enable_thinking": False, "custom": 1}, renders_like_router=True)
    prompt_tokenizer.token_ids(_chat(reasoning_effort="high"), server)
    call = prompt_tokenizer._tokenizer.template_calls[-1]
    assert (call["reasoning_effort"], call["enable_thinking"], call["custom"]) == ("high", True, 1)
    prompt_tokenizer.token_ids(_chat(chat_template_kwargs={"enable_thinking": None}), server)
    assert prompt_tokenizer._tokenizer.template_calls[-1]["enable_thinking"] is False  # None keeps the default


# Renders what vLLM hands a template: thinking switch, effort, tools, and a variable of the request's own.
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\ntools {{ tools | length }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.reasoning_content is defined and m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{%- endif %}"
    "{{ m.content }}{%- if m.tool_calls is defined %}{{ m.tool_calls | tojson }}{%- endif %}"
    "{%- if m.flavour is defined %} flavour {{ m.flavour }}{%- endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if reasoning_effort is defined and reasoning_effort %}effort {{ reasoning_effort }}\n{%- endif %}"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- if flavour is defined %}flavour {{ flavour }}{%- endif %}{%- endif %}"
)
TOOL = {"type": "function", "function": {"name": "lookup", "description": "find", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def template_tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    special = ["<unk>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    backend.train_from_iterator(["hello world think assistant user system tools effort flavour " * 50],
                                trainers.BpeTrainer(vocab_size=300, special_tokens=special,
                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out = tmp_path_factory.mktemp("tokenizer")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=TEMPLATE, eos_token="<|im_end|>")
    tokenizer.save_pretrained(out)
    return str(out)


def _vllm_ids(tokenizer, request, rendering: EngineRendering) -> list[int]:
    """The ids vLLM's renderer makes of `request`: its own merge of template arguments
    (`OnlineRenderer.preprocess_chat`), its own parsing of the messages (content format "string",
    which replicas that render like the router use) and its own `safe_apply_chat_template`."""
    from vllm.renderers.chat_utils import parse_chat_messages
    from vllm.renderers.hf import safe_apply_chat_template
    from vllm.renderers.params import merge_kwargs

    excluded = rendering.exclude_tools_when_tool_choice_none and request.tool_choice == "none"
    tools = None if request.tools is None or excluded else [tool.model_dump() for tool in request.tools]
    engine_defaults = merge_kwargs(dict(rendering.default_chat_template_kwargs), {"tools": tools, "tokenize": False})
    params = request.build_chat_params(None, "auto").with_defaults(engine_defaults)
    model_config = SimpleNamespace(revision=None, code_revision=None, trust_remote_code=False, tokenizer_revision=None,
                                   tokenizer=tokenizer.name_or_path, model=tokenizer.name_or_path,
                                   hf_config=SimpleNamespace(model_type="llama"))
    model_config.multimodal_config, model_config.enable_prompt_embeds, model_config.is_multimodal_model = None, False, False
    conversation, _, _ = parse_chat_messages(list(request.messages), model_config, content_format="string")
    text = safe_apply_chat_template(model_config, tokenizer, conversation, **params.get_apply_chat_template_kwargs())
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    ("fields", "rendering"),
    [
        ({"reasoning_effort": "none"}, ALIKE),
        ({"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}, ALIKE),
        ({}, EngineRendering({"enable_thinking": False}, renders_like_router=True)),
        ({"chat_template_kwargs": {"enable_thinking": True, "flavour": "x"}},
         EngineRendering({"enable_thinking": False, "flavour": "y"}, renders_like_router=True)),
        ({"tools": [TOOL], "tool_choice": "none"}, EngineRendering({}, True, renders_like_router=True)),
        ({"tools": [TOOL], "tool_choice": "none"}, ALIKE),
        ({"tools": [TOOL], "tool_choice": "auto", "response_format": {"type": "json_object"}}, ALIKE),
        ({"add_generation_prompt": False, "continue_final_message": True}, ALIKE),
    ],
    ids=["effort-none", "kwargs-over-effort", "server-default", "request-over-server", "tools-excluded",
         "tools-kept", "tool-choice-and-format", "continue"],
)
def test_forwarded_ids_are_the_ids_vllm_renders(template_tokenizer_dir, fields, rendering):
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hello world"}], **fields)
    prompt_tokenizer = PromptTokenizer(template_tokenizer_dir)
    assert is_forwardable(request, rendering)
    expected = _vllm_ids(AutoTokenizer.from_pretrained(template_tokenizer_dir), request, rendering)
    assert prompt_tokenizer.chat_token_ids(request, rendering) == expected


CALL = {"role": "assistant", "content": None,
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "lookup", "arguments": '{"q": 1}'}}]}


@pytest.mark.parametrize(
    "messages",
    [
        # What OpenAI clients send after a tool call: no content beside the call (vLLM renders "").
        [{"role": "user", "content": "hello"}, CALL, {"role": "tool", "tool_call_id": "c", "content": "world"}],
        # Interleaved thinking sent back: vLLM hands the template `reasoning` and `reasoning_content`.
        [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world", "reasoning": "think"},
         {"role": "user", "content": "hello"}],
        [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world", "reasoning_content": "think"},
         {"role": "user", "content": "hello"}],
        # vLLM drops Claude Code's attribution line of system text.
        [{"role": "system", "content": "x-anthropic-billing-header: cch=123\nsystem hello"},
         {"role": "user", "content": "hello"}],
        [{"role": "system", "content": "x-anthropic-billing-header: cch=123"}, {"role": "user", "content": "hello"}],
        # A key vLLM does not keep never reaches the template; an empty call list is no calls.
        [{"role": "user", "content": "hello", "flavour": "x"}, {"role": "assistant", "content": "a", "tool_calls": []},
         {"role": "user", "content": "hello", "name": "bob"}],
        # Arguments that are not a JSON object are rendered as an empty object.
        [{"role": "user", "content": "hello"},
         {**CALL, "tool_calls": [{**CALL["tool_calls"][0], "function": {"name": "lookup", "arguments": "{oops"}}]},
         {"role": "tool", "tool_call_id": "c", "content": "world"}],
    ],
    ids=["content-none", "reasoning", "reasoning-content", "billing-header", "billing-header-alone", "other-keys",
         "bad-arguments"],
)
def test_forwarded_ids_of_each_kind_of_message_are_the_ids_vllm_renders(template_tokenizer_dir, messages):
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    request = ChatCompletionRequest(model="m", messages=messages)
    assert is_forwardable(request, ALIKE)
    expected = _vllm_ids(AutoTokenizer.from_pretrained(template_tokenizer_dir), request, ALIKE)
    assert PromptTokenizer(template_tokenizer_dir).chat_token_ids(request, ALIKE) == expected


@pytest.mark.parametrize(
    "messages",
    [
        # An Anthropic gateway's system prompt: text parts, the first Claude Code's attribution line.
        [{"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: cch=111"},
                                        {"type": "text", "text": "system hello"}]},
         {"role": "user", "content": "hello"}],
        [{"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: cch=1\nsystem"}]},
         {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}],
        # Tool results as Claude Code and Cursor send them.
        [{"role": "user", "content": "hello"}, CALL,
         {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "line 1"},
                                                          {"type": "text", "text": "line 2"}]}],
        # Parts vLLM drops (empty or null text) or reads as text (other text types, a tool reference's name).
        [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""},
                                      {"type": "text", "text": None}, "", {"type": "text", "text": "b"}]}],
        [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"},
                                      {"type": "output_text", "text": "c"}]},
         {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm"}, {"type": "text", "text": "d"},
                                           {"type": "refusal", "refusal": "no"}]}],
        [{"role": "user", "content": "hello"}, CALL,
         {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "l1"},
                                                          {"type": "tool_reference", "name": "lookup"}]}],
        # vLLM drops Claude Code's attribution line from string and `text` parts only.
        [{"role": "system", "content": [{"type": "input_text", "text": "x-anthropic-billing-header: cch=1\nrest"},
                                        {"type": "text", "text": "x-anthropic-billing-header: cch=2\nmore"}]},
         {"role": "user", "content": "hello"}],
        # A template that never names `developer`: vLLM makes it `system`, merging system messages in front.
        [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hello"}],
        [{"role": "system", "content": "be kind"}, {"role": "user", "content": "hello"},
         {"role": "developer", "content": [{"type": "text", "text": "be brief"}]}, {"role": "system", "content": ""}],
    ],
    ids=["system-parts", "user-parts", "tool-parts", "empty-parts", "other-text-types", "tool-reference",
         "billing-header-text-parts-only", "developer", "developer-merged"],
)
def test_messages_the_router_only_routes_render_as_vllm_renders_them(template_tokenizer_dir, messages):
    """The router only routes these (content parts and the developer role are not forwarded), but on ids that
    must match the engine's, or every block after the first difference is a miss (a system prompt of parts
    rendered nothing at all)."""
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    request = ChatCompletionRequest(model="m", messages=messages)
    assert not is_forwardable(request, ALIKE)
    expected = _vllm_ids(AutoTokenizer.from_pretrained(template_tokenizer_dir), request, ALIKE)
    assert PromptTokenizer(template_tokenizer_dir).chat_token_ids(request, ALIKE) == expected


def test_a_system_message_of_content_parts_still_renders_for_routing(template_tokenizer_dir):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    request = ChatCompletionRequest(model="m", messages=[
        {"role": "system", "content": [{"type": "text", "text": "hello"}]}, {"role": "user", "content": "world"}])
    assert not is_forwardable(request, ALIKE)
    assert PromptTokenizer(template_tokenizer_dir).chat_token_ids(request, ALIKE)  # raised on the parts


class _Loads:
    """A tokenizer loader that fails a given number of times, then returns a stand-in tokenizer."""

    def __init__(self, num_failures: int) -> None:
        self.num_failures = num_failures
        self.sources: list[str] = []

    def __call__(self, source: str):
        self.sources.append(source)
        if len(self.sources) <= self.num_failures:
            raise OSError("the hub cannot be reached")
        return _Tokenizer()


def test_routing_never_loads_the_tokenizer_itself():
    loads = _Loads(num_failures=0)
    prompt_tokenizer = PromptTokenizer("org/model", load=loads)
    assert prompt_tokenizer.token_ids(_chat()) is None
    assert prompt_tokenizer.token_ids(SimpleNamespace(prompt="text")) is None
    assert prompt_tokenizer.token_ids(SimpleNamespace(prompt=[5, 6])) == [5, 6]  # token ids need no tokenizer
    assert loads.sources == []


def test_a_failed_load_is_tried_again_after_a_growing_wait():
    loads = _Loads(num_failures=3)
    prompt_tokenizer = PromptTokenizer("org/model", load=loads)
    waits: list[float] = []
    prompt_tokenizer.load_until_loaded(wait=lambda seconds: waits.append(seconds) or False)
    assert waits == [1.0, 2.0, 4.0] and len(loads.sources) == 4
    assert prompt_tokenizer.token_ids(_chat()) == [ord(c) for c in "Be brief.|hi"]


def test_loading_stops_when_told_to():
    loads = _Loads(num_failures=10)
    prompt_tokenizer = PromptTokenizer("org/model", load=loads)
    prompt_tokenizer.load_until_loaded(wait=lambda seconds: True)
    assert len(loads.sources) == 1 and not prompt_tokenizer.is_loaded


def test_the_wait_between_loads_is_capped():
    assert load_retry_wait_s(1) == 1.0
    assert load_retry_wait_s(100) == load_retry_wait_s(10) == 300.0


def test_the_tokenizer_loads_on_a_thread_of_its_own():
    loads = _Loads(num_failures=0)
    prompt_tokenizer = PromptTokenizer("org/model", load=loads)
    prompt_tokenizer.start_loading().join(timeout=30)
    assert prompt_tokenizer.is_loaded and loads.sources == ["org/model"]


def test_prompt_chars_counts_every_string_the_prompt_is_rendered_from():
    from pydantic import BaseModel

    class Function(BaseModel):
        name: str
        parameters: dict

    class Tool(BaseModel):
        type: str
        function: Function

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "a" * 1000}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    tool = Tool(type="function", function=Function(name="f", parameters={"properties": {"q": {"description": "d" * 500}}}))
    counted = prompt_chars(_chat(messages, tools=[tool]))
    assert counted >= 2 + 1000 + 500
    assert prompt_chars(_chat([{"role": "user", "content": [{"type": "text", "text": "t" * 300}]}])) >= 300
    assert prompt_chars(SimpleNamespace(prompt="p" * 400)) == 400
    assert prompt_chars(SimpleNamespace(prompt=["p" * 400])) == 400  # a batch of one is rendered unwrapped
    assert prompt_chars(SimpleNamespace(prompt=[1, 2, 3])) == 0  # token ids are not rendered


def test_prompt_chars_stays_a_cheap_lower_bound_for_a_deeply_nested_value():
    deep: object = "x" * 10
    for _ in range(10_000):
        deep = [deep]
    assert prompt_chars(_chat([{"role": "user", "content": deep}])) == len("user")  # the text lies too deep


def test_forwarded_ids_are_forgotten_with_their_request():
    """One entry per request the router handed ids: it goes when the request does, taken back or not."""
    import gc

    class Request(SimpleNamespace):
        pass

    forwarded = ForwardedTokenIds()
    kept, dropped = Request(kv_transfer_params=None), Request(kv_transfer_params=None)
    forwarded.forward(kept, [1, 2])
    forwarded.forward(dropped, [3])
    del dropped
    gc.collect()
    assert len(forwarded) == 1
    forwarded.take_back(kept)
    assert kept.kv_transfer_params is None and len(forwarded) == 0


def test_the_router_and_orchestrator_load_the_tokenizer_the_engines_load(template_tokenizer_dir, tmp_path):
    """A tokenizer of custom code loads only where the engines trust the model's code: without the engines'
    `trust_remote_code`, the router rendered nothing (every request by load) and the orchestrator never started."""
    import json
    import shutil

    from cluster.config import load_config
    from router.adapter import RouterArgs
    from serve_apps.builders import request_router_config

    folder = tmp_path / "custom"
    shutil.copytree(template_tokenizer_dir, folder)
    (folder / "custom_tokenizer.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\nclass CustomTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings.update(tokenizer_class="CustomTokenizer", auto_map={"AutoTokenizer": [None, "custom_tokenizer.CustomTokenizer"]})
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_pretrained(str(folder))

    cfg = load_config(environ={}, overrides={"model": {"source": str(folder)},
                                             "replicas": {"engine_kwargs": {"trust_remote_code": True,
                                                                            "revision": 20240101}}})
    assert cfg.tokenizer_kwargs() == {"trust_remote_code": True, "revision": "20240101"}
    args = RouterArgs.model_validate(request_router_config(cfg)["request_router_kwargs"])
    assert args.model_source == str(folder)
    assert type(load_pretrained(args.model_source, **args.tokenizer_kwargs)).__name__ == "CustomTokenizer"

    # A tokenizer of its own, at its own revision, as vLLM takes them.
    cfg = load_config(environ={}, overrides={"model": {"source": str(folder)}, "replicas": {"engine_kwargs": {
        "tokenizer": template_tokenizer_dir, "revision": "main", "tokenizer_revision": "v2"}}})
    assert (cfg.tokenizer_source(), cfg.tokenizer_kwargs()) == (template_tokenizer_dir, {"revision": "v2"})
    # As vLLM's config reads it: the engines ran the model's code, the tokenizer had to be loaded with it too.
    for written in ("yes", "true", 1):
        cfg = load_config(environ={}, overrides={"replicas": {"engine_kwargs": {"trust_remote_code": written}}})
        assert cfg.tokenizer_kwargs() == {"trust_remote_code": True}
    assert load_config(environ={}, overrides={"replicas": {"engine_kwargs": {"trust_remote_code": "no"}}}
                       ).tokenizer_kwargs() == {}
