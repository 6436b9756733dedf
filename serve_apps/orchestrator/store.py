"""Redis-backed session store: session records, transcripts, turn locks, idempotency and step stats.

Keys of one session share a hash tag (`warmpath:{<id>}:...`) so the Lua scripts
touching several of them also run on Redis Cluster.

Invariants:
- The transcript's logical length (messages ever committed, counting compacted
  ones) only grows: a compaction replaces r messages by one summary and adds
  r - 1 to a stored offset, and every commit appends at least one message. So
  `expected_len` identifies one state of the transcript; a retried or stale turn
  fails its length check instead of writing twice, even across compactions.
- A commit is one Lua script: length check, optional compaction, messages, step
  stats, idempotent result and TTL refresh all happen or none do.
- A turn lock is released only by the holder whose random token it still stores
  (compare-and-delete), so a holder whose lock expired cannot free another's.
- Redis being unreachable surfaces as `StoreUnavailable`, never as a redis-py
  exception, so the HTTP layer maps it to 503 in one place.
- An idempotency key's record (`RememberedTurn`) holds the fingerprint of the
  request that ran under it and every event the turn produced (runs of text
  deltas joined, as the HTTP API's unstreamed body shows them), so a retry of
  the same request replays exactly that, and another request under the same
  key is recognised and refused instead of silently answered with the first.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, Field, JsonValue
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from serve_apps.orchestrator.models import CreateSessionRequest, Message, PrefixFingerprint, SessionId, StepStats

logger = logging.getLogger(__name__)

# What the HTTP ingress accepts in `Idempotency-Key`; the orchestrator checks it again for every ingress.
MAX_IDEMPOTENCY_KEY_CHARS = 256

_COMMIT_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  return redis.error_reply('WARMPATH_NOT_FOUND')
end
local stored = redis.call('LLEN', KEYS[2])
local removed = tonumber(redis.call('HGET', KEYS[1], 'removed') or '0')
local length = removed + stored
if length ~= tonumber(ARGV[1]) then
  return redis.error_reply('WARMPATH_STALE ' .. length)
end
local num_replaced = tonumber(ARGV[2])
if num_replaced > stored then
  return redis.error_reply('WARMPATH_BAD_COMPACTION ' .. stored)
end
if num_replaced > 0 then
  redis.call('LTRIM', KEYS[2], num_replaced, -1)
  redis.call('LPUSH', KEYS[2], ARGV[3])
  redis.call('HSET', KEYS[1], 'removed', removed + num_replaced - 1)
end
local num_messages = tonumber(ARGV[5])
local num_stats = tonumber(ARGV[6])
for i = 1, num_messages do
  redis.call('RPUSH', KEYS[2], ARGV[9 + i - 1])
end
for i = 1, num_stats do
  redis.call('RPUSH', KEYS[3], ARGV[9 + num_messages + i - 1])
end
redis.call('LTRIM', KEYS[3], -tonumber(ARGV[10 + num_messages + num_stats - 1]), -1)
if ARGV[7] ~= '' then
  redis.call('HSETNX', KEYS[4], ARGV[7], ARGV[8])
end
for i = 1, 4 do
  redis.call('PEXPIRE', KEYS[i], ARGV[4])
end
return length + num_messages
"""

_RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# Extends the lock only while this holder still owns it.
_RENEW_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""


class StoreUnavailable(RuntimeError):
    """Redis cannot be reached; callers answer 503."""


class SessionNotFound(LookupError):
    """No such session, or it expired; callers answer 404."""


class SessionBusy(RuntimeError):
    """Another turn holds the session's lock; callers answer 409."""


class StaleTurn(RuntimeError):
    """The transcript moved since the turn read it; nothing was written."""

    def __init__(self, session_id: str, expected_len: int, actual_len: int) -> None:
        super().__init__(f"session {session_id}: expected transcript length {expected_len}, found {actual_len}")
        self.expected_len = expected_len
        self.actual_len = actual_len


class SessionRecord(BaseModel):
    """What is stored about a session besides its transcript."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    session_id: SessionId = Field(description="Opaque id (secrets.token_urlsafe(24)).")
    owner_key_id: str = Field(description="Id of the API key that created the session.", min_length=1)
    request: CreateSessionRequest = Field(description="The validated creation request.")
    prefix_fingerprint: PrefixFingerprint = Field(description="Fingerprint of the cacheable prefix.")
    created_at_s: float = Field(description="Unix time of creation.")


class RememberedTurn(BaseModel):
    """What an idempotency key remembers of the turn that committed under it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    request_sha256: str | None = Field(
        description="`request_fingerprint` of the request that ran; None in records written before it was kept."
    )
    events: list[dict[str, JsonValue]] = Field(description="The turn's events as the client got them, deltas joined.")

    @classmethod
    def from_stored(cls, raw: str) -> "RememberedTurn":
        """Parses a stored record; a bare list of events (the older form) has no fingerprint."""
        value = json.loads(raw)
        if isinstance(value, list):
            return cls(request_sha256=None, events=value)
        return cls.model_validate(value)


def idempotency_key_problem(key: str) -> str | None:
    """Why `key` cannot be an idempotency key, or None when it can."""
    if 1 <= len(key) <= MAX_IDEMPOTENCY_KEY_CHARS:
        return None
    return f"idempotency-key must be 1-{MAX_IDEMPOTENCY_KEY_CHARS} characters"


def request_fingerprint(endpoint: str, request: BaseModel) -> str:
    """sha256 of what defines a turn: the endpoint and the request body, less its `stream` flag.

    A retry may switch between streamed and unstreamed answers and is still the
    same turn; any other difference (the message, `tool_choice`, a result) is not.
    """
    body = request.model_dump(mode="json", exclude={"stream"})
    text = json.dumps({"endpoint": endpoint, "request": body}, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class TranscriptSnapshot:
    """The transcript as one turn read it; pass `length` back as `commit_turn(expected_len=...)`."""

    messages: tuple[Message, ...]
    length: int


@dataclass(frozen=True)
class Compaction:
    """Replace the first `num_messages_replaced` stored messages by `summary` (from compression)."""

    num_messages_replaced: int
    summary: Message


@contextmanager
def _redis_errors(session_id: str = "") -> Iterator[None]:
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError, OSError) as err:
        raise StoreUnavailable(f"session store unreachable: {err}") from err
    except ResponseError as err:
        text = str(err)
        if text.startswith("WARMPATH_NOT_FOUND"):
            raise SessionNotFound(session_id) from None
        raise


class SessionStore:
    """Sessions in Redis. All keys of a session expire together `ttl_s` after its creation or last commit."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        ttl_s: float = 24 * 3600,
        lock_ttl_s: float = 15.0,
        max_step_stats: int = 1024,
        key_prefix: str = "warmpath",
    ) -> None:
        if ttl_s <= 0 or lock_ttl_s <= 0 or max_step_stats < 1:
            raise ValueError("ttl_s and lock_ttl_s must be positive and max_step_stats at least 1")
        self._redis = client
        self._ttl_ms = int(ttl_s * 1000)
        self._lock_ttl_ms = int(lock_ttl_s * 1000)
        self._max_step_stats = max_step_stats
        self._prefix = key_prefix
        self._commit = client.register_script(_COMMIT_SCRIPT)
        self._release = client.register_script(_RELEASE_SCRIPT)
        self._renew = client.register_script(_RENEW_SCRIPT)

    @classmethod
    def from_url(cls, url: str, **kwargs: float | int | str) -> "SessionStore":
        """A store over a new client with bounded connect and command timeouts."""
        client = aioredis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=2.0, socket_timeout=5.0)
        return cls(client, **kwargs)

    async def aclose(self) -> None:
        await self._redis.aclose()

    def _key(self, session_id: str, part: str) -> str:
        return f"{self._prefix}:{{{session_id}}}:{part}"

    def _keys(self, session_id: str) -> list[str]:
        return [self._key(session_id, part) for part in ("meta", "log", "stats", "idem")]

    async def create(
        self, request: CreateSessionRequest, owner_key_id: str, prefix_fingerprint: PrefixFingerprint
    ) -> SessionRecord:
        """Stores a new session with an empty transcript."""
        record = SessionRecord(
            session_id=SessionId(secrets.token_urlsafe(24)),
            owner_key_id=owner_key_id,
            request=request,
            prefix_fingerprint=prefix_fingerprint,
            created_at_s=time.time(),
        )
        meta = self._key(record.session_id, "meta")
        with _redis_errors(record.session_id):
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hset(meta, mapping={"record": record.model_dump_json(), "removed": 0})
                pipe.pexpire(meta, self._ttl_ms)
                await pipe.execute()
        return record

    async def get(self, session_id: str) -> SessionRecord:
        """The session's record; raises SessionNotFound."""
        with _redis_errors(session_id):
            raw = await self._redis.hget(self._key(session_id, "meta"), "record")
        if raw is None:
            raise SessionNotFound(session_id)
        return SessionRecord.model_validate_json(raw)

    async def delete(self, session_id: str) -> bool:
        """Deletes every key of the session; True if it existed."""
        meta, *others = self._keys(session_id)
        with _redis_errors(session_id):
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(meta)
                pipe.delete(*others, self._key(session_id, "lock"))
                num_meta, _ = await pipe.execute()
        return num_meta > 0

    async def transcript(self, session_id: str) -> TranscriptSnapshot:
        """The stored transcript and its logical length, read in one transaction."""
        meta, log = self._key(session_id, "meta"), self._key(session_id, "log")
        with _redis_errors(session_id):
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hget(meta, "removed")
                pipe.lrange(log, 0, -1)
                removed, items = await pipe.execute()
        if removed is None:
            raise SessionNotFound(session_id)
        messages = tuple(Message.model_validate_json(item) for item in items)
        return TranscriptSnapshot(messages=messages, length=int(removed) + len(messages))

    @asynccontextmanager
    async def turn_lock(self, session_id: str) -> AsyncIterator[None]:
        """Holds the session's turn lock for the block; raises SessionBusy if another turn holds it.

        While the block runs, the lock is renewed every `lock_ttl_s / 3`, so a
        live turn keeps it however long it takes, and a dead holder (a killed
        orchestrator replica) frees it within `lock_ttl_s`: a retried turn can
        start soon after. A turn that loses the lock anyway (Redis restarted
        without it) is still safe because `commit_turn` checks the length.
        """
        key, token = self._key(session_id, "lock"), secrets.token_hex(16)
        with _redis_errors(session_id):
            acquired = await self._redis.set(key, token, nx=True, px=self._lock_ttl_ms)
        if not acquired:
            raise SessionBusy(f"session {session_id} is running another turn")
        renewer = asyncio.ensure_future(self._keep_lock(key, token))
        try:
            yield
        finally:
            renewer.cancel()
            try:
                with _redis_errors(session_id):
                    await self._release(keys=[key], args=[token])
            except StoreUnavailable as err:
                # Raising here would hide the turn's own outcome; the lock's TTL frees it.
                logger.warning("could not release turn lock of %s: %s", session_id, err)

    async def _keep_lock(self, key: str, token: str) -> None:
        interval_s = self._lock_ttl_ms / 3000
        while True:
            await asyncio.sleep(interval_s)
            try:
                if not await self._renew(keys=[key], args=[token, self._lock_ttl_ms]):
                    return  # lost it (expired while Redis was away); the commit's length check still guards
            except Exception as err:  # Redis away: keep trying, the turn's own calls report the outage
                logger.warning("could not renew turn lock %s: %s", key, err)

    async def commit_turn(
        self,
        session_id: str,
        expected_len: int,
        new_messages: Sequence[Message],
        stats: Sequence[StepStats],
        *,
        compaction: Compaction | None = None,
        idem_key: str | None = None,
        result_json: str | None = None,
    ) -> int:
        """Appends one turn atomically, if the transcript is still at `expected_len`.

        Args:
            session_id: the session.
            expected_len: `TranscriptSnapshot.length` the turn started from.
            new_messages: the turn's messages, at least one.
            stats: per-step cache stats of the turn.
            compaction: a compression done during the turn, applied before the append.
            idem_key: with `result_json`, remembered as the turn's result in the same write.
            result_json: the turn's result as returned to the client.

        Returns:
            The new logical length.

        Raises:
            StaleTurn: the transcript changed since `expected_len`; nothing was written.
            SessionNotFound: the session is gone.
        """
        if not new_messages:
            raise ValueError("a turn commits at least one message")
        if (idem_key is None) != (result_json is None):
            raise ValueError("idem_key and result_json go together")
        if compaction is not None and compaction.num_messages_replaced < 1:
            raise ValueError("a compaction replaces at least one message")
        num_replaced = compaction.num_messages_replaced if compaction else 0
        summary_json = compaction.summary.model_dump_json(exclude_none=True) if compaction else ""
        args: list[str | int] = [
            expected_len, num_replaced, summary_json, self._ttl_ms, len(new_messages), len(stats),
            idem_key or "", result_json or "",
        ]
        args.extend(m.model_dump_json(exclude_none=True) for m in new_messages)
        args.extend(s.model_dump_json() for s in stats)
        args.append(self._max_step_stats)
        try:
            with _redis_errors(session_id):
                return int(await self._commit(keys=self._keys(session_id), args=args))
        except ResponseError as err:
            kind, _, value = str(err).partition(" ")
            if kind == "WARMPATH_STALE":
                raise StaleTurn(session_id, expected_len, int(value)) from None
            if kind == "WARMPATH_BAD_COMPACTION":
                raise ValueError(f"compaction replaces {num_replaced} messages but {value} are stored") from None
            raise

    async def remember_turn_result(self, session_id: str, idem_key: str, result_json: str) -> bool:
        """Stores a turn's result under its idempotency key; the first result wins. True if stored."""
        key = self._key(session_id, "idem")
        with _redis_errors(session_id):
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hsetnx(key, idem_key, result_json)
                pipe.pexpire(key, self._ttl_ms)
                is_stored, _ = await pipe.execute()
        return bool(is_stored)

    async def lookup_turn_result(self, session_id: str, idem_key: str) -> str | None:
        """The result remembered under `idem_key`, or None when the turn never completed."""
        with _redis_errors(session_id):
            return await self._redis.hget(self._key(session_id, "idem"), idem_key)

    async def step_stats(self, session_id: str) -> list[StepStats]:
        """Per-step cache stats of the session, oldest first (the last `max_step_stats`)."""
        with _redis_errors(session_id):
            items = await self._redis.lrange(self._key(session_id, "stats"), 0, -1)
        return [StepStats.model_validate_json(item) for item in items]
