"""Context compression that never loses an exact value.

Old rounds are replaced by ONE message: the model-written summary plus a
"Facts:" ledger of every exact value found in them (numbers, ids, dates, emails,
URLs, quoted strings, flattened JSON fields). The ledger is extracted by
deterministic rules, never by the model, because a summary can drop or round a
figure while the agent may need it verbatim ten steps later.

Invariants:
- The system prompt and tools are not part of the history and are never touched,
  so the cached prefix and its fingerprint survive compression.
- A round starts at a user message; the last `keep_last_rounds` rounds stay
  verbatim, so a tool call is never separated from its result.
- Ledger entries hold no newline; a previous summary's ledger is carried forward
  entry by entry when it is compressed again.
- `CompressionReport.ledger_retained_fraction` is measured on the new messages.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

from serve_apps.orchestrator.models import CompressionReport, Message, SessionLimits
from serve_apps.orchestrator.prompt import TokenAccount

__all__ = [
    "SUMMARY_MESSAGE_NAME",
    "CompressionPlan",
    "CompressionReport",
    "apply_compression",
    "extract_facts",
    "plan_compression",
    "summarization_input",
]

SUMMARY_MESSAGE_NAME = "warmpath-context-summary"
FACTS_HEADER = "Facts:"
_MAX_INLINE_STRING_CHARS = 200
_UNITS = (
    r"%|‰|[KMGT]i?B|B|ns|µs|us|ms|s|sec|secs|min|mins|h|hr|hrs|days?|weeks?|months?|years?|"
    r"kg|g|mg|t|lbs?|oz|km|m|cm|mm|mi|ft|L|ml|°C|°F|USD|EUR|GBP|CNY|JPY|RMB|tokens?|x"
)
# Earlier-listed patterns win ties between matches of equal start and length.
_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (name, re.compile(pattern))
    for name, pattern in (
        ("json_field", r'"([\w.$@-]{1,64})"\s*:\s*(?:"([^"\\\n]{0,200})"|(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|true|false|null))'),
        ("url", r"https?://[^\s<>\"'`]+[^\s<>\"'`.,;:!?)\]}]"),
        ("email", r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"),
        ("uuid", r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"),
        ("datetime", r"\b\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?(?![\w:])"),
        ("time", r"\b\d{1,2}:\d{2}(?::\d{2})?\b"),
        ("id", r"\b(?=[A-Za-z0-9_/-]*\d)[A-Za-z][A-Za-z0-9]*(?:[-_/][A-Za-z0-9]+)+\b"),
        ("hex", r"\b0x[0-9a-fA-F]+\b|\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{8,128}\b"),
        ("quoted", r'"([^"\n]{1,200})"|“([^”\n]{1,200})”|(?<!\w)\'([^\'\n]{1,200})\'(?!\w)'),
        ("number", rf"(?<![\w.])(?:[$€£¥]\s?)?-?(?:\d{{1,3}}(?:,\d{{3}})+|\d+)(?:\.\d+)?(?:\s?(?:{_UNITS}))?(?![\w])"),
    )
)


class _Numeral(str):
    """A JSON number kept as the exact text the tool wrote (`1284.50` stays `1284.50`)."""


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON")


def _is_single_line(text: str) -> bool:
    """Ledger entries are `- ` lines; anything `str.splitlines` would split cannot be one."""
    return text.splitlines() == [text]


def _fact_from_match(name: str, match: re.Match[str]) -> str:
    if name == "json_field":
        key, string_value, literal = match.groups()
        return f"{key}={string_value if string_value is not None else literal}"
    if name == "quoted":
        return next(group for group in match.groups() if group is not None)
    return match.group(0)


def _regex_facts(text: str) -> list[str]:
    """Non-overlapping matches, earliest first; at one start the longest (then earliest pattern) wins."""
    candidates = []
    for priority, (name, pattern) in enumerate(_PATTERNS):
        for match in pattern.finditer(text):
            if match.end() > match.start():
                candidates.append((match.start(), -(match.end() - match.start()), priority, name, match))
    candidates.sort(key=lambda c: c[:3])
    facts, taken_until = [], 0
    for start, _neg_len, _priority, name, match in candidates:
        if start >= taken_until:
            facts.append(_fact_from_match(name, match))
            taken_until = match.end()
    return facts


def _flatten(node: object, path: str, out: list[str]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            _flatten(value, f"{path}.{key}" if path else str(key), out)
    elif isinstance(node, list):
        for index, item in enumerate(node):
            _flatten(item, f"{path}[{index}]", out)
    elif isinstance(node, str) and not isinstance(node, _Numeral):
        if len(node) <= _MAX_INLINE_STRING_CHARS and (not node or _is_single_line(node)):
            out.append(f"{path}={node}" if path else node)
        else:
            out.extend(_regex_facts(node))
    else:
        literal = node if isinstance(node, _Numeral) else json.dumps(node)
        out.append(f"{path}={literal}" if path else literal)


def extract_facts(text: str, *, key_prefix: str = "") -> list[str]:
    """Exact values in `text`, in order of first appearance, without duplicates.

    A text holding one JSON object or array is flattened into `path=value`
    entries (`order.items[0].sku=A-1`, numbers as written); anything else, and
    JSON that does not parse (a truncated tool result), is scanned for numbers
    with optional units, ids, UUIDs, hex hashes, ISO dates and times, emails,
    URLs, quoted strings and `"key": value` pairs.

    Args:
        text: message content or tool-call arguments.
        key_prefix: prepended to JSON paths, e.g. the tool name.

    Returns:
        Ledger entries; none contains a newline.
    """
    facts: list[str] = []
    stripped = text.strip()
    parsed = False
    if stripped[:1] in ("{", "["):
        try:
            document = json.loads(stripped, parse_float=_Numeral, parse_int=_Numeral, parse_constant=_reject_constant)
            parsed = True
        except ValueError:
            parsed = False
    if parsed:
        _flatten(document, key_prefix.rstrip("."), facts)
    else:
        facts = _regex_facts(text)
    return list(dict.fromkeys(fact for fact in facts if fact and _is_single_line(fact)))


def _previous_ledger(message: Message) -> list[str]:
    """Ledger entries of an earlier summary message: the `- ` lines after its last `Facts:` line."""
    content = message.content or ""
    _, found, block = content.rpartition(f"\n{FACTS_HEADER}\n")
    if not found:
        return []
    return [line[2:] for line in block.splitlines() if line.startswith("- ")]


def _is_summary(message: Message) -> bool:
    return message.name == SUMMARY_MESSAGE_NAME


def build_ledger(messages: Sequence[Message]) -> list[str]:
    """Every exact value in `messages`, carried-forward ledgers first in their original order."""
    facts: list[str] = []
    for message in messages:
        if _is_summary(message):
            facts.extend(_previous_ledger(message))
            continue
        # Paths say which call a value came from and in which direction it went.
        prefix = f"{message.name}.result." if message.role == "tool" and message.name else ""
        if message.content:
            facts.extend(extract_facts(message.content, key_prefix=prefix))
        for call in message.tool_calls or ():
            facts.extend(extract_facts(call.arguments, key_prefix=f"{call.name}.arguments."))
    return list(dict.fromkeys(facts))


@dataclass(frozen=True)
class CompressionPlan:
    """Replace `history[:num_messages_compressed]` by one summary message.

    `ledger` is what that message will list; hand it to the summarizer too.
    """

    num_messages_compressed: int
    tokens_before: int
    tokens_compressed: int
    remaining_tokens_before: int
    ledger: tuple[str, ...]


def plan_compression(
    messages: Sequence[Message], account: TokenAccount, limits: SessionLimits
) -> CompressionPlan | None:
    """Decides whether and where to compress.

    Args:
        messages: the session history (no system message), aligned with `account.message_tokens`.
        account: token account of the prompt built from `messages`.
        limits: the session's limits.

    Returns:
        None when at least `compress_below_fraction` of the window remains, or
        when nothing lies before the last `keep_last_rounds` rounds; the caller
        then refuses the step if `account.remaining_tokens` is negative.
    """
    if len(messages) != len(account.message_tokens):
        raise ValueError(f"{len(messages)} messages but {len(account.message_tokens)} token counts")
    if account.remaining_tokens >= limits.compress_below_fraction * account.context_window_tokens:
        return None
    round_starts = [i for i, m in enumerate(messages) if m.role == "user" and not _is_summary(m)]
    if len(round_starts) <= limits.keep_last_rounds:
        return None
    cut = round_starts[-limits.keep_last_rounds]
    if all(_is_summary(m) for m in messages[:cut]):
        return None
    return CompressionPlan(
        num_messages_compressed=cut,
        tokens_before=account.total_tokens,
        tokens_compressed=sum(account.message_tokens[:cut]),
        remaining_tokens_before=account.remaining_tokens,
        ledger=tuple(build_ledger(messages[:cut])),
    )


def summarization_input(messages: Sequence[Message]) -> str:
    """Plain transcript of the messages to compress, for the model that writes `summary_text`."""
    lines = []
    for message in messages:
        if message.content:
            lines.append(f"{message.name if _is_summary(message) else message.role}: {message.content}")
        for call in message.tool_calls or ():
            lines.append(f"assistant called {call.name}({call.arguments})")
    return "\n".join(lines)


def _summary_content(summary_text: str, num_messages: int, ledger: Sequence[str]) -> str:
    facts = "\n".join(f"- {fact}" for fact in ledger) or "(none)"
    return (
        f"[Summary of {num_messages} earlier messages. Values under {FACTS_HEADER!r} are exact.]\n"
        f"{summary_text.strip()}\n{FACTS_HEADER}\n{facts}"
    )


def _context_text(messages: Sequence[Message]) -> str:
    parts = []
    for message in messages:
        parts.append(message.content or "")
        parts.extend(call.arguments for call in message.tool_calls or ())
    return "\n".join(parts)


def apply_compression(
    messages: Sequence[Message],
    plan: CompressionPlan,
    summary_text: str,
    *,
    recount: Callable[[Sequence[Message]], TokenAccount],
) -> tuple[list[Message], CompressionReport]:
    """Replaces the planned messages by one summary message with a facts ledger.

    The ledger is extracted again from the messages actually dropped, so the
    report measures what was kept, not what was planned.

    Args:
        messages: the history the plan was made for.
        plan: from `plan_compression`.
        summary_text: the summarizer's text; may be empty, the ledger is added regardless.
        recount: token account of a prompt built from a given history.

    Returns:
        The new history and the report.
    """
    cut = plan.num_messages_compressed
    if not 0 < cut < len(messages):
        raise ValueError(f"cannot compress {cut} of {len(messages)} messages")
    ledger = build_ledger(messages[:cut])
    summary = Message(role="user", content=_summary_content(summary_text, cut, ledger), name=SUMMARY_MESSAGE_NAME)
    new_messages = [summary, *messages[cut:]]
    context = _context_text(new_messages)
    retained = sum(1 for fact in ledger if fact in context)
    report = CompressionReport(
        num_messages_compressed=cut,
        tokens_before=plan.tokens_before,
        tokens_after=recount(new_messages).total_tokens,
        ledger_size=len(ledger),
        ledger_retained_fraction=retained / len(ledger) if ledger else 1.0,
    )
    return new_messages, report
