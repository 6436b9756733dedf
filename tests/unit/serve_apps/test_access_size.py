"""serve_apps.access.AccessMiddleware's body-size limit at its boundary, on plain ASGI calls (auth off: no Redis)."""

from __future__ import annotations

import asyncio
import json

import pytest

from cluster.config import AccessConfig
from serve_apps.access import AccessMiddleware, GuardSettings

LIMIT = 1024


async def _echo_length(scope, receive, send) -> None:
    """The app behind the guard: reads the whole body and answers 200 with its length."""
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(size).encode()})


def _post(body: bytes, is_declared: bool, chunk_bytes: int = 300) -> tuple[int, bytes]:
    """POSTs `body` through the middleware: with a content-length, or in chunks without one."""
    middleware = AccessMiddleware(_echo_length, GuardSettings(access=AccessConfig(is_auth_enabled=False,
                                                                                 max_request_bytes=LIMIT)))
    headers = [(b"content-type", b"application/json")]
    if is_declared:
        headers.append((b"content-length", str(len(body)).encode()))
    chunks = [body[i:i + chunk_bytes] for i in range(0, len(body), chunk_bytes)] or [b""]
    start, response_body = post_through(middleware, headers, chunks)
    return start["status"], response_body


def post_through(middleware, headers: list[tuple[bytes, bytes]], chunks: list[bytes]) -> tuple[dict, bytes]:
    """The response start message and body of a POST to /v1/chat/completions sent through `middleware` in `chunks`."""
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers}
    asyncio.run(middleware(scope, receive, send))
    (start,) = [m for m in sent if m["type"] == "http.response.start"]
    return start, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


@pytest.mark.parametrize("is_declared", [True, False], ids=["content-length", "chunked"])
@pytest.mark.parametrize("size, status", [(LIMIT - 1, 200), (LIMIT, 200), (LIMIT + 1, 413)])
def test_a_body_of_exactly_the_limit_passes_and_one_byte_more_is_413(is_declared, size, status):
    code, body = _post(b"x" * size, is_declared)
    assert code == status
    if status == 200:
        assert body == str(size).encode()
    else:
        assert json.loads(body)["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("content_length", [b"2", b"not a number"])
def test_a_body_whose_length_the_headers_do_not_frame_is_counted(content_length):
    """A server that frames a body by its chunks keeps a Content-Length beside them (h11 does): the chunks count."""
    middleware = AccessMiddleware(_echo_length, GuardSettings(access=AccessConfig(is_auth_enabled=False,
                                                                                 max_request_bytes=LIMIT)))
    headers = [(b"content-length", content_length), (b"transfer-encoding", b"chunked")]
    start, body = post_through(middleware, headers, [b"x" * 1000] * 5)
    assert start["status"] == 413 and json.loads(body)["error"]["code"] == "request_too_large"
