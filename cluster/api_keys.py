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
A key created with an expiry has its first two entries expire at that instant
(Redis' own expiry), so an expired key is unknown from then on, everywhere at once.

`authorize` looks the key up and takes one token in a single Lua script, so a
request costs one round trip and two ingress replicas can never both spend the
last token. The script reads Redis' own clock: ingress clocks need not agree.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import secrets
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional, Sequence, TypeVar

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, Field
from redis.exceptions import RedisError

T = TypeVar("T")
KEY_PREFIX = "wp_"
ALL_PERMISSIONS = "*"
_NS = "warmpath:"

# KEYS[1] = apikey:<hash>; ARGV[1] = key id prefix for the bucket key
# Returns {0} for an unknown key, else {1, record_json, is_allowed, retry_after_ms}.
_AUTHORIZE = """
local raw = redis.call('HGET', KEYS[1], 'record')
if not raw then return {0} end
local record = cjson.decode(raw)
local rate = tonumber(record['requests_per_s'])
local burst = tonumber(record['burst'])
local bucket = ARGV[1] .. record['key_id']
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
  retry_after_ms = math.ceil((1 - tokens) * 1000 / rate)
end
redis.call('HSET', bucket, 'tokens', tostring(tokens), 'ts_ms', now_ms)
redis.call('PEXPIRE', bucket, math.ceil(burst * 1000 / rate) + 1000)
return {1, raw, is_allowed, retry_after_ms}
"""


class StoreUnavailable(RuntimeError):
    """Redis did not answer; callers answer 503 and never guess."""


class ApiKeyRecord(BaseModel):
    """What is stored about a key (never the key itself)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key_id: str = Field(description="Public id of the key (prefix of its hash); names it in logs and sessions.")
    name: str = Field(description="Label given at creation.", max_length=128)
    permissions: tuple[str, ...] = Field(description="Permissions the key holds; '*' holds all.")
    requests_per_s: float = Field(description="Sustained request rate of the key's token bucket.", gt=0)
    burst: int = Field(description="Bucket size: requests allowed at once after idling.", ge=1)
    created_at_s: float = Field(description="Unix time of creation.")
    expires_at_s: Optional[float] = Field(None, description="Unix time the key stops working; None: never.")

    def missing_permissions(self, required: Sequence[str]) -> list[str]:
        """Permissions in `required` this key lacks, in order (none when it holds '*')."""
        return missing_permissions(self.permissions, required)


def missing_permissions(held: Sequence[str], required: Sequence[str]) -> list[str]:
    """Permissions in `required` that `held` lacks, in order; '*' in `held` holds them all."""
    if ALL_PERMISSIONS in held:
        return []
    return [p for p in required if p not in held]


@dataclass(frozen=True)
class Authorization:
    """Outcome of one `authorize`: `record` is None for an unknown key."""

    record: Optional[ApiKeyRecord]
    is_allowed: bool
    retry_after_s: float


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

    @classmethod
    def from_url(cls, url: str) -> "ApiKeyStore":
        return cls(aioredis.Redis.from_url(url, decode_responses=True, socket_timeout=2, socket_connect_timeout=2))

    async def aclose(self) -> None:
        await self._redis.aclose()

    async def create(
        self, name: str, permissions: list[str], requests_per_s: float, burst: int, key: str | None = None,
        expires_in_s: float | None = None,
    ) -> tuple[str, ApiKeyRecord]:
        """Stores a new key (or registers `key`, e.g. one kept in a local state file); returns it and its record.

        `expires_in_s` (> 0) makes the key stop working that long after creation.
        """
        if expires_in_s is not None and not expires_in_s > 0:
            raise ValueError(f"expires_in_s must be > 0, got {expires_in_s}")
        key = key or generate_api_key()
        key_hash = hash_api_key(key)
        now_s = time.time()
        record = ApiKeyRecord(
            key_id=key_id_of(key_hash), name=name, permissions=tuple(permissions),
            requests_per_s=requests_per_s, burst=burst, created_at_s=now_s,
            expires_at_s=None if expires_in_s is None else now_s + expires_in_s,
        )
        entries = (_NS + "apikey:" + key_hash, _NS + "apikey-id:" + record.key_id)
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hset(entries[0], "record", record.model_dump_json())
                pipe.set(entries[1], key_hash)
                if record.expires_at_s is not None:
                    for entry in entries:
                        pipe.pexpireat(entry, math.ceil(record.expires_at_s * 1000))
                await pipe.execute()
        except RedisError as err:
            raise StoreUnavailable(str(err)) from None
        return key, record

    async def lookup(self, key: str) -> Optional[ApiKeyRecord]:
        """The record of `key`, without spending a token."""
        try:
            raw = await self._redis.hget(_NS + "apikey:" + hash_api_key(key), "record")
        except RedisError as err:
            raise StoreUnavailable(str(err)) from None
        return ApiKeyRecord.model_validate_json(raw) if raw else None

    async def authorize(self, key: str) -> Authorization:
        """Looks `key` up and takes one token from its bucket, atomically."""
        try:
            reply = await self._authorize(keys=[_NS + "apikey:" + hash_api_key(key)], args=[_NS + "ratelimit:"])
        except RedisError as err:
            raise StoreUnavailable(str(err)) from None
        if not reply or int(reply[0]) == 0:
            return Authorization(record=None, is_allowed=False, retry_after_s=0.0)
        record = ApiKeyRecord.model_validate_json(reply[1])
        return Authorization(record=record, is_allowed=bool(int(reply[2])), retry_after_s=int(reply[3]) / 1000)

    async def list(self) -> list[ApiKeyRecord]:
        records = []
        try:
            async for id_key in self._redis.scan_iter(match=_NS + "apikey-id:*", count=500):
                key_hash = await self._redis.get(id_key)
                raw = await self._redis.hget(_NS + "apikey:" + key_hash, "record") if key_hash else None
                if raw:
                    records.append(ApiKeyRecord.model_validate_json(raw))
        except RedisError as err:
            raise StoreUnavailable(str(err)) from None
        return sorted(records, key=lambda r: r.created_at_s)

    async def revoke(self, key_id: str) -> bool:
        """Deletes a key by id; True if it existed. Requests with it fail from the next one on."""
        try:
            key_hash = await self._redis.get(_NS + "apikey-id:" + key_id)
            if key_hash is None:
                return False
            await self._redis.delete(_NS + "apikey:" + key_hash, _NS + "apikey-id:" + key_id, _NS + "ratelimit:" + key_id)
        except RedisError as err:
            raise StoreUnavailable(str(err)) from None
        return True
