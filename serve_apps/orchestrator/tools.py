"""Tool-call validation, the structured-output schema of one call, and HTTP tool execution.

Invariants:
- Nothing a tool does raises into the session loop: a refused connection, an
  HTTP error, a hang, a non-JSON or oversized body all become a `ToolOutcome`
  with status "error" or "timeout" whose content the model reads next step.
  A success without a body (204, an empty 200) is "ok" with `{"status": <code>}`.
- Arguments travel as the model's raw JSON text: the validator parses them only
  to check them, and the HTTP body embeds the original text, so numerals such as
  `1284.50` reach the tool exactly as written. The one rewrite: raw control
  characters inside strings (a literal newline) are escaped, which JSON requires.
- A result larger than `max_bytes` keeps its first `max_bytes` bytes (cut on a
  UTF-8 character boundary) followed by a visible `…[truncated N bytes]` marker.
"""

from __future__ import annotations

import asyncio
import copy
import decimal
import functools
import json
import math
import ssl
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, NoReturn

import certifi
import httpx
from jsonschema import Draft202012Validator, ValidationError, validators
from pydantic import JsonValue
from referencing import Registry

from cluster import telemetry
from serve_apps.orchestrator.models import HttpExecution, ToolCall, ToolSpec
from serve_apps.orchestrator.check_deadline import (
    CheckTimeout, PatternCheckTimeout, check_deadline, compile_ahead, deadline_checked, install,
)
from serve_apps.orchestrator.gc_pause import gc_paused
from serve_apps.orchestrator.tool_network import Destination, ToolNetworkPolicy
from serve_apps.orchestrator.tool_schema import ARGUMENT_FORMATS, compact_json_utf8, prefix_def_refs, schema_patterns

# Bodies beyond this are refused rather than buffered: a tool cannot exhaust replica memory.
MAX_TOOL_RESPONSE_BYTES = 8 * 1024 * 1024
MAX_REPORTED_VIOLATIONS = 16
# Tool arguments and tool replies nest at most this deep (real ones: a handful of levels).
MAX_ARGUMENT_DEPTH = 64
# Bound on connecting to one address of a tool's host (httpx's default), whatever the tool's timeout.
CONNECT_TIMEOUT_S = 5.0
_ERROR_BODY_SNIPPET_BYTES = 512
# An error result's message (what the model reads) and its reason (what traces record), at most.
MAX_ERROR_MESSAGE_BYTES = 1024
MAX_VIOLATION_MESSAGE_BYTES = 300  # one schema violation's message, which quotes the value at fault
MAX_VIOLATION_PATH_BYTES = 200  # its path, which names the properties on the way (a model may write long ones)
MAX_ERROR_REASON_BYTES = 200
# Content codings a reply may come in (asked for `identity`, some servers compress anyway), decoded one
# layer at most, never past MAX_TOOL_RESPONSE_BYTES: httpx inflated each read whole and stacked layers
# (`gzip, gzip`) in one go, so 590 bytes on the wire became 256 MiB in memory before the size check.
_ZLIB_CODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
# Checking a reply (up to MAX_TOOL_RESPONSE_BYTES of JSON: up to a second of Python) runs on a thread of its
# own, with the cyclic collector paused (`gc_pause`): on the event loop every stream and turn of the replica
# waited for it. (The loop still waits while the JSON parser's C code holds the GIL: 0.1-0.4 s for 8 MB.)
_REPLY_CHECKS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tool-reply-check")
# CPU time of the checking thread one call's whole check may take, its `pattern`s included (real calls take
# well under a millisecond; the event loop waits meanwhile). CPU, not wall time: `check_deadline`.
CHECK_BUDGET_S = 0.1

install()

ToolCallErrorKind = Literal["unknown_tool", "invalid_json", "schema_violation"]
ToolStatus = Literal["ok", "error", "timeout"]


@dataclass(frozen=True)
class SchemaViolation:
    """One JSON Schema error: `path` is a JSONPath into the arguments (`$.items[0].qty`)."""

    path: str
    message: str


@dataclass(frozen=True)
class ToolCallError:
    """Why a call was refused. `message` is written for the model, which gets a chance to retry."""

    call_id: str
    tool_name: str
    kind: ToolCallErrorKind
    detail: str
    violations: tuple[SchemaViolation, ...] = ()

    @property
    def message(self) -> str:
        lines = [f"tool call {self.call_id} to {self.tool_name!r} was rejected ({self.kind}): {self.detail}"]
        lines.extend(f"- {v.path}: {v.message}" for v in self.violations)
        return "\n".join(lines)


@dataclass(frozen=True)
class ToolOutcome:
    """Result of running one tool; `content` is what the model sees.

    `reason` says why a call failed without any text the tool or the model sent
    (a tool's error body may echo user data): what a trace may carry.
    """

    status: ToolStatus
    content: str
    is_truncated: bool = False
    reason: str = ""


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses to inf
        raise ValueError(f"{text[:40]} is out of range for a JSON number")
    return value


def _unique_members(pairs: list[tuple[str, JsonValue]]) -> dict[str, JsonValue]:
    """An object whose keys are each written once.

    Why refuse a repeated key: the arguments reach a tool as the model wrote them, and
    which of two values a parser keeps is up to the parser (Python's keeps the last, many
    keep the first), so the value the schema checked might not be the one the tool reads.
    """
    members: dict[str, JsonValue] = {}
    for key, value in pairs:
        if key in members:
            shown = repr(key) if len(key) <= 64 else f"{key[:64]!r}… ({len(key)} characters)"
            raise ValueError(f"the key {shown} appears twice in one object")
        members[key] = value
    return members


def _check_depth(value: JsonValue) -> None:
    """Level by level, so that a reply of millions of values costs one list per level, not a tuple per value."""
    nodes = [value]
    for level in range(1, MAX_ARGUMENT_DEPTH + 2):
        containers = [node for node in nodes if isinstance(node, (dict, list))]
        if not containers:
            return
        if level > MAX_ARGUMENT_DEPTH:
            raise ValueError(f"nested deeper than {MAX_ARGUMENT_DEPTH} levels")
        nodes = []
        for node in containers:
            nodes.extend(node.values() if isinstance(node, dict) else node)


class _InexactNumber(ValueError):
    """A numeral that is not exactly the 64-bit float it rounds to."""


def _exact_float(text: str) -> float:
    """`_finite_float`, refusing a numeral that is not exactly its float.

    Why: the schema's checks read numbers as floats while the tool gets the text as written, so
    `100.000000000000001` passed `maximum: 100` (read as 100.0) to a tool that parses decimals, and
    `1e-400` failed `exclusiveMinimum: 0` (read as 0.0) though positive.
    """
    value = _finite_float(text)
    written = decimal.Decimal(text)
    # Its shortest text (`0.1`), or the float's whole binary expansion (`0.1000000000000000055511151231257827...`).
    if written != decimal.Decimal(repr(value)) and written != decimal.Decimal(value):
        raise _InexactNumber(f"the number {text[:40]} is not exactly a 64-bit float: the schema's checks would read "
                             f"it as {value!r}, a tool parsing decimals as written; write at most 17 significant "
                             "digits, and no number nearer 0 than 1e-307")
    return value


def parse_arguments(arguments: str, *, is_exact: bool = False) -> JsonValue:
    """A tool call's arguments, parsed strictly (`parse_strict_json`); with `is_exact`, a number that is not
    exactly its float is refused too (`_InexactNumber`, as validation does: elsewhere the arguments are only
    rendered or sent as written)."""
    return parse_strict_json(arguments, "tool arguments", _exact_float if is_exact else _finite_float)


def parse_strict_json(text: str, what: str, parse_float: Callable[[str], float] = _finite_float) -> JsonValue:
    """Strict JSON parse: NaN, Infinity, out-of-range numbers, lone surrogates and a key written twice in one
    object (`_unique_members`) are refused like any other non-JSON text.

    Nesting is bounded (MAX_ARGUMENT_DEPTH), so neither the parser nor schema
    validation after it can run out of stack on hostile input.

    Raises:
        ValueError: a `json.JSONDecodeError` for text that is not JSON, else saying what JSON
            was refused (`what` names the text where a message needs it).
    """
    try:
        value = json.loads(
            text, parse_constant=_reject_constant, parse_float=parse_float, object_pairs_hook=_unique_members
        )
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_ARGUMENT_DEPTH} levels") from None
    _check_depth(value)
    # A lone surrogate escape parses, but no UTF-8 writer (the session store, a tool's HTTP body) can carry it.
    compact_json_utf8(value, what)
    return value


_SHORT_ESCAPES = {"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def escape_raw_control_characters(text: str) -> str:
    """`text` with every raw control character (U+0000-U+001F) inside a JSON string escaped.

    Why: models write literal newlines and tabs into string arguments (file contents,
    code), and vLLM's JSON grammar lets them through, but JSON forbids them raw.
    Escaping them, and nothing else, keeps every other character of the model's
    text as written (numerals included). Outside strings they are whitespace and stay.
    """
    out: list[str] = []
    is_in_string = is_escaped = False
    for char in text:
        if is_in_string:
            if is_escaped:
                is_escaped = False
            elif char == "\\":
                is_escaped = True
            elif char == '"':
                is_in_string = False
            elif char < " ":
                char = _SHORT_ESCAPES.get(char) or f"\\u{ord(char):04x}"
        elif char == '"':
            is_in_string = True
        out.append(char)
    return "".join(out)


def _decimal_multiple_of(validator, multiple, instance, schema):
    """`multipleOf` in decimal: jsonschema divides binary floats, so 19.99 was no multiple of 0.01 and a correct
    price was refused (the model retried it until the turn failed). Numbers are taken as written (`repr`)."""
    if not validator.is_type(instance, "number") or isinstance(instance, bool):
        return
    try:
        with decimal.localcontext() as context:
            context.prec = 10_000  # every quotient of numbers JSON text can hold here (ints stop at 4,300 digits)
            context.traps[decimal.Inexact] = False
            remainder = decimal.Decimal(repr(instance)) % decimal.Decimal(repr(multiple))
    except (decimal.InvalidOperation, ValueError):  # an infinity, or a quotient past even that precision
        remainder = 1
    if remainder:
        yield ValidationError(f"{instance!r} is not a multiple of {multiple!r}")


_DeadlineCheckedValidator = deadline_checked(validators.extend(Draft202012Validator, {"multipleOf": _decimal_multiple_of}))


def _validator(schema: dict) -> Draft202012Validator:
    # An empty registry: references resolve inside the schema only (models.ToolSpec
    # already refuses others), so validation never fetches anything. Every format of
    # Draft 2020-12 is asserted (`tool_schema.ARGUMENT_FORMATS`: date, date-time, uri,
    # email, uuid, ...): the schema's author asked for it, and the grammar of a forced
    # call does not enforce it.
    return _DeadlineCheckedValidator(schema, registry=Registry(), format_checker=ARGUMENT_FORMATS)


def validate_tool_call(call: ToolCall, tools: Sequence[ToolSpec]) -> ToolCall | ToolCallError:
    """Checks a model-emitted call against the session's tools.

    Args:
        call: the call as the model wrote it.
        tools: the session's tools.

    Returns:
        The call when valid (unchanged, or with raw control characters in its
        strings escaped: `escape_raw_control_characters`), else a `ToolCallError`
        naming every violated path (up to MAX_REPORTED_VIOLATIONS, sorted by path).
    """
    spec = next((tool for tool in tools if tool.name == call.name), None)
    if spec is None:
        known = ", ".join(sorted(tool.name for tool in tools)) or "none"
        return ToolCallError(call.id, call.name, "unknown_tool", f"no tool named {call.name!r}; available: {known}")
    try:
        arguments = parse_arguments(call.arguments, is_exact=True)
    except _InexactNumber as err:
        return ToolCallError(call.id, call.name, "invalid_json", str(err))
    except ValueError as err:
        invalid = ToolCallError(call.id, call.name, "invalid_json", f"arguments are not a JSON document: {err}")
        escaped = escape_raw_control_characters(call.arguments)
        if escaped == call.arguments:
            return invalid
        try:
            arguments = parse_arguments(escaped, is_exact=True)
        except _InexactNumber as inexact:
            return ToolCallError(call.id, call.name, "invalid_json", str(inexact))
        except ValueError:
            return invalid
        call = call.model_copy(update={"arguments": escaped})
    compile_ahead(schema_patterns(spec.parameters))  # the deadline is the matching's, not the compiling's
    try:
        # The collector paused: a full collection that fell inside the check ran on its thread's CPU time, the
        # budget's measure (0.4 s over a few million live objects), and a valid call was refused as too costly.
        with gc_paused(), check_deadline(CHECK_BUDGET_S):
            errors = sorted(_validator(spec.parameters).iter_errors(arguments), key=lambda e: (e.json_path, e.message))
    except (RecursionError, OverflowError) as err:  # e.g. `multipleOf` on a number with hundreds of digits
        return ToolCallError(call.id, call.name, "schema_violation", f"arguments cannot be checked: {type(err).__name__}")
    except PatternCheckTimeout:
        detail = f"a `pattern` of the tool's schema took over {CHECK_BUDGET_S:g} s to check against the arguments"
        return ToolCallError(call.id, call.name, "schema_violation", detail)
    except CheckTimeout:
        detail = (f"checking the arguments against the tool's schema took over {CHECK_BUDGET_S:g} s "
                  "(it applies its subschemas to the arguments too many times)")
        return ToolCallError(call.id, call.name, "schema_violation", detail)
    if not errors:
        return call
    # jsonschema's messages quote the value at fault whole: a 64 KB argument came back to the model several
    # times over, in a repair step that could then overflow the window.
    violations = tuple(SchemaViolation(truncate_text(e.json_path, MAX_VIOLATION_PATH_BYTES)[0],
                                       truncate_text(e.message, MAX_VIOLATION_MESSAGE_BYTES)[0])
                       for e in errors[:MAX_REPORTED_VIOLATIONS])
    detail = f"{len(errors)} schema violation(s) in the arguments"
    return ToolCallError(call.id, call.name, "schema_violation", detail, violations)


def tool_choice_schema(tools: Sequence[ToolSpec]) -> dict[str, JsonValue]:
    """JSON Schema of exactly one valid call, for the engine's structured outputs.

    One `anyOf` branch per tool ties the name to that tool's argument schema, so
    a constrained model cannot pair a name with another tool's arguments. Each
    tool's `$defs` are hoisted to the root as `<tool>.<def>` with references
    rewritten, since a nested schema's `#/$defs/...` would otherwise resolve
    against the combined root.
    """
    if not tools:
        raise ValueError("a session without tools has no tool call to constrain")
    branches: list[JsonValue] = []
    defs: dict[str, JsonValue] = {}
    for tool in sorted(tools, key=lambda t: t.name):
        parameters = copy.deepcopy(tool.parameters)
        parameters.pop("$schema", None)
        for def_name, definition in (parameters.pop("$defs", None) or {}).items():
            defs[f"{tool.name}.{def_name}"] = prefix_def_refs(definition, f"{tool.name}.")
        branches.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.name]},
                    "arguments": prefix_def_refs(parameters, f"{tool.name}."),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, JsonValue] = {"anyOf": branches}
    if defs:
        schema["$defs"] = defs
    return schema


def conflicting_defs(tools: Sequence[ToolSpec]) -> str | None:
    """Why vLLM cannot build the call grammar of `tool_choice: "required"` for these tools, or None.

    vLLM hoists every tool's top-level `$defs` into one map under their plain
    names and refuses a name two tools define differently ("Tool definition ...
    has multiple schemas"), so every forced turn of such a session would fail.
    A name defined identically by several tools is merged and accepted. Identically means
    as JSON text: vLLM compares Python values, to which `true` and `1` are equal, and would
    keep one of `{"const": true}` and `{"const": 1}` for both tools.
    """
    defined_by: dict[str, tuple[str, bytes]] = {}
    for tool in sorted(tools, key=lambda t: t.name):
        for def_name, definition in (tool.parameters.get("$defs") or {}).items():
            text = compact_json_utf8(definition, f"$defs/{def_name}")
            first = defined_by.setdefault(def_name, (tool.name, text))
            if first[1] != text:
                return (
                    f"tools {first[0]!r} and {tool.name!r} both define $defs/{def_name} with different schemas; "
                    "the grammar of a forced tool call merges all tools' $defs by name, so rename one of them"
                )
    return None


def truncate_text(text: str, max_bytes: int) -> tuple[str, bool]:
    """Keeps at most `max_bytes` UTF-8 bytes of `text` and appends a marker saying how many were cut.

    Returns:
        (text, is_truncated). The marker is not counted in `max_bytes`.
    """
    raw = text.encode("utf-8")
    if len(raw) <= max_bytes:
        return text, False
    kept = raw[:max_bytes].decode("utf-8", errors="ignore")
    omitted = len(raw) - len(kept.encode("utf-8"))
    return f"{kept}…[truncated {omitted} bytes]", True


def _error(tool_name: str, message: str, status: ToolStatus = "error", reason: str | None = None) -> ToolOutcome:
    """An error result the model sees as `{"error", "tool"}`; `reason` (default: `message`) is for traces.

    Both are bounded: a message may quote the reply (a repeated key of any length), and a 2 MB one went
    into the session's transcript whole, past `max_tool_result_bytes`, and into the tool's span status.
    """
    shown, _ = truncate_text(message, MAX_ERROR_MESSAGE_BYTES)
    traced, _ = truncate_text(message if reason is None else reason, MAX_ERROR_REASON_BYTES)
    return ToolOutcome(status, json.dumps({"error": shown, "tool": tool_name}, ensure_ascii=False), reason=traced)


async def _post(client: httpx.AsyncClient, destination: Destination, body: bytes, tool_name: str,
                max_bytes: int, timeout: httpx.Timeout) -> ToolOutcome:
    # The turn's trace goes on in a tool server that reads W3C trace context.
    headers = telemetry.inject(
        {"content-type": "application/json", "accept": "application/json", "accept-encoding": "identity"}
    )
    url = httpx.URL(destination.url)
    # The name as sent (its A-label for an IDN): httpx's own Host header and `URL.host` decode an `xn--`
    # label to Unicode, and raise on one IDNA 2008 refuses (an emoji domain, `xn--zz`), which a URL check
    # at session creation accepts.
    headers["host"] = url.netloc.decode("ascii")
    extensions = {"sni_hostname": url.raw_host.decode("ascii")} if url.scheme == "https" else {}
    targets = [url]
    if destination.addresses:
        # Connect to the checked addresses; the name still goes in Host and, over TLS, in SNI and
        # the certificate check.
        targets = [url.copy_with(host=address) for address in destination.addresses]
    for target in targets[:-1]:
        try:
            return await _send(client, target, headers, extensions, body, tool_name, max_bytes, timeout)
        except (httpx.ConnectError, httpx.ConnectTimeout):
            continue  # nothing was sent: the host's next checked address may answer
    return await _send(client, targets[-1], headers, extensions, body, tool_name, max_bytes, timeout)


async def _send(client: httpx.AsyncClient, url: httpx.URL, headers: dict, extensions: dict, body: bytes,
                tool_name: str, max_bytes: int, timeout: httpx.Timeout) -> ToolOutcome:
    async with client.stream(
        "POST", url, content=body, headers=headers, extensions=extensions, timeout=timeout
    ) as response:
        coding = response.headers.get("content-encoding", "identity").strip().lower() or "identity"
        if response.is_stream_consumed:  # built in memory (a mock transport): read and decoded already
            coding = "identity"
        if coding != "identity" and coding not in _ZLIB_CODINGS:
            if not response.is_success:  # the status says what failed; the body is unreadable
                return _error(tool_name, f"HTTP {response.status_code} (a {coding!r} reply, not read)",
                              reason=f"HTTP {response.status_code}")
            return _error(tool_name, f"tool replied in Content-Encoding {coding!r}; warmpath asks for identity and "
                                     f"decodes one layer of {', '.join(sorted(_ZLIB_CODINGS))} at most")
        decoder = _LayerDecoder(coding) if coding != "identity" else None
        chunks: list[bytes] = []
        num_bytes = 0
        problem = None  # why the body does not decode; a failed call (non-2xx) still reports its status
        async for data in _wire_bytes(response):
            if decoder is not None:
                try:
                    data = decoder.decode(data, MAX_TOOL_RESPONSE_BYTES + 1 - num_bytes)
                except zlib.error as err:
                    problem = f"tool's {coding} reply does not decode ({err})"
                    break
            num_bytes += len(data)
            if num_bytes > MAX_TOOL_RESPONSE_BYTES:
                return _error(tool_name, f"response exceeded {MAX_TOOL_RESPONSE_BYTES} bytes")
            chunks.append(data)
        if problem is None and decoder is not None and not decoder.is_complete:
            problem = f"tool's {coding} reply ends before its compressed stream does"
        if problem is not None:
            if response.is_success:
                return _error(tool_name, problem)
            chunks = []  # the status says what failed; the body is unreadable
    raw = b"".join(chunks)
    return await asyncio.get_running_loop().run_in_executor(
        _REPLY_CHECKS, _checked_reply, response.status_code, response.is_success, raw, tool_name, max_bytes
    )


class _LayerDecoder:
    """One gzip or deflate layer, decoded no further than asked: never more than `limit` bytes out of a call
    (zlib keeps the rest of its input for the next). `deflate` may come without its zlib header (raw, as
    many servers send it), which httpx accepts too."""

    def __init__(self, coding: str) -> None:
        self._coding = coding
        self._zlib = zlib.decompressobj(_ZLIB_CODINGS[coding])
        self._num_in = 0
        self._held = b""  # deflate's first byte, alone: its header or not is told by the second

    def decode(self, data: bytes, limit: int) -> bytes:
        """Decoded bytes of `data`, at most `limit` (one more than the caller's room tells it the reply is over).

        Raises:
            zlib.error: the data does not decode, or comes after the end of the compressed stream (zlib keeps
                such bytes, copying them whole at each call: a reply streaming them held memory without bound
                and the event loop for seconds, uncounted by the size limit).
        """
        if self._zlib.eof:
            if data:
                raise zlib.error("data after the end of the compressed stream")
            return b""
        if self._coding == "deflate" and not self._num_in:
            data, self._held = self._held + data, b""
            if len(data) < 2:  # one byte passes as a zlib header's first; its fault would show only later
                self._held = data
                return b""
        try:
            out = self._zlib.decompress(data, limit)
        except zlib.error:
            if self._coding != "deflate" or self._num_in:
                raise
            self._zlib = zlib.decompressobj(-zlib.MAX_WBITS)
            out = self._zlib.decompress(data, limit)
        self._num_in += len(data)
        while self._zlib.unconsumed_tail and len(out) < limit:
            out += self._zlib.decompress(self._zlib.unconsumed_tail, limit - len(out))
        if self._zlib.unused_data:  # a second gzip member, or anything else after the end
            raise zlib.error("data after the end of the compressed stream")
        return out

    @property
    def is_complete(self) -> bool:
        """The compressed stream ended (or none came: an empty body, a 204, says nothing to decode)."""
        return self._zlib.eof or not (self._num_in or self._held)


async def _wire_bytes(response: httpx.Response):
    """The reply's bytes as they came, content coding and all (httpx's `aiter_bytes` decodes each read whole)."""
    if response.is_stream_consumed:
        yield response.content
        return
    async for data in response.aiter_raw():
        yield data


def _checked_reply(status_code: int, is_success: bool, raw: bytes, tool_name: str, max_bytes: int) -> ToolOutcome:
    """What the model sees of a tool's reply: the JSON document, cut to `max_bytes`, or why it was refused."""
    if not is_success:
        snippet = raw[:_ERROR_BODY_SNIPPET_BYTES].decode("utf-8", errors="replace")
        return _error(tool_name, f"HTTP {status_code}: {snippet}", reason=f"HTTP {status_code}")
    if not raw.strip():
        # A success with nothing to say (204 No Content, or an empty 200): the model learns it worked.
        return ToolOutcome("ok", json.dumps({"status": status_code}))
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark (some servers send one) is no part of the document
    except UnicodeDecodeError as err:
        return _error(tool_name, f"tool replied with {len(raw)} bytes that are not UTF-8 (byte {err.start})")
    try:
        with gc_paused():  # the parsed value is dropped inside: only the check needed it
            parse_strict_json(text, "its strings")
    except json.JSONDecodeError as err:
        return _error(tool_name, f"tool replied with {len(raw)} bytes that are not a JSON document "
                                 f"({err.msg}, line {err.lineno} column {err.colno})")
    except ValueError as err:  # JSON, but what a session cannot hold or a parser could read two ways
        # The reason leaves the reply's text out of traces, as the other refusals' do.
        return _error(tool_name, f"tool's JSON reply is refused: {err}", reason="tool's JSON reply is refused")
    content, is_truncated = truncate_text(text, max_bytes)
    return ToolOutcome("ok", content, is_truncated)


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """The TLS settings of every tool call: httpx's own defaults (certifi's CA bundle), built once."""
    return ssl.create_default_context(cafile=certifi.where())


def _phase_timeout(timeout_s: float) -> httpx.Timeout:
    """httpx's per-phase timeouts for one tool call: `timeout_s` for writing, each read and the pool.

    Why: a client's own defaults (httpx's are 5 s) would cut off a tool declared
    with a longer `timeout_s`; set per request, these also override a pooled
    client's. Connecting keeps a shorter bound, so an address that drops
    packets leaves time to try the host's next checked address (`_post`). The
    deadline of the whole exchange is `run_http_tool`'s.
    """
    return httpx.Timeout(timeout_s, connect=min(timeout_s, CONNECT_TIMEOUT_S))


async def run_http_tool(
    spec: ToolSpec,
    arguments: str,
    timeout_s: float,
    max_bytes: int,
    *,
    client: httpx.AsyncClient | None = None,
    network: ToolNetworkPolicy | None = None,
) -> ToolOutcome:
    """POSTs `{"name": ..., "arguments": ...}` to the tool and returns what the model should see.

    Args:
        spec: an HTTP tool.
        arguments: the call's validated JSON text, embedded verbatim in the body.
        timeout_s: deadline for the whole exchange (usually `spec.execution.timeout_s` or less).
        max_bytes: results beyond this many bytes are truncated with a marker.
        client: a pooled client to reuse; a private one is opened and closed otherwise.
        network: where tools may point; a refused URL is an error result, never a request.

    Returns:
        "ok" with the reply body (a JSON document), "timeout", or "error" with a
        JSON `{"error", "tool"}` description. Tool faults never raise.
    """
    if not isinstance(spec.execution, HttpExecution):
        raise ValueError(f"tool {spec.name!r} is executed by the client, not over HTTP")
    outcome = await _run_http_tool(spec, arguments, timeout_s, max_bytes, client, network)
    if outcome.status != "ok":  # an error's text is bounded, but JSON escaping may still take it past max_bytes
        content, is_truncated = truncate_text(outcome.content, max_bytes)
        if is_truncated:
            outcome = ToolOutcome(outcome.status, content, True, outcome.reason)
    return outcome


async def _run_http_tool(
    spec: ToolSpec, arguments: str, timeout_s: float, max_bytes: int, client: httpx.AsyncClient | None,
    network: ToolNetworkPolicy | None,
) -> ToolOutcome:
    try:
        parse_arguments(arguments)
    except ValueError as err:
        return _error(spec.name, f"arguments are not a JSON document: {err}",
                      reason="arguments are not a JSON document")
    body = f'{{"name":{json.dumps(spec.name)},"arguments":{arguments}}}'.encode("utf-8")
    own_client = client is None
    # Tool endpoints are addressed directly; proxy variables must not reroute them. One TLS context for every
    # call: building one loads the CA bundle, 50-60 ms on the event loop per call. (Not one pooled client:
    # its connections are pooled by address, whatever name their certificate was checked for.)
    http = client if client is not None else httpx.AsyncClient(trust_env=False, verify=_tls_context())
    try:
        async with asyncio.timeout(timeout_s):
            if network is None:
                destination: Destination | str = Destination(spec.execution.url)
            else:
                destination = await network.check_destination(spec.execution.url)
            if isinstance(destination, str):
                return _error(spec.name, destination, reason="destination refused by tool_network")
            return await _post(http, destination, body, spec.name, max_bytes, _phase_timeout(timeout_s))
    except (TimeoutError, httpx.TimeoutException):
        return _error(spec.name, f"no complete reply within {timeout_s:g} s", status="timeout")
    except (httpx.HTTPError, httpx.StreamError, httpx.InvalidURL, OSError, UnicodeError) as err:
        # UnicodeError: a host name no IDNA codec takes, wherever a library decodes it.
        return _error(spec.name, f"{type(err).__name__}: {err}", reason=type(err).__name__)  # may quote its reply
    finally:
        if own_client:
            await http.aclose()
