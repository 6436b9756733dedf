"""Facts ledger extraction and compression planning, with token counts supplied directly.

The same flow against a real tokenizer and chat template is in test_prompt.py.
"""

import json

import pytest

from serve_apps.orchestrator.compression import (
    SUMMARY_MESSAGE_NAME,
    apply_compression,
    extract_facts,
    plan_compression,
    summarization_input,
)
from serve_apps.orchestrator.models import Message, SessionLimits, ToolCall
from serve_apps.orchestrator.prompt import TokenAccount


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Order ORD-98231 ships on 2026-11-30.", ["ORD-98231", "2026-11-30"]),
        ("Total due: 1,284.50 USD, paid $99.95", ["1,284.50 USD", "$99.95"]),
        ("took 250 ms at 40% load, 3 retries", ["250 ms", "40%", "3"]),
        ("at 2026-11-30T08:15:00Z then 14:05", ["2026-11-30T08:15:00Z", "14:05"]),
        ("trace 123e4567-e89b-12d3-a456-426614174000 ok", ["123e4567-e89b-12d3-a456-426614174000"]),
        ("commit 9fceb02d0ae598e95dc970b74767f19372d61af8", ["9fceb02d0ae598e95dc970b74767f19372d61af8"]),
        ("mail ops@example.com or see https://example.com/a?b=1.", ["ops@example.com", "https://example.com/a?b=1"]),
        ('the customer said "ship it friday" and \'leave at door\'', ["ship it friday", "leave at door"]),
        ("lowercase ids like inv_2026_001 and user-42 count", ["inv_2026_001", "user-42"]),
        ("-3.5 degrees and 0x1F", ["-3.5", "0x1F"]),
        ("no values here at all", []),
        ("ORD-1 and ORD-1 again", ["ORD-1"]),
    ],
)
def test_extract_facts_from_text(text, expected):
    assert extract_facts(text) == expected


@pytest.mark.parametrize(
    "document, key_prefix, expected",
    [
        (
            '{"order": {"id": "ORD-98231", "items": [{"sku": "A-1", "qty": 2}]}, "total": 1284.50, "paid": false}',
            "",
            ["order.id=ORD-98231", "order.items[0].sku=A-1", "order.items[0].qty=2", "total=1284.50", "paid=false"],
        ),
        ('[{"eta": "2026-11-30", "note": null}]', "", ["[0].eta=2026-11-30", "[0].note=null"]),
        ('{"amount": "1,284.50", "big": 1e400}', "get_invoice.", ["get_invoice.amount=1,284.50", "get_invoice.big=1e400"]),
        ('{"memo": "line one\\nref ORD-5 due 2026-01-02"}', "", ["ORD-5", "2026-01-02"]),
    ],
)
def test_extract_facts_flattens_json_with_numerals_as_written(document, key_prefix, expected):
    assert extract_facts(document, key_prefix=key_prefix) == expected


def test_extract_facts_reads_truncated_json_fields():
    truncated = '{"order_id": "ORD-98231", "total": 1284.50, "rows": ["aaa…[truncated 900 bytes]'
    assert extract_facts(truncated)[:2] == ["order_id=ORD-98231", "total=1284.50"]


PROSE = "It is moving through the regional hub and tracking updates every day. " * 3


def _round(index: int) -> list[Message]:
    """One round: user asks, assistant calls a tool, tool answers, assistant replies."""
    call = ToolCall(id=f"c{index}", name="get_order", arguments=json.dumps({"order_id": f"ORD-{9000 + index}"}))
    result = {"order_id": f"ORD-{9000 + index}", "total": f"{index},284.50", "eta": f"2026-11-{10 + index}"}
    return [
        Message(role="user", content=f"status of order {index}?"),
        Message(role="assistant", content=None, tool_calls=[call]),
        Message(role="tool", content=json.dumps(result), tool_call_id=f"c{index}", name="get_order"),
        Message(role="assistant", content=f"Order {index} arrives soon. " + PROSE),
    ]


def _history(num_rounds: int) -> list[Message]:
    return [message for index in range(1, num_rounds + 1) for message in _round(index)]


def _tokens(message: Message) -> int:
    """Stand-in token count: about one token per four characters."""
    text = (message.content or "") + "".join(call.arguments for call in message.tool_calls or ())
    return 4 + len(text) // 4


def _account(messages, window: int, reserve: int = 16) -> TokenAccount:
    return TokenAccount(
        prefix_tokens=50,
        message_tokens=tuple(_tokens(m) for m in messages),
        generation_prompt_tokens=3,
        context_window_tokens=window,
        output_reserve_tokens=reserve,
        prefix_fingerprint="fp",
    )


LIMITS = SessionLimits(keep_last_rounds=2)


@pytest.mark.parametrize(
    "num_rounds, window, expected_cut",
    [
        (5, 100_000, None),  # plenty of room
        (2, 100, None),  # over budget but only the kept rounds exist
        (3, 100, 4),
        (5, 100, 12),
    ],
)
def test_plan_keeps_last_rounds(num_rounds, window, expected_cut):
    history = _history(num_rounds)
    plan = plan_compression(history, _account(history, window), LIMITS)
    assert (plan.num_messages_compressed if plan else None) == expected_cut
    if plan:
        assert history[plan.num_messages_compressed].role == "user"


def test_plan_triggers_below_fraction_of_window():
    history = _history(4)
    total = _account(history, 10**6).total_tokens
    reserve = 16
    # Remaining exactly 20% of the window: no compression; one token less: compression.
    window = int((total + reserve) / 0.8)
    while window - total - reserve < 0.2 * window:
        window += 1
    assert plan_compression(history, _account(history, window, reserve), SessionLimits()) is None
    assert plan_compression(history, _account(history, window - 1, reserve), SessionLimits()) is not None


def test_plan_rejects_misaligned_account():
    history = _history(3)
    with pytest.raises(ValueError):
        plan_compression(history, _account(history[:-1], 100), LIMITS)


def test_apply_keeps_every_value_verbatim():
    history = _history(5)
    plan = plan_compression(history, _account(history, 100), LIMITS)
    new_history, report = apply_compression(
        history, plan, "User asked about orders 1-3.", recount=lambda messages: _account(messages, 100)
    )
    summary = new_history[0]
    assert (summary.role, summary.name) == ("user", SUMMARY_MESSAGE_NAME)
    assert new_history[1:] == history[plan.num_messages_compressed :]
    for value in ["ORD-9001", "ORD-9003", "3,284.50", "2026-11-12", "get_order.result.total=1,284.50"]:
        assert value in summary.content
    assert report.num_messages_compressed == 12
    assert report.ledger_size == len(plan.ledger) > 0
    assert report.ledger_retained_fraction == 1.0
    assert report.tokens_before == _account(history, 100).total_tokens
    assert report.tokens_after == _account(new_history, 100).total_tokens < report.tokens_before


def test_recompression_carries_the_previous_ledger_forward():
    history = _history(5)
    first, _ = apply_compression(
        history, plan_compression(history, _account(history, 100), LIMITS), "", recount=lambda m: _account(m, 100)
    )
    longer = first + _history(8)[20:]
    plan = plan_compression(longer, _account(longer, 100), LIMITS)
    assert plan is not None
    second, report = apply_compression(longer, plan, "still orders", recount=lambda m: _account(m, 100))
    assert [m.name for m in second].count(SUMMARY_MESSAGE_NAME) == 1
    for value in ["get_order.arguments.order_id=ORD-9001", "get_order.result.eta=2026-11-11", "ORD-9005", "2026-11-15"]:
        assert value in second[0].content
    assert report.ledger_retained_fraction == 1.0


def test_summary_only_prefix_is_not_recompressed():
    history = _history(5)
    first, _ = apply_compression(
        history, plan_compression(history, _account(history, 100), LIMITS), "", recount=lambda m: _account(m, 100)
    )
    assert plan_compression(first, _account(first, 100), LIMITS) is None


def test_summarization_input_lists_calls_and_results():
    text = summarization_input(_round(1))
    assert 'assistant called get_order({"order_id": "ORD-9001"})' in text
    assert text.startswith("user: status of order 1?")
