r"""JSON Schema validation of a tool call, checked under a deadline.

Why: a session's tool schemas come from its client and the arguments from the
model, which a prompt can steer, and the check runs on the orchestrator's event
loop (every session on the replica waits while it runs). Two shapes cost far
more than their size:
- a backtracking `pattern` (`^(a+)+$`) doubles its time under Python's `re` with
  each extra character. jsonschema calls `re.search` from two of its modules;
  those calls go through `DeadlineRe`, which uses the `regex` engine (same
  syntax) with a timeout while a deadline is active, and plain `re` otherwise.
  It reads the pattern as JSON Schema does, in ECMAScript's dialect
  (`as_ecmascript`): Python's `$` also matches before a final newline and its
  `\d`, `\w` match any script's digits and letters, so `^[a-z0-9-]+$` would let
  `"report-1\n"` through and `^\d{4}$` the Arabic-Indic `"١٢٣٤"`;
- subschemas applied to one value many times over: an `allOf` of four `$ref`s,
  each to a definition that is another such `allOf`, applies the last one 4^15
  times on 15 levels (1.8 KB of schema). jsonschema remembers nothing it has
  checked, so the classes `deadline_checked` makes test the deadline before
  each keyword they apply;
- one keyword that runs long by itself: jsonschema's `uniqueItems` compares
  every pair of items once they cannot be sorted (one `{}` among them), 12 s for
  8,000 short items; `deadline_checked` applies it as one pass over canonical
  forms of the items (`_unique_items`).

The deadline is measured in the checking thread's own CPU time (`time.thread_time`), not wall time:
while another thread holds the GIL (a tool reply's JSON parsed beside the event loop: 0.1-0.3 s for
8 MB) or the host is busy, a call's check of a few microseconds could pass a wall-clock budget, and a
valid call was refused as a schema violation. (A `pattern`'s own timeout, in the `regex` engine, is
wall time: it gets what the budget has left.)
"""

from __future__ import annotations

import functools
import re
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import jsonschema._keywords
import jsonschema._utils
import regex
from jsonschema import validators
from jsonschema.exceptions import ValidationError

from serve_apps.orchestrator.bounded_cache import CostBoundedCache

_deadline: ContextVar[float | None] = ContextVar("warmpath_check_deadline", default=None)


class CheckTimeout(Exception):
    """A schema check ran past its deadline."""


class PatternCheckTimeout(CheckTimeout):
    """A schema's regular expression ran past the check's deadline."""


# ECMAScript's classes, as Python spells them: ASCII digits and word characters, and its white space (Python's
# also holds \x1c-\x1f and \x85, and lacks the byte order mark).
_ECMASCRIPT_CODE_POINTS = {  # inclusive ranges
    "d": ((0x30, 0x39),),
    "w": ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)),
    "s": ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
          (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF)),
}


def _class_text(ranges: Sequence[tuple[int, int]]) -> str:
    return "".join(_escaped(low) + (f"-{_escaped(high)}" if high > low else "") for low, high in ranges)


def _escaped(code_point: int) -> str:
    """The shortest escape of a code point both regular expression engines read."""
    if code_point < 0x100:
        return f"\\x{code_point:02x}"
    return f"\\u{code_point:04x}" if code_point < 0x10000 else f"\\U{code_point:08x}"


def _complement(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    out, start = [], 0
    for low, high in ranges:  # sorted, apart
        if low > start:
            out.append((start, low - 1))
        start = high + 1
    return out + ([(start, sys.maxunicode)] if start <= sys.maxunicode else [])


# The members of each class as a character class's text; by the uppercase letter, of its negation, which
# a class can hold (`[\w\W]`, any character, as ECMAScript reads it).
_ECMASCRIPT_CLASSES = {
    **{letter: _class_text(ranges) for letter, ranges in _ECMASCRIPT_CODE_POINTS.items()},
    **{letter.upper(): _class_text(_complement(ranges)) for letter, ranges in _ECMASCRIPT_CODE_POINTS.items()},
}
# What ECMAScript's `.` matches: anything but its four line terminators (Python's `.` stops at `\n` only).
_ECMASCRIPT_DOT = "[^\\n\\r\\u2028\\u2029]"


# The letters ECMAScript (with the `u` flag, as JSON Schema's validators compile) takes after a backslash.
_ECMASCRIPT_ESCAPE_LETTERS = frozenset("bBcdDfknpPrsStuvwWx")
_POSIX_CLASS = re.compile(r"\[:\^?[A-Za-z]+:\]")  # `regex` reads `[:^alpha:]` and `[:Digit:]` too


def non_ecmascript_syntax(pattern: str) -> str | None:
    r"""What in `pattern` ECMAScript reads otherwise than Python's engines, or None.

    A letter escape ECMAScript has not (`\A`, `\Z`, `\z`, `\G`, `\K`, `\h`) and a POSIX class
    (`[[:digit:]]`) are anchors and classes to `regex`, which checks the calls (`as_ecmascript`), and
    a literal letter and a class then a `]` to the grammar of forced calls (xgrammar): no value
    met both, and every forced call was refused as a schema violation.
    """
    for at, piece, in_class in pattern_pieces(pattern):
        if len(piece) == 2:
            escaped = piece[1]
            if escaped.isascii() and escaped.isalpha() and escaped not in _ECMASCRIPT_ESCAPE_LETTERS:
                return f"\\{escaped} is no escape of JSON Schema's regular expressions (ECMAScript)"
        elif piece == "[" and not in_class and pattern.startswith(("]", "^]"), at + 1):
            # ECMAScript's `[]` matches nothing and `[^]` any character; to Python's engines the `]` is a literal.
            empty = pattern[at:at + pattern.index("]", at) - at + 1]
            return (f"{empty} matches {'nothing' if empty == '[]' else 'any character'} in JSON Schema's regular "
                    "expressions (ECMAScript), and its `]` is a literal to other engines: write [\\s\\S] for any "
                    "character, or \\] for the bracket")
        elif in_class and (posix := _POSIX_CLASS.match(pattern, at)) is not None:
            return f"{posix.group()} is a POSIX class, which JSON Schema's regular expressions (ECMAScript) do not have"
    return None


def pattern_pieces(pattern: str) -> Iterator[tuple[int, str, bool]]:
    """(offset, piece, in a class): each escape (`\\x`) or other character of `pattern`, and whether it lies
    inside a character class (a class's closing `]` does, its opening `[` does not)."""
    in_class = False
    at = 0
    while at < len(pattern):
        if pattern[at] == "\\" and at + 1 < len(pattern):
            yield at, pattern[at:at + 2], in_class
            at += 2
            continue
        char = pattern[at]
        yield at, char, in_class
        in_class = char != "]" if in_class else char == "["
        at += 1


# Patterns longer than this are rewritten anew where asked (compiling one, counting its size) rather than
# cached: a rewrite is up to ~70 times its pattern (each `\S` a class of ranges), and a cache of long ones
# held hundreds of megabytes.
MAX_CACHED_PATTERN_CHARS = 1024


def as_ecmascript(pattern: str) -> str:
    r"""`pattern` rewritten so that Python's regex engines match what ECMAScript's matches.

    `$` outside a character class becomes `\Z` (the very end only), and `.` anything but a line
    terminator (`\r`, U+2028 and U+2029 too, so `^.+$` keeps a value on one line); `\d`, `\w`,
    `\s` become ECMAScript's classes (ASCII digits and word characters, its white space) and `\D`,
    `\W`, `\S` those classes negated, inside a class as their members (`[\s\S]`: any character; with
    Python's meaning it refused a value holding U+0085, and `[^\W]` took `é`).
    """
    return _rewritten(pattern) if len(pattern) > MAX_CACHED_PATTERN_CHARS else _cached_rewrite(pattern)


def _rewritten(pattern: str) -> str:
    out: list[str] = []
    for _, piece, in_class in pattern_pieces(pattern):
        escaped = piece[1] if len(piece) == 2 else ""
        if escaped in _ECMASCRIPT_CLASSES:
            members = _ECMASCRIPT_CLASSES[escaped]
            out.append(members if in_class else f"[{members}]")
        elif not in_class and piece == "$":
            out.append(r"\Z")
        elif not in_class and piece == ".":
            out.append(_ECMASCRIPT_DOT)
        else:
            out.append(piece)
    return "".join(out)


_cached_rewrite = functools.lru_cache(maxsize=1024)(_rewritten)


class _CompiledPatterns:
    """Patterns compiled as ECMAScript reads them (`as_ecmascript`), by pattern and flags, least recently used
    first out beyond `max_chars` of their rewrites in all.

    Why its own cache: the check compiles before it matches, and only matching runs under a timeout, so a
    tool's patterns are compiled ahead of its check (`compile_ahead`); and `regex`'s own cache kept up to 500
    compiled rewrites of any size (a few MB each for patterns of thousands of class elements: gigabytes).
    """

    def __init__(self, max_chars: int) -> None:
        self._compiled: CostBoundedCache[regex.Pattern] = CostBoundedCache(
            max_chars, lambda compiled: len(compiled.pattern))

    def get(self, pattern: str, flags: int = 0) -> regex.Pattern:
        return self._compiled.get(
            (pattern, flags), lambda: regex.compile(as_ecmascript(pattern), flags, cache_pattern=False))


COMPILED_PATTERNS = _CompiledPatterns(max_chars=4 * 1024 * 1024)


def compile_ahead(patterns: Iterable[str]) -> None:
    """Compiles `patterns` into COMPILED_PATTERNS before a check, whose deadline then bounds matching alone (a
    pattern of thousands of elements compiles for about a second: inside the deadline, a tool's first valid call
    was refused). One that does not compile is left to the check, which reports it."""
    for pattern in patterns:
        try:
            COMPILED_PATTERNS.get(pattern)
        except (regex.error, RecursionError, OverflowError):
            pass


class DeadlineRe:
    """What jsonschema's keyword modules call `re`: `search` bounded by the active deadline, the rest `re`'s."""

    def __getattr__(self, name: str):
        return getattr(re, name)

    @staticmethod
    def search(pattern, string, flags=0):
        deadline = _deadline.get()
        if deadline is None:
            return re.search(pattern, string, flags)
        remaining = deadline - time.thread_time()
        if remaining <= 0:
            raise PatternCheckTimeout
        try:
            return COMPILED_PATTERNS.get(pattern, flags).search(string, timeout=remaining)
        except TimeoutError:
            raise PatternCheckTimeout from None


def install() -> None:
    """Routes jsonschema's `re.search` calls (`pattern`, `patternProperties`, additional-property matching) here."""
    for module in (jsonschema._keywords, jsonschema._utils):
        if not isinstance(module.re, DeadlineRe):
            module.re = DeadlineRe()


def _checked(keyword):
    def apply(validator, value, instance, schema):
        deadline = _deadline.get()
        if deadline is not None and time.thread_time() > deadline:
            raise CheckTimeout
        return keyword(validator, value, instance, schema)

    return apply


def _canonical(value: object) -> object:
    """A hashable form of a JSON value that two values share exactly when JSON Schema calls them equal:
    numbers by value (`1` and `1.0`), never a boolean as a number, objects whatever their key order."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return (type(value).__name__, value)
    if isinstance(value, (int, float)):
        return ("number", int(value) if isinstance(value, float) and value.is_integer() else value)
    if isinstance(value, dict):
        return ("object", frozenset((key, _canonical(item)) for key, item in value.items()))
    if isinstance(value, (list, tuple)):
        return ("array", tuple(_canonical(item) for item in value))
    return ("other", repr(value))


def _unique_items(validator, is_unique, instance, schema):
    """`uniqueItems` in one pass (jsonschema's compares every pair once items cannot be sorted)."""
    if not is_unique or not validator.is_type(instance, "array"):
        return
    seen = set()
    for item in instance:
        key = _canonical(item)
        if key in seen:
            yield ValidationError(f"{instance!r} has non-unique elements")
            return
        seen.add(key)


def deadline_checked(validator_class: type) -> type:
    """`validator_class` whose every keyword tests the active deadline before it applies (`CheckTimeout` past it)."""
    keywords = {**validator_class.VALIDATORS, "uniqueItems": _unique_items}
    return validators.extend(validator_class, {name: _checked(keyword) for name, keyword in keywords.items()})


@contextmanager
def check_deadline(seconds: float) -> Iterator[None]:
    """Every check run inside shares `seconds` of this thread's CPU time: past them a keyword or a regular
    expression raises `CheckTimeout`."""
    token = _deadline.set(time.thread_time() + seconds)
    try:
        yield
    finally:
        _deadline.reset(token)
