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
- All keys of a session expire together, `ttl_s` after its creation, its last
  commit, or the last time a turn took or renewed its lock: a running turn
  keeps its session alive however long it takes.
- A turn lock is released only by the holder whose random token it still stores
  (compare-and-delete), so a holder whose lock expired cannot free another's; nor
  can it commit, or renew its lock, once another turn has taken the lock, even
  one that ran and released it since (the session records the last taker).
- A session whose log was lost while its record stayed (an evicting Redis, a key
  deleted by hand) is `SessionDamaged` to every read, never a session with no
  messages: a committed session always has at least one (`_LOG_LOST_LUA`).
- A commit whose reply was lost is settled before the turn reports: saved if
  Redis ran it, else voided so that it cannot land later (`_SETTLE_SCRIPT`),
  and then sent once more, under a new attempt of its id, on the connection
  the settling found working (a Redis restart during the turn loses no turn).
- A session created while the reply to its write was lost is deleted (its id
  never reached the client), so it holds no place of its key's quota.
- Redis being unreachable, or refusing for a state of its own (out of memory,
  read-only replica, failed snapshot save, no such database), surfaces as
  `StoreUnavailable` naming that state, never as a redis-py exception, so the
  HTTP layer maps it to 503 in one place.
- A Redis full under `noeviction` refuses writes and anything queued in MULTI,
  so what a client needs to recover works without either: `get`, `view` and
  `transcript` (`no-writes` scripts), `step_stats`, `lookup_turn_result` and `delete` (an
  `allow-oom` script that only DELs, freeing memory). A turn's replay is read
  under its turn lock, which is a write: a full Redis refuses it with the turn.
  Script flags need Redis 7.
- Idempotent reads, lock calls and deletes retry once on a dead pooled
  connection (`retry_on_dead_connection`), so the first call after a Redis
  restart succeeds; a commit is retried only once settled as never run (a
  ConnectionError does not say whether it ran, and a second run would report
  a saved turn as stale).
- An idempotency key's record (`RememberedTurn`) holds the fingerprint of the
  request that ran under it and every event the turn produced (runs of text
  deltas joined, as the HTTP API's unstreamed body shows them), so a retry of
  the same request replays exactly that, and another request under the same
  key is recognised and refused instead of silently answered with the first.
  A session keeps the records of its last `max_idempotency_records` (64) keyed
  turns, and of those only the newest that fit `max_idempotency_bytes` (512 KiB)
  together, the last stored always kept: the commit that stores a record evicts
  the oldest beyond either bound, in the same script. A retry under an evicted
  key runs as a new turn. (Each record holds every tool result of its turn: by
  count alone, a session of tool-heavy turns kept megabytes of them.)
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import TypeVar

import redis.asyncio as aioredis
from pydantic import BaseModel, Field, JsonValue
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from cluster.redis_errors import redis_refusal, retry_on_dead_connection
from cluster.redis_pool import is_pool_exhausted, pooled_client
from serve_apps.orchestrator.models import (
    STORED, CreateSessionRequest, Message, PrefixFingerprint, SessionId, StepStats, StrictModel,
)
from serve_apps.orchestrator.owner_sessions import OwnerSessions, SessionQuota, SessionQuotaExceeded

logger = logging.getLogger(__name__)
T = TypeVar("T")

# What the HTTP ingress accepts in `Idempotency-Key`; the orchestrator checks it again for every ingress.
MAX_IDEMPOTENCY_KEY_CHARS = 256
# Where the commit id goes in `_COMMIT_SCRIPT`'s ARGV (0-based).
_COMMIT_ID_ARG = 11
# How soon a renewal that failed (Redis slow or away) is tried again, within the lock's lease.
LOCK_RENEW_RETRY_S = 1.0
# Idempotency records a session keeps (its most recent keyed turns); each holds every event of its turn.
MAX_IDEMPOTENCY_RECORDS = 64
# Bytes those records may take together; the newest is kept whatever its size.
MAX_IDEMPOTENCY_BYTES = 512 * 1024
# The parts of a session's key, in the order the scripts take them as KEYS[1..5].
_SESSION_PARTS = ("meta", "log", "stats", "idem", "idem-order")

# remember(hash, order, key, value, max_records, max_bytes): HSETNX, and the key joins the insertion order;
# the oldest records are dropped while more than `max_records` are kept or they take more than `max_bytes`
# (the one just stored stays). Returns 1 if stored, 0 if the key already had one (the first wins).
_REMEMBER_LUA = """
local function remember(hash, order, key, value, max_records, max_bytes)
  if redis.call('HSETNX', hash, key, value) == 0 then
    return 0
  end
  redis.call('RPUSH', order, key)
  for _ = 1, redis.call('LLEN', order) - max_records do
    redis.call('HDEL', hash, redis.call('LPOP', order))
  end
  local keys = redis.call('LRANGE', order, 0, -1)
  local total = 0
  for i = 1, #keys do
    total = total + redis.call('HSTRLEN', hash, keys[i])
  end
  local at = 1
  while total > max_bytes and at < #keys do
    total = total - redis.call('HSTRLEN', hash, keys[at])
    redis.call('HDEL', hash, redis.call('LPOP', order))
    at = at + 1
  end
  return 1
end
"""

# KEYS: meta, log, stats, idem, idem-order, lock. ARGV: expected_len, num_replaced, summary, ttl_ms,
# num_messages, num_stats, idem_key, result_json, max_step_stats, max_idempotency_records, lock token ('' for
# none), commit id, max_idempotency_bytes (FIXED of them), then the messages, the stats, and the stats' prompt
# tokens, cached tokens and compressions, added to the session's running totals. A turn whose lock another turn
# holds now, or took since (its own lock expired: the other turn ran on the same transcript), is refused, and so is a commit
# `_SETTLE_SCRIPT` voided. A commit id is `<turn>.<attempt>`: voiding an attempt voids its turn's earlier ones
# too, so an attempt still on its way cannot land after a later one was voided and the turn reported unsaved.
# Flagged (no flags: not `allow-oom`) so that a full Redis refuses the whole script up front: unflagged, Redis
# refuses only at the first write that may grow memory, and a compaction's is LTRIM.
_COMMIT_SCRIPT = "#!lua\n" + _REMEMBER_LUA + """
local FIXED = 13
if redis.call('EXISTS', KEYS[1]) == 0 then
  return redis.error_reply('WARMPATH_NOT_FOUND')
end
local voided = redis.call('HGET', KEYS[1], 'voided_commit')
if voided then
  local turn, attempt = string.match(ARGV[12], '^(%x+)%.(%d+)$')
  local voided_turn, voided_attempt = string.match(voided, '^(%x+)%.(%d+)$')
  if voided == ARGV[12] or (turn and turn == voided_turn and tonumber(attempt) <= tonumber(voided_attempt)) then
    return redis.error_reply('WARMPATH_VOIDED')
  end
end
local holder = redis.call('GET', KEYS[6]) or redis.call('HGET', KEYS[1], 'lock_taker')
if ARGV[11] ~= '' and holder and holder ~= ARGV[11] then
  return redis.error_reply('WARMPATH_LOCK_TAKEN')
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
  redis.call('RPUSH', KEYS[2], ARGV[FIXED + i])
end
for i = 1, num_stats do
  redis.call('RPUSH', KEYS[3], ARGV[FIXED + num_messages + i])
end
redis.call('LTRIM', KEYS[3], -tonumber(ARGV[9]), -1)
if redis.call('HEXISTS', KEYS[1], 'steps_total') == 1 then  -- a session created with running totals
  local totals = FIXED + num_messages + num_stats
  redis.call('HINCRBY', KEYS[1], 'steps_total', num_stats)
  redis.call('HINCRBY', KEYS[1], 'prompt_tokens_total', ARGV[totals + 1])
  redis.call('HINCRBY', KEYS[1], 'cached_tokens_total', ARGV[totals + 2])
  redis.call('HINCRBY', KEYS[1], 'compressions_total', ARGV[totals + 3])
end
if ARGV[7] ~= '' then
  remember(KEYS[4], KEYS[5], ARGV[7], ARGV[8], tonumber(ARGV[10]), tonumber(ARGV[13]))
end
redis.call('HSET', KEYS[1], 'last_commit', ARGV[12])
for i = 1, 5 do
  redis.call('PEXPIRE', KEYS[i], ARGV[4])
end
return length + num_messages
"""

# KEYS: meta. ARGV: a commit id whose reply was lost. 1: that commit ran; 0: it did not, and never will (the
# commit script refuses a voided id); -1: the session is gone. Atomic against the commit itself, so a commit
# still on its way when this runs is voided, not left to land after the turn was reported failed.
_SETTLE_SCRIPT = """#!lua flags=allow-oom
if redis.call('EXISTS', KEYS[1]) == 0 then
  return -1
end
if redis.call('HGET', KEYS[1], 'last_commit') == ARGV[1] then
  return 1
end
redis.call('HSET', KEYS[1], 'voided_commit', ARGV[1])
return 0
"""

# A session that committed a turn has at least one message in its log (a compaction leaves its summary), so
# an empty log beside a commit's mark means the log key was lost (evicted by a Redis made to evict after the
# session started, deleted by hand) while the record stayed. KEYS[1]: meta, KEYS[2]: log.
_LOG_LOST_LUA = """
if redis.call('LLEN', KEYS[2]) == 0 and redis.call('HEXISTS', KEYS[1], 'last_commit') == 1 then
  return redis.error_reply('WARMPATH_LOG_LOST')
end
"""

# The whole session as GET shows it, read at one instant: read one by one, a commit landing between the
# reads showed a transcript without its steps, or totals ahead of both. False if the session does not
# exist; totals fields are nil for a session created before they were kept. KEYS: meta, log, stats.
# ARGV: the totals' field names (`_TOTALS`).
_VIEW_SCRIPT = """#!lua flags=no-writes
local meta = redis.call('HMGET', KEYS[1], 'record', 'removed', unpack(ARGV))
if not meta[1] or not meta[2] then
  return false
end
""" + _LOG_LOST_LUA + """
return {meta, redis.call('LRANGE', KEYS[2], 0, -1), redis.call('LRANGE', KEYS[3], 0, -1)}
"""

# Read-only, so a Redis full under noeviction still runs it (MULTI would be refused): the record's
# `removed` offset and the log in one atomic read. Nil when the session does not exist.
_TRANSCRIPT_SCRIPT = """#!lua flags=no-writes
local removed = redis.call('HGET', KEYS[1], 'removed')
if not removed then
  return false
end
""" + _LOG_LOST_LUA + """
return {removed, redis.call('LRANGE', KEYS[2], 0, -1)}
"""

# Only DELs, which free memory, so `allow-oom` lets a full Redis run it: deleting a session is how a
# client makes room. KEYS[1] is the record; returns 1 if it existed.
_DELETE_SCRIPT = """#!lua flags=allow-oom
local existed = redis.call('DEL', KEYS[1])
redis.call('DEL', unpack(KEYS, 2))
return existed
"""

# Takes the turn lock (KEYS[6]) for token ARGV[1] and refreshes the session's TTL, so a turn starts with
# its full `ttl_s` left. Returns -1 if the session does not exist, 0 if another token holds the lock, else
# 1; taking it again with the same token succeeds (a retried call whose first try got through). A take
# records its token as the session's `lock_taker` (in meta), which outlives the lock.
# With ARGV[4] '1' it renews a held lock: one that expired (Redis away, or the holder stalled, past its
# lease) is taken again only while its token is still the last taker, i.e. no other turn took the lock
# since, even one that ran and released it in between; 0 means another turn took it, -1 that the session
# was deleted mid-turn. KEYS: meta, log, stats, idem, idem-order, lock. ARGV: token, lock_ttl_ms,
# session_ttl_ms, '1' for a renewal ('0' for a take).
_ACQUIRE_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  return -1
end
local holder = redis.call('GET', KEYS[6])
if holder and holder ~= ARGV[1] then
  return 0
end
if not holder then
  if ARGV[4] == '1' then
    if redis.call('HGET', KEYS[1], 'lock_taker') ~= ARGV[1] then
      return 0
    end
  else
    redis.call('HSET', KEYS[1], 'lock_taker', ARGV[1])
  end
end
redis.call('SET', KEYS[6], ARGV[1], 'PX', ARGV[2])
for i = 1, 5 do
  redis.call('PEXPIRE', KEYS[i], ARGV[3])
end
return 1
"""

# Frees the turn lock (KEYS[1]) if token ARGV[1] holds it, and ends the token's claim as the session's last
# taker (KEYS[2], meta; '' is no turn's token): a renewal of the ended turn that Redis runs after this (sent
# before it) must not take the free lock back as its own, and a stalled turn's commit is still refused
# (`_COMMIT_SCRIPT` reads the last taker). Returns 1 if the lock was freed. KEYS: lock, meta. `allow-oom`: a
# full Redis must still free a turn's lock (its HSET writes an empty string over a token), or the client's
# retry, once it has made room, is refused busy for the lease.
_RELEASE_SCRIPT = """#!lua flags=allow-oom
if redis.call('HGET', KEYS[2], 'lock_taker') == ARGV[1] then
  redis.call('HSET', KEYS[2], 'lock_taker', '')
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class StoreUnavailable(RuntimeError):
    """Redis cannot be reached, or refuses for a state of its own (full, read-only, ...); callers answer 503."""


class CommitOutcomeUnknown(StoreUnavailable):
    """Redis went away while a turn committed, before whether the commit ran could be learnt: the turn may
    or may not be saved (answered as `turn_interrupted`: only a retry under the same Idempotency-Key is safe)."""


class SessionDamaged(StoreUnavailable):
    """The session's record is in Redis but its messages are not: answered as the store's failure, never as a
    session without history (its next turn ran on none)."""


class SessionNotFound(LookupError):
    """No such session, or it expired; callers answer 404."""


class SessionBusy(RuntimeError):
    """Another turn holds the session's lock; callers answer 409."""


class TurnLockTaken(RuntimeError):
    """The turn's lock expired (its holder stalled or Redis lost it) and another turn took it; nothing was
    written: the other turn ran or runs on the same transcript, and of the two only it may commit."""


class StaleTurn(RuntimeError):
    """The transcript moved since the turn read it; nothing was written."""

    def __init__(self, session_id: str, expected_len: int, actual_len: int) -> None:
        super().__init__(f"session {session_id}: expected transcript length {expected_len}, found {actual_len}")
        self.expected_len = expected_len
        self.actual_len = actual_len


class SessionRecord(StrictModel):
    """What is stored about a session besides its transcript."""

    session_id: SessionId = Field(description="Opaque id (secrets.token_urlsafe(24)).")
    owner_key_id: str = Field(description="Id of the API key that created the session.", min_length=1)
    request: CreateSessionRequest = Field(description="The validated creation request.")
    prefix_fingerprint: PrefixFingerprint = Field(description="Fingerprint of the cacheable prefix.")
    created_at_s: float = Field(description="Unix time of creation.")


class RememberedTurn(StrictModel):
    """What an idempotency key remembers of the turn that committed under it."""

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
        return cls.model_validate(value, context=STORED)


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


# The session record's running totals (`StepTotals`), in its field order.
_TOTALS = ("steps_total", "prompt_tokens_total", "cached_tokens_total", "compressions_total")


@dataclass(frozen=True)
class StepTotals:
    """Every step's figures summed, kept by each commit: the stored stats keep only the last `max_step_stats`."""

    num_steps: int
    prompt_tokens: int
    cached_tokens: int
    num_compressions: int

    @classmethod
    def of(cls, stats: Sequence[StepStats]) -> "StepTotals":
        return cls(
            len(stats), sum(s.prompt_tokens for s in stats), sum(s.cached_tokens for s in stats),
            sum(1 for s in stats if s.compression is not None),
        )


@dataclass(frozen=True)
class TranscriptSnapshot:
    """The transcript as one turn read it; pass `length` back as `commit_turn(expected_len=...)`."""

    messages: tuple[Message, ...]
    length: int


@dataclass(frozen=True)
class SessionView:
    """A session as one read saw it (`SessionStore.view`): record, transcript, kept steps and running totals."""

    record: SessionRecord
    transcript: TranscriptSnapshot
    steps: list[StepStats]
    totals: StepTotals  # summed from the kept steps for a session created before totals were kept


@dataclass(frozen=True)
class Compaction:
    """Replace the first `num_messages_replaced` stored messages by `summary` (from compression).

    `num_compressions`: the compressions of the turn it stands for (a turn over the window may compress
    again); the session's totals count them.
    """

    num_messages_replaced: int
    summary: Message
    num_compressions: int = 1


def _snapshot(removed: bytes | str, items: Sequence[bytes | str]) -> TranscriptSnapshot:
    """The transcript the stored log holds, its length counting the `removed` messages compaction dropped."""
    messages = tuple(Message.model_validate_json(item, context=STORED) for item in items)
    return TranscriptSnapshot(messages=messages, length=int(removed) + len(messages))


@contextmanager
def _redis_errors(session_id: str = "") -> Iterator[None]:
    """Maps redis-py's errors to the store's: outages and Redis' own refusals to StoreUnavailable (503).

    Any other ResponseError (a script's own error, a bug) is left to the caller.
    """
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError, OSError) as err:
        # Callers see what failed, not where Redis lives (its address is in redis-py's text): that goes to the log.
        logger.warning("session store unreachable: %s", err)
        if is_pool_exhausted(err):
            raise StoreUnavailable("every connection to the session store is busy; retry shortly") from err
        failure = "timed out" if isinstance(err, (RedisTimeoutError, TimeoutError)) else "no connection"
        raise StoreUnavailable(f"session store unreachable ({failure})") from err
    except ResponseError as err:
        if str(err).startswith("WARMPATH_NOT_FOUND"):
            raise SessionNotFound(session_id) from None
        if str(err).startswith("WARMPATH_LOG_LOST"):
            raise SessionDamaged(
                f"session {session_id}: its messages are missing from Redis, which kept its record (a Redis that "
                "evicts keys, or keys deleted outside warmpath): its history is lost; delete the session and "
                "start a new one"
            ) from None
        refusal = redis_refusal(err)
        if refusal is not None:
            raise StoreUnavailable(refusal) from None
        raise


# How often a turn lock that could not be released (Redis away) is tried again, while it would still hold.
RELEASE_RETRY_S = 0.5


class SessionStore:
    """Sessions in Redis. All keys of a session expire together `ttl_s` after its creation, last commit or last turn."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        ttl_s: float = 24 * 3600,
        lock_ttl_s: float = 15.0,
        max_step_stats: int = 1024,
        max_idempotency_records: int = MAX_IDEMPOTENCY_RECORDS,
        max_idempotency_bytes: int = MAX_IDEMPOTENCY_BYTES,
        key_prefix: str = "warmpath",
    ) -> None:
        if ttl_s <= 0 or lock_ttl_s <= 0 or max_step_stats < 1 or max_idempotency_records < 1:
            raise ValueError(
                "ttl_s and lock_ttl_s must be positive, max_step_stats and max_idempotency_records at least 1"
            )
        self._redis = client
        self._ttl_ms = int(ttl_s * 1000)
        self._lock_ttl_ms = int(lock_ttl_s * 1000)
        self._max_step_stats = max_step_stats
        self._max_idempotency_records = max_idempotency_records
        self._max_idempotency_bytes = max_idempotency_bytes
        self._prefix = key_prefix
        self._commit = client.register_script(_COMMIT_SCRIPT)
        self._read_transcript = client.register_script(_TRANSCRIPT_SCRIPT)
        self._read_view = client.register_script(_VIEW_SCRIPT)
        self._delete = client.register_script(_DELETE_SCRIPT)
        self._acquire = client.register_script(_ACQUIRE_SCRIPT)
        self._release = client.register_script(_RELEASE_SCRIPT)
        self._settle = client.register_script(_SETTLE_SCRIPT)
        self._owners = OwnerSessions(
            client, lambda session_id: self._key(session_id, "meta"), ttl_ms=self._ttl_ms, key_prefix=key_prefix
        )
        self._lost_locks: set[str] = set()  # tokens of turn locks held here that a renewal found taken
        self._pending_releases: set[asyncio.Task] = set()  # `_release_when_back`'s, held until they end

    @classmethod
    def from_url(cls, url: str, **kwargs: float | int | str) -> "SessionStore":
        """A store over a new client with bounded connect and command timeouts."""
        return cls(pooled_client(url, reply_timeout_s=5.0, connect_timeout_s=2.0), **kwargs)

    async def aclose(self) -> None:
        for task in list(self._pending_releases):
            task.cancel()
        await self._redis.aclose()

    def _key(self, session_id: str, part: str) -> str:
        return f"{self._prefix}:{{{session_id}}}:{part}"

    def _keys(self, session_id: str) -> list[str]:
        """The session's data keys, as the scripts take them (KEYS[1..5]); the lock is apart."""
        return [self._key(session_id, part) for part in _SESSION_PARTS]

    async def _idempotent(self, call: Callable[[], Awaitable[T]]) -> T:
        """`call()`, retried once on a dead pooled connection; only for calls that may safely run twice."""
        return await retry_on_dead_connection(self._redis, call)

    def _lock_args(self, session_id: str, token: str, is_renewal: bool = False) -> dict[str, list]:
        """KEYS and ARGV of the acquire script, taking the lock or renewing it (`_ACQUIRE_SCRIPT`)."""
        return {
            "keys": [*self._keys(session_id), self._key(session_id, "lock")],
            "args": [token, self._lock_ttl_ms, self._ttl_ms, "1" if is_renewal else "0"],
        }

    async def create(
        self,
        request: CreateSessionRequest,
        owner_key_id: str,
        prefix_fingerprint: PrefixFingerprint,
        quota: SessionQuota | None = None,
    ) -> SessionRecord:
        """Stores a new session with an empty transcript.

        With a `quota` the session counts among its key's live sessions (`owner_sessions`),
        and SessionQuotaExceeded is raised, nothing written, when the key is at its limit.
        """
        record = SessionRecord(
            session_id=SessionId(secrets.token_urlsafe(24)),
            owner_key_id=owner_key_id,
            request=request,
            prefix_fingerprint=prefix_fingerprint,
            created_at_s=time.time(),
        )
        meta = self._key(record.session_id, "meta")

        async def write() -> None:  # the same record twice is the same write: safe to retry
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hset(meta, mapping={"record": record.model_dump_json(), "removed": 0, **dict.fromkeys(_TOTALS, 0)})
                pipe.pexpire(meta, self._ttl_ms)
                await pipe.execute()

        may_have_landed = False  # the record
        try:
            if quota is not None:
                with _redis_errors(record.session_id):
                    await self._idempotent(lambda: self._owners.reserve(owner_key_id, quota, record.session_id))
            with _redis_errors(record.session_id):
                try:
                    may_have_landed = True
                    await self._idempotent(write)
                except ResponseError:
                    may_have_landed = False  # Redis refused the transaction (full, read-only): nothing was written
                    raise
        except SessionQuotaExceeded:
            raise  # no place taken, nothing written
        except BaseException:
            # Nothing written (a refusal; a reservation whose reply was lost, or whose caller left, may have
            # taken a place): the place is given back. After a lost reply or a cancellation of the write the
            # record may have landed, but its id never reached the client: deleted, uncounted. Should that fail
            # too, the place is held for its grace, then settled by the record's PTTL.
            if may_have_landed:
                await asyncio.shield(self._discard(record.session_id, owner_key_id if quota is not None else None))
            elif quota is not None:
                await asyncio.shield(self._uncount(owner_key_id, record.session_id))
            raise
        return record

    async def _discard(self, session_id: str, owner_key_id: str | None) -> None:
        """Deletes a session whose creation failed after its write may have landed; an outage only logs."""
        try:
            await self.delete(session_id, owner_key_id)
        except StoreUnavailable as err:
            logger.warning("could not remove session %s, whose creation failed: %s", session_id, err)

    async def get(self, session_id: str) -> SessionRecord:
        """The session's record; raises SessionNotFound."""
        return SessionRecord.model_validate_json(await self._record_json(session_id), context=STORED)

    async def owner_of(self, session_id: str) -> str:
        """The id of the key that created the session, read alone from its record; raises SessionNotFound.

        Why not `get`: deleting a session must not depend on the rest of its record reading back under
        this release's checks (a record an older release wrote, a later check refuses).
        """
        owner = json.loads(await self._record_json(session_id)).get("owner_key_id")
        if not isinstance(owner, str) or not owner:
            raise ValueError(f"session {session_id}'s record names no owner")
        return owner

    async def _record_json(self, session_id: str) -> str | bytes:
        """The session's record as stored (JSON); raises SessionNotFound."""
        with _redis_errors(session_id):
            raw = await self._idempotent(lambda: self._redis.hget(self._key(session_id, "meta"), "record"))
        if raw is None:
            raise SessionNotFound(session_id)
        return raw

    async def delete(self, session_id: str, owner_key_id: str | None = None) -> bool:
        """Deletes every key of the session at once, also on a full Redis; True if it existed.

        A try retried after a dead connection counts as having deleted it: the first try may have
        run with its reply lost, leaving the retry nothing to delete. With `owner_key_id`, the
        session stops counting among that key's live sessions.
        """
        keys = [*self._keys(session_id), self._key(session_id, "lock")]
        num_tries = 0

        async def delete_keys() -> int:
            nonlocal num_tries
            num_tries += 1
            return await self._delete(keys=keys)

        with _redis_errors(session_id):
            existed = bool(await self._idempotent(delete_keys)) or num_tries > 1
        if owner_key_id is not None:
            await self._uncount(owner_key_id, session_id)
        return existed

    async def _uncount(self, owner_key_id: str, session_id: str) -> None:
        """Drops the session from its key's count; an outage only logs (the key's creations drop it once its
        recorded expiry passes and its record is found gone: `owner_sessions`)."""
        try:
            with _redis_errors(session_id):
                await self._idempotent(lambda: self._owners.release(owner_key_id, session_id))
        except StoreUnavailable as err:
            logger.warning("could not uncount session %s of key %s: %s", session_id, owner_key_id, err)

    async def transcript(self, session_id: str) -> TranscriptSnapshot:
        """The stored transcript and its logical length, read atomically (also on a full Redis)."""
        keys = [self._key(session_id, "meta"), self._key(session_id, "log")]
        with _redis_errors(session_id):
            reply = await self._idempotent(lambda: self._read_transcript(keys=keys))
        if reply is None:
            raise SessionNotFound(session_id)
        removed, items = reply
        return _snapshot(removed, items)

    async def view(self, session_id: str) -> SessionView:
        """Record, transcript, steps and totals in one read (also on a full Redis); raises SessionNotFound."""
        keys = [self._key(session_id, part) for part in ("meta", "log", "stats")]
        with _redis_errors(session_id):
            reply = await self._idempotent(lambda: self._read_view(keys=keys, args=_TOTALS))
        if reply is None:
            raise SessionNotFound(session_id)
        (record, removed, *totals), items, stat_items = reply
        steps = [StepStats.model_validate_json(item, context=STORED) for item in stat_items]
        return SessionView(
            record=SessionRecord.model_validate_json(record, context=STORED),
            transcript=_snapshot(removed, items),
            steps=steps,
            totals=StepTotals.of(steps) if None in totals else StepTotals(*(int(value) for value in totals)),
        )

    @asynccontextmanager
    async def turn_lock(self, session_id: str, owner_key_id: str | None = None) -> AsyncIterator[str]:
        """Holds the session's turn lock for the block, giving its token; raises SessionBusy if another turn holds it.

        Raises SessionNotFound if the session does not exist. Taking the lock
        and each renewal also refresh the TTL of every key of the session, so
        the session cannot expire under a running turn. With `owner_key_id`, its
        key's count of live sessions is kept as long (`OwnerSessions.touch`), then
        and when the block ends.

        While the block runs, the lock is renewed every third of `lock_ttl_s`
        (or of `ttl_s`, if shorter), so a live turn keeps it however long it
        takes, and a dead holder (a killed orchestrator replica) frees it within
        `lock_ttl_s`: a retried turn can start soon after. A turn that loses the
        lock anyway (its process stalled, Redis restarted without it) cannot commit
        over another: `commit_turn` takes the token and checks it and the length.
        """
        lock_args = self._lock_args(session_id, secrets.token_hex(16))
        try:
            with _redis_errors(session_id):
                outcome = await self._idempotent(lambda: self._acquire(**lock_args))
        except BaseException:
            # Redis may have taken the lock and only its reply be lost (a timeout), or the turn cancelled
            # while the script ran (its client hung up): freed with this holder's token, or the session
            # would refuse turns as busy until the lock expires. Shielded: a cancellation must not stop it.
            await asyncio.shield(self._release_lock(session_id, lock_args))
            raise
        if outcome == -1:
            raise SessionNotFound(session_id)
        if outcome == 0:
            raise SessionBusy(f"session {session_id} is running another turn")
        renewer = None
        try:  # from here on the lock is released however the block ends, a cancellation included
            await self._touch_owner(owner_key_id)
            renewer = asyncio.ensure_future(self._keep_lock(session_id, lock_args, owner_key_id))
            yield lock_args["args"][0]
        finally:
            if renewer is not None:
                renewer.cancel()
            self._lost_locks.discard(lock_args["args"][0])
            # Shielded: a turn cancelled as it ends (its client left at its last event) still frees the lock,
            # else the session refused the next turn as busy until the lock expired.
            await asyncio.shield(self._release_lock(session_id, lock_args))
            await self._touch_owner(owner_key_id)

    def lock_lost(self, token: str) -> bool:
        """Whether a renewal found another turn holding the turn lock `token` names (`turn_lock`).

        Why ask: such a turn cannot commit, and another turn may be running the session meanwhile; a turn
        that asks before each step and each server-side tool stops there instead of running tools twice.
        """
        return token in self._lost_locks

    async def _touch_owner(self, owner_key_id: str | None) -> None:
        """Keeps the key's session count as long as its sessions (`OwnerSessions.touch`); an outage only logs."""
        if owner_key_id is None:
            return
        try:
            with _redis_errors():
                await self._idempotent(lambda: self._owners.touch(owner_key_id))
        except StoreUnavailable as err:
            logger.warning("could not refresh the session count of key %s: %s", owner_key_id, err)

    async def _release_lock(self, session_id: str, lock_args: dict[str, list]) -> None:
        """Frees the lock if this holder still has it; an outage only logs, and the release is tried again as
        Redis comes back (`_release_when_back`)."""
        try:
            await self._try_release(session_id, lock_args)
        except StoreUnavailable as err:
            # Raising here would hide the turn's own outcome.
            logger.warning("could not release turn lock of %s: %s; trying again while it would hold", session_id, err)
            self._release_when_back(session_id, lock_args)

    async def _try_release(self, session_id: str, lock_args: dict[str, list]) -> None:
        lock_key, token = lock_args["keys"][-1], lock_args["args"][0]
        with _redis_errors(session_id):
            keys = [lock_key, self._key(session_id, "meta")]
            await self._idempotent(lambda: self._release(keys=keys, args=[token]))

    def _release_when_back(self, session_id: str, lock_args: dict[str, list]) -> None:
        """Tries the release again every `RELEASE_RETRY_S` until it lands or the lock would have expired anyway.

        Why: a turn cut off by a Redis crash left its lock in Redis's AOF, and once Redis was back the session
        answered every turn, the client's retry of that one included, `409 session_busy` until the lock expired.
        The release frees the lock only where this holder still has it, so trying again is safe.
        """
        async def retry() -> None:
            deadline = time.monotonic() + self._lock_ttl_ms / 1000
            while time.monotonic() < deadline:
                await asyncio.sleep(RELEASE_RETRY_S)
                try:
                    await self._try_release(session_id, lock_args)
                    return
                except StoreUnavailable:
                    continue

        task = asyncio.ensure_future(retry())
        self._pending_releases.add(task)
        task.add_done_callback(self._pending_releases.discard)

    async def _keep_lock(self, session_id: str, lock_args: dict[str, list], owner_key_id: str | None) -> None:
        """Renews the lock and the session's TTL (and its key's count's) until cancelled, or the lock is lost."""
        interval_s = min(self._lock_ttl_ms, self._ttl_ms) / 3000
        delay_s = interval_s
        renew_args = self._lock_args(session_id, lock_args["args"][0], is_renewal=True)
        while True:
            await asyncio.sleep(delay_s)
            try:
                renewed = await self._idempotent(lambda: self._acquire(**renew_args))
                if renewed == 0:
                    # Another turn took it after it expired (Redis away, or this process stalled, past the
                    # lease), and may have released it since: this turn stops at its next step or tool
                    # (`lock_lost`); its commit is refused.
                    self._lost_locks.add(lock_args["args"][0])
                    return
                if renewed == -1:
                    return  # the session was deleted: the turn's commit reports it
            except Exception as err:  # Redis away: keep trying, the turn's own calls report the outage
                logger.warning("could not renew turn lock of %s: %s", session_id, err)
                delay_s = min(interval_s, LOCK_RENEW_RETRY_S)  # a failed renewal used up part of the lease
                continue
            delay_s = interval_s
            await self._touch_owner(owner_key_id)

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
        lock_token: str | None = None,
    ) -> int:
        """Appends one turn atomically, if the transcript is still at `expected_len`.

        When Redis' reply is lost (a timeout, a dropped connection), the commit is settled
        on a fresh connection (`_SETTLE_SCRIPT`): reported saved if it ran, else voided so
        that it never lands later, and sent once more (the second attempt's lost reply is
        settled the same way, and the turn then reported not saved).

        Args:
            session_id: the session.
            expected_len: `TranscriptSnapshot.length` the turn started from.
            new_messages: the turn's messages, at least one.
            stats: per-step cache stats of the turn.
            compaction: a compression done during the turn, applied before the append.
            idem_key: with `result_json`, remembered as the turn's result in the same write (the
                oldest records beyond the session's `max_idempotency_records`, or past
                `max_idempotency_bytes` together, are dropped).
            result_json: the turn's result as returned to the client.
            lock_token: the turn lock the turn holds (`turn_lock`'s), so that a turn whose lock another
                turn took after it expired cannot commit.

        Returns:
            The new logical length.

        Raises:
            StaleTurn: the transcript changed since `expected_len`; nothing was written.
            TurnLockTaken: another turn holds the session's lock now; nothing was written.
            SessionNotFound: the session is gone.
            StoreUnavailable: Redis refused or could not be reached; nothing was written, or (said in
                its message) whether it was is unknown, Redis having gone before it could be settled.
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
            idem_key or "", result_json or "", self._max_step_stats, self._max_idempotency_records,
            lock_token or "", "", self._max_idempotency_bytes,  # the commit id is set per attempt
        ]
        args.extend(m.model_dump_json(exclude_none=True) for m in new_messages)
        args.extend(s.model_dump_json() for s in stats)
        added = StepTotals.of(stats)
        # A compaction counts though no step reports it (a resume with no steps left that had to compress, a
        # second compression at a pause after its step's report).
        num_compressions = max(added.num_compressions, compaction.num_compressions if compaction is not None else 0)
        args.extend([added.prompt_tokens, added.cached_tokens, num_compressions])
        keys = [*self._keys(session_id), self._key(session_id, "lock")]
        # A commit whose reply was lost and that Redis says never ran (voided) is sent once more, on the
        # connection the settling found working, under a new id: a Redis restart during the turn would
        # otherwise lose the whole turn's work, though nothing of it was written.
        turn_id = secrets.token_hex(12)
        for attempt in (1, 2):
            commit_id = f"{turn_id}.{attempt}"
            args[_COMMIT_ID_ARG] = commit_id
            lost = await self._commit_or_lost(session_id, keys, args, expected_len, num_replaced)
            if isinstance(lost, int):
                return lost
            if await self._settled(session_id, commit_id, lost):
                return expected_len + len(new_messages)
        failure = "timed out" if isinstance(lost, (RedisTimeoutError, TimeoutError)) else "no connection"
        raise StoreUnavailable(f"session store unreachable ({failure}); the turn was not saved") from lost

    async def _commit_or_lost(
        self, session_id: str, keys: list[str], args: list[str | int], expected_len: int, num_replaced: int
    ) -> int | Exception:
        """The new length if the commit script ran and answered, else the error that lost its reply."""
        try:
            with _redis_errors(session_id):
                try:
                    return int(await self._commit(keys=keys, args=args))
                except (RedisConnectionError, RedisTimeoutError, OSError) as err:
                    if is_pool_exhausted(err):  # never sent
                        raise
                    return err
        except ResponseError as err:
            kind, _, value = str(err).partition(" ")
            if kind == "WARMPATH_STALE":
                raise StaleTurn(session_id, expected_len, int(value)) from None
            if kind == "WARMPATH_LOCK_TAKEN":
                raise TurnLockTaken(f"session {session_id}: this turn's lock expired and another turn took it; "
                                    "nothing of this turn was saved") from None
            if kind == "WARMPATH_BAD_COMPACTION":
                raise ValueError(f"compaction replaces {num_replaced} messages but {value} are stored") from None
            raise

    async def _settled(self, session_id: str, commit_id: str, lost: Exception) -> bool:
        """Whether the commit whose reply was lost ran; if not, it is voided and never will.

        Raises:
            SessionNotFound: the session is gone.
            CommitOutcomeUnknown: Redis could not be asked.
        """
        logger.warning("session %s: the reply to a commit was lost (%s); settling it", session_id, lost)
        try:
            with _redis_errors(session_id):
                outcome = await self._idempotent(lambda: self._settle(keys=[self._key(session_id, "meta")],
                                                                      args=[commit_id]))
        except StoreUnavailable as err:
            raise CommitOutcomeUnknown(
                f"the session store went away while saving the turn ({err}); whether it was saved is unknown: "
                "read the session before sending the turn again, or resend it with the same Idempotency-Key"
            ) from lost
        if outcome == -1:
            raise SessionNotFound(session_id)
        return outcome == 1

    async def lookup_turn_result(self, session_id: str, idem_key: str) -> str | None:
        """The result remembered under `idem_key`, or None when the turn never completed."""
        with _redis_errors(session_id):
            return await self._idempotent(lambda: self._redis.hget(self._key(session_id, "idem"), idem_key))

    async def step_stats(self, session_id: str) -> list[StepStats]:
        """Per-step cache stats of the session, oldest first (the last `max_step_stats`)."""
        with _redis_errors(session_id):
            items = await self._idempotent(lambda: self._redis.lrange(self._key(session_id, "stats"), 0, -1))
        return [StepStats.model_validate_json(item, context=STORED) for item in items]
