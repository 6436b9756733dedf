"""Which chat requests carry the router's token ids to the engine, and how."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from router.prompt_tokens import FORWARDED_IDS_KEY, forward_token_ids, is_forwardable

TEXT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
CALL = {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                             "function": {"name": "f", "arguments": "{}"}}]}


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
    ],
)
def test_only_requests_the_router_renders_exactly_are_forwarded(request_, expected):
    assert is_forwardable(request_) is expected


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
    from router.prompt_tokens import PromptTokenizer

    prompt_tokenizer = PromptTokenizer("unused")
    prompt_tokenizer._tokenizer = _Tokenizer()
    return prompt_tokenizer


@pytest.mark.parametrize("fields", [{"prompt_logprobs": 1}, {"prompt_logprobs": 0}, {"echo": True}])
def test_requests_that_skip_the_prefix_cache_have_nothing_to_route_on(fields):
    assert _prompt_tokenizer().token_ids(_chat(**fields)) is None
    assert _prompt_tokenizer().token_ids(SimpleNamespace(prompt="abc", **fields)) is None


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
