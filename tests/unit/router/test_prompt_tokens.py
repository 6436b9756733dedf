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
