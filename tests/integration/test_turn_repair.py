"""The turn loop's handling of invalid tool calls, with a scripted model and a real Redis store.

The model is scripted (under a grammar, a random-weight model rarely emits an
invalid call: a raw control character in a string is the one seen); tokenizer,
chat template and store are the real ones.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from serve_apps.orchestrator.models import CreateSessionRequest, Message, ToolCall
from serve_apps.orchestrator.prompt import prefix_fingerprint
from serve_apps.orchestrator.store import SessionStore
from serve_apps.orchestrator.turns import ModelReply, TurnRunner

MODEL_DIR = Path(__file__).resolve().parents[2] / ".warmpath" / "models" / "warmpath-tiny"
SCHEMA = {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"], "additionalProperties": False}


class ScriptedModel:
    def __init__(self, replies: list[ModelReply]) -> None:
        self.replies = list(replies)
        self.prompts: list[list] = []
        self.tool_choices: list = []

    async def chat(self, session_id, messages, tools, tool_choice, max_tokens):
        self.prompts.append(messages)
        self.tool_choices.append(tool_choice)
        yield self.replies.pop(0)


def _call(arguments: str, call_id: str) -> ModelReply:
    return ModelReply(tool_calls=[ToolCall(id=call_id, name="lookup_order", arguments=arguments)], prompt_tokens=10)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    if not MODEL_DIR.is_dir():
        pytest.skip("the model is not built (warmpath build-model)")
    return AutoTokenizer.from_pretrained(MODEL_DIR)


def _run_turn(redis_url, tokenizer, replies, tool_choice="required", output_reserve_tokens=512):  # noqa: F811
    async def main():
        store = SessionStore.from_url(redis_url)
        request = CreateSessionRequest.model_validate({
            "model": "warmpath-tiny", "system_prompt": "Support agent.",
            "tools": [{"name": "lookup_order", "description": "d", "parameters": SCHEMA, "execution": {"kind": "client"}}],
            "limits": {"output_reserve_tokens": output_reserve_tokens},
        })
        record = await store.create(request, "owner", prefix_fingerprint(tokenizer, request.system_prompt, request.tools))
        model = ScriptedModel(replies)
        runner = TurnRunner(record, (), 0, store, model, tokenizer, 8192)
        events = [e async for e in runner.run([Message(role="user", content="Where is my order?")], tool_choice)]
        transcript = await store.transcript(record.session_id)
        await store.aclose()
        return events, transcript, model

    return asyncio.run(main())


def test_an_invalid_call_goes_back_to_the_model_and_is_repaired(redis_url, tokenizer):  # noqa: F811
    events, transcript, model = _run_turn(redis_url, tokenizer, [
        _call('{"order_id": 5}', "c1"),           # schema violation
        _call('{"order_id": "ORD-1', "c2"),       # not JSON (cut off)
        _call('{"order_id": "ORD-1234"}', "c3"),  # valid
    ])
    kinds = [e.kind for e in events]
    assert kinds.count("tool_result") == 2 and kinds[-1] == "requires_action"
    errors = [e.content for e in events if e.kind == "tool_result"]
    assert "$.order_id" in errors[0] and "c1" in errors[0]
    assert "c2" in errors[1]
    assert [c.id for c in events[-1].tool_calls] == ["c3"]
    roles = [m.role for m in transcript.messages]
    assert roles == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    # The cut-off arguments are kept as {} (as vLLM renders them); the model saw the error texts.
    assert transcript.messages[3].tool_calls[0].arguments == "{}"
    assert "$.order_id" in str(model.prompts[1])
    # A required call is still owed after an invalid one: the repair steps decode under the same choice.
    assert model.tool_choices == ["required", "required", "required"]


def test_a_raw_newline_in_a_string_argument_is_escaped_not_refused(redis_url, tokenizer):  # noqa: F811
    events, transcript, model = _run_turn(redis_url, tokenizer, [_call('{"order_id": "ORD-1\nORD-2"}', "c1")])
    assert events[-1].kind == "requires_action"
    assert [c.arguments for c in events[-1].tool_calls] == ['{"order_id": "ORD-1\\nORD-2"}']
    assert transcript.messages[-1].tool_calls[0].arguments == '{"order_id": "ORD-1\\nORD-2"}'
    assert model.tool_choices == ["required"]


def test_a_model_that_keeps_failing_ends_the_turn_and_commits_nothing(redis_url, tokenizer):  # noqa: F811
    events, transcript, _ = _run_turn(redis_url, tokenizer, [_call('{"order_id": 5}', f"c{i}") for i in range(5)])
    assert events[-1].kind == "error" and events[-1].code == "invalid_tool_call"
    assert "$.order_id" in events[-1].message
    assert transcript.messages == () and transcript.length == 0


def test_a_call_cut_off_by_the_token_budget_says_so(redis_url, tokenizer):  # noqa: F811
    cut = [ModelReply(tool_calls=[ToolCall(id=f"c{i}", name="lookup_order", arguments='{"order_id": "ORD-12')],
                      prompt_tokens=10, finish_reason="length") for i in range(3)]
    events, transcript, _ = _run_turn(redis_url, tokenizer, cut)
    assert events[-1].kind == "error" and events[-1].code == "invalid_tool_call"
    assert "limits.output_reserve_tokens" in events[-1].message
    assert all("limits.output_reserve_tokens" in e.content for e in events if e.kind == "tool_result")
    assert transcript.messages == ()


def test_an_empty_answer_completes_the_turn_with_empty_text(redis_url, tokenizer):  # noqa: F811
    # The model stopped at once: no text and no call (seen from the random-weight model).
    events, transcript, _ = _run_turn(redis_url, tokenizer, [ModelReply(prompt_tokens=10)], tool_choice="auto")
    assert events[-1].kind == "final" and events[-1].message.content == ""
    assert [(m.role, m.content) for m in transcript.messages] == [("user", "Where is my order?"), ("assistant", "")]


@pytest.mark.parametrize("tool_choice", ["required", "lookup_order"])
def test_a_forced_step_without_a_call_is_retried_then_fails_and_commits_nothing(redis_url, tokenizer, tool_choice):  # noqa: F811
    # Cut off by a 16-token budget before any call was parsed: no call, finish_reason "length".
    cut = [ModelReply(prompt_tokens=10, finish_reason="length") for _ in range(3)]
    events, transcript, model = _run_turn(redis_url, tokenizer, cut, tool_choice=tool_choice, output_reserve_tokens=16)
    assert events[-1].kind == "error" and events[-1].code == "invalid_tool_call"
    assert "limits.output_reserve_tokens" in events[-1].message
    assert not any(e.kind == "final" for e in events)
    assert transcript.messages == () and transcript.length == 0
    assert len(model.tool_choices) == 3 and all(c == model.tool_choices[0] for c in model.tool_choices)


def test_a_forced_step_without_a_call_is_repaired_by_a_later_call(redis_url, tokenizer):  # noqa: F811
    events, transcript, model = _run_turn(redis_url, tokenizer, [ModelReply(prompt_tokens=10), _call('{"order_id": "ORD-1"}', "c1")])
    assert events[-1].kind == "requires_action" and [c.id for c in events[-1].tool_calls] == ["c1"]
    # The empty reply left nothing in the history: the retry saw the same prompt.
    assert [m.role for m in transcript.messages] == ["user", "assistant"]
    assert model.prompts[0] == model.prompts[1]
    assert model.tool_choices == ["required", "required"]
