"""One error shape for everything the ingresses refuse: OpenAI's, with a message a person can read.

Why: an OpenAI client reads `error.message` and raises by status, so every
refusal (our own checks, Ray Serve LLM's, the engine's, FastAPI's 404/405 and
body validation) should answer `{"error": {"message", "type", "param", "code"}}`. Ray Serve LLM
wraps each failure as `Message: <text> (Request ID: ...), Internal exception:
<class> (Request ID: ...), original exception: ...` with the wrapper's class
name as `type`; clients get the text alone (the request id travels in the
`x-request-id` header), `type` named by status as the openai SDK names its
exceptions, and `param` when vLLM named the parameter.
"""

from __future__ import annotations

import email.message
import json
import logging
import math
import re
from typing import Any, Mapping, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

ERROR_TYPES = {
    400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
    405: "MethodNotAllowedError", 408: "RequestTimeoutError", 409: "ConflictError", 413: "RequestTooLargeError",
    422: "UnprocessableEntityError", 429: "RateLimitError", 500: "InternalServerError", 502: "BadGatewayError",
    503: "ServiceUnavailableError", 504: "GatewayTimeoutError",
}

logger = logging.getLogger("ray.serve")

# Where Ray Serve LLM logs each failure it turns into a response (`get_response_for_error`).
_RAY_ERROR_LOGGER = "ray.serve.ray.llm._internal.serve.utils.server_utils"


class _ClientErrorsInOneLine(logging.Filter):
    """Ray Serve LLM logs every refused request with its whole traceback, a client's mistake (a 4xx: an
    unknown model, a bad parameter) at WARNING too: one line each, saying what was refused, keeps the log
    readable; server failures keep their tracebacks."""

    def filter(self, record: logging.LogRecord) -> bool:
        fields = getattr(record, "ray_serve_extra_fields", None)
        status = fields.get("status_code") if isinstance(fields, dict) else None
        if isinstance(status, int) and status < 500 and record.exc_info:
            err = record.exc_info[1]
            # Ray Serve LLM's HTTP exceptions keep their text in `message` (their str is empty).
            text = readable_message(str(getattr(err, "message", None) or err))[:300]
            record.msg = f"{record.getMessage()}: {status} {type(err).__name__}: {text}"
            record.args = None
            record.exc_info = record.exc_text = None
        return True


logging.getLogger(_RAY_ERROR_LOGGER).addFilter(_ClientErrorsInOneLine())

# Ray Serve LLM's text for a call the engine itself failed (its own text goes to the log: paths, devices).
ENGINE_FAILURE_MESSAGE = "Internal Server Error"
# What an ingress answers where no process behind it can take the call (its replica died, none runs yet).
UNAVAILABLE_MESSAGE = "a serving process is unavailable; retry"

# Messages echo what clients sent (a model name, a role, a value), so they are taken apart with
# `str.find` and anchored matches only: a regex that backtracks over the rest of the text at every
# occurrence of its first literal is quadratic in a body of megabytes, on the ingress's event loop.
_PREFIX = "Message: "
_WRAPPER_END = ", Internal exception: "
_REQUEST_ID = " (Request ID: "
# Ray names a non-HTTP exception in its message: "vllm.exceptions.VLLMValidationError: <text>".
_EXCEPTION_NAME = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception): ")
# The grammar compiler's log prefix inside vLLM's message: "[10:37:09] /path/json_schema_converter.cc:4950: ".
_NATIVE_LOG_PREFIX = re.compile(r"\[\d{2}:\d{2}:\d{2}\] [^\s:]+:\d+: ")
_PARAMETER = "(parameter="
_PARAMETER_NAME = re.compile(r"[A-Za-z_][\w.\[\]]*")


def error_type(status: int) -> str:
    """The openai SDK's exception name for an HTTP status."""
    return ERROR_TYPES.get(status) or ("InternalServerError" if status >= 500 else "BadRequestError")


def _without_request_id(text: str) -> str:
    """`text` without a trailing ` (Request ID: ...)` (an id holds no `)`)."""
    if text.endswith(")"):
        start = text.rfind(_REQUEST_ID)
        if start != -1 and text.find(")", start + len(_REQUEST_ID)) == len(text) - 1:
            return text[:start]
    return text


def _unwrapped(text: str) -> str | None:
    """The text inside one `Message: <text> (Request ID: ...), Internal exception: ...` wrapping, or None."""
    if not text.startswith(_PREFIX):
        return None
    end = text.find(_WRAPPER_END)  # wrapped twice, the first one ends the inner wrapping's text
    return None if end == -1 else _without_request_id(text[len(_PREFIX):end])


def readable_message(raw: str) -> str:
    """The text of a failure without Ray Serve LLM's wrapping (applied as often as it was wrapped)."""
    text = raw.strip()
    while (inner := _unwrapped(text)) is not None:
        text = _without_request_id(inner.strip())
        if text.startswith(_PREFIX) and _unwrapped(text) is None:
            text = text[len(_PREFIX):]
    text = _NATIVE_LOG_PREFIX.sub("", _without_request_id(text))
    return _EXCEPTION_NAME.sub("", text) or "the request failed"


def vllm_parameter(text: str) -> str | None:
    """The parameter a message ending in vLLM's `(parameter=<name>)` or `(parameter=<name>, value=...)` names."""
    if not text.endswith(")"):
        return None
    start = text.find(_PARAMETER)
    while start != -1:
        name = _PARAMETER_NAME.match(text, start + len(_PARAMETER))
        if name is not None and (name.end() == len(text) - 1 or text.startswith(", value=", name.end())):
            return name.group(0)
        start = text.find(_PARAMETER, start + 1)
    return None


def error_body(status: int, message: str, code: Optional[str] = None, param: Optional[str] = None) -> dict[str, Any]:
    """The JSON body of a refusal with this status; `param` defaults to the parameter vLLM's message names."""
    text = readable_message(message)
    if param is None:
        param = vllm_parameter(text)
    return {"error": {"message": text, "type": error_type(status), "param": param, "code": code}}


def retry_after_header(retry_after_s: float) -> tuple[str, str]:
    """`retry-after` in whole seconds, at least 1 (HTTP's delay-seconds form; gRPC carries it as metadata)."""
    return "retry-after", str(max(1, math.ceil(retry_after_s)))


def _unavailable_body() -> dict[str, Any]:
    return error_body(503, UNAVAILABLE_MESSAGE, code="unavailable")


def unavailable_response(retry_after_s: float = 1) -> JSONResponse:
    """The 503 `unavailable` of a call no process could take, with `Retry-After`."""
    return JSONResponse(_unavailable_body(), status_code=503, headers=dict([retry_after_header(retry_after_s)]))


def is_unavailable(err: Exception) -> bool:
    """Whether `err` says no process could take the call (its replica died, none runs yet, or all are full)."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    return isinstance(err, (RayActorError, DeploymentUnavailableError, BackPressureError))


def exception_body(err: Exception, request_id: str) -> tuple[int, dict[str, Any]]:
    """Status and body for an exception that escaped a route, classified as Ray Serve LLM does.

    A call no process could take is a 503 `unavailable` (retry; the gRPC ingress answers
    UNAVAILABLE). vLLM's client errors (a `tool_choice` naming no tool) are 400s with their own
    text; anything unexpected is a 500 whose message says no more than that (the log has the rest).
    """
    from ray.llm._internal.serve.utils.server_utils import get_response_for_error

    if is_unavailable(err):
        logger.warning("no serving process could take the call: %r", err)
        return 503, _unavailable_body()

    error = get_response_for_error(err, request_id).error
    param = getattr(err, "param", None)  # an engine refusal's field, where the ingress carried it (`refusal`)
    return error.code, error_body(error.code, error.message, param=param if isinstance(param, str) else None)


def refusal(error: Mapping[str, Any]) -> Exception:
    """An engine's `ErrorResponse.error` (as a dict) as the exception the ingress answers it with, its `param` kept."""
    from ray.llm._internal.serve.core.configs.openai_api_models import OpenAIHTTPException

    status, message = engine_error(error)
    exception = OpenAIHTTPException(message=message, status_code=status or 500, type=error_type(status or 500))
    exception.param = error.get("param")
    return exception


class Utf8JSONResponse(JSONResponse):
    """A JSON body with each lone surrogate written as '?'.

    Why: Starlette's strict UTF-8 encoding raises on one, and the answer became a 500: model output can
    hold one (a tool parser's `json.loads` of the model's `"\\ud800"` in the arguments), and an error
    message can echo one the client sent (an unknown model's name).
    """

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None,
                          separators=(",", ":")).encode("utf-8", errors="replace")


def exception_response(err: Exception, request: Optional[Request]) -> JSONResponse:
    """`exception_body` as the response, under the request id Ray's middleware gave `request` (a 503
    `unavailable` with `Retry-After`: the delay Serve's back-pressure names, else 1 s)."""
    status, body = exception_body(err, getattr(request.state, "request_id", "") if request is not None else "")
    headers = dict([retry_after_header(getattr(err, "retry_after_s", None) or 1)]) if is_unavailable(err) else None
    return Utf8JSONResponse(body, status_code=status, headers=headers)


def engine_error(error: Mapping[str, Any]) -> tuple[Optional[int], str]:
    """(HTTP status or None, readable message) of an engine `ErrorResponse.error` as a dict."""
    status = error.get("code")
    return (status if isinstance(status, int) else None), readable_message(str(error.get("message") or ""))


def client_engine_error(error: Mapping[str, Any]) -> tuple[Optional[int], str]:
    """`engine_error` as a client may read it: the engine's own failure (a 500, or no status) is said as Ray
    Serve LLM says it before a stream (`ENGINE_FAILURE_MESSAGE`), its text logged, not sent."""
    status, message = engine_error(error)
    if (status or 500) == 500:
        logger.warning("engine error: %s", message)
        return status, ENGINE_FAILURE_MESSAGE
    return status, message


# The other fields at fault a validation message names beside its first problem's.
MORE_FIELDS_NAMED = 3


def validation_problem(errors: Sequence[Mapping[str, Any]], prefix: str = "") -> tuple[str, Optional[str]]:
    """(message, field) for pydantic's `errors()`: the first problem, and the field at fault.

    Pydantic's own text (one line per error, documentation links) is for developers; this
    names the field as the request spells it (`tools[0].parameters`), under `prefix` if given.
    """
    errors = _closest_union_member(list(errors))
    first = errors[0] if errors else {}
    where = _field_path(first.get("loc", ()), prefix)
    message = f"{where or 'the request body'}: {first.get('msg', 'invalid value')}"
    others = list(dict.fromkeys(_field_path(e.get("loc", ()), prefix) or "the request body" for e in errors))
    others = [field for field in others if field != (where or "the request body")]
    if others:  # named, so that a client fixes them all at once, not one per try
        named = ", ".join(others[:MORE_FIELDS_NAMED])
        rest = len(others) - MORE_FIELDS_NAMED
        message += f" (and problems in {named}{f' and {rest} more fields' if rest > 0 else ''})"
    # A value that matches none of a union's forms fails once per form, each under the form's name:
    # the field is where all those problems meet.
    shared = _field_path(_common_prefix([_without_tags(e.get("loc", ())) for e in errors]), prefix)
    return message, shared or where


def validation_error_body(errors: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A 400 body for a request that failed schema validation: the first problem, its field as `param`."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error")
        return error_body(400, "the request body is not valid JSON" + (f": {detail}" if detail else ""),
                          code="invalid_json")
    message, param = validation_problem(errors)
    return error_body(400, message, code="invalid_parameter", param=param)


def _common_prefix(locs: Sequence[Sequence[Any]]) -> tuple:
    prefix: list = []
    for parts in zip(*locs):
        if any(part != parts[0] for part in parts):
            break
        prefix.append(parts[0])
    return tuple(prefix)


# Names pydantic puts in an error's location for a type it tried, not a field of the request:
# union members (`ChatCompletionUserMessageParam`, `str`, `list[constrained-int]`) and
# validators (`function-wrap[...]`).
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "bytes", "list", "dict", "tuple", "set", "none", "any"})


def _is_tag(part: Any) -> bool:
    return isinstance(part, str) and (part[:1].isupper() or any(c in part for c in "[(-") or part in _TYPE_NAMES)


def _without_tags(loc: Sequence[Any]) -> tuple:
    return tuple(part for part in loc if not _is_tag(part))


def _closest_union_member(errors: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The errors of the union member the value came closest to, where it matched none.

    Pydantic reports every member's failures (22 for a user message whose
    content is null); of the members whose literals matched (the `role`), the one
    with the fewest is what the client most likely meant (a user message, whose
    content must be a string). When several tie, a field all
    of them refused as a literal (the `type` of a content part) is the one to name,
    with every value the members accept.
    """
    loc = tuple(errors[0].get("loc", ())) if errors else ()
    at = next((i for i, part in enumerate(loc) if _is_tag(part)), None)
    if at is None:
        return errors
    members: dict[str, list[Mapping[str, Any]]] = {}
    others = []
    for error in errors:
        where = tuple(error.get("loc", ()))
        if where[:at] == loc[:at] and len(where) > at and _is_tag(where[at]):
            members.setdefault(where[at], []).append(error)
        else:
            others.append(error)
    if len(members) < 2:
        return errors
    # A member that refused a literal (a message's `role`) is one the client did not mean, if any other is left.
    members = {tag: member for tag, member in members.items()
               if not any(error.get("type") == "literal_error" for error in member)} or members
    # So is one refusing the value's very type (`stop` as a string, for a list of five): the others say what is wrong.
    members = {tag: member for tag, member in members.items()
               if not all(_is_type_miss_at(error, at + 1) for error in member)} or members
    fewest = min(map(len, members.values()))
    closest = [member for member in members.values() if len(member) == fewest]
    if len(closest) > 1:
        literals: dict[tuple, list[str]] = {}
        for member in closest:
            for error in member:
                if error.get("type") == "literal_error":
                    literals.setdefault(_without_tags(error["loc"]), []).append(str(error["ctx"]["expected"]))
        for where, expected in literals.items():
            if len(expected) == len(closest):
                return [{"loc": where, "msg": f"Input should be {', '.join(expected)}", "type": "literal_error"}] + others
    return closest[0] + others


def _is_type_miss_at(error: Mapping[str, Any], depth: int) -> bool:
    """Whether `error` says the value at `depth` of its location is not of the type asked (`string_type`)."""
    return len(error.get("loc", ())) == depth and str(error.get("type", "")).endswith("_type")


def _field_path(loc: Sequence[Any], prefix: str = "") -> Optional[str]:
    """`messages[0].role` for FastAPI's ("body", "messages", 0, "role"), without pydantic's type names."""
    parts = list(loc)[1:] if loc and loc[0] in ("body", "query", "path", "header") else list(loc)
    path = prefix
    for part in _without_tags(parts):
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or None


def _is_read_as_json(content_type: str) -> bool:
    """Whether FastAPI parses a body of `content_type` as JSON (`fastapi.routing`, strict content types):
    `application/json` or `application/*+json` only, not `text/json` or `application/x-json`."""
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


async def _validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
    content_type = request.headers.get("content-type") or ""
    if not _is_read_as_json(content_type) and any(tuple(e.get("loc") or ()) == ("body",) for e in err.errors()):
        # FastAPI reads a body as JSON only under a JSON content type: a JSON body sent as a form (curl's
        # `-d` without `-H 'content-type: application/json'`) was refused as "not a valid dictionary".
        message = (f"the request body must be JSON sent with content-type: application/json (this request's: "
                   f"{content_type or 'none'})")
        return JSONResponse(error_body(400, message, code="invalid_json"), status_code=400)
    return JSONResponse(validation_error_body(err.errors()), status_code=400)


async def _client_error(request: Request, err: Exception) -> JSONResponse:
    return exception_response(err, request)


async def _openai_http_exception(request: Request, err) -> JSONResponse:
    # An engine's own failure is said as before a stream (`client_engine_error`): its text is for the log.
    _, message = client_engine_error({"code": err.status_code, "message": err.message})
    return JSONResponse(error_body(err.status_code, message), status_code=err.status_code)


# FastAPI's text for a body it could not decode other than as bad JSON syntax (not UTF-8, nested too deep).
_UNPARSED_BODY = "There was an error parsing the body"


async def _http_exception(request: Request, err: StarletteHTTPException) -> JSONResponse:
    if err.status_code == 400 and err.detail == _UNPARSED_BODY:
        return JSONResponse(validation_error_body([{"type": "json_invalid", "ctx": {"error": _unparsed_why(err)}}]),
                            status_code=400)
    return JSONResponse(error_body(err.status_code, str(err.detail)), status_code=err.status_code,
                        headers=getattr(err, "headers", None))


def _unparsed_why(err: Exception) -> str:
    """Why FastAPI could not read a body, in the words `invalid_json` uses."""
    cause = err.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return f"it is not UTF-8 text (byte {cause.start})"
    if isinstance(cause, RecursionError):
        return "it nests arrays or objects too deeply"
    return "it could not be decoded"


def install(app: FastAPI) -> None:
    """Answers the app's HTTP and OpenAI exceptions in the one shape (before Ray's middleware re-wraps them)."""
    # Imported here: Ray Serve LLM's API models import vLLM and torch, which the admission guard does without.
    from ray.llm._internal.serve.core.configs.openai_api_models import OpenAIHTTPException
    from ray.llm._internal.serve.utils.server_utils import VLLM_CLIENT_ERRORS

    for client_error in VLLM_CLIENT_ERRORS:  # raised while FastAPI parses a body (vLLM's request validators)
        app.add_exception_handler(client_error, _client_error)

    app.add_exception_handler(OpenAIHTTPException, _openai_http_exception)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_exception_handler(RequestValidationError, _validation_error)  # replaces Ray Serve LLM's


__all__ = [
    "ERROR_TYPES", "engine_error", "error_body", "error_type", "exception_body", "exception_response", "install",
    "readable_message", "validation_error_body", "validation_problem",
]
