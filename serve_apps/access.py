"""Admission of every call: API key, rate limit and request size, for HTTP and gRPC alike.

Why one guard for both ingresses: a key, its permissions and its token bucket
must mean the same thing whichever protocol a client speaks. The guard answers
with a `Caller` (who is calling, holding which permissions) that the ingress
passes to the orchestrator, which owns the session-level checks (ownership,
tool permissions).

Failure rules, in order: no or unknown key, or two different keys in one call
-> 401; bucket empty -> 429 with `Retry-After`; key store unreachable or
refusing (read-only replica, failed snapshot) -> 503 with `Retry-After` (fail
closed and fast: a guard that cannot check a key admits nobody; why goes to the
log, never to a caller who may hold no key at all). A key store that is full
(`maxmemory`, noeviction) still checks keys and buckets, so clients can still
delete sessions to make room. With `access.is_auth_enabled` off, every call is
the anonymous caller holding all permissions, and nothing touches Redis.

The HTTP side is a plain ASGI middleware, so it runs before FastAPI parses a
body and can refuse an oversized one without reading it into memory. Every
refusal made here, the size limit's included, is counted in
`warmpath_access_denials` by its code (`count_denial`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from pydantic import BaseModel, ConfigDict, Field

from cluster.api_keys import ALL_PERMISSIONS, ApiKeyStore, StoreUnavailable
from cluster.config import AccessConfig
from cluster.redis_pool import refuse_unsuitable_redis, serving_redis_url
from serve_apps.api_errors import error_body, retry_after_header

logger = logging.getLogger("ray.serve")

ANONYMOUS_KEY_ID = "anonymous"
# Suggested wait before retrying a call refused because Redis (API keys or sessions) is unavailable.
STORE_RETRY_AFTER_S = 1.0
# Error codes of those refusals, whoever makes them (this guard, the orchestrator, a turn).
STORE_UNAVAILABLE_CODES = frozenset({"key_store_unavailable", "store_unavailable"})
# Suggested wait before retrying a turn refused because another turn runs on the session: a hint to poll,
# not the other turn's remaining time (a turn holds the lock for as long as it runs).
SESSION_BUSY_RETRY_AFTER_S = 1.0
_RETRY_AFTER_S_BY_CODE = {
    **dict.fromkeys(STORE_UNAVAILABLE_CODES, STORE_RETRY_AFTER_S), "session_busy": SESSION_BUSY_RETRY_AFTER_S,
}
# Paths any client (or probe) may call without a key.
PUBLIC_PATHS = frozenset({"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


@dataclass(frozen=True)
class Caller:
    """Who is calling: the key's public id, its permissions ('*' holds all) and its own session limit."""

    key_id: str
    permissions: tuple[str, ...]
    max_sessions: Optional[int] = None  # None: the cluster's `access.max_sessions_per_key`

    def to_dict(self) -> dict[str, Any]:
        return {"key_id": self.key_id, "permissions": list(self.permissions), "max_sessions": self.max_sessions}

    @classmethod
    def from_dict(cls, caller: dict[str, Any]) -> "Caller":
        """The caller `to_dict` wrote (as it crosses to the orchestrator)."""
        return cls(
            key_id=caller["key_id"], permissions=tuple(caller["permissions"]), max_sessions=caller.get("max_sessions")
        )


ANONYMOUS = Caller(key_id=ANONYMOUS_KEY_ID, permissions=(ALL_PERMISSIONS,))


def retry_headers(code: Optional[str]) -> dict[str, str]:
    """`retry-after` for a refusal with this error code when waiting can clear it (Redis unavailable, the
    session busy with another turn); none otherwise."""
    retry_after_s = _RETRY_AFTER_S_BY_CODE.get(code)
    return {} if retry_after_s is None else dict([retry_after_header(retry_after_s)])


class AccessDenied(Exception):
    """A call refused before it reached any deployment."""

    def __init__(self, status: int, code: str, message: str, retry_after_s: Optional[float] = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        """Its HTTP headers: `retry-after`, and for a 401 the scheme it takes, as HTTP asks of every 401
        (RFC 9110, `WWW-Authenticate`)."""
        if self.retry_after_s is not None:
            return dict([retry_after_header(self.retry_after_s)])
        return {"www-authenticate": "Bearer"} if self.status == 401 else {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, code=self.code)


def count_denial(denied: AccessDenied) -> AccessDenied:
    """Counts a refusal in `warmpath_access_denials` by its code; returns it, for the caller to raise or send."""
    from serve_apps.metrics import WarmpathMetrics

    WarmpathMetrics.get().access_denials.inc(tags={"code": denied.code})
    return denied


def request_too_large(message: str) -> AccessDenied:
    """The 413 of a request over `access.max_request_bytes`, counted."""
    return count_denial(AccessDenied(413, "request_too_large", message))


class GuardSettings(BaseModel):
    """What a guard needs, as plain data (it travels to each ingress replica)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    access: AccessConfig = Field(description="Auth switch, limits.")
    redis_url: Optional[str] = Field(None, description="Key store; required when auth is on.")


def credentials_from(headers: Iterable[tuple[str, str]]) -> Optional[str]:
    """The API key in `authorization: Bearer <key>` or `x-api-key: <key>`, if any (HTTP headers or gRPC metadata).

    A non-empty Bearer key is used, else `x-api-key`, whatever order they come in; an
    empty value counts as absent. Two different keys in one call are refused rather
    than one of them checked: which key the caller meant is not for the server to guess.

    Raises:
        AccessDenied: 401 `invalid_api_key` when the call carries two different keys.
    """
    keys = set()
    for name, value in headers:
        lowered = name.lower()
        if lowered == "authorization" and value[:7].lower() == "bearer ":
            keys.add(value[7:].strip())
        elif lowered == "x-api-key":
            keys.add(value.strip())
    keys.discard("")
    if len(keys) > 1:
        raise AccessDenied(
            401, "invalid_api_key",
            "the call carries different API keys (in its 'Authorization: Bearer' and 'x-api-key' headers); "
            "send one key",
        )
    return next(iter(keys), None)


class AccessGuard:
    """Turns presented credentials into a `Caller` or an `AccessDenied`."""

    def __init__(self, settings: GuardSettings) -> None:
        self.settings = settings
        self._keys: Optional[ApiKeyStore] = None
        if settings.access.is_auth_enabled:
            # Like the orchestrator: the config's URL, else the pod's REDIS_URL (from a Secret on Kubernetes).
            redis_url = serving_redis_url(settings.redis_url, "access.is_auth_enabled")
            refuse_unsuitable_redis(redis_url)
            self._keys = ApiKeyStore.from_url(redis_url)

    async def admit(self, key: Optional[str]) -> Caller:
        """The caller behind `key`; raises AccessDenied (counted by reason in `warmpath_access_denials`)."""
        try:
            return await self._admit(key)
        except AccessDenied as denied:
            count_denial(denied)
            raise

    async def admit_call(self, headers: Iterable[tuple[str, str]]) -> Caller:
        """The caller behind the key a call's HTTP headers or gRPC metadata carry (`credentials_from`); as `admit`."""
        if self._keys is None:
            return ANONYMOUS  # with keys off, whatever a call carries is not looked at
        try:
            key = credentials_from(headers)
        except AccessDenied as denied:
            count_denial(denied)
            raise
        return await self.admit(key)

    async def _admit(self, key: Optional[str]) -> Caller:
        if self._keys is None:
            return ANONYMOUS
        if not key:
            raise AccessDenied(401, "missing_api_key", "an API key is required: send 'Authorization: Bearer <key>'")
        try:
            outcome = await self._keys.authorize(key)
        except StoreUnavailable as err:
            logger.warning("API key check failed: the key store is unavailable: %s", err)
            raise AccessDenied(
                503, "key_store_unavailable", "the API key store is unavailable", STORE_RETRY_AFTER_S
            ) from None
        if outcome.record is None:
            raise AccessDenied(401, "invalid_api_key", "the API key is not valid")
        if not outcome.is_allowed:
            raise AccessDenied(
                429, "rate_limited",
                f"rate limit of key {outcome.record.key_id} reached "
                f"({outcome.record.requests_per_s:g} requests/s, burst {outcome.record.burst})",
                outcome.retry_after_s,
            )
        record = outcome.record
        return Caller(key_id=record.key_id, permissions=record.permissions, max_sessions=record.max_sessions)


class AccessMiddleware:
    """ASGI middleware: size limit, then admission; the caller lands in `scope["state"]["caller"]`."""

    def __init__(self, app, settings: GuardSettings) -> None:
        self.app = app
        self._settings = settings
        self._guard: Optional[AccessGuard] = None  # built in the serving process, as it starts (or on first use)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan" and self._guard is None:
            # Serve starts the app's lifespan as the replica starts: a guard that cannot be built (keys on
            # without a Redis URL, a Redis Cluster) fails the replica's start with its reason, once, rather
            # than every request with a bare 500 (each asking Redis again on the event loop).
            self._guard = AccessGuard(self._settings)
        # CORS preflights carry no credentials by design; the CORS middleware inside answers them.
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        if self._guard is None:
            self._guard = AccessGuard(self._settings)
        limit = self._settings.access.max_request_bytes
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope.get("headers", [])]
        content_length = next((v for k, v in headers if k.lower() == "content-length"), None)
        try:
            declared = int(content_length) if content_length is not None else None
        except ValueError:
            declared = None
        if any(k.lower() == "transfer-encoding" for k, _ in headers):
            declared = None  # the chunks frame the body, whatever length the headers also claim
        try:
            if declared is not None and declared > limit:
                raise request_too_large(f"request body of {declared} bytes exceeds {limit} bytes")
            caller = await self._guard.admit_call(headers)
        except AccessDenied as denied:
            await _send_json(send, denied.status, denied.body(), denied.headers())
            return
        scope.setdefault("state", {})["caller"] = caller
        if declared is not None or scope.get("method") in ("GET", "HEAD", "DELETE", "OPTIONS"):
            # A declared length was checked above, and the HTTP server holds the client to it.
            await self.app(scope, receive, send)
            return
        await self._run_buffered(scope, receive, send, limit)

    async def _run_buffered(self, scope, receive, send, limit: int) -> None:
        """Runs the app on a body without a declared length: buffered up to `limit` first, then replayed."""
        chunks, received = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before finishing its body
            chunks.append(message.get("body", b""))
            received += len(chunks[-1])
            if received > limit:
                denied = request_too_large(f"request body exceeds {limit} bytes")
                await _send_json(send, denied.status, denied.body(), denied.headers())
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        is_replayed = False

        async def replay():
            nonlocal is_replayed
            if not is_replayed:
                is_replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _send_json(send, status: int, body: dict[str, Any], headers: dict[str, str]) -> None:
    payload = json.dumps(body).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw_headers += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": payload})
