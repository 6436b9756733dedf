"""JSON Schema validation of a tool call, checked under a deadline.

Why: a session's tool schemas come from its client and the arguments from the
model, which a prompt can steer, and the check runs on the orchestrator's event
loop (every session on the replica waits while it runs). Two shapes cost far
more than their size:
- a backtracking `pattern` (`^(a+)+$`) doubles its time under Python's `re` with
  each extra character. jsonschema calls `re.search` from two of its modules;
  those calls go through `DeadlineRe`, which uses the `regex` engine (same
  syntax) with a timeout while a deadline is active, and plain `re` otherwise;
- subschemas applied to one value many times over: an `allOf` of four `$ref`s,
  each to a definition that is another such `allOf`, applies the last one 4^15
  times on 15 levels (1.8 KB of schema). jsonschema remembers nothing it has
  checked, so the classes `deadline_checked` makes test the deadline before
  each keyword they apply.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import jsonschema._keywords
import jsonschema._utils
import regex
from jsonschema import validators

_deadline: ContextVar[float | None] = ContextVar("warmpath_check_deadline", default=None)


class CheckTimeout(Exception):
    """A schema check ran past its deadline."""


class PatternCheckTimeout(CheckTimeout):
    """A schema's regular expression ran past the check's deadline."""


class DeadlineRe:
    """What jsonschema's keyword modules call `re`: `search` bounded by the active deadline, the rest `re`'s."""

    def __getattr__(self, name: str):
        return getattr(re, name)

    @staticmethod
    def search(pattern, string, flags=0):
        deadline = _deadline.get()
        if deadline is None:
            return re.search(pattern, string, flags)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise PatternCheckTimeout
        try:
            return regex.search(pattern, string, flags, timeout=remaining)
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
        if deadline is not None and time.monotonic() > deadline:
            raise CheckTimeout
        return keyword(validator, value, instance, schema)

    return apply


def deadline_checked(validator_class: type) -> type:
    """`validator_class` whose every keyword tests the active deadline before it applies (`CheckTimeout` past it)."""
    return validators.extend(
        validator_class, {name: _checked(keyword) for name, keyword in validator_class.VALIDATORS.items()}
    )


@contextmanager
def check_deadline(seconds: float) -> Iterator[None]:
    """Every check run inside shares `seconds`: past them a keyword or a regular expression raises `CheckTimeout`."""
    token = _deadline.set(time.monotonic() + seconds)
    try:
        yield
    finally:
        _deadline.reset(token)
