"""API keys: issued once in plain text, stored only as hashes, checked and rate-limited in Redis.

Why Redis: every ingress replica (HTTP and gRPC, any node) must see the same
keys and draw from the same token bucket, and the session store already lives
there. Nothing here keeps a key in plain text: Redis holds the SHA-256 of each
key (keys are 256 random bits, so a fast unsalted hash is the right tool, as
for GitHub's tokens), and the plain key is shown once, to whoever created it.

Layout (all under the `warmpath:` prefix):
- `apikey:<sha256 hex>`  hash {record: ApiKeyRecord JSON}
- `apikey-id:<key id>`   the sha256 hex, so a key can be listed and revoked by id
- `ratelimit:<key id>`   hash {tokens, ts_ms}, the key's token bucket
- `apikey-revoked:<sha256 hex>`  the key id, left by `revoke` and kept without expiry
A key created with an expiry has its first two entries expire that long after
creation (a relative expiry, so Redis' clock decides, not the creating machine's;
the record's timestamps come from Redis' `TIME` too), so an expired key is unknown
from then on, everywhere at once.

Why revocation leaves a marker: a revoked key may have leaked, and a copy of it
outlives its record (the local admin key's file, a backup). `create` refuses to
register a revoked key again, so `warmpath up` can tell a revoked admin key
(replace it) from one a new or flushed Redis never saw (register it again). The
marker is a few dozen bytes per revocation, written by an operator's command.

A stored record that no longer validates (written by hand, or by a build that let a
non-finite rate through) never takes a request down with it: `authorize` and
`lookup` treat its key as unknown, and `list` reports it apart by id so it can be
revoked.

`authorize` looks the key up and takes one token in a single Lua script, so a
request costs one round trip and two ingress replicas can never both spend the
last token. The script reads Redis' own clock: ingress clocks need not agree.
It is flagged `allow-oom` (Redis 7+): a Redis full under `noeviction` still
admits and rate-limits callers (a bucket is a few bytes, and expires), so a
client can still reach DELETE /v1/sessions/{id}, the call that frees memory.
A Redis that is down still refuses everyone (503): the guard fails closed.
`revoke` is flagged the same way, so a leaked key can be revoked on a full Redis.

A bucket's expiry is the time an empty bucket takes to refill, which records keep
under `MAX_REFILL_S`; the script still caps it (and the retry delay), and hands
Redis whole milliseconds, so no stored rate can make a call fail with a Redis error.

Redis refusing a command for a state of its own (full, read-only replica,
failed snapshot, missing database) is an outage, not a bug: it answers 503
naming the state (`cluster.redis_errors`). Reads retry once on a dead pooled
connection, so the first call after a Redis restart does not fail.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import secrets
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Optional, Sequence, TypeVar

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from redis.client import NEVER_DECODE
from redis.exceptions import RedisError, ResponseError, WatchError

from cluster.config import MAX_KEY_BURST, MAX_REFILL_S, refill_problem
from cluster.redis_errors import redis_refusal, retry_on_dead_connection
from cluster.redis_pool import pooled_client

T = TypeVar("T")
KEY_PREFIX = "wp_"
ALL_PERMISSIONS = "*"
MAX_KEY_NAME_LENGTH = 128
# How long a key check waits for Redis' reply before calling it unreachable (503). A Redis that is
# down refuses the connection at once; a busy host can delay a healthy reply past 2 s.
REDIS_REPLY_TIMEOUT_S = 5.0
# The bucket's expiry and a refusal's retry delay are capped here, in whole milliseconds.
MAX_BUCKET_TTL_MS = int(MAX_REFILL_S * 1000)
_NS = "warmpath:"
MAX_KEY_LIFETIME_DAYS = 36_500  # 100 years; Redis expiry instants must fit in 64-bit milliseconds
logger = logging.getLogger(__name__)

# KEYS[1] = apikey:<hash>; ARGV[1] = key id prefix for the bucket key; ARGV[2] = MAX_BUCKET_TTL_MS
# Returns {0} for an unknown key, {2, record_json} for a record that is no JSON object with a
# string key_id, or whose rate or burst is unusable (the bucket arithmetic would fail or never
# refuse), {3} for an entry that is no hash, else
# {1, record_json, is_allowed, retry_after_ms}.
# `allow-oom`: the bucket update must run on a Redis that is full (noeviction), see the module docstring.
_AUTHORIZE = """#!lua flags=allow-oom
local raw = redis.pcall('HGET', KEYS[1], 'record')
if type(raw) == 'table' and raw.err then return {3} end  -- a hand-written entry of another type
if not raw then return {0} end
local is_json, record = pcall(cjson.decode, raw)
if not is_json or type(record) ~= 'table' or type(record['key_id']) ~= 'string' then return {2, raw} end
local rate = tonumber(record['requests_per_s'])
local burst = tonumber(record['burst'])
if not rate or not burst or not (rate > 0) or rate == math.huge or not (burst >= 1) or burst == math.huge then
  return {2, raw}
end
local bucket = ARGV[1] .. record['key_id']
local max_ttl_ms = tonumber(ARGV[2])
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local state = redis.call('HMGET', bucket, 'tokens', 'ts_ms')
local tokens = tonumber(state[1]) or burst
local ts_ms = tonumber(state[2]) or now_ms
tokens = math.min(burst, tokens + math.max(0, now_ms - ts_ms) * rate / 1000)
local is_allowed = 0
local retry_after_ms = 0
if tokens >= 1 then
  tokens = tokens - 1
  is_allowed = 1
else
  retry_after_ms = math.min(math.ceil((1 - tokens) * 1000 / rate), max_ttl_ms)
end
redis.call('HSET', bucket, 'tokens', tostring(tokens), 'ts_ms', now_ms)
-- '%d': Redis writes a Lua number as '%.17g', in exponent form from 1e17 on, which PEXPIRE refuses.
local ttl_ms = math.min(math.ceil(burst * 1000 / rate) + 1000, max_ttl_ms)
redis.call('PEXPIRE', bucket, string.format('%d', ttl_ms))
return {1, raw, is_allowed, retry_after_ms}
"""

# KEYS[1] = apikey-id:<key id>; ARGV[1] = the namespace prefix, ARGV[2] = the key id.
# Returns 1 if the key existed, else 0. Deletes the key's entries and leaves its revocation
# marker in one step; an id entry of another type (written by hand, `keys list` names it) is
# deleted alone: it names no hash to mark. `allow-oom`: see the module docstring.
_REVOKE = """#!lua flags=allow-oom
local key_hash = redis.pcall('GET', KEYS[1])
if type(key_hash) == 'table' and key_hash.err then
  redis.call('DEL', KEYS[1])
  return 1
end
if not key_hash then return 0 end
redis.call('SET', ARGV[1] .. 'apikey-revoked:' .. key_hash, ARGV[2])
redis.call('DEL', ARGV[1] .. 'apikey:' .. key_hash, KEYS[1], ARGV[1] .. 'ratelimit:' .. ARGV[2])
return 1
"""


# Tries `create` makes: a generated key whose id is taken is drawn again, and a write a concurrent change
# interrupted is made again.
KEY_WRITE_ATTEMPTS = 3


class StoreUnavailable(RuntimeError):
    """Redis did not answer, or refused for a state of its own; callers answer 503 and never guess."""


def _unavailable(err: RedisError) -> StoreUnavailable:
    """The 503 of a failed key-store call, naming Redis' state when it refused for one."""
    refusal = redis_refusal(err) if isinstance(err, ResponseError) else None
    return StoreUnavailable(refusal or str(err))


class KeyRevoked(ValueError):
    """The key given to `create` was revoked: it stays refused, and only a new key can take its place."""


class KeyIdTaken(ValueError):
    """The id of the key given to `create` (the first 48 bits of its hash) is another stored key's."""


class InvalidStoreUrl(ValueError):
    """The key store's URL is not a Redis URL (redis://, rediss:// or unix://)."""


class ApiKeyRecord(BaseModel):
    """What is stored about a key (never the key itself)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key_id: str = Field(description="Public id of the key (prefix of its hash); names it in logs and sessions.")
    name: str = Field(description="Label given at creation.", max_length=MAX_KEY_NAME_LENGTH)
    permissions: tuple[str, ...] = Field(description="Permissions the key holds; '*' holds all.")
    # Finite only: JSON has no infinity (pydantic writes it as null), and the rate-limit
    # script divides by the rate.
    requests_per_s: float = Field(
        description="Sustained request rate of the key's token bucket.", gt=0, allow_inf_nan=False
    )
    burst: int = Field(description="Bucket size: requests allowed at once after idling.", ge=1, le=MAX_KEY_BURST)
    created_at_s: float = Field(description="Unix time of creation.", allow_inf_nan=False)
    expires_at_s: Optional[float] = Field(
        None, description="Unix time the key stops working; None: never.", allow_inf_nan=False
    )
    max_sessions: Optional[int] = Field(
        None, description="Live sessions the key may hold at once; None: the cluster's access.max_sessions_per_key.",
        ge=1,
    )

    @model_validator(mode="after")
    def _check_refill_time(self) -> "ApiKeyRecord":
        """Refuses a bucket that would take `MAX_REFILL_S` or longer to refill (see its comment)."""
        if (problem := refill_problem(self.burst, self.requests_per_s)) is not None:
            raise ValueError(f"burst / requests_per_s (how long an empty bucket takes to refill) {problem}")
        return self

    def missing_permissions(self, required: Sequence[str]) -> list[str]:
        """Permissions in `required` this key lacks, in order (none when it holds '*')."""
        return missing_permissions(self.permissions, required)


def missing_permissions(held: Sequence[str], required: Sequence[str]) -> list[str]:
    """Permissions in `required` that `held` lacks, in order; '*' in `held` holds them all."""
    if ALL_PERMISSIONS in held:
        return []
    return [p for p in required if p not in held]


@dataclass(frozen=True)
class UnreadableKey:
    """A stored key whose record does not validate; it can only be revoked."""

    key_id: str
    problem: str


@dataclass(frozen=True)
class KeyListing:
    """Every stored key: readable records by creation time, then the unreadable ones by id."""

    records: list[ApiKeyRecord]
    unreadable: list[UnreadableKey]


@dataclass(frozen=True)
class Authorization:
    """Outcome of one `authorize`: `record` is None for an unknown key."""

    record: Optional[ApiKeyRecord]
    is_allowed: bool
    retry_after_s: float


def _record_problem(err: ValidationError) -> str:
    """The first problem of a record that does not validate, on one line."""
    item = err.errors()[0]
    where = ".".join(str(p) for p in item["loc"]) or "record"
    more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{where}: {item['msg']}{more}"


def _unreadable_entry(err: UnicodeDecodeError | ResponseError) -> Optional[str]:
    """Why a key's entries could not be read where they were written by hand, or None for another refusal.

    Why: an entry that is no UTF-8 text, or of another Redis type than this module writes, failed
    the key check as an internal error or as an unavailable store (a 503 clients retry), and
    `keys list` as a whole; like a record that does not validate, it is refused and listed apart.
    """
    if isinstance(err, UnicodeDecodeError):
        return "it is not UTF-8 text"
    return _OTHER_REDIS_TYPE if str(err).startswith("WRONGTYPE") else None


_OTHER_REDIS_TYPE = "its entry is of another Redis type"


def _warn_unreadable(key_hash: str, problem: str) -> None:
    logger.warning("API key %s has an unreadable record (%s); the key is refused", key_id_of(key_hash), problem)


def _parse_record(raw: str, key_hash: str) -> Optional[ApiKeyRecord]:
    """The record stored as `raw` for the key hashed `key_hash`, or None (logged) when it does not validate."""
    try:
        return ApiKeyRecord.model_validate_json(raw)
    except ValidationError as err:
        _warn_unreadable(key_hash, _record_problem(err))
        return None


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_id_of(key_hash: str) -> str:
    return "key_" + key_hash[:12]


def bearer_headers(key: str | None) -> dict[str, str]:
    """The header a client sends its key in; none when there is no key (auth off)."""
    return {"authorization": f"Bearer {key}"} if key else {}


def generate_api_key() -> str:
    """A new key: the `wp_` prefix (so scanners and humans recognise it) and 256 random bits."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def run_with_store(url: str, work: Callable[["ApiKeyStore"], Awaitable[T]]) -> T:
    """Runs `work(store)` on a new event loop with a store of its own, closed after (CLI, bring-up, tests)."""

    async def run() -> T:
        store = ApiKeyStore.from_url(url)
        try:
            return await work(store)
        finally:
            await store.aclose()

    return asyncio.run(run())


class ApiKeyStore:
    """Creates, looks up, lists and revokes keys; one instance per process, safe across tasks."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._redis = client
        self._authorize = client.register_script(_AUTHORIZE)
        self._revoke = client.register_script(_REVOKE)

    @classmethod
    def from_url(cls, url: str) -> "ApiKeyStore":
        """A store on the Redis at `url`; raises InvalidStoreUrl when `url` cannot name one (nothing connects yet)."""
        try:
            client = pooled_client(url, reply_timeout_s=REDIS_REPLY_TIMEOUT_S, connect_timeout_s=2)
        except ValueError as err:
            raise InvalidStoreUrl(str(err)) from None
        return cls(client)

    async def aclose(self) -> None:
        await self._redis.aclose()

    async def create(
        self, name: str, permissions: list[str], requests_per_s: float, burst: int, key: str | None = None,
        expires_in_s: float | None = None, max_sessions: int | None = None,
    ) -> tuple[str, ApiKeyRecord]:
        """Stores a new key (or registers `key`, e.g. one kept in a local state file); returns it and its record.

        `expires_in_s` (> 0, at most MAX_KEY_LIFETIME_DAYS) makes the key stop working that
        long after creation, by Redis' clock. Raises ValueError (pydantic's ValidationError for
        the record's fields) before anything is written, KeyRevoked when `key` was revoked, and
        KeyIdTaken when `key`'s id is another key's (a new key whose id is taken is drawn again:
        two keys under one id would share a bucket and each other's sessions).
        """
        if expires_in_s is not None and not 0 < expires_in_s <= MAX_KEY_LIFETIME_DAYS * 86_400:
            # Beyond it Redis refuses the expiry inside the transaction, after the key is stored.
            raise ValueError(f"expires_in_s must be > 0 and at most {MAX_KEY_LIFETIME_DAYS} days, got {expires_in_s}")
        for _ in range(KEY_WRITE_ATTEMPTS):
            new_key = key or generate_api_key()
            key_hash = hash_api_key(new_key)
            try:
                now_s = await self._redis_time_s()
                record = ApiKeyRecord(
                    key_id=key_id_of(key_hash), name=name, permissions=tuple(permissions),
                    requests_per_s=requests_per_s, burst=burst, created_at_s=now_s,
                    expires_at_s=None if expires_in_s is None else now_s + expires_in_s, max_sessions=max_sessions,
                )
                await self._write(key_hash, record)
                return new_key, record
            except KeyIdTaken:
                if key is not None:
                    raise
            except WatchError:  # its revocation marker or its id changed meanwhile: looked at again
                continue
            except RedisError as err:
                raise _unavailable(err) from None
        raise StoreUnavailable(f"no key could be stored in {KEY_WRITE_ATTEMPTS} tries (its entries kept changing)")

    async def _redis_time_s(self) -> float:
        """Redis' clock, in Unix seconds: every key's timestamps agree whichever machine created it."""
        seconds, microseconds = await retry_on_dead_connection(self._redis, self._redis.time)
        return seconds + microseconds / 1e6

    async def _write(self, key_hash: str, record: ApiKeyRecord) -> None:
        """Stores `record` unless its key was revoked (checked and written in one transaction).

        An expiring key's entries expire at the record's `expires_at_s` itself (Redis' clock when
        `create` read it, plus the lifetime), not a lifetime counted from this later write.
        """
        entries = (_NS + "apikey:" + key_hash, _NS + "apikey-id:" + record.key_id)
        marker = _NS + "apikey-revoked:" + key_hash
        async with self._redis.pipeline(transaction=True) as pipe:
            await pipe.watch(marker, entries[1])
            if await pipe.exists(marker):
                raise KeyRevoked(f"API key {record.key_id} was revoked")
            if await pipe.get(entries[1]) not in (None, key_hash):
                raise KeyIdTaken(
                    f"API key id {record.key_id} (the first 48 bits of the key's hash) is another key's; "
                    "register another key"
                )
            pipe.multi()
            # Without a field left unset (`max_sessions`), an older build still reads the records of keys
            # that do not use it.
            pipe.hset(entries[0], "record", record.model_dump_json(exclude_none=True))
            pipe.set(entries[1], key_hash)
            if record.expires_at_s is not None:
                for entry in entries:
                    pipe.pexpireat(entry, math.floor(record.expires_at_s * 1000))  # never past it
            await pipe.execute()

    async def lookup(self, key: str) -> Optional[ApiKeyRecord]:
        """The record of `key`, without spending a token."""
        key_hash = hash_api_key(key)
        try:
            raw = await retry_on_dead_connection(
                self._redis, lambda: self._redis.hget(_NS + "apikey:" + key_hash, "record")
            )
        except (UnicodeDecodeError, ResponseError) as err:
            if (problem := _unreadable_entry(err)) is None:
                raise _unavailable(err) from None
            _warn_unreadable(key_hash, problem)
            return None
        except RedisError as err:
            raise _unavailable(err) from None
        return _parse_record(raw, key_hash) if raw else None

    async def authorize(self, key: str) -> Authorization:
        """Looks `key` up and takes one token from its bucket, atomically."""
        key_hash = hash_api_key(key)
        try:
            # A retry may take a second token when the first try ran but its reply was lost; never a free one.
            reply = await retry_on_dead_connection(self._redis, lambda: self._authorize(
                keys=[_NS + "apikey:" + key_hash], args=[_NS + "ratelimit:", MAX_BUCKET_TTL_MS]
            ))
        except UnicodeDecodeError as err:
            _warn_unreadable(key_hash, _unreadable_entry(err))
            return Authorization(record=None, is_allowed=False, retry_after_s=0.0)
        except RedisError as err:
            raise _unavailable(err) from None
        if not reply or int(reply[0]) == 0:
            return Authorization(record=None, is_allowed=False, retry_after_s=0.0)
        if int(reply[0]) == 3:
            _warn_unreadable(key_hash, _OTHER_REDIS_TYPE)
            return Authorization(record=None, is_allowed=False, retry_after_s=0.0)
        record = _parse_record(reply[1], key_hash)
        if int(reply[0]) == 2 or record is None:  # refused as unknown: a bucket cannot be kept for it
            if record is not None:
                logger.warning("API key %s has an unusable rate or burst; the key is refused", record.key_id)
            return Authorization(record=None, is_allowed=False, retry_after_s=0.0)
        return Authorization(record=record, is_allowed=bool(int(reply[2])), retry_after_s=int(reply[3]) / 1000)

    async def list(self) -> KeyListing:
        """Every stored key; one whose record does not validate is listed apart, by id, not raised."""
        records = []
        unreadable = []
        id_prefix = _NS + "apikey-id:"
        try:
            async for raw_name in self._id_key_names(id_prefix + "*"):
                try:
                    id_key = raw_name.decode()
                except UnicodeDecodeError:  # written by hand: no command here can name it
                    shown = raw_name[len(id_prefix):].decode(errors="backslashreplace")
                    unreadable.append(UnreadableKey(key_id=shown, problem="its name is not UTF-8 text (delete it "
                                                    "with redis-cli)"))
                    continue
                try:
                    key_hash = await self._redis.get(id_key)
                    raw = await self._redis.hget(_NS + "apikey:" + key_hash, "record") if key_hash else None
                except (UnicodeDecodeError, ResponseError) as err:
                    if (problem := _unreadable_entry(err)) is None:
                        raise
                    unreadable.append(UnreadableKey(key_id=id_key[len(id_prefix):], problem=problem))
                    continue
                if not raw:
                    continue  # revoked or expired between the scan and the reads
                try:
                    records.append(ApiKeyRecord.model_validate_json(raw))
                except ValidationError as err:
                    unreadable.append(UnreadableKey(key_id=id_key[len(id_prefix):], problem=_record_problem(err)))
        except RedisError as err:
            raise _unavailable(err) from None
        return KeyListing(
            records=sorted(records, key=lambda r: r.created_at_s), unreadable=sorted(unreadable, key=lambda u: u.key_id)
        )

    async def _id_key_names(self, pattern: str) -> AsyncIterator[bytes]:
        """The names matching `pattern`, undecoded: one that is no UTF-8 failed the whole scan as decoded."""
        cursor = 0
        while True:
            cursor, names = await self._redis.execute_command(
                "SCAN", cursor, "MATCH", pattern, "COUNT", 500, **{NEVER_DECODE: True})
            for name in names:
                yield name
            if not int(cursor):
                return

    async def revoke(self, key_id: str) -> bool:
        """Deletes a key by id and marks it revoked; True if it existed. Requests with it fail from the next one on.

        Not retried on a dead connection: a lost reply would make the retry answer False for a key it revoked.
        """
        try:
            is_revoked = await self._revoke(keys=[_NS + "apikey-id:" + key_id], args=[_NS, key_id])
        except RedisError as err:
            raise _unavailable(err) from None
        return bool(int(is_revoked))
