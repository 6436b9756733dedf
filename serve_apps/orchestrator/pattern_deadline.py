"""Regular expressions of JSON Schema validation, checked under a deadline.

Why: `pattern` and `patternProperties` come from a session's tool schemas and the
strings they test from the model, which a prompt can steer. Under Python's `re` a
backtracking pattern (`^(a+)+$`) doubles its time with each extra character and
holds the orchestrator's event loop meanwhile, every session on the replica with
it. jsonschema calls `re.search` from two of its modules; those calls go through
`DeadlineRe`, which uses the `regex` engine (same syntax) with a timeout while a
`pattern_deadline` is active, and plain `re` otherwise.
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

_deadline: ContextVar[float | None] = ContextVar("warmpath_pattern_deadline", default=None)


class PatternCheckTimeout(Exception):
    """A schema's regular expression ran past the validation's deadline."""


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


@contextmanager
def pattern_deadline(seconds: float) -> Iterator[None]:
    """Every schema regular expression run inside shares `seconds`; past them one raises `PatternCheckTimeout`."""
    token = _deadline.set(time.monotonic() + seconds)
    try:
        yield
    finally:
        _deadline.reset(token)
