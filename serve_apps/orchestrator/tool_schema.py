"""Checks on a tool's `parameters` JSON Schema, so validating calls against it is safe and cheap.

Invariants `check_tool_parameters` holds for every accepted schema:
- it is a Draft 2020-12 JSON Schema describing an object, and
  every `$ref` in it points into its own top-level `$defs` (no remote documents,
  no `$id` rebasing), so validation never does I/O and the schema can be
  embedded verbatim into the structured-output schema of `tools.tool_choice_schema`;
- it is bounded before anything walks it recursively: at most
  MAX_SCHEMA_BYTES of compact JSON, at most MAX_SCHEMA_DEPTH nested objects and
  arrays, only what JSON can carry (no NaN, which the store would write as null,
  and no lone surrogates, which it could not write at all), and every `$ref`
  lands on an existing subschema through chains of at most MAX_REF_HOPS `$ref`s
  that do not descend into the arguments, so nothing the client sends as a schema
  makes `tools.validate_tool_call` recurse without end or fail on the schema
  (how deep the arguments may nest is for tools.py to bound);
- `$schema`, where present, names Draft 2020-12: jsonschema switches dialect on a
  nested `$schema`, and older dialects read 2020-12 keywords differently;
- every number in it fits what vLLM's grammar compiler (xgrammar) reads numbers
  as: every number is within the float64 range, an integer a keyword holds
  (a bound, a length; not a `const`/`enum` value) fits int64, a count
  (`maxLength`, `minItems`, ...) is written as an integer (the minimums within
  int32), and the bounds (`minimum`, `maximum`, ...) of an `integer` schema are
  whole numbers within int64. A schema that breaks this is accepted by JSON
  Schema but fails every turn forced to call a tool (`tool_choice: "required"`
  or a tool name), so it is refused at creation;
- every `pattern` (and `patternProperties` name) compiles under the `regex`
  engine the call checks run it with (`check_deadline`), in JSON Schema's
  ECMAScript dialect (named groups `(?<name>...)` too, which Python's `re`
  refuses: the metaschema's own format check is left to this one); one that
  only `re` compiles would fail every call of its tool inside the orchestrator;
  it has no Unicode property class (`\\p{L}`), which the grammar compiler
  cannot take; and it
  unrolls to at most `MAX_PATTERN_UNROLLED` elements (`[a-z]{1,30000}` is
  30,000): the grammar compiler expands counted repeats, and its time grows
  about with their square (30,000 took 74 s on one core; `maxLength` bounds a
  long string without that; optional copies nested in optional copies weigh
  `NESTED_OPTIONAL_REPEAT_WEIGHT` times a level). The size is measured before anything compiles the
  pattern, and a session's tools together stay within
  `MAX_SESSION_PATTERN_UNROLLED` (`pattern_elements`, checked by `CreateSessionRequest`).

What the compiler still refuses at a turn is the request's fault, not a replica's:
`grammar_failure_message` recognises the engine's error for it. So is a `$defs`
name two tools define differently, which vLLM cannot merge into the grammar of a
`required` call (`tools.conflicting_defs` refuses such tools at creation).
"""

from __future__ import annotations

import copy
import json
import math
import re
import re._constants
import re._parser
import sys
import warnings
from collections.abc import Callable, Iterator
from urllib.parse import unquote

import jsonschema_rs
import regex
from jsonschema import Draft202012Validator, FormatChecker
from jsonschema.exceptions import SchemaError
from pydantic import JsonValue

from serve_apps.orchestrator.check_deadline import as_ecmascript, non_ecmascript_syntax, pattern_pieces

# Bounds on a tool's `parameters`. Real tool schemas are a few KiB and a handful of
# levels deep; these leave room for them while keeping validation cheap and its
# recursion (several Python frames per level) far below the interpreter's limit.
MAX_SCHEMA_BYTES = 16384
MAX_SCHEMA_DEPTH = 16
# `$ref`s followed without descending into the arguments (`$ref` to `$ref`, `allOf`, ...):
# a cycle of them never terminates, and a long chain exhausts the stack just the same.
MAX_REF_HOPS = 16
# Keywords that would make a schema resolve references outside itself.
_REBASING_KEYWORDS = ("$id", "$anchor", "$dynamicRef", "$dynamicAnchor", "$recursiveRef")
_LOCAL_REF_PREFIX = "#/$defs/"
_DRAFT_2020_12_URIS = ("https://json-schema.org/draft/2020-12/schema", "https://json-schema.org/draft/2020-12/schema#")
# Draft 2020-12 keywords whose value is a subschema, a list of subschemas, or a map of
# names to subschemas: the only places a `$ref` may land.
_SUBSCHEMA_KEYWORDS = frozenset(
    {
        "additionalProperties", "contains", "contentSchema", "else", "if", "items", "not",
        "propertyNames", "then", "unevaluatedItems", "unevaluatedProperties",
    }
)
_SUBSCHEMA_LIST_KEYWORDS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})
_SUBSCHEMA_MAP_KEYWORDS = frozenset({"$defs", "dependentSchemas", "patternProperties", "properties"})
# Keywords whose value is instance data, never read as a schema: a `{"$ref": ...}` there is a value.
_DATA_KEYWORDS = frozenset({"const", "default", "enum", "examples"})
# Applicators that validate the instance they are given, not a part of it.
_IN_PLACE_KEYWORDS = frozenset({"allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentSchemas"})
_ARRAY_INDEX = re.compile(r"0|[1-9][0-9]*")
# The range the grammar compiler parses integers into.
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
_FLOAT64_MAX = int(sys.float_info.max)
_INTEGER_BOUND_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# Keywords holding a count, which the grammar compiler reads as an integer (5.0 is refused there); it
# takes the minimums up to int32's maximum.
_COUNT_KEYWORDS = frozenset({"minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
                             "minContains", "maxContains"})
_MIN_COUNT_KEYWORDS = frozenset({"minLength", "minItems", "minProperties", "minContains"})
INT32_MAX = 2**31 - 1
# vLLM's messages when xgrammar cannot compile a structured-output request
# (vllm/v1/structured_output/backend_xgrammar.py), or when the tools' `$defs`
# cannot be merged into the schema of a `required` call (vllm/tool_parsers/utils.py).
_GRAMMAR_FAILURE = re.compile(
    r"Failed to transform (?:json schema|regex|choices) into a grammar"
    r"|The provided JSON schema contains features not supported by xgrammar"
    r"|Tool definition '.*' has multiple schemas"
)

SchemaLocation = tuple[str | int, ...]


def _checked_as_a_pattern(pattern: object) -> bool:
    """The metaschema's `format: regex` (on `pattern`s and `patternProperties` names) is left to
    `_check_pattern`, which compiles in JSON Schema's own ECMAScript dialect with `regex` (named groups
    `(?<name>...)`, `\\p{L}` classes): the default check compiles with Python's `re`, which refuses both."""
    return True


# The metaschema's format checks: none but `regex`, left to `_check_pattern` (`_checked_as_a_pattern`). Not
# jsonschema's own set, which grows with the optional packages installed (`uri`, `uri-reference` with
# rfc3986-validator): jsonschema-rs, which answers first (`_check_metaschema`), asserts none.
_METASCHEMA_FORMATS = FormatChecker(formats=())
_METASCHEMA_FORMATS.checks("regex")(_checked_as_a_pattern)


_UUID = re.compile(r"[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}", re.ASCII)


def _is_uuid(value: object) -> bool:
    """`format: uuid`: RFC 9562's hyphenated hex form exactly. jsonschema's check reads it with `uuid.UUID`,
    which takes `urn:uuid:` text, braces, a sign, underscores and non-ASCII digits (`+2345678-1234-...`)."""
    return not isinstance(value, str) or _UUID.fullmatch(value) is not None


# Draft 2020-12's formats jsonschema checks only with optional packages (rfc3339-validator, rfc3986-validator,
# ...), which jsonschema-rs checks in Rust: without them, `date-time`, `uri` or `hostname` in a tool's schema
# took any text (`"next tuesday"`), while `date` was checked.
_FORMATS_CHECKED_IN_RUST = ("date-time", "time", "duration", "hostname", "uri", "uri-reference", "iri",
                            "iri-reference", "uri-template", "json-pointer", "relative-json-pointer")


def _rust_format_check(name: str) -> Callable[[object], bool]:
    """`format: <name>` as jsonschema-rs judges it, in Rust; a format applies to strings only."""
    validator = jsonschema_rs.validator_for({"type": "string", "format": name}, validate_formats=True)
    return lambda value: not isinstance(value, str) or validator.is_valid(value)


# What a tool's arguments are checked with: every Draft 2020-12 format, `regex` as ECMAScript's, `uuid` as its
# RFC's, those jsonschema has no checker for here as jsonschema-rs checks them.
ARGUMENT_FORMATS = copy.deepcopy(Draft202012Validator.FORMAT_CHECKER)
# `regex`: ECMA-262's with the `u` flag as JSON Schema's test suite reads it (a lone `]` or `{` is none; `\a` is no
# escape), judged by jsonschema-rs's ECMAScript parser. Compiled as Python's `re` after a rewrite, valid
# ECMAScript was refused (`\k<name>`, `[^]`, `\u{1F600}`) and Python's own syntax accepted (`(?i)`,
# `(?P<name>...)`, `a++`, `(?#...)`). It parses without writing counted repeats out (`a{1000000000}` costs
# nothing) and without recursion (a million nested groups: 50 ms).
ARGUMENT_FORMATS.checks("regex")(_rust_format_check("regex"))
ARGUMENT_FORMATS.checks("uuid")(_is_uuid)
for _name in _FORMATS_CHECKED_IN_RUST:
    if _name not in ARGUMENT_FORMATS.checkers:
        ARGUMENT_FORMATS.checks(_name)(_rust_format_check(_name))


def check_tool_parameters(value: dict[str, JsonValue]) -> None:
    """Raises ValueError, with a message naming the problem, unless `value` holds the invariants above."""
    # Bounds first: the metaschema check recurses per level and would overflow the stack on deep input.
    _check_bounds(value)
    _check_metaschema(value)
    if value.get("type") != "object":
        raise ValueError('tool arguments are a JSON object: the schema needs "type": "object"')
    refs: dict[str, str] = {}
    _check_keywords(value, "", refs)
    for pattern, where in _schema_patterns(value, ""):
        _check_pattern(pattern, where)
    # After the metaschema check: resolution relies on keyword values having their schema shapes.
    _check_ref_chains(value, refs)


def _check_metaschema(value: dict[str, JsonValue]) -> None:
    """Raises ValueError unless `value` is a Draft 2020-12 schema by the metaschema.

    jsonschema-rs answers first, in Rust: the same check in Python took 0.1-0.2 s for a schema at
    MAX_SCHEMA_BYTES, so a session of 128 such tools held the one thread that checks bodies for 16-23 s, ahead of
    every tenant's session. Python's jsonschema still words a refusal (its messages name the keyword and the
    path), and has the last word where they differ. Neither asserts a format of the metaschema's here: Python's
    checker has none for `uri`/`uri-reference` without optional packages, `regex` is `_check_pattern`'s, and
    jsonschema-rs asserts none unless asked; tests hold the two to the same verdicts over every keyword.
    Only where the root's `$schema` is absent or 2020-12's: jsonschema-rs reads another as the dialect to check
    by, and looks up one it does not know (Python's checks by 2020-12's metaschema whatever the value).
    """
    if value.get("$schema", _DRAFT_2020_12_URIS[0]) in _DRAFT_2020_12_URIS:
        try:
            if jsonschema_rs.meta.is_valid(value):
                return
        except (jsonschema_rs.ReferencingError, ValueError):  # a verdict Python's check gives, with its message
            pass
    try:
        Draft202012Validator.check_schema(value, format_checker=_METASCHEMA_FORMATS)
    except SchemaError as err:
        where = "/".join(str(p) for p in err.absolute_path) or "<root>"
        raise ValueError(f"not a valid Draft 2020-12 JSON Schema at {where}: {err.message}") from None


def pattern_elements(schema: JsonValue) -> int:
    """The elements every `pattern` of an accepted schema unrolls to, summed: what its grammar costs to build.

    A session's tools are compiled into one grammar for a turn forced to call one
    (`tool_choice: "required"`), so `CreateSessionRequest` bounds the sum over all of them
    (`MAX_SESSION_PATTERN_UNROLLED`).
    """
    return sum(_pattern_size(pattern) for pattern, _ in _schema_patterns(schema, ""))


def schema_patterns(schema: JsonValue) -> list[str]:
    """Every regular expression of an accepted schema (`pattern` values, `patternProperties` names)."""
    return [pattern for pattern, _ in _schema_patterns(schema, "")]


def unchecked_pattern_elements(parameters: object) -> int:
    """`pattern_elements` of a tool's parameters not yet checked, as session creation sums them before it checks
    (and compiles) each tool's; 0 for parameters the tool's own check refuses unread: not an object, over
    MAX_SCHEMA_BYTES, or not writable as JSON (measured first, in C: a huge pattern was parsed for seconds)."""
    if not isinstance(parameters, dict):
        return 0
    try:
        if len(compact_json_utf8(parameters, "tool parameters")) > MAX_SCHEMA_BYTES:
            return 0
        return pattern_elements(parameters)
    except (ValueError, TypeError, RecursionError):
        return 0


def _schema_patterns(node: JsonValue, path: str) -> Iterator[tuple[str, str]]:
    """Every regular expression of a schema (`pattern` values, `patternProperties` names) and where it is,
    walked as `_check_keywords` walks: data keywords hold values, not schemas."""
    if isinstance(node, dict):
        for key, value in node.items():
            where = f"{path}/{key}"
            if key in _DATA_KEYWORDS:
                continue
            if key == "pattern" and isinstance(value, str):
                yield value, where
            if key == "patternProperties" and isinstance(value, dict):
                yield from ((name, f"{where}/{name}") for name in value)
            if key in _SUBSCHEMA_MAP_KEYWORDS and isinstance(value, dict):
                for name, sub in value.items():
                    yield from _schema_patterns(sub, f"{where}/{name}")
            else:
                yield from _schema_patterns(value, where)
    elif isinstance(node, list):
        for index, item in enumerate(node):
            yield from _schema_patterns(item, f"{path}/{index}")


def compact_json_utf8(value: JsonValue, what: str) -> bytes:
    """`value` as compact, key-sorted JSON in UTF-8: the bytes the session store or a tool's HTTP body carries.

    Raises:
        ValueError: naming `what`, for a value JSON text cannot carry: a lone
            surrogate (Python's `json.loads` turns `"\\ud800"` into one, and
            pydantic's JsonValue keeps it) or an integer too long to print.
    """
    try:
        return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as err:
        surrogate = err.object[err.start : err.end]
        raise ValueError(f"{what} hold a lone surrogate {surrogate!r}, which is not Unicode text") from None
    except ValueError as err:  # an integer too long to print
        raise ValueError(f"{what} cannot be written as JSON: {err}") from None


def prefix_def_refs(schema: JsonValue, prefix: str) -> JsonValue:
    """A copy of `schema` whose `#/$defs/X...` references read `#/$defs/<prefix>X...`.

    For hoisting a schema's `$defs` into a larger one under prefixed names. Only
    subschema positions are rewritten: under `const`, `enum`, `default` or
    `examples` a `{"$ref": ...}` is a value the arguments must equal, not a reference.
    """
    if not isinstance(schema, dict):
        return copy.deepcopy(schema)
    out: dict[str, JsonValue] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith(_LOCAL_REF_PREFIX):
            out[key] = f"{_LOCAL_REF_PREFIX}{prefix}{value[len(_LOCAL_REF_PREFIX):]}"
        elif key in _SUBSCHEMA_KEYWORDS:
            out[key] = prefix_def_refs(value, prefix)
        elif key in _SUBSCHEMA_LIST_KEYWORDS and isinstance(value, list):
            out[key] = [prefix_def_refs(item, prefix) for item in value]
        elif key in _SUBSCHEMA_MAP_KEYWORDS and isinstance(value, dict):
            out[key] = {name: prefix_def_refs(sub, prefix) for name, sub in value.items()}
        else:
            out[key] = copy.deepcopy(value)
    return out


def _check_bounds(schema: dict[str, JsonValue]) -> None:
    """Size, depth and finiteness, checked iteratively before anything recurses into the schema.

    Size goes first: it is measured in C, so a huge body is refused before a Python
    walk over it. Integers beyond the float64 range are refused here, wherever they
    are: the grammar compiler fails on such a number, even as a `const` value. What JSON cannot carry is refused here too, because the session
    store writes the schema as JSON: a lone surrogate (Python's `json.loads` accepts
    `"\\ud800"`, and pydantic's JsonValue keeps it) makes that write fail, and NaN or
    Infinity would be stored as null, so the schema re-read would not be the one sent.
    """
    num_bytes = len(compact_json_utf8(schema, "tool parameters"))
    if num_bytes > MAX_SCHEMA_BYTES:
        raise ValueError(
            f"tool parameters schema is {num_bytes} bytes of compact JSON, "
            f"over the limit MAX_SCHEMA_BYTES={MAX_SCHEMA_BYTES}"
        )
    depth = 0
    stack: list[tuple[JsonValue, int, str]] = [(schema, 1, "")]
    while stack:
        node, level, path = stack.pop()
        if isinstance(node, dict):
            depth = max(depth, level)
            stack.extend((value, level + 1, f"{path}/{key}") for key, value in node.items())
        elif isinstance(node, list):
            depth = max(depth, level)
            stack.extend((item, level + 1, f"{path}/{index}") for index, item in enumerate(node))
        elif isinstance(node, float) and not math.isfinite(node):
            raise ValueError(f"{path or '/'}: {node} is not a JSON number")
        elif isinstance(node, int) and not isinstance(node, bool) and abs(node) > _FLOAT64_MAX:
            raise ValueError(
                f"{path or '/'}: an integer of {len(str(abs(node)))} digits is beyond the float64 range, "
                "which the grammar of forced tool calls needs"
            )
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(
            f"tool parameters schema nests {depth} levels of objects and arrays, "
            f"over the limit MAX_SCHEMA_DEPTH={MAX_SCHEMA_DEPTH}"
        )


def _check_keywords(node: JsonValue, path: str, refs: dict[str, str]) -> None:
    """Rejects keywords that leave the schema or switch dialect, and collects `$ref` values with where they occur.

    Data keywords (`const`, `enum`, `default`, `examples`) are not walked: what they
    hold is a value the arguments are compared with, so `{"const": {"$ref": "x"}}` is
    valid. Under a map of subschemas (`properties`, ...) the keys are names, so a
    property named `const` or `$ref` is still checked as the schema it is. Anything
    else, unknown keywords included, is walked as if it could hold schemas.
    """
    if isinstance(node, dict):
        _check_integer_bounds(node, path)
        for key, value in node.items():
            where = f"{path}/{key}"
            if key == "$ref" and isinstance(value, str):
                if not value.startswith(_LOCAL_REF_PREFIX):
                    raise ValueError(f"{where}: only local references into '#/$defs/' are allowed, got {value!r}")
                refs.setdefault(value, where)
            if key in _REBASING_KEYWORDS and isinstance(value, str):
                raise ValueError(f"{where}: {key} is not allowed in tool parameters")
            if key == "$schema" and isinstance(value, str) and value not in _DRAFT_2020_12_URIS:
                raise ValueError(f"{where}: only Draft 2020-12 ({_DRAFT_2020_12_URIS[0]}) is supported, got {value!r}")
            if key in _DATA_KEYWORDS:
                continue
            if key in _SUBSCHEMA_MAP_KEYWORDS and isinstance(value, dict):
                for name, sub in value.items():
                    _check_keywords(sub, f"{where}/{name}", refs)
            else:
                _check_keywords(value, where, refs)
    elif isinstance(node, list):
        for index, item in enumerate(node):
            _check_keywords(item, f"{path}/{index}", refs)
    elif isinstance(node, int) and not isinstance(node, bool) and not INT64_MIN <= node <= INT64_MAX:
        # A keyword's number (a bound, a length): the grammar compiler reads it as int64.
        raise ValueError(
            f"{path}: an integer of {len(str(abs(node)))} digits does not fit in 64 bits, "
            "which the grammar of forced tool calls needs"
        )


# Most elements a `pattern` may unroll to (`_unrolled_size`): 4,096 compiles in about 0.3 s.
MAX_PATTERN_UNROLLED = 4096
# What the elements of a repeat of optional copies (`{n,m}`, n < m) weigh inside another, per level: the grammar
# compiler's work on such nesting grew about tenfold a level (measured: `(?:[a-z]{1,64}){1,64}` 6.9 s against
# 0.7 s for `[a-z]{1,4096}`, the same 4,096 elements; three levels of 16, 20.6 s).
NESTED_OPTIONAL_REPEAT_WEIGHT = 8
# Most elements all patterns of a session's tools may unroll to, together: the grammar of a forced call
# holds every tool, and builds in about 0.2 s per thousand elements (16 patterns of 4,095 took 14 s).
MAX_SESSION_PATTERN_UNROLLED = 16384
# How deep a pattern's groups may nest: far beyond what a value's syntax needs, far below the stack the call
# checks have left for the regular expression engines, which parse groups recursively.
MAX_PATTERN_GROUP_DEPTH = 32


def _check_pattern(pattern: str, where: str) -> None:
    """A regular expression the grammar compiler reads (`_grammar_regex_problem`; no `\\p{...}` class) and
    expands to at most `MAX_PATTERN_UNROLLED` elements, in ECMAScript's syntax, which the grammar and the
    checks read alike (`non_ecmascript_syntax`), and that the call checks can run: they run it with `regex`
    (`check_deadline`), which refuses some that `re` compiles.

    Measured before compiling: `regex` writes counted repeats out as it compiles, and a
    15-character `a{100000000,}` took gigabytes; the check compiles uncached.
    """
    depth = _group_depth(pattern)
    if depth > MAX_PATTERN_GROUP_DEPTH:
        # The engines parse groups recursively: checked here from a shallow stack, a pattern nested about 200
        # deep compiled, and the call check (deeper in the stack) refused every call as unable to check it.
        raise ValueError(f"{where}: {pattern[:80]!r} nests its groups {depth} deep, over {MAX_PATTERN_GROUP_DEPTH}")
    size = _pattern_size(pattern)
    if size > MAX_PATTERN_UNROLLED:
        raise ValueError(
            f"{where}: {pattern[:80]!r} unrolls to {min(size, 10**9)}{'+' if size > 10**9 else ''} elements (a "
            f"repeat of optional copies inside another counting {NESTED_OPTIONAL_REPEAT_WEIGHT} times a level), over "
            f"{MAX_PATTERN_UNROLLED}: the grammar of "
            "forced tool calls expands counted repeats ({n,m}), which takes minutes at this size; bound a long "
            "string with maxLength instead"
        )
    if (problem := non_ecmascript_syntax(pattern)) is not None:
        raise ValueError(f"{where}: {pattern[:80]!r}: {problem}; the grammar of forced tool calls and the call "
                         "checks would read it differently")
    if _has_property_class(pattern):
        raise ValueError(
            f"{where}: {pattern[:80]!r} uses a Unicode property class (\\p{{...}}), which the grammar of forced "
            "tool calls (xgrammar) cannot take; spell the characters out in a class ([A-Za-z\\u00C0-\\u024F])"
        )
    try:
        regex.compile(as_ecmascript(pattern), cache_pattern=False)
    except regex.error as err:
        raise ValueError(f"{where}: {pattern!r} is not a regular expression the checks can run: {err}") from None
    except RecursionError:  # the engine parses groups recursively: hundreds nested exhaust the stack
        raise ValueError(f"{where}: {pattern[:80]!r} nests its groups too deeply to be checked") from None
    problem = _grammar_regex_problem(pattern)
    if problem is not None:
        raise ValueError(
            f"{where}: {pattern[:80]!r} is a regular expression the grammar of forced tool calls (xgrammar) cannot "
            f"read ({problem}): word boundaries (\\b), lookbehind, inline flags and backreferences are beyond it"
        )


def _group_depth(pattern: str) -> int:
    """How deep `pattern`'s groups nest (an escaped or in-class parenthesis is none)."""
    depth = deepest = 0
    for _, piece, in_class in pattern_pieces(pattern):
        if not in_class and piece == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif not in_class and piece == ")":
            depth = max(depth - 1, 0)
    return deepest


def _grammar_regex_problem(pattern: str) -> str | None:
    """Why vLLM's grammar compiler (xgrammar, `serve_apps.builders`) cannot read `pattern`, or None.

    Its regex reader takes less than JSON Schema's ECMAScript (`\\b`, `(?<=a)b`, `(?i:a)`,
    `x{,5}`): a session with such a pattern would fail every turn forced to call a tool. Reading
    one takes well under a millisecond (counted repeats are written out only when compiling).
    """
    import xgrammar  # vLLM's own dependency; imported where a pattern is first checked

    try:
        xgrammar.Grammar.from_regex(pattern)
    except RuntimeError as err:
        text = str(err).strip()
        text = text[text.find("Regex parsing error"):] if "Regex parsing error" in text else text
        return text.splitlines()[0].rstrip(".") if text else type(err).__name__
    return None


def _pattern_size(pattern: str) -> int:
    """The elements `pattern` unrolls to (`_unrolled_size`), found by parsing alone (microseconds)."""
    try:
        with warnings.catch_warnings():  # `re` warns of syntax it may read otherwise one day (`[[`): only counted here
            warnings.simplefilter("ignore", FutureWarning)
            return _unrolled_size(re._parser.parse(_as_re_syntax(as_ecmascript(pattern))).data)
    except (re.error, RecursionError, OverflowError):
        # Syntax `re` cannot parse: no nesting is known, so every count is taken as nested in the others.
        size = 1
        for low, high in _COUNTED_REPEAT.findall(pattern):
            size *= max(int(low), int(high or 0), 1) * NESTED_OPTIONAL_REPEAT_WEIGHT
            if size > MAX_PATTERN_UNROLLED:
                break
        return size


def _has_property_class(pattern: str) -> bool:
    """Whether `pattern` has a `\\p{...}` or `\\P{...}` escape (an escaped backslash before a `p` is none)."""
    return any(piece in ("\\p", "\\P") and pattern[at + 2:at + 3] == "{" for at, piece, _ in pattern_pieces(pattern))


# The numbers of counted repeats (`{n}`, `{n,}`, `{n,m}`), for a pattern `re` cannot parse.
_COUNTED_REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def _as_re_syntax(pattern: str) -> str:
    """`pattern` with ECMAScript's named groups `(?<name>` as groups Python's `re` reads, for counting its repeats:
    unnamed, since a name may repeat in ECMAScript's branches (`(?<g>x)|(?<g>y)`) and `re` refuses that (counted
    as unparsable, their nesting was not)."""
    return re.sub(r"\(\?<(?![=!])[^>]*>", "(?:", pattern)


def _unrolled_size(items, depth: int = 0) -> int:
    """Elements of a parsed pattern (`re._parser`) with every counted repeat written out: a repeat counts its
    body as often as its bound (an unbounded one as often as its minimum, at least once: its loop). A repeat
    of optional copies inside `depth` others weighs `NESTED_OPTIONAL_REPEAT_WEIGHT` times its elements."""
    size = 0
    for op, value in items:
        if op in (re._constants.MAX_REPEAT, re._constants.MIN_REPEAT, re._constants.POSSESSIVE_REPEAT):
            low, high, body = value
            is_loop = high == re._constants.MAXREPEAT
            copies = max(low, 1) if is_loop else high
            is_optional = not is_loop and high > low
            weight = NESTED_OPTIONAL_REPEAT_WEIGHT if is_optional and depth else 1
            size += copies * weight * _unrolled_size(body, depth + 1 if is_optional else depth)
        elif op is re._constants.SUBPATTERN:
            size += _unrolled_size(value[-1], depth)
        elif op is re._constants.ATOMIC_GROUP:
            size += _unrolled_size(value, depth)
        elif op is re._constants.BRANCH:
            size += sum(_unrolled_size(branch, depth) for branch in value[1])
        elif op is re._constants.GROUPREF_EXISTS:  # (?(1)yes|no)
            size += sum(_unrolled_size(branch, depth) for branch in value[1:] if branch is not None)
        elif op in (re._constants.ASSERT, re._constants.ASSERT_NOT):
            size += _unrolled_size(value[1], depth)
        else:
            size += 1
        if size > MAX_PATTERN_UNROLLED:
            return size  # enough to refuse: nested bounds must not multiply into a huge int first
    return size


def _check_integer_bounds(schema: dict[str, JsonValue], path: str) -> None:
    """Counts are written as integers (the minimums within int32), and the bounds of a schema that admits
    integers are whole numbers within int64: how the grammar compiler reads them."""
    for key in _COUNT_KEYWORDS.intersection(schema):
        count = schema[key]
        if isinstance(count, float):
            raise ValueError(
                f"{path}/{key}: write {count} as an integer (JSON Schema allows a decimal, but the grammar of "
                "forced tool calls reads a count as an integer only)"
            )
        if key in _MIN_COUNT_KEYWORDS and isinstance(count, int) and count > INT32_MAX:
            raise ValueError(f"{path}/{key}: {count} is over {INT32_MAX}, the most the grammar of forced tool calls takes")
    types = schema.get("type")
    if not (types == "integer" or (isinstance(types, list) and "integer" in types)):
        return
    for key in _INTEGER_BOUND_KEYWORDS:
        bound = schema.get(key)
        if isinstance(bound, float) and not INT64_MIN <= bound <= INT64_MAX:
            raise ValueError(
                f"{path}/{key}: {bound} is outside the 64-bit integer range, which the grammar of "
                "forced tool calls needs for an integer's bounds"
            )
        if isinstance(bound, float) and not bound.is_integer():
            raise ValueError(
                f"{path}/{key}: {bound} is not a whole number, which the grammar of forced tool calls needs "
                "for an integer's bounds"
            )


# The keywords vLLM's check (`has_xgrammar_unsupported_json_features`) refuses a subschema for, alone or together.
_GRAMMAR_FEATURE_KEYWORDS = ("multipleOf", "uniqueItems", "contains", "minContains", "maxContains", "format",
                             "pattern", "minLength", "maxLength", "propertyNames", "patternProperties", "allOf")


def unsupported_grammar_features(schema: JsonValue) -> str | None:
    """Where and what in `schema` vLLM refuses as the grammar of a forced call, or None (also without vLLM here).

    vLLM's xgrammar backend (`serve_apps.builders`) refuses some keywords outright (`multipleOf` on a number,
    `uniqueItems` on an array, a `format` outside its list, such as `regex`) and some pairs (a `pattern`
    beside a length bound), with one message for the whole request: a forced turn failed naming no
    keyword. Its own check decides; the deepest subschema it refuses is named, with the keywords found
    there. Such a schema is fine where calls are not forced (`tool_choice: auto`).
    """
    try:
        from vllm.v1.structured_output.backend_xgrammar import has_xgrammar_unsupported_json_features
    except ImportError:
        return None
    if not isinstance(schema, dict) or not has_xgrammar_unsupported_json_features(schema):
        return None
    node, path = schema, ""
    while True:  # into the first child the check refuses, as the check itself walks (dict values, list items)
        child = next(((f"{path}/{key}", value) for key, value in _subschemas(node)
                      if has_xgrammar_unsupported_json_features(value)), None)
        if child is None:
            break
        path, node = child
    found = [f"{key}: {json.dumps(node[key])[:60]}" if key == "format" else key
             for key in _GRAMMAR_FEATURE_KEYWORDS if key in node]
    return f"{', '.join(found) or 'its keywords'} at {path or '<root>'}"


def _subschemas(node: dict) -> Iterator[tuple[str, dict]]:
    """The objects directly inside `node`, each with its key (`properties`, `items/0`)."""
    for key, value in node.items():
        if isinstance(value, dict):
            yield key, value
        elif isinstance(value, list):
            yield from ((f"{key}/{index}", item) for index, item in enumerate(value) if isinstance(item, dict))


def grammar_failure_message(message: str) -> str | None:
    """The engine's error text when the grammar compiler refused the tools' schemas, else None.

    Such a failure is the request's fault (a schema the compiler cannot handle),
    so it is not worth a retry. `message` is the readable text
    (`api_errors.readable_message`, which also drops the compiler's log prefix).
    """
    if _GRAMMAR_FAILURE.search(message) is None:
        return None
    return message.strip()


def _resolve_ref(root: dict[str, JsonValue], ref: str) -> tuple[SchemaLocation, JsonValue]:
    """The subschema `ref` names, decoded the way `referencing` decodes it (percent-escapes, then `~1`/`~0`).

    Only locations that hold a subschema are accepted: `referencing` would follow a
    pointer to any value, and the validator then fails on a string or a property map.
    """
    node: JsonValue = root
    holds = "schema"  # what `node` is: a schema, a list of schemas, or a map of names to schemas
    location: list[str | int] = []
    for segment in unquote(ref[2:]).split("/"):
        if holds == "list":
            if not (isinstance(node, list) and _ARRAY_INDEX.fullmatch(segment) and int(segment) < len(node)):
                raise ValueError(f"$ref {ref!r} points to nothing: no item {segment!r}")
            node, holds = node[int(segment)], "schema"
            location.append(int(segment))
            continue
        key = segment.replace("~1", "/").replace("~0", "~")
        if not (isinstance(node, dict) and key in node):
            raise ValueError(f"$ref {ref!r} points to nothing: no {key!r}")
        if holds == "map" or key in _SUBSCHEMA_KEYWORDS:
            holds = "schema"
        elif key in _SUBSCHEMA_LIST_KEYWORDS:
            holds = "list"
        elif key in _SUBSCHEMA_MAP_KEYWORDS:
            holds = "map"
        else:
            raise ValueError(f"$ref {ref!r} does not point to a subschema: {key!r} holds none")
        node = node[key]
        location.append(key)
    if holds != "schema":
        raise ValueError(f"$ref {ref!r} points to a {holds} of subschemas, not to a subschema")
    return tuple(location), node


def _in_place_refs(schema: JsonValue) -> list[str]:
    """`$ref`s the validator follows on the instance `schema` is given, before descending into any part of it."""
    found: list[str] = []
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue  # a boolean schema; shapes below are guaranteed by the metaschema check
        if isinstance(node.get("$ref"), str):
            found.append(node["$ref"])
        for key in _IN_PLACE_KEYWORDS.intersection(node):
            value = node[key]
            if isinstance(value, list):
                stack.extend(value)
            elif key == "dependentSchemas" and isinstance(value, dict):
                stack.extend(value.values())
            else:
                stack.append(value)
    return found


def _check_ref_chains(root: dict[str, JsonValue], refs: dict[str, str]) -> None:
    """Every `$ref` resolves to a subschema; no chain of `$ref`s on one instance cycles or exceeds MAX_REF_HOPS.

    Chains that descend into the arguments (`properties`, `items`, ...) may recurse:
    they end with the arguments.
    """
    targets: dict[str, tuple[SchemaLocation, JsonValue]] = {}
    for ref, where in refs.items():
        try:
            targets[ref] = _resolve_ref(root, ref)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
    longest_hops: dict[SchemaLocation, int] = {}

    def visit(node: JsonValue, trail: list[SchemaLocation], followed: list[str]) -> int:
        # Recursion stays within MAX_REF_HOPS + 1 frames: longer trails raise first.
        if trail[-1] not in longest_hops:
            hops = 0
            for ref in _in_place_refs(node):
                location, target = targets[ref]
                chain = " -> ".join([*followed, ref])
                if location in trail:
                    raise ValueError(f"$ref cycle that never descends into the arguments: {chain}")
                if len(followed) + 1 > MAX_REF_HOPS:
                    raise ValueError(
                        f"$ref chain of at least {len(followed) + 1} hops that never descends into the arguments, "
                        f"over the limit MAX_REF_HOPS={MAX_REF_HOPS}: {chain}"
                    )
                hops = max(hops, 1 + visit(target, [*trail, location], [*followed, ref]))
            longest_hops[trail[-1]] = hops
        num_hops = len(followed) + longest_hops[trail[-1]]
        if num_hops > MAX_REF_HOPS:
            raise ValueError(
                f"$ref chain of {num_hops} hops that never descends into the arguments, "
                f"over the limit MAX_REF_HOPS={MAX_REF_HOPS}: {' -> '.join(followed)} -> ..."
            )
        return longest_hops[trail[-1]]

    visit(root, [()], [])
    # A target is entered through a `$ref`, and that hop counts too.
    for ref, (location, target) in targets.items():
        visit(target, [location], [ref])
