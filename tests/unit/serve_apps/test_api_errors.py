"""Every refusal answers OpenAI's error shape with the failure's own text, whoever raised it."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel
from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest

from serve_apps import api_errors
from serve_apps.api_errors import engine_error, error_body, error_type, readable_message

# As Ray Serve LLM's `get_response_for_error` words them (captured from the running cluster).
WRAPPED_MAX_TOKENS = (
    "Message: max_tokens=10000000 cannot be greater than max_model_len=8192. Please request fewer output tokens. "
    "(parameter=max_tokens, value=10000000) (Request ID: cf288097-94aa-447b-a71d-27ca9df831fe), Internal exception: "
    "ray.llm._internal.serve.core.configs.openai_api_models.OpenAIHTTPException "
    "(Request ID: cf288097-94aa-447b-a71d-27ca9df831fe), original exception: "
)
WRAPPED_EMPTY = (
    "Message: Cannot apply chat template to an empty conversation. Provide at least one message. "
    "(Request ID: f1e94d64), Internal exception: ray.llm._internal.serve.core.configs.openai_api_models."
    "OpenAIHTTPException (Request ID: f1e94d64), original exception: "
)


@pytest.mark.parametrize("raw, text", [
    (WRAPPED_MAX_TOKENS, "max_tokens=10000000 cannot be greater than max_model_len=8192. Please request fewer "
                         "output tokens. (parameter=max_tokens, value=10000000)"),
    (WRAPPED_EMPTY, "Cannot apply chat template to an empty conversation. Provide at least one message."),
    # wrapped twice (an engine error re-raised at the ingress and wrapped again)
    (f"Message: {WRAPPED_EMPTY} (Request ID: x), Internal exception: OpenAIHTTPException (Request ID: x), "
     "original exception: ", "Cannot apply chat template to an empty conversation. Provide at least one message."),
    ("Internal Server Error (Request ID: 1)", "Internal Server Error"),
    ("prompt too long", "prompt too long"),
    ("a, Internal exception: in plain text", "a, Internal exception: in plain text"),
    ("", "the request failed"),
])
def test_readable_message_drops_rays_wrapping_only(raw, text):
    assert readable_message(raw) == text


def test_error_body_names_the_type_by_status_and_the_parameter_vllm_named():
    assert error_body(400, WRAPPED_MAX_TOKENS)["error"] == {
        "message": readable_message(WRAPPED_MAX_TOKENS), "type": "BadRequestError", "param": "max_tokens",
        "code": None,
    }
    assert error_body(429, "slow down", code="rate_limited")["error"] == {
        "message": "slow down", "type": "RateLimitError", "param": None, "code": "rate_limited",
    }
    assert [error_type(s) for s in (401, 404, 418, 500, 507)] == [
        "AuthenticationError", "NotFoundError", "BadRequestError", "InternalServerError", "InternalServerError",
    ]


def test_engine_error_keeps_the_status_and_unwraps_the_message():
    assert engine_error({"message": WRAPPED_EMPTY, "type": "OpenAIHTTPException", "code": 400}) == (
        400, "Cannot apply chat template to an empty conversation. Provide at least one message.")
    assert engine_error({"message": "odd"}) == (None, "odd")


@pytest.fixture(scope="module")
def client() -> TestClient:
    from ray.llm._internal.serve.core.configs.openai_api_models import OpenAIHTTPException
    from ray.llm._internal.serve.core.ingress.ingress import init

    app = init()  # Ray Serve LLM's app, with its own error middleware, as the ingress builds it
    api_errors.install(app)

    @app.post("/v1/engine")
    async def engine():
        raise OpenAIHTTPException(status_code=400, message=WRAPPED_MAX_TOKENS, type="OpenAIHTTPException")

    @app.post("/v1/vllm")
    async def vllm_refusal():
        from vllm.exceptions import VLLMValidationError

        raise VLLMValidationError("tool_choice names no tool", parameter="tool_choice")

    @app.get("/v1/ours")
    async def ours():
        raise OpenAIHTTPException(status_code=400, message="idempotency-key must be 1-256 characters",
                                  type="BadRequestError")

    return TestClient(app)


def test_an_engine_error_reaches_the_client_unwrapped(client):
    response = client.post("/v1/engine")
    assert response.status_code == 400
    assert response.json() == {"error": {
        "message": readable_message(WRAPPED_MAX_TOKENS), "type": "BadRequestError", "param": "max_tokens", "code": None,
    }}


def test_a_vllm_client_error_is_a_400_in_the_same_shape(client):
    response = client.post("/v1/vllm")
    assert response.status_code == 400
    assert response.json()["error"] == {"message": "tool_choice names no tool (parameter=tool_choice)",
                                         "type": "BadRequestError", "param": "tool_choice", "code": None}


def test_an_ingress_check_is_not_wrapped_by_rays_middleware(client):
    response = client.get("/v1/ours")
    assert (response.status_code, response.json()["error"]["message"]) == (
        400, "idempotency-key must be 1-256 characters")


def test_unknown_routes_and_methods_answer_the_same_shape(client):
    missing = client.get("/v1/nothing")
    assert (missing.status_code, missing.json()) == (
        404, {"error": {"message": "Not Found", "type": "NotFoundError", "param": None, "code": None}})
    wrong_method = client.get("/v1/engine")
    assert wrong_method.status_code == 405
    assert wrong_method.headers["allow"] == "POST"
    assert wrong_method.json()["error"]["type"] == "MethodNotAllowedError"


def test_an_error_chunk_mid_stream_is_rewritten_and_other_chunks_are_not():
    from serve_apps.ingress_http import readable_error_frame

    text = 'data: {"choices": [{"delta": {"content": "say \\"error\\": 1"}}]}\n\n'
    assert readable_error_frame(text) == text
    wrapped = {"error": {"message": WRAPPED_EMPTY, "type": "OpenAIHTTPException", "code": 400}}
    frame = text + f"data: {json.dumps(wrapped)}\n\ndata: [DONE]\n\n"
    lines = readable_error_frame(frame).split("\n")
    assert lines[0] == text.split("\n")[0] and lines[-3:] == ["data: [DONE]", "", ""]
    assert json.loads(lines[2][len("data: "):]) == {"error": {
        "message": "Cannot apply chat template to an empty conversation. Provide at least one message.",
        "type": "BadRequestError", "param": None, "code": None,
    }}


def test_an_engine_failure_mid_stream_says_no_more_than_before_the_stream():
    from serve_apps.ingress_http import readable_error_frame

    internal = {"error": {"message": "'NoneType' object has no attribute 'token_ids' in /app/kv.py",
                          "type": "InternalServerError", "code": 500}}
    (line, *_) = readable_error_frame(f"data: {json.dumps(internal)}\n\n").split("\n")
    assert json.loads(line[len("data: "):])["error"]["message"] == "Internal Server Error"


class _Item(BaseModel):
    role: str


class _Body(BaseModel):
    messages: list[_Item]
    max_tokens: int = 1


def test_body_validation_names_the_field_as_param():
    from ray.llm._internal.serve.core.ingress.ingress import init

    app = init()
    api_errors.install(app)

    @app.post("/v1/things")
    async def things(body: _Body):
        return {}

    client = TestClient(app)
    missing = client.post("/v1/things", json={"messages": [{}], "max_tokens": "many"})
    assert missing.status_code == 400
    assert missing.json()["error"] == {
        "message": "messages[0].role: Field required (and problems in max_tokens)", "type": "BadRequestError",
        "param": "messages[0].role", "code": "invalid_parameter",
    }
    both = client.post("/v1/things", json={"messages": [{"role": 1}, {"role": 2}]})
    assert both.json()["error"]["param"] == "messages"  # where the two problems meet
    many = client.post("/v1/things", json={"messages": [{}, {}, {}, {}, {}], "max_tokens": "many"})
    assert many.json()["error"]["message"] == ("messages[0].role: Field required (and problems in messages[1].role, "
                                               "messages[2].role, messages[3].role and 2 more fields)")
    broken = client.post("/v1/things", content=b"{bad", headers={"content-type": "application/json"})
    assert broken.status_code == 400
    error = broken.json()["error"]
    assert error["message"].startswith("the request body is not valid JSON") and error["code"] == "invalid_json"
    assert error["param"] is None
    # A body FastAPI cannot decode for another reason than JSON syntax is malformed the same way.
    for raw, why in [(b'{"messages": "\xff\xfe"}', "it is not UTF-8 text (byte 14)"),
                     (b"[" * 100_000 + b"]" * 100_000, "it nests arrays or objects too deeply")]:
        unread = client.post("/v1/things", content=raw, headers={"content-type": "application/json"})
        assert unread.status_code == 400 and unread.json()["error"] == {
            "message": f"the request body is not valid JSON: {why}", "type": "BadRequestError", "param": None,
            "code": "invalid_json"}


@pytest.mark.parametrize("content_type, is_read", [
    ("application/json", True), ("application/json; charset=utf-8", True), ("application/merge-patch+json", True),
    ("text/json", False), ("application/x-json", False), ("application/json-seq", False), ("text/plain", False),
    ("", False),
])
def test_a_body_fastapi_does_not_read_as_json_is_named_by_its_content_type(content_type, is_read):
    """FastAPI parses `application/json` and `application/*+json` only: a JSON body sent as `text/json` was
    `invalid_parameter` "Input should be a valid dictionary", since the check took any type naming json."""
    from ray.llm._internal.serve.core.ingress.ingress import init

    app = init()
    api_errors.install(app)

    @app.post("/v1/things")
    async def things(body: _Body):
        return {}

    answer = TestClient(app).post("/v1/things", content=b'{"messages": [{"role": "user"}]}',
                                  headers={"content-type": content_type} if content_type else {})
    if is_read:
        assert answer.status_code == 200, answer.json()
    else:
        error = answer.json()["error"]
        assert (answer.status_code, error["code"]) == (400, "invalid_json")
        assert error["message"].endswith(f"(this request's: {content_type or 'none'})")


def test_an_exception_from_vllm_is_a_400_with_its_own_text_and_anything_else_a_bare_500():
    from vllm.exceptions import VLLMValidationError

    from serve_apps.api_errors import exception_body

    status, body = exception_body(VLLMValidationError(
        "The tool specified in `tool_choice` does not match any of the specified `tools`", parameter="tool_choice"), "r1")
    assert status == 400
    assert body["error"]["message"].startswith("The tool specified in `tool_choice` does not match")
    assert (body["error"]["type"], body["error"]["param"]) == ("BadRequestError", "tool_choice")
    status, body = exception_body(RuntimeError("secret internals"), "r2")
    assert status == 500 and body["error"]["message"] == "Internal Server Error"


def test_readable_message_drops_a_leading_exception_name():
    assert readable_message("Message: vllm.exceptions.VLLMValidationError: bad tool (Request ID: 1), Internal exception: "
                            "x (Request ID: 1), original exception: bad tool") == "bad tool"
    assert readable_message("ValueError: nope") == "nope"
    assert readable_message("Errors: none of the above") == "Errors: none of the above"


class _FailingIngress:
    """Stands in for the ingress past its tracing wrapper: the engine call raises."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def _span_name(self, call_method: str, model: str) -> str:
        return call_method

    async def _traced_llm_request(self, body, call_method, raw_request, span, is_usage_asked):
        raise self.error


def test_an_exception_escaping_an_openai_route_is_answered_in_the_same_shape():
    import asyncio
    from types import SimpleNamespace

    from vllm.exceptions import VLLMValidationError

    from serve_apps.ingress_http import WarmpathIngress

    def answer(error):
        return asyncio.run(WarmpathIngress._process_llm_request(
            _FailingIngress(error), SimpleNamespace(model="m"), "completions", None))

    crashed = answer(RuntimeError("engine internals"))
    assert crashed.status_code == 500
    assert json.loads(crashed.body)["error"] == {
        "message": "Internal Server Error", "type": "InternalServerError", "param": None, "code": None}
    refused = answer(VLLMValidationError("n must be 1 here", parameter="n"))
    assert refused.status_code == 400 and json.loads(refused.body)["error"]["param"] == "n"
    with pytest.raises(asyncio.CancelledError):  # a cancelled request is not answered
        answer(asyncio.CancelledError())


@pytest.mark.parametrize("body, message, param", [
    # Null content fails every message form (22 problems); the user form, whose role matched, is the one meant.
    ({"model": "m", "messages": [{"role": "user", "content": None}]},
     "messages[0].content: Input should be a valid string", "messages[0].content"),
    ({"model": "m", "messages": [{"content": "x"}]}, "messages[0].role: Field required", "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     "response_format.type: Input should be 'text', 'json_object' or 'json_schema'", "response_format"),
])
def test_union_and_validator_names_never_reach_the_client(body, message, param):
    from pydantic import ValidationError
    from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest

    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest.model_validate(body)
    error = api_errors.validation_error_body([{**e, "loc": ("body", *e["loc"])} for e in err.value.errors()])["error"]
    assert error["message"].startswith(message) and error["param"] == param
    assert "Param" not in error["message"] and "function-wrap" not in error["message"]


def test_a_list_members_type_name_is_not_part_of_the_path():
    errors = [{"loc": ("body", "prompt", "list[constrained-int]", 0), "msg": "Input should be >= 0", "type": "x"},
              {"loc": ("body", "prompt", "str"), "msg": "Input should be a valid string", "type": "string_type"}]
    assert api_errors.validation_error_body(errors)["error"]["message"].startswith("prompt[0]: Input should be >= 0")


def test_the_grammar_compilers_log_prefix_is_not_part_of_the_message():
    raw = ("Failed to transform json schema into a grammar: [10:37:09] /project/cpp/json_schema_converter.cc:4950: "
           "Cannot find field nope")
    assert readable_message(raw) == "Failed to transform json schema into a grammar: Cannot find field nope"


@pytest.mark.parametrize("unit", [" (Request ID: ", "(parameter=a, value=", "Message: ", ", Internal exception: "])
def test_a_message_echoing_a_megabyte_of_client_text_is_taken_apart_in_linear_time(unit):
    """A model name or role is echoed in the error (`Got request for model "..."`); repeated, these pieces
    made the unwrapping regexes backtrack over the rest of the text at each one: quadratic, on the event loop."""
    echoed = unit * (1_048_576 // len(unit))
    started = time.perf_counter()
    body = error_body(404, f'Got request for model "{echoed}". Could not find base model with ID "{echoed}".')
    assert time.perf_counter() - started < 30  # about 0.01 s here (seconds on a loaded host); quadratic took minutes
    assert body["error"]["message"].startswith("Got request for model") and body["error"]["param"] is None


@pytest.mark.parametrize("text, param", [
    ("bad value (parameter=tool_choice)", "tool_choice"),
    ("bad value (parameter=messages[0].content, value=x (parameter=y))", "messages[0].content"),
    ("bad value (parameter=tool_choice) and more", None),
    ("(parameter=, value=1)", None),
])
def test_the_parameter_is_the_first_that_runs_to_the_messages_end(text, param):
    assert error_body(400, text)["error"]["param"] == param


def test_the_field_vllm_names_apart_from_its_text_is_kept():
    from serve_apps.api_errors import exception_body, refusal
    from serve_apps.ingress_http import readable_error_frame

    error = {"message": "suffix is only supported for models with FIM completion rendering",
             "type": "BadRequestError", "code": 400, "param": "suffix"}
    status, body = exception_body(refusal(error), "rid")
    assert status == 400 and body["error"]["param"] == "suffix"
    (line, *_) = readable_error_frame(f"data: {json.dumps({'error': error})}\n\n").split("\n")
    assert json.loads(line[len("data: "):])["error"]["param"] == "suffix"


@pytest.mark.parametrize("stop, message, param", [
    (["a", "b", "c", "d", "e"], "stop: List should have at most 4 items after validation, not 5", "stop"),
    ([1], "stop[0]: Input should be a valid string", "stop[0]"),
    (5, "stop: Input should be a valid string", "stop"),
])
def test_a_union_field_names_the_problem_of_the_member_the_value_was_of(stop, message, param):
    """A list of five stops was told it should be a string: the string member's type miss said nothing useful."""
    from ray.llm._internal.serve.core.ingress.ingress import init

    app = init()
    api_errors.install(app)

    @app.post("/v1/chat")
    async def chat(body: ChatCompletionRequest):
        return {}

    response = TestClient(app).post("/v1/chat", json={"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                       "stop": stop})
    assert response.status_code == 400
    assert (response.json()["error"]["message"], response.json()["error"]["param"]) == (message, param)



def test_an_engine_failure_raised_as_an_http_exception_says_no_more_than_any_other_500(client):
    """`/tokenize` and `/detokenize` re-raise the engine's answer: a 500's text (paths, a model folder) is logged."""
    from ray.llm._internal.serve.core.configs.openai_api_models import OpenAIHTTPException

    from serve_apps.api_errors import ENGINE_FAILURE_MESSAGE

    app = client.app

    @app.post("/v1/tokenize-failed")
    async def tokenize_failed():
        raise OpenAIHTTPException(status_code=500, message="OOM in /opt/vllm/worker.py for /models/secret",
                                  type="InternalServerError")

    response = client.post("/v1/tokenize-failed")
    assert response.status_code == 500 and response.json()["error"]["message"] == ENGINE_FAILURE_MESSAGE
    assert client.get("/v1/ours").json()["error"]["message"] == "idempotency-key must be 1-256 characters"


@pytest.mark.parametrize(("err", "has_traceback"), [
    ("client", False),  # an unknown model: the client's mistake, one line saying so
    ("server", True),  # a failure of ours keeps its traceback
])
def test_a_refused_request_is_logged_in_one_line_a_failure_with_its_traceback(err, has_traceback):
    import logging

    from ray.llm._internal.serve.core.configs.openai_api_models import OpenAIHTTPException

    from serve_apps import api_errors

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    ray_logger = logging.getLogger(api_errors._RAY_ERROR_LOGGER)
    handler = Keep()
    ray_logger.addHandler(handler)
    try:
        exception = (OpenAIHTTPException(status_code=404, message="model m is not served", type="NotFoundError")
                     if err == "client" else RuntimeError("engine core died"))
        api_errors.exception_body(exception, "req-1")
    finally:
        ray_logger.removeHandler(handler)
    (record,) = records
    assert bool(record.exc_info) is has_traceback
    if not has_traceback:
        assert "404" in record.getMessage() and "model m is not served" in record.getMessage()


def test_an_error_echoing_a_lone_surrogate_is_still_answered():
    """A refusal may echo what the client sent (an unknown model's name): Starlette's strict UTF-8 encoding
    raised on a lone surrogate there, inside the error handler, and the answer became a 500."""
    from ray.llm._internal.serve.core.configs.openai_api_models import OpenAIHTTPException

    err = OpenAIHTTPException(message='Got request for model "\ud800".', status_code=404, type="NotFoundError")
    response = api_errors.exception_response(err, None)
    assert response.status_code == 404
    assert json.loads(response.body)["error"]["message"] == 'Got request for model "?".'
