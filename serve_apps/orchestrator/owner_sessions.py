"""Each API key's live sessions, counted so that no one key can fill the session store.

Why: a session holds its prompt and tool schemas for `session_ttl_s` (a day by
default), up to hundreds of KB each on a large window, and Redis runs under
`noeviction`. A key within its rate limit could otherwise create sessions until
Redis is full, after which every client's creations and turns answer 503. With a
limit, a key at its quota is refused (429 `session_quota_exceeded`) and everyone
else is untouched.

Layout: `warmpath:{owner:<key id>}:sessions`, a sorted set of the key's session
ids, each scored by the Unix time (ms, Redis' clock) its session was last known to expire. One
key's sessions live in as many hash slots as they have ids, so the index has a
slot of its own and is never read inside a session's scripts.

Settled lazily, with no work on the turn path but one expiry refresh: a
creation first takes a place scored a short grace ahead (`RESERVATION_GRACE_MS`),
since whether its record gets written is not known yet (a reply lost to a
timeout, a cancelled call). Before each creation, the members whose scores have
passed, and those scored further ahead than a session now lives (`session_ttl_s`
was lowered), are looked up by the `PTTL` of their records: those gone (expired,
deleted while the index was not told, never written) are removed, the others are
scored by their remaining time. So a place taken by a creation that failed is
free again within the grace, and a session written after all counts. A creation
Redis refused outright (full, read-only) gives its place back at once, and so
does a delete (the store deletes a session whose creation's outcome it could not
learn: the client never got its id). Counting and adding are one script, so two creations racing for
a key's last place cannot both have it.

The index expires `session_ttl_s` after its key's last creation or turn (`touch`),
the same events that move its sessions' expiries, so it outlives every session
it counts and goes away with the last of them.

What is not counted: sessions created before the index existed (until they
expire), and those of keys holding every permission ('*': the admin key, and
every call when API keys are off), which never enter it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import redis.asyncio as aioredis

from cluster.api_keys import ALL_PERMISSIONS
from serve_apps.access import Caller

# Members looked up per round trip while pruning.
PRUNE_BATCH = 512

# How long a new session's place is held before its record is looked up: longer than a creation's
# write can take to land, so one that lands late is still counted.
RESERVATION_GRACE_MS = 60_000

# Extends KEYS[1]'s expiry to ARGV[1] ms unless it already lasts longer (PEXPIRE GT leaves a key
# without expiry alone, and a new index has none).
_EXTEND_LUA = """
local function extend(key, ttl_ms)
  local left = redis.call('PTTL', key)
  if left ~= -2 and left < tonumber(ttl_ms) then
    redis.call('PEXPIRE', key, ttl_ms)
  end
end
"""

# KEYS[1]: the owner's index. ARGV: session id, its provisional score (ms), limit ('' for none), the
# index's TTL (ms). Returns 1 when the id is counted (also when a retried call finds it already is),
# 0 when the key is at its limit.
_RESERVE_SCRIPT = _EXTEND_LUA + """
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  return 1
end
local limit = tonumber(ARGV[3])
if limit and redis.call('ZCARD', KEYS[1]) >= limit then
  return 0
end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
extend(KEYS[1], ARGV[4])
return 1
"""

_TOUCH_SCRIPT = _EXTEND_LUA + """
extend(KEYS[1], ARGV[1])
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
            f"API key {owner_key_id} holds {limit} live session{'' if limit == 1 else 's'}, its limit; delete one "
            "(DELETE /v1/sessions/{session_id}, or Agent.DeleteSession over gRPC) or wait for one to expire"
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
        self._touch = client.register_script(_TOUCH_SCRIPT)

    def index_key(self, owner_key_id: str) -> str:
        return f"{self._prefix}:{{owner:{owner_key_id}}}:sessions"

    async def reserve(self, owner_key_id: str, quota: SessionQuota, session_id: str) -> None:
        """Counts `session_id` against the key's `quota` before its session is written.

        Safe to run twice (a retry after a lost reply finds the id counted). Raises
        SessionQuotaExceeded when the key is at its limit.
        """
        index = self.index_key(owner_key_id)
        now_ms = await self._now_ms()
        await self._prune(index, now_ms)
        limit = "" if quota.limit is None else quota.limit
        grace_ms = min(RESERVATION_GRACE_MS, self._ttl_ms)
        args = [session_id, now_ms + grace_ms, limit, self._ttl_ms]
        if not await self._reserve(keys=[index], args=args):
            raise SessionQuotaExceeded(owner_key_id, quota.limit)

    async def release(self, owner_key_id: str, session_id: str) -> None:
        """Stops counting `session_id` (deleted, or refused by Redis before it was written)."""
        await self._redis.zrem(self.index_key(owner_key_id), session_id)

    async def touch(self, owner_key_id: str) -> None:
        """Keeps the key's index for `session_ttl_s` from now, as a turn keeps its session."""
        await self._touch(keys=[self.index_key(owner_key_id)], args=[self._ttl_ms])

    async def _now_ms(self) -> int:
        """Redis' clock (ms): every replica scores the index by it, as Redis expires the records by it.

        Why not this host's: a replica whose clock ran a minute ahead of another's took that one's fresh
        reservation for overdue, found no record yet, dropped it and took the place: the key went over
        its limit, the late record uncounted for its whole TTL.
        """
        seconds, microseconds = await self._redis.time()
        return int(seconds) * 1000 + int(microseconds) // 1000

    async def _prune(self, index: str, now_ms: int) -> None:
        """Looks up the members due a look (`_due`) by their records' PTTL: drops the gone, re-scores the rest."""
        while True:
            due = await self._due(index, now_ms)
            if not due:
                return
            async with self._redis.pipeline(transaction=False) as pipe:
                for session_id in due:
                    pipe.pttl(self._record_key(session_id))
                remaining_ms = await pipe.execute()
            gone = [s for s, ttl in zip(due, remaining_ms) if ttl == -2]
            # Within (now, now + TTL], so this call does not look at it again; -1 (no expiry) never happens
            # to a session record, and counts as a full TTL should it.
            alive = {
                s: now_ms + (min(max(ttl, 1), self._ttl_ms) if ttl >= 0 else self._ttl_ms)
                for s, ttl in zip(due, remaining_ms) if ttl != -2
            }
            async with self._redis.pipeline(transaction=False) as pipe:
                if gone:
                    pipe.zrem(index, *gone)
                if alive:
                    pipe.zadd(index, alive, xx=True)
                await pipe.execute()
            if len(due) < PRUNE_BATCH:
                return

    async def _due(self, index: str, now_ms: int) -> list[str]:
        """Up to PRUNE_BATCH members whose recorded expiry passed, or lies further ahead than a session lives.

        The second kind were scored under a longer `session_ttl_s` (lowered since), so their
        sessions may already be gone.
        """
        passed = await self._redis.zrangebyscore(index, "-inf", now_ms, start=0, num=PRUNE_BATCH)
        if len(passed) == PRUNE_BATCH:
            return passed
        beyond = await self._redis.zrangebyscore(
            index, f"({now_ms + self._ttl_ms}", "+inf", start=0, num=PRUNE_BATCH - len(passed)
        )
        return passed + beyond
