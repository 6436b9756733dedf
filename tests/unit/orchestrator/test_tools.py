"""Tool-call validation, the one-call schema, and HTTP tool faults against a real loopback server."""

import asyncio
import gzip
import json
import socket
import threading
import time
import uuid
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from jsonschema import Draft202012Validator

from serve_apps.orchestrator.models import CreateSessionRequest, ToolCall, ToolSpec
from serve_apps.orchestrator.tools import (
    MAX_ARGUMENT_DEPTH,
    MAX_REPORTED_VIOLATIONS,
    CHECK_BUDGET_S,
    SchemaViolation,
    ToolCallError,
    conflicting_defs,
    escape_raw_control_characters,
    run_http_tool,
    tool_choice_schema,
    truncate_text,
    validate_tool_call,
)

ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]+$"},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
                "required": ["sku", "qty"],
            },
        },
    },
    "required": ["order_id"],
    "additionalProperties": False,
}
DEFS_SCHEMA = {
    "type": "object",
    "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
    "properties": {"at": {"$ref": "#/$defs/point"}},
    "required": ["at"],
}


def _spec(name, parameters, url="http://127.0.0.1:9/"):
    return ToolSpec(name=name, parameters=parameters, execution={"kind": "http", "url": url, "timeout_s": 5})


TOOLS = [_spec("create_order", ORDER_SCHEMA), _spec("plot", DEFS_SCHEMA)]


def _call(name, arguments):
    return ToolCall(id="call-1", name=name, arguments=arguments)


def test_a_refusal_of_arguments_under_long_property_names_stays_bounded():
    """Each violation's message was cut, its path not: 8 KiB of arguments under a long property name made a
    128 KiB refusal, which the client's error carried whole."""
    name = "p" * 8000
    spec = _spec("deep", {"type": "object", "properties": {name: {"type": "array", "items": {"type": "integer"}}}})
    error = validate_tool_call(_call("deep", json.dumps({name: ["x"] * 40})), [spec])
    assert error.kind == "schema_violation" and len(error.message.encode()) < 16 * 1024
    assert all(len(v.path.encode()) <= 200 + len("…[truncated 99999 bytes]".encode()) for v in error.violations)


@pytest.mark.parametrize("number, is_accepted", [
    ("1284.50", True), ("0.1", True), ("1e2", True), ("19.99", True), ("-0.0", True), ("1.7976931348623157e308", True),
    ("12345678901234567890", True),  # an integer is exact however long
    ("0.1000000000000000055511151231257827021181583404541015625", True),  # 0.1's float, written out exactly
    ("0.1000000000000000055511151231257827", False),  # ... cut short: neither its float nor that float's text
    # The checks read each as its float (100.0, 0.0, 1.0), the tool as written: `maximum: 100` passed the first.
    ("100.000000000000001", False), ("1e-400", False), ("0.99999999999999999", False),
])
def test_a_number_the_checks_would_read_as_another_float_is_refused(number, is_accepted):
    spec = _spec("pay", {"type": "object", "properties": {"amount": {"type": "number"}}})
    checked = validate_tool_call(_call("pay", f'{{"amount": {number}}}'), [spec])
    assert isinstance(checked, ToolCall) is is_accepted
    if not is_accepted:
        assert checked.kind == "invalid_json" and "is not exactly a 64-bit float" in checked.message


def test_raw_control_characters_in_strings_are_escaped_and_nothing_else_changes():
    # A literal newline and tab in a string (as models write file contents), one after an escaped quote.
    raw = '{"order_id": "ORD-1", "items": [{"sku": "line one\nline\ttwo \\"q\u0001", "qty": 1}]}'
    call = validate_tool_call(_call("create_order", raw), TOOLS)
    assert isinstance(call, ToolCall) and call.id == "call-1"
    assert call.arguments == '{"order_id": "ORD-1", "items": [{"sku": "line one\\nline\\ttwo \\"q\\u0001", "qty": 1}]}'
    assert json.loads(call.arguments) == json.loads(raw, strict=False)
    # Whitespace between tokens is JSON's own and stays; numerals stay as written.
    assert escape_raw_control_characters('{\n\t"x": 1284.50\r\n}') == '{\n\t"x": 1284.50\r\n}'


def test_escaping_does_not_rescue_text_that_is_not_json():
    error = validate_tool_call(_call("create_order", '{"order_id": "ORD-1\n'), TOOLS)
    assert isinstance(error, ToolCallError) and error.kind == "invalid_json"


@pytest.mark.parametrize(
    "name, arguments",
    [
        ("create_order", '{"order_id": "ORD-98231"}'),
        ("create_order", '{"order_id": "ORD-1", "items": [{"sku": "\\ud83d\\ude00", "qty": 1}]}'),  # a surrogate pair is one character
        ("create_order", '{"order_id": "ORD-1", "items": [{"sku": "A-1", "qty": 2}]}'),
        ("plot", '{"at": {"x": 1284.50}}'),
    ],
)
def test_valid_call_is_returned_unchanged(name, arguments):
    call = _call(name, arguments)
    assert validate_tool_call(call, TOOLS) is call


@pytest.mark.parametrize(
    "name, arguments, kind, paths",
    [
        ("delete_everything", "{}", "unknown_tool", []),
        ("Create_Order", '{"order_id": "ORD-1"}', "unknown_tool", []),  # names match exactly, case included
        ("create_order", '{"order_id": ', "invalid_json", []),
        ("create_order", '{"order_id": NaN}', "invalid_json", []),
        ("create_order", '{"order_id": 1e999}', "invalid_json", []),
        ("create_order", '{"order_id": ' + "[" * 65 + "]" * 65 + "}", "invalid_json", []),
        ("create_order", "not json", "invalid_json", []),
        ("create_order", '{"order_id": "ORD-\\ud800"}', "invalid_json", []),
        ("create_order", '{"\\udfff": 1}', "invalid_json", []),
        # The schema would check the last value; a tool whose parser keeps the first would read "../x".
        ("create_order", '{"order_id": "../x", "order_id": "ORD-1"}', "invalid_json", []),
        ("plot", '{"at": {"x": 1, "x": 2}}', "invalid_json", []),
        ("create_order", "[]", "schema_violation", ["$"]),
        ("create_order", "{}", "schema_violation", ["$"]),
        ("create_order", '{"order_id": "X-1"}', "schema_violation", ["$.order_id"]),
        (
            "create_order",
            '{"order_id": "ORD-1", "items": [{"sku": "A", "qty": 1}, {"sku": 5, "qty": 0}]}',
            "schema_violation",
            ["$.items[1].qty", "$.items[1].sku"],
        ),
        ("create_order", '{"order_id": "ORD-1", "extra": true}', "schema_violation", ["$"]),
        ("plot", '{"at": {"x": "far"}}', "schema_violation", ["$.at.x"]),
    ],
)
def test_invalid_call_error_names_kind_and_paths(name, arguments, kind, paths):
    error = validate_tool_call(_call(name, arguments), TOOLS)
    assert isinstance(error, ToolCallError)
    assert error.kind == kind
    assert [violation.path for violation in error.violations] == paths
    for path in paths:
        assert path in error.message


def _nested(depth: int) -> str:
    """An arguments object nesting `depth` levels: the object itself, then arrays."""
    return '{"a": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"


@pytest.mark.parametrize("depth, is_valid", [(MAX_ARGUMENT_DEPTH, True), (MAX_ARGUMENT_DEPTH + 1, False)])
def test_arguments_may_nest_exactly_to_the_depth_limit(depth, is_valid):
    spec = _spec("anything", {"type": "object"})
    outcome = validate_tool_call(_call("anything", _nested(depth)), [spec])
    if is_valid:
        assert isinstance(outcome, ToolCall)
    else:
        assert isinstance(outcome, ToolCallError) and outcome.kind == "invalid_json"
        assert f"nested deeper than {MAX_ARGUMENT_DEPTH} levels" in outcome.detail


def test_violations_are_sorted_by_path_then_message_and_capped():
    """20 violations: 7 integers failing two keywords each (listed multipleOf first), 6 strings failing one."""
    integer = {"multipleOf": 5, "minimum": 10}
    names = {"k": integer, "b": {"type": "string"}, "e": integer, "m": integer, "h": {"type": "string"},
             "a": integer, "j": {"type": "string"}, "c": integer, "l": {"type": "string"}, "g": integer,
             "f": {"type": "string"}, "i": integer, "d": {"type": "string"}}
    spec = _spec("many", {"type": "object", "properties": names})
    arguments = {name: 3 for name in reversed(list(names))}
    error = validate_tool_call(_call("many", json.dumps(arguments)), [spec])
    less, multiple, not_string = "3 is less than the minimum of 10", "3 is not a multiple of 5", "3 is not of type 'string'"
    expected = [
        ("$.a", less), ("$.a", multiple), ("$.b", not_string), ("$.c", less), ("$.c", multiple),
        ("$.d", not_string), ("$.e", less), ("$.e", multiple), ("$.f", not_string), ("$.g", less),
        ("$.g", multiple), ("$.h", not_string), ("$.i", less), ("$.i", multiple), ("$.j", not_string),
        ("$.k", less),  # the 16th; $.k's second violation, $.l and $.m are counted, not listed
    ]
    assert MAX_REPORTED_VIOLATIONS == len(expected)
    assert error.kind == "schema_violation" and error.detail == "20 schema violation(s) in the arguments"
    assert error.violations == tuple(SchemaViolation(path, message) for path, message in expected)
    assert error.message.splitlines()[1:] == [f"- {path}: {message}" for path, message in expected]


def test_unknown_tool_error_lists_available_tools():
    error = validate_tool_call(_call("nope", "{}"), TOOLS)
    assert "create_order, plot" in error.message


@pytest.mark.parametrize(
    "instance, is_valid",
    [
        ({"name": "create_order", "arguments": {"order_id": "ORD-5"}}, True),
        ({"name": "plot", "arguments": {"at": {"x": 3}}}, True),
        ({"name": "plot", "arguments": {"order_id": "ORD-5"}}, False),
        ({"name": "create_order", "arguments": {"at": {"x": 3}}}, False),
        ({"name": "plot", "arguments": {"at": {"x": "3"}}}, False),
        ({"name": "other", "arguments": {}}, False),
        ({"name": "plot", "arguments": {"at": {"x": 3}}, "extra": 1}, False),
        ({"name": "plot"}, False),
    ],
)
def test_tool_choice_schema_admits_exactly_one_valid_call(instance, is_valid):
    schema = tool_choice_schema(TOOLS)
    Draft202012Validator.check_schema(schema)
    assert Draft202012Validator(schema).is_valid(instance) is is_valid


def test_tool_choice_schema_hoists_defs_per_tool():
    schema = tool_choice_schema(TOOLS)
    assert set(schema["$defs"]) == {"plot.point"}
    assert "$defs" not in json.dumps(schema["anyOf"]).replace("#/$defs/plot.point", "")


LITERAL_REF_SCHEMA = {
    "type": "object",
    "$defs": {"mode": {"enum": ["fast", "safe"]}},
    "properties": {
        # A property may be called "default"; its value is a schema whose $ref must follow the hoisting.
        "default": {"$ref": "#/$defs/mode"},
        # Under const and enum a {"$ref": ...} object is data the arguments must equal.
        "marker": {"const": {"$ref": "#/$defs/mode"}},
        "choice": {"enum": [{"$ref": "#/$defs/mode"}, 1]},
    },
    "required": ["default", "marker", "choice"],
}


@pytest.mark.parametrize(
    "arguments, is_valid",
    [
        ({"default": "fast", "marker": {"$ref": "#/$defs/mode"}, "choice": {"$ref": "#/$defs/mode"}}, True),
        ({"default": "fast", "marker": {"$ref": "#/$defs/mode"}, "choice": 1}, True),
        ({"default": "slow", "marker": {"$ref": "#/$defs/mode"}, "choice": 1}, False),
        ({"default": "fast", "marker": {"$ref": "#/$defs/lit.mode"}, "choice": 1}, False),
        ({"default": "fast", "marker": {"$ref": "#/$defs/mode"}, "choice": {"$ref": "#/$defs/lit.mode"}}, False),
    ],
)
def test_tool_choice_schema_rewrites_references_but_not_data_that_looks_like_one(arguments, is_valid):
    spec = _spec("lit", LITERAL_REF_SCHEMA)
    schema = tool_choice_schema([spec])
    Draft202012Validator.check_schema(schema)
    properties = schema["anyOf"][0]["properties"]["arguments"]["properties"]
    assert properties["default"] == {"$ref": "#/$defs/lit.mode"}
    assert properties["marker"] == {"const": {"$ref": "#/$defs/mode"}}
    # The combined schema and the tool's own validation agree on every call.
    assert Draft202012Validator(schema).is_valid({"name": "lit", "arguments": arguments}) is is_valid
    assert isinstance(validate_tool_call(_call("lit", json.dumps(arguments)), [spec]), ToolCallError) is not is_valid


CHAINED_DEFS_SCHEMA = {
    "type": "object",
    "$defs": {
        "route": {"type": "object", "properties": {"stops": {"type": "array", "items": {"$ref": "#/$defs/stop"}}}},
        "stop": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
    "properties": {"route": {"$ref": "#/$defs/route"}},
    "required": ["route"],
}


@pytest.mark.parametrize(
    "arguments, is_valid",
    [
        ({"route": {"stops": [{"code": "AMS"}, {"code": "BER"}]}}, True),
        ({"route": {"stops": [{"code": "AMS"}, {"code": 7}]}}, False),
        ({"route": {"stops": [{}]}}, False),
    ],
)
def test_tool_choice_schema_rewrites_references_between_hoisted_defs(arguments, is_valid):
    """A def that refers to another def of its tool must follow it to its hoisted name."""
    spec = _spec("trip", CHAINED_DEFS_SCHEMA)
    schema = tool_choice_schema([spec, *TOOLS])
    Draft202012Validator.check_schema(schema)
    assert schema["$defs"]["trip.route"]["properties"]["stops"]["items"] == {"$ref": "#/$defs/trip.stop"}
    assert Draft202012Validator(schema).is_valid({"name": "trip", "arguments": arguments}) is is_valid
    assert isinstance(validate_tool_call(_call("trip", json.dumps(arguments)), [spec]), ToolCallError) is not is_valid


def test_tool_choice_schema_needs_tools():
    with pytest.raises(ValueError):
        tool_choice_schema([])


@pytest.mark.parametrize(
    "text, max_bytes, expected, is_truncated",
    [
        ("short", 10, "short", False),
        ("x" * 10, 10, "x" * 10, False),
        ("x" * 25, 10, "x" * 10 + "…[truncated 15 bytes]", True),
        ("é" * 6, 5, "éé…[truncated 8 bytes]", True),  # 2-byte characters are never split
    ],
)
def test_truncate_text(text, max_bytes, expected, is_truncated):
    assert truncate_text(text, max_bytes) == (expected, is_truncated)


class _ToolHandler(BaseHTTPRequestHandler):
    """Loopback tool server; the path picks the behaviour."""

    release = threading.Event()
    traceparents: list = []  # each call's W3C trace context header, None where it had none
    accept_encodings: list = []
    bodies: dict = {}  # replies made ahead of a call

    def log_message(self, *args):
        pass

    def _reply(self, status: int, body: bytes, content_type: str = "application/json", coding: str | None = None) -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        if coding is not None:
            self.send_header("content-encoding", coding)
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        body = self.rfile.read(int(self.headers["content-length"]))
        _ToolHandler.traceparents.append(self.headers.get("traceparent"))
        if self.path == "/ok":
            self._reply(200, b'{"order_id": "ORD-98231", "total": 1284.50, "eta": "2026-11-30"}')
        elif self.path == "/echo":
            self._reply(200, body)
        elif self.path == "/fail":
            self._reply(500, b"Internal Server Error: db down")
        elif self.path == "/garbage":
            self._reply(200, b"<html>\xff\xfe not json", "text/html")
        elif self.path == "/text":
            self._reply(200, b"plain words", "text/plain")
        elif self.path == "/duplicate-key":
            self._reply(200, b'{"id": 1, "id": 2}')
        elif self.path == "/deep":
            self._reply(200, b"[" * 100 + b"]" * 100)
        elif self.path == "/surrogate":
            self._reply(200, b'{"name": "\\ud800"}')
        elif self.path == "/huge":
            self._reply(200, json.dumps({"rows": ["r" * 100] * 1000}).encode())
        elif self.path == "/gzip":  # compressed though `identity` was asked for
            _ToolHandler.accept_encodings.append(self.headers.get("accept-encoding"))
            self._reply(200, gzip.compress(b'{"total": 1284.50}'), coding="gzip")
        elif self.path == "/gzip-bomb":  # 64 KiB on the wire, 64 MiB inflated
            self._reply(200, _ToolHandler.bodies.get(self.path) or _gzip_of_spaces(64 << 20), coding="gzip")
        elif self.path == "/gzip-twice":
            self._reply(200, gzip.compress(gzip.compress(b"{}")), coding="gzip, gzip")
        elif self.path == "/gzip-cut":
            self._reply(200, gzip.compress(b'{"total": 1284.50}')[:-12], coding="gzip")
        elif self.path == "/raw-deflate":  # deflate without its zlib header, as many servers send it
            packer = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
            self._reply(200, packer.compress(b'{"total": 5.00}') + packer.flush(), coding="deflate")
        elif self.path == "/gzip-no-content":
            self.send_response(204)
            self.send_header("content-encoding", "gzip")
            self.end_headers()
        elif self.path == "/gzip-failing":
            self._reply(500, gzip.compress(b"db down")[:5], coding="gzip")
        elif self.path == "/gzip-trailing":  # a whole gzip stream, then bytes after its end
            self._reply(200, gzip.compress(b'{"ok": 1}') + b"\0" * (256 << 10), coding="gzip")
        elif self.path == "/gzip-two-members":
            self._reply(200, gzip.compress(b'{"a": 1}') + gzip.compress(b'{"b": 2}'), coding="gzip")
        elif self.path == "/brotli-failing":
            self._reply(503, b"\x0b\x02\x80overloaded", coding="br")
        elif self.path == "/control-characters-failing":
            self._reply(500, b"\x01" * 600)
        elif self.path == "/long-duplicate-key":
            key = "k" * 2_000_000
            self._reply(200, json.dumps({key: 1}).encode()[:-1] + b', "' + key.encode() + b'": 2}')
        elif self.path == "/bom":
            self._reply(200, b'\xef\xbb\xbf{"ok": true}')
        elif self.path == "/no-content":
            self.send_response(204)
            self.end_headers()
        elif self.path == "/empty":
            self._reply(200, b"")
        elif self.path == "/hang":
            type(self).release.wait(10)
            self._reply(200, b"{}")
        else:
            self._reply(404, b"no such tool")


def _gzip_of_spaces(num_bytes: int) -> bytes:
    """A gzip stream of a JSON array holding `num_bytes` spaces, made a megabyte at a time (the test measures
    the memory a reply takes: the server must not take it first)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    parts = [packer.compress(b"[")]
    spaces = b" " * (1 << 20)
    for _ in range(num_bytes >> 20):
        parts.append(packer.compress(spaces))
    parts.append(packer.compress(b"]") + packer.flush())
    return b"".join(parts)


@pytest.fixture(scope="module")
def tool_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ToolHandler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    _ToolHandler.release.set()
    server.shutdown()
    server.server_close()


def _run(url, arguments='{"order_id": "ORD-98231"}', timeout_s=5.0, max_bytes=4096):
    spec = _spec("create_order", ORDER_SCHEMA, url=url)
    return asyncio.run(run_http_tool(spec, arguments, timeout_s=timeout_s, max_bytes=max_bytes))


def test_ok_result_is_the_body_verbatim(tool_server):
    outcome = _run(f"{tool_server}/ok")
    assert (outcome.status, outcome.is_truncated) == ("ok", False)
    assert "1284.50" in outcome.content and "ORD-98231" in outcome.content


def test_request_body_carries_name_and_arguments_as_written(tool_server):
    outcome = _run(f"{tool_server}/echo", arguments='{"order_id": "ORD-7", "amount": 1284.50}')
    assert outcome.status == "ok"
    assert outcome.content == '{"name":"create_order","arguments":{"order_id": "ORD-7", "amount": 1284.50}}'
    assert json.loads(outcome.content)["arguments"]["order_id"] == "ORD-7"


@pytest.mark.parametrize(
    "path, status, fragment",
    [
        ("/fail", "error", "HTTP 500: Internal Server Error: db down"),
        ("/missing", "error", "HTTP 404"),
        ("/garbage", "error", "bytes that are not UTF-8 (byte 6)"),
        ("/text", "error", "bytes that are not a JSON document (Expecting value, line 1 column 1)"),
        ("/duplicate-key", "error", "tool's JSON reply is refused: the key 'id' appears twice in one object"),
        ("/deep", "error", "tool's JSON reply is refused: nested deeper than"),
        ("/surrogate", "error", "tool's JSON reply is refused: its strings hold a lone surrogate"),
        ("/hang", "timeout", "no complete reply within 0.3 s"),
    ],
)
def test_tool_faults_become_outcomes(tool_server, path, status, fragment):
    # Only the hanging tool needs a short timeout; the others answer at once, however loaded the machine.
    outcome = _run(f"{tool_server}{path}", timeout_s=0.3 if path == "/hang" else 5.0)
    assert outcome.status == status
    assert fragment in json.loads(outcome.content)["error"]
    assert "db down" not in outcome.reason  # what traces carry: never the tool's own text


def test_a_tool_call_carries_the_turns_trace_context(tool_server):
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("execute_tool create_order") as span:
        outcome = _run(f"{tool_server}/ok")
    context = span.get_span_context()
    assert outcome.status == "ok"
    assert _ToolHandler.traceparents[-1].startswith(f"00-{context.trace_id:032x}-{context.span_id:016x}-")


def test_connection_refused_is_an_error_outcome():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    outcome = _run(f"http://127.0.0.1:{port}/tool")
    assert outcome.status == "error"
    assert json.loads(outcome.content)["tool"] == "create_order"


def test_huge_result_is_truncated_with_marker(tool_server):
    outcome = _run(f"{tool_server}/huge", max_bytes=1000)
    full_size = len(json.dumps({"rows": ["r" * 100] * 1000}).encode())
    assert (outcome.status, outcome.is_truncated) == ("ok", True)
    assert outcome.content.endswith(f"…[truncated {full_size - 1000} bytes]")
    assert len(outcome.content.encode()) < 1100


def test_a_compressed_reply_is_decoded_one_layer_and_never_past_the_size_limit(tool_server):
    """httpx inflated each read whole, stacked codings included: 590 bytes on the wire became 256 MiB in memory
    before the size check, and two layers would take the orchestrator down."""
    import tracemalloc

    ok = _run(f"{tool_server}/gzip")
    assert (ok.status, json.loads(ok.content)) == ("ok", {"total": 1284.50})
    assert _ToolHandler.accept_encodings[-1] == "identity"
    body = _gzip_of_spaces(64 << 20)  # the server's reply, made before the measurement (served from the cache)
    _ToolHandler.bodies["/gzip-bomb"] = body
    tracemalloc.start()
    try:
        bomb = _run(f"{tool_server}/gzip-bomb")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert bomb.status == "error" and "response exceeded" in json.loads(bomb.content)["error"]
    assert peak < 32 << 20  # bytes: a few MiB over the 8 MiB limit, not the 64 MiB inflated
    twice = _run(f"{tool_server}/gzip-twice")
    assert twice.status == "error" and "Content-Encoding 'gzip, gzip'" in json.loads(twice.content)["error"]
    cut = _run(f"{tool_server}/gzip-cut")
    assert cut.status == "error" and "ends before its compressed stream" in json.loads(cut.content)["error"]


def test_bytes_after_the_end_of_a_compressed_reply_are_refused(tool_server):
    """zlib keeps what follows the end of its stream, copying it whole at each read: a reply streaming zeros
    after a small gzip stream held memory without bound and the event loop for seconds, never counted by the
    size limit; a second gzip member was dropped unseen."""
    for path in ("/gzip-trailing", "/gzip-two-members"):
        outcome = _run(f"{tool_server}{path}")
        assert outcome.status == "error", (path, outcome)
        assert "data after the end of the compressed stream" in json.loads(outcome.content)["error"]


def test_a_failed_calls_status_is_kept_in_an_unread_content_encoding(tool_server):
    """A 503 in a Content-Encoding warmpath does not decode said only that; a failed call's status is kept."""
    outcome = _run(f"{tool_server}/brotli-failing")
    assert outcome.status == "error" and outcome.reason == "HTTP 503"
    assert json.loads(outcome.content)["error"].startswith("HTTP 503")


def test_an_error_result_is_cut_to_the_sessions_limit_after_its_escaping(tool_server):
    """600 control characters in a 500's body became 3,108 bytes of \\u0001 escapes, past a 256-byte limit."""
    outcome = _run(f"{tool_server}/control-characters-failing", max_bytes=256)
    assert outcome.status == "error" and outcome.is_truncated
    kept = outcome.content.encode("utf-8")
    assert len(kept) <= 256 + len("…[truncated 9999 bytes]".encode("utf-8")) and b"[truncated" in kept


def test_a_reply_is_checked_off_the_event_loop(tool_server, monkeypatch):
    """An 8 MiB JSON reply held the orchestrator's loop for seconds (parsed, walked, dumped), every stream and turn
    of the replica waiting."""
    from serve_apps.orchestrator import tools

    threads = []
    real = tools._checked_reply

    def recording(*args):
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(tools, "_checked_reply", recording)
    assert _run(f"{tool_server}/ok").status == "ok"
    assert len(threads) == 1 and threads[0].startswith("tool-reply-check")


def test_a_large_reply_is_checked_without_a_garbage_collection():
    """Millions of small lists and dicts set off full collections that walk every live object holding Python's
    lock: the loop stalled 1.2-1.5 s for an 8 MiB reply of `[[],[],...]` (0.25 s without them)."""
    import gc

    from serve_apps.orchestrator import tools

    collections = []

    def note(phase, info):
        collections.append((phase, info["generation"]))

    raw = ("[" + ",".join(['{"a":[1]}'] * 200_000) + "]").encode()
    assert gc.isenabled()
    gc.callbacks.append(note)
    try:
        outcome = tools._checked_reply(200, True, raw, "t", 1000)
    finally:
        gc.callbacks.remove(note)
    assert (outcome.status, outcome.is_truncated, collections) == ("ok", True, [])
    assert gc.isenabled()


def test_every_call_shares_one_tls_context(monkeypatch):
    """Each call's client built its own, loading the CA bundle on the event loop: 50-60 ms a tool call."""
    import ssl

    contexts = []
    real_client = httpx.AsyncClient

    def recording_client(**kwargs):
        contexts.append(kwargs.get("verify"))
        return real_client(transport=_RecordingTransport(), **kwargs)

    monkeypatch.setattr(httpx, "AsyncClient", recording_client)
    spec = ToolSpec(name="t", execution={"kind": "http", "url": "https://tools.internal/t"})
    for _ in range(2):
        assert asyncio.run(run_http_tool(spec, "{}", timeout_s=5, max_bytes=100)).status == "ok"
    assert isinstance(contexts[0], ssl.SSLContext) and contexts[0] is contexts[1]


def test_a_refusal_quoting_the_reply_is_bounded_for_the_model_and_left_out_of_traces(tool_server):
    """A reply repeating a 2 MB key: its refusal quoted the key whole into the session's transcript (past
    max_tool_result_bytes) and into the tool span's status."""
    outcome = _run(f"{tool_server}/long-duplicate-key", max_bytes=4096)
    assert outcome.status == "error" and "appears twice" in json.loads(outcome.content)["error"]
    assert len(outcome.content.encode()) < 2048 and outcome.reason == "tool's JSON reply is refused"


@pytest.mark.parametrize("path, status, expected", [
    ("/raw-deflate", "ok", '{"total": 5.00}'),
    ("/gzip-no-content", "ok", '{"status": 204}'),  # nothing to decode: no stream cut short
    ("/gzip-failing", "error", "HTTP 500"),  # the status says what failed, whatever the body
])
def test_compressed_replies_decode_as_httpx_decoded_them(tool_server, path, status, expected):
    outcome = _run(f"{tool_server}{path}")
    assert outcome.status == status and expected in outcome.content, outcome.content


@pytest.mark.parametrize("wbits", [-zlib.MAX_WBITS, zlib.MAX_WBITS], ids=["raw", "zlib"])
def test_deflate_read_a_byte_at_a_time_decodes_with_or_without_its_header(wbits):
    """Raw deflate was told apart from zlib's header only while nothing had been read: a first read of one byte
    passed as a header's first, and the next failed the reply ("incorrect header check")."""
    from serve_apps.orchestrator.tools import _LayerDecoder

    packer = zlib.compressobj(6, zlib.DEFLATED, wbits)
    body = packer.compress(b'{"total": 5.00}') + packer.flush()
    decoder = _LayerDecoder("deflate")
    out = decoder.decode(body[:1], 1000)
    assert (out, decoder.is_complete) == (b"", False)  # one byte held: not an empty, finished reply
    for at in range(1, len(body)):
        out += decoder.decode(body[at:at + 1], 1000)
    assert (out, decoder.is_complete) == (b'{"total": 5.00}', True)


def test_a_reply_with_a_byte_order_mark_is_its_json_document(tool_server):
    outcome = _run(f"{tool_server}/bom")
    assert (outcome.status, outcome.content) == ("ok", '{"ok": true}')


@pytest.mark.parametrize("arguments, is_valid", [
    ('{"amount": 19.99}', True), ('{"amount": 0.07}', True), ('{"amount": 1284.50}', True), ('{"amount": 4.35}', True),
    ('{"amount": 19.995}', False), ('{"amount": 1e300}', True), ('{"qty": 0.3}', True), ('{"qty": 0.35}', False),
    ('{"count": 9}', True), ('{"count": 10}', False),
])
def test_multiple_of_is_decided_in_decimal(arguments, is_valid):
    """jsonschema divides binary floats: 19.99 was no multiple of 0.01, and a correct price was refused until the
    turn failed."""
    spec = _spec("pay", {"type": "object", "properties": {
        "amount": {"type": "number", "multipleOf": 0.01}, "qty": {"type": "number", "multipleOf": 0.1},
        "count": {"type": "integer", "multipleOf": 3}}})
    assert isinstance(validate_tool_call(_call("pay", arguments), [spec]), ToolCall) is is_valid


def test_client_tool_cannot_run_over_http():
    spec = ToolSpec(name="ask_user", execution={"kind": "client"})
    with pytest.raises(ValueError, match="executed by the client"):
        asyncio.run(run_http_tool(spec, "{}", timeout_s=1, max_bytes=100))


class _RecordingTransport(httpx.AsyncBaseTransport):
    """Answers every request with `{}` and keeps the timeouts httpx would have applied to it."""

    def __init__(self) -> None:
        self.timeouts: list[dict] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.timeouts.append(request.extensions["timeout"])
        return httpx.Response(200, content=b"{}")


@pytest.mark.parametrize("is_pooled", [True, False])
def test_a_tool_may_take_its_whole_timeout_to_reply(monkeypatch, is_pooled):
    """httpx's own 5 s defaults (or a pooled client's) never cut off a tool declared with a longer timeout."""
    transport = _RecordingTransport()
    real_client = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kwargs: real_client(transport=transport, **kwargs))
    spec = ToolSpec(name="slow", execution={"kind": "http", "url": "http://tools.internal/slow", "timeout_s": 20})

    async def call():
        if not is_pooled:
            return await run_http_tool(spec, "{}", timeout_s=20, max_bytes=100)
        async with real_client(transport=transport, timeout=1.0) as pooled:
            return await run_http_tool(spec, "{}", timeout_s=20, max_bytes=100, client=pooled)

    assert asyncio.run(call()).status == "ok"
    (timeouts,) = transport.timeouts
    assert timeouts["read"] == timeouts["write"] == timeouts["pool"] == 20
    assert timeouts["connect"] == 5.0  # leaves time for the host's next address


@pytest.mark.parametrize("path, status_code", [("/no-content", 204), ("/empty", 200)])
def test_a_success_without_a_body_is_an_ok_result(tool_server, path, status_code):
    outcome = _run(f"{tool_server}{path}")
    assert (outcome.status, outcome.is_truncated) == ("ok", False)
    assert json.loads(outcome.content) == {"status": status_code}


BOOKING_SCHEMA = {
    "type": "object",
    "properties": {
        "date": {"type": "string", "format": "date"},
        "email": {"type": "string", "format": "email"},
        "id": {"type": "string", "format": "uuid"},
        "host": {"type": "string", "format": "ipv4"},
    },
}


@pytest.mark.parametrize(
    "arguments, paths",
    [
        ({"date": "2026-02-28", "email": "a@b.c", "id": "6f1c2a4e-3b5d-4c7e-9f0a-1b2c3d4e5f60", "host": "10.0.0.1"},
         []),
        ({"date": "2026-02-30"}, ["$.date"]),
        ({"date": "next tuesday", "email": "nobody"}, ["$.date", "$.email"]),
        ({"id": "not-a-uuid", "host": "10.0.0.300"}, ["$.host", "$.id"]),
        # `uuid.UUID` reads these, jsonschema's check with it: no UUID's text has a sign, `_`, other digits, a tail.
        ({"id": "+2345678-1234-5678-1234-567812345678"}, ["$.id"]),
        ({"id": "1_345678-1234-5678-1234-567812345678"}, ["$.id"]),
        ({"id": "1234567\u0660-1234-5678-1234-567812345678"}, ["$.id"]),
        ({"id": "12345678-1234-5678-1234-567812345678----"}, ["$.id"]),
        ({"id": "6F1C2A4E-3B5D-4C7E-9F0A-1B2C3D4E5F60"}, []),
    ],
)
def test_formats_are_checked_where_they_can_be(arguments, paths):
    spec = _spec("book", BOOKING_SCHEMA)
    outcome = validate_tool_call(_call("book", json.dumps(arguments)), [spec])
    if not paths:
        assert isinstance(outcome, ToolCall)
    else:
        assert isinstance(outcome, ToolCallError) and outcome.kind == "schema_violation"
        assert [violation.path for violation in outcome.violations] == paths


@pytest.mark.parametrize("format_name, valid, invalid", [
    ("date-time", "2026-12-07T10:00:00+01:00", "next tuesday"),
    ("time", "10:00:00Z", "noonish"),
    ("duration", "PT1H30M", "a while"),
    ("hostname", "db-primary.internal", "-- not a host --"),
    ("uri", "https://example.com/a", "not a uri"),
    ("uri-reference", "../a#x", "http://[bad"),
    ("json-pointer", "/a/b", "a"),
])
def test_every_draft_2020_12_format_is_checked(format_name, valid, invalid):
    """jsonschema checks these only with optional packages: without them a `date-time` argument took any text."""
    spec = _spec("book", {"type": "object", "properties": {"at": {"type": "string", "format": format_name}}})
    assert isinstance(validate_tool_call(_call("book", json.dumps({"at": valid})), [spec]), ToolCall)
    outcome = validate_tool_call(_call("book", json.dumps({"at": invalid})), [spec])
    assert isinstance(outcome, ToolCallError) and outcome.kind == "schema_violation"
    assert [violation.path for violation in outcome.violations] == ["$.at"]


def _with_defs(name: str, defs: dict) -> ToolSpec:
    item_refs = {key: {"$ref": f"#/$defs/{key}"} for key in defs}
    return ToolSpec(name=name, parameters={"type": "object", "$defs": defs, "properties": item_refs},
                    execution={"kind": "client"})


ITEM = {"type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}}}


def test_tools_defining_one_def_name_differently_are_named():
    refund_item = {"type": "object", "properties": {"order_id": {"type": "string"}}}
    tools = [_with_defs("refund", {"Item": refund_item}), _with_defs("add_to_cart", {"Item": ITEM, "Cart": ITEM})]
    problem = conflicting_defs(tools)
    assert problem is not None
    assert "'add_to_cart' and 'refund'" in problem and "$defs/Item" in problem


@pytest.mark.parametrize("first, second", [({"const": True}, {"const": 1}), ({"enum": [0, 1]}, {"enum": [False, 1]})])
def test_definitions_python_calls_equal_but_json_does_not_are_named(first, second):
    """vLLM merges them as equal and keeps one: the grammar would force a value validation then refuses."""
    problem = conflicting_defs([_with_defs("a", {"Flag": first}), _with_defs("b", {"Flag": second})])
    assert problem is not None and "$defs/Flag" in problem


@pytest.mark.parametrize(
    "tools",
    [
        # The same definition under one name (keys in another order) is merged, as vLLM does.
        [_with_defs("a", {"Item": ITEM}), _with_defs("b", {"Item": dict(reversed(list(ITEM.items())))})],
        [_with_defs("a", {"Item": ITEM}), _with_defs("b", {"Line": ITEM})],
        [_with_defs("a", {"Item": ITEM}), _spec("plain", ORDER_SCHEMA)],
        [],
    ],
)
def test_tools_whose_defs_merge_are_accepted(tools):
    assert conflicting_defs(tools) is None


def _pattern_tool(schema: dict) -> list:
    create = CreateSessionRequest.model_validate({"model": "m", "tools": [
        {"name": "lookup", "execution": {"kind": "client"}, "parameters": {"type": "object", **schema}}]})
    return create.tools


# Wall-clock time, where the budget is the check's CPU time: a busy 2-core host stretched 0.1 s to 1.6 s. Each
# stall these catch took 12 s or more.
STALL_S = 60 * CHECK_BUDGET_S


@pytest.mark.parametrize("schema, arguments", [
    ({"properties": {"q": {"type": "string", "pattern": "^(a|a)*$"}}}, {"q": "a" * 40 + "!"}),
    ({"patternProperties": {"^(a|a)*$": {"type": "string"}}}, {"a" * 40 + "!": "x"}),
    ({"patternProperties": {"^(a|a)*$": {}}, "additionalProperties": False}, {"a" * 40 + "!": 1}),
])
def test_a_backtracking_schema_pattern_is_a_violation_within_the_budget_not_a_stall(schema, arguments):
    call = ToolCall(id="c1", name="lookup", arguments=json.dumps(arguments))
    start = time.monotonic()
    result = validate_tool_call(call, _pattern_tool(schema))
    assert time.monotonic() - start < STALL_S  # under `re` alone: hours
    assert isinstance(result, ToolCallError) and result.kind == "schema_violation"
    assert "`pattern`" in result.detail


def test_patterns_still_decide_as_before_under_the_deadline():
    tools = _pattern_tool({"properties": {"q": {"type": "string", "pattern": "^ORD-[0-9]+$"}},
                           "patternProperties": {"^x-": {"type": "integer"}}})
    ok = ToolCall(id="c1", name="lookup", arguments='{"q": "ORD-12", "x-n": 3}')
    assert validate_tool_call(ok, tools) == ok
    bad = validate_tool_call(ToolCall(id="c2", name="lookup", arguments='{"q": "ORD-x", "x-n": "3"}'), tools)
    assert isinstance(bad, ToolCallError) and {v.path for v in bad.violations} == {"$.q", "$['x-n']"}
    # Outside a validation, jsonschema's regular expressions run without a deadline, as before.
    assert Draft202012Validator({"pattern": "^(a|a)*$"}).is_valid("aaaa")


@pytest.mark.parametrize("rows, is_valid", [
    ([{}] + list(range(8000)), True),  # jsonschema compared every pair once `{}` made them unsortable: 12 s
    ([{"a": 1, "b": [1, 2]}, {"b": [1, 2], "a": 1.0}], False),  # equal as JSON Schema reads them
    ([True, 1, None, False, 0, "", [1, 2], [2, 1]], True),  # a boolean is no number; arrays keep their order
])
def test_unique_items_is_decided_in_one_pass_within_the_budget(rows, is_valid):
    tools = _pattern_tool({"properties": {"rows": {"type": "array", "uniqueItems": True}}})
    call = ToolCall(id="c1", name="lookup", arguments=json.dumps({"rows": rows}))
    start = time.monotonic()
    result = validate_tool_call(call, tools)
    assert time.monotonic() - start < STALL_S
    assert (result == call) is is_valid
    if not is_valid:
        assert isinstance(result, ToolCallError) and "non-unique" in result.violations[0].message


def _fanned_out_refs(fanout: int, depth: int) -> dict:
    """Definitions each applying the next one `fanout` times to the same value: `fanout ** depth` applications."""
    defs = {f"d{level}": {"allOf": [{"$ref": f"#/$defs/d{level + 1}"}] * fanout} for level in range(depth)}
    defs[f"d{depth}"] = {"type": "object"}
    return {"$defs": defs, "allOf": [{"$ref": "#/$defs/d0"}]}


def test_a_schema_that_applies_its_subschemas_exponentially_often_is_a_violation_within_the_budget():
    tools = _pattern_tool(_fanned_out_refs(fanout=4, depth=14))  # accepted at creation: 1.7 KB, 15 hops
    call = ToolCall(id="c1", name="lookup", arguments="{}")
    start = time.monotonic()
    result = validate_tool_call(call, tools)
    assert time.monotonic() - start < STALL_S  # unbounded: 4**15 applications, hours
    assert isinstance(result, ToolCallError) and result.kind == "schema_violation"
    assert "too many times" in result.detail


def test_a_schema_applying_a_few_subschemas_in_place_still_decides():
    tools = _pattern_tool(_fanned_out_refs(fanout=2, depth=3))
    assert isinstance(validate_tool_call(ToolCall(id="c1", name="lookup", arguments="{}"), tools), ToolCall)


@pytest.mark.parametrize("schema, arguments, is_valid", [
    # JSON Schema's patterns are ECMAScript's: `$` is the very end, `\d` and `\w` are ASCII.
    ({"properties": {"q": {"type": "string", "pattern": "^[a-z0-9-]+$"}}}, {"q": "report-1\n"}, False),
    ({"properties": {"q": {"type": "string", "pattern": "^[a-z0-9-]+$"}}}, {"q": "report-1"}, True),
    ({"properties": {"q": {"type": "string", "pattern": r"^\d{4}$"}}}, {"q": "\u0661\u0662\u0663\u0664"}, False),
    ({"properties": {"q": {"type": "string", "pattern": r"^\d{4}$"}}}, {"q": "1234"}, True),
    ({"properties": {"q": {"type": "string", "pattern": r"^\w+$"}}}, {"q": "r\u00e9sum\u00e9"}, False),
    ({"properties": {"q": {"type": "string", "pattern": r"^[\w-]+\$$"}}}, {"q": "a-b$"}, True),
    ({"patternProperties": {r"^x-\d+$": {}}, "additionalProperties": False}, {"x-1\n": 1}, False),
    ({"patternProperties": {r"^x-\d+$": {}}, "additionalProperties": False}, {"x-12": 1}, True),
    # `.` stops at every line terminator, `\s` is ECMAScript's white space.
    ({"properties": {"q": {"type": "string", "pattern": "^.+$"}}}, {"q": "a\rb"}, False),
    ({"properties": {"q": {"type": "string", "pattern": "^.+$"}}}, {"q": "a\u2028b"}, False),
    ({"properties": {"q": {"type": "string", "pattern": "^a.b$"}}}, {"q": "a b"}, True),
    ({"properties": {"q": {"type": "string", "pattern": "^[.]$"}}}, {"q": "x"}, False),
    ({"properties": {"q": {"type": "string", "pattern": r"^\s$"}}}, {"q": "\ufeff"}, True),
    ({"properties": {"q": {"type": "string", "pattern": r"^\s$"}}}, {"q": "\x1c"}, False),
    ({"properties": {"q": {"type": "string", "pattern": r"^[\s,]+\S$"}}}, {"q": "\ufeff, x"}, True),
    # `\D`, `\W`, `\S` inside a class too: `[\s\S]` is any character, `[^\W]` ASCII word characters only.
    ({"properties": {"q": {"type": "string", "pattern": r"^[\s\S]+$"}}}, {"q": "a\x85b"}, True),
    ({"properties": {"q": {"type": "string", "pattern": r"^[\w\W]+$"}}}, {"q": "caf\u00e9"}, True),
    ({"properties": {"q": {"type": "string", "pattern": r"^[\d\D]+$"}}}, {"q": "\u0661\u0662"}, True),
    ({"properties": {"q": {"type": "string", "pattern": r"^[^\W]+$"}}}, {"q": "\u00e9"}, False),
    ({"properties": {"q": {"type": "string", "pattern": r"^[\S]+$"}}}, {"q": "\ufeff"}, False),
    ({"properties": {"q": {"type": "string", "pattern": r"^[\W]+$"}}}, {"q": "\u00e9-"}, True),
])
def test_patterns_match_as_json_schema_reads_them(schema, arguments, is_valid):
    call = ToolCall(id="c1", name="lookup", arguments=json.dumps(arguments))
    result = validate_tool_call(call, _pattern_tool(schema))
    assert isinstance(result, ToolCall) is is_valid, result


@pytest.mark.parametrize(("pattern", "is_valid"), [
    (r"(?<year>\d{4})-(?<month>\d{2})", True),  # ECMAScript's named groups: Python's `re` refused them
    (r"^[A-Z]{3}-\d+$", True),
    ("(unclosed", False),
    # Judged as ECMAScript's, not Python's: `re` refused the first three after a rewrite and took the rest.
    (r"(?<y>\d)\k<y>", True), ("[^]", True), (r"\u{1F600}", True),
    ("(?i)abc", False), (r"(?P<y>\d)", False), ("a++", False), ("(?#note)a", False),
    ("a{1000000000}", True), ("(" * 100_000 + "a" + ")" * 100_000, True),  # neither written out nor recursed
    # The dialect with the `u` flag, as JSON Schema's test suite reads it: a lone bracket or brace is no pattern.
    ("]", False), ("a{", False), (r"\a", False),
])
def test_a_regex_format_argument_is_judged_as_an_ecmascript_regular_expression(pattern, is_valid):
    spec = _spec("find", {"type": "object", "properties": {"pattern": {"type": "string", "format": "regex"}},
                          "required": ["pattern"]})
    checked = validate_tool_call(_call("find", json.dumps({"pattern": pattern})), [spec])
    assert isinstance(checked, ToolCall) is is_valid, checked
    if not is_valid:
        assert "regex" in checked.message


def test_a_violations_message_is_bounded_though_it_quotes_the_value_at_fault():
    """jsonschema quotes the value whole: a 64 KB argument over its maxLength came back as a 64 KB rejection, and
    the several keywords a value fails at once multiplied it, into a repair step that could overflow the window."""
    from serve_apps.orchestrator.models import ToolCall

    schema = {"type": "object", "properties": {"content": {"type": "string", "maxLength": 4000, "pattern": "^x*$"}}}
    spec = _spec("write_file", schema)
    call = ToolCall(id="c1", name="write_file", arguments=json.dumps({"content": "y" * 64_000}))
    error = validate_tool_call(call, [spec])
    assert isinstance(error, ToolCallError) and len(error.violations) == 2
    assert all(len(v.message.encode()) < 400 and "[truncated" in v.message for v in error.violations)


def test_long_patterns_are_rewritten_each_time_not_cached():
    """A rewrite is up to ~70 times its pattern (each `\\S` a class of ranges): 1,024 cached rewrites of
    16 KiB patterns held gigabytes."""
    from serve_apps.orchestrator import check_deadline

    long_pattern = "^" + "[\\S]" * check_deadline.MAX_CACHED_PATTERN_CHARS + "$"
    before = check_deadline._cached_rewrite.cache_info().currsize
    rewritten = check_deadline.as_ecmascript(long_pattern)
    assert check_deadline._cached_rewrite.cache_info().currsize == before
    assert rewritten == check_deadline.as_ecmascript(long_pattern) and "\\S" not in rewritten
    assert check_deadline.as_ecmascript(r"^\d$") == "^[\\x30-\\x39]\\Z"  # the shortest escapes


def _pattern_spec(name: str, pattern: str, *, of_items: bool = False) -> ToolSpec:
    string = {"type": "string", "pattern": pattern}
    schema = {"type": "array", "items": string} if of_items else string
    return ToolSpec.model_validate({"name": name, "execution": {"kind": "client"}, "parameters": {
        "type": "object", "properties": {"v": schema, "w": {"type": "integer"}}}})


def test_a_tools_first_call_is_not_refused_for_the_time_its_patterns_take_to_compile():
    """Only matching runs under the check's deadline: a pattern of 4,000 class elements compiles for most of a
    second, and inside the deadline the tool's first valid call was refused (its second was taken)."""
    pattern = "^" + "\\S" * 4000 + f"(?:{uuid.uuid4().hex})?$"  # compiled nowhere before
    spec = _pattern_spec("wide", pattern)
    call = ToolCall(id="c1", name="wide", arguments=json.dumps({"v": "x" * 4000, "w": 1}))  # `w` checked after
    assert isinstance(validate_tool_call(call, [spec]), ToolCall)


def test_a_long_pattern_checked_on_every_item_stays_within_the_budget():
    """Rewritten anew at each match, a 1,200-character pattern on 400 items took the whole 0.1 s budget."""
    codes = [f"{chr(65 + i // 26 % 26)}{chr(65 + i % 26)}{chr(65 + (i * 7) % 26)}" for i in range(120)]
    pattern = "^(?:" + "|".join(f"{code}-\\d{{2}}" for code in codes) + ")$"
    spec = _pattern_spec("legs", pattern, of_items=True)
    call = ToolCall(id="c1", name="legs", arguments=json.dumps({"v": [f"{codes[i % 120]}-{i % 100:02d}" for i in range(400)]}))
    assert all(isinstance(validate_tool_call(call, [spec]), ToolCall) for _ in range(3))


def test_compiled_patterns_are_bounded_by_their_rewrites_and_kept_out_of_regexs_own_cache():
    """`regex` kept up to 500 compiled rewrites of any size: a few MB each for patterns of thousands of class
    elements, gigabytes in all."""
    import regex

    from serve_apps.orchestrator.check_deadline import _CompiledPatterns

    regex.purge()
    compiled = _CompiledPatterns(max_chars=3000)
    patterns = {n: f"^\\S{{{n}}}[{'a' * 200}]" for n in range(1, 30)}
    for n, pattern in patterns.items():
        assert compiled.get(pattern).search("x" * n + "a")
    assert compiled._compiled.total_cost <= 3000 and 1 < len(compiled._compiled) < len(patterns)
    assert compiled.get(patterns[29]) is compiled.get(patterns[29])  # kept: the most recent
    assert regex._main._cache == {} if hasattr(regex, "_main") else True


def test_the_argument_check_runs_with_the_collector_paused(monkeypatch):
    """The check's budget is its thread's CPU time, which a full collection falling inside it spent too (0.4 s over
    a few million live objects): a valid call was refused as too costly to check (seen once in CI)."""
    import gc

    from serve_apps.orchestrator import tools

    seen = []
    validator = tools._validator

    class Recording:
        def __init__(self, schema):
            self._checker = validator(schema)

        def iter_errors(self, instance):
            seen.append(gc.isenabled())
            return self._checker.iter_errors(instance)

    monkeypatch.setattr(tools, "_validator", Recording)
    spec = _spec("book", {"type": "object", "properties": {"a": {"type": "integer"}}})
    call = _call("book", '{"a": 1}')
    assert gc.isenabled()
    assert validate_tool_call(call, [spec]) is call
    assert seen == [False] and gc.isenabled()
