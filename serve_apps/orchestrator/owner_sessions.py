"""Each API key's live sessions, counted so that no one key can fill the session store.

Why: a session holds its prompt and tool schemas for `session_ttl_s` (a day by
default), up to hundreds of KB each on a large window, and Redis runs under
`noeviction`. A key within its rate limit could otherwise create sessions until
Redis is full, after which every client's creations and turns answer 503. With a
limit, a key at its quota is refused (429 `session_quota_exceeded`) and everyone
else is untouched.

Layout: `warmpath:{owner:<key id>}:sessions`, a sorted set of the key's session
ids, each scored by the Unix time (ms) its session was last known to expire. One
key's sessions live in as many hash slots as they have ids, so the index has a
slot of its own and is never read inside a session's scripts.

Kept exact lazily, with no work on the turn path: a session's expiry moves with
each turn, but its score is only read when it has passed. Before each creation
the members whose scores have passed are looked up (`PTTL` of each one's
record): those gone (expired, or deleted while their index entry was not) are
removed, the others are scored again by their remaining time. Deleting a session
removes its member at once. Counting and adding are one script, so two
creations racing for a key's last place cannot both have it.

What is not counted: sessions created before the index existed (until they
expire), and those of keys holding every permission ('*': the admin key, and
every call when API keys are off), which never enter it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import redis.asyncio as aioredis

from cluster.api_keys import ALL_PERMISSIONS
from serve_apps.access import Caller

# Members looked up per round trip while pruning.
PRUNE_BATCH = 512

# KEYS[1]: the owner's index. ARGV: session id, its expiry (ms), limit ('' for none). Returns 1 when the
# id is counted (also when a retried call finds it already is), 0 when the key is at its limit.
_RESERVE_SCRIPT = """
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  return 1
end
local limit = tonumber(ARGV[3])
if limit and redis.call('ZCARD', KEYS[1]) >= limit then
  return 0
end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
return 1
"""


@dataclass(frozen=True)
class SessionQuota:
    """How many live sessions a key may hold; `limit` None counts them without a bound."""

    limit: int | None


class SessionQuotaExceeded(RuntimeError):
    """The key already holds its limit of live sessions; callers answer 429, and nothing was written."""

    def __init__(self, owner_key_id: str, limit: int | None) -> None:
        super().__init__(
            f"API key {owner_key_id} holds {limit} live sessions, its limit; delete one "
            "(DELETE /v1/sessions/{session_id}) or wait for one to expire"
        )
        self.owner_key_id = owner_key_id
        self.limit = limit


def session_quota(caller: Caller, default_limit: int | None) -> SessionQuota | None:
    """The quota a new session of `caller` counts against; None for a key holding every permission.

    The key's own `max_sessions` when it was created with one, else the cluster's
    `access.max_sessions_per_key` (None: counted, no limit).
    """
    if ALL_PERMISSIONS in caller.permissions:
        return None
    return SessionQuota(limit=caller.max_sessions if caller.max_sessions is not None else default_limit)


class OwnerSessions:
    """The per-key index of live sessions. Redis errors propagate; the session store maps them."""

    def __init__(
        self, client: aioredis.Redis, record_key: Callable[[str], str], *, ttl_ms: int, key_prefix: str = "warmpath"
    ) -> None:
        self._redis = client
        self._record_key = record_key  # a session's record key, whose PTTL is the session's
        self._ttl_ms = ttl_ms
        self._prefix = key_prefix
        self._reserve = client.register_script(_RESERVE_SCRIPT)

    def index_key(self, owner_key_id: str) -> str:
        return f"{self._prefix}:{{owner:{owner_key_id}}}:sessions"

    async def reserve(self, owner_key_id: str, quota: SessionQuota, session_id: str) -> None:
        """Counts `session_id` against the key's `quota` before its session is written.

        Safe to run twice (a retry after a lost reply finds the id counted). Raises
        SessionQuotaExceeded when the key is at its limit.
        """
        index = self.index_key(owner_key_id)
        now_ms = _now_ms()
        await self._prune(index, now_ms)
        limit = "" if quota.limit is None else quota.limit
        if not await self._reserve(keys=[index], args=[session_id, now_ms + self._ttl_ms, limit]):
            raise SessionQuotaExceeded(owner_key_id, quota.limit)

    async def release(self, owner_key_id: str, session_id: str) -> None:
        """Stops counting `session_id` (deleted, or never written)."""
        await self._redis.zrem(self.index_key(owner_key_id), session_id)

    async def _prune(self, index: str, now_ms: int) -> None:
        """Drops members whose sessions are gone; scores the others whose known expiry passed by their PTTL.

        Each round re-scores what it keeps into the future or removes it, so no
        member is looked at twice and the loop ends.
        """
        while True:
            due = await self._redis.zrangebyscore(index, "-inf", now_ms, start=0, num=PRUNE_BATCH)
            if not due:
                return
            async with self._redis.pipeline(transaction=False) as pipe:
                for session_id in due:
                    pipe.pttl(self._record_key(session_id))
                remaining_ms = await pipe.execute()
            gone = [s for s, ttl in zip(due, remaining_ms) if ttl == -2]
            # At least 1 ms ahead, so this call does not look at it again; -1 (no expiry) never happens to a
            # session record, and counts as a full TTL should it.
            alive = {
                s: now_ms + (max(ttl, 1) if ttl >= 0 else self._ttl_ms) for s, ttl in zip(due, remaining_ms) if ttl != -2
            }
            async with self._redis.pipeline(transaction=False) as pipe:
                if gone:
                    pipe.zrem(index, *gone)
                if alive:
                    pipe.zadd(index, alive, xx=True)
                await pipe.execute()
            if len(due) < PRUNE_BATCH:
                return


def _now_ms() -> int:
    return int(time.time() * 1000)
