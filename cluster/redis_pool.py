"""The Redis client both stores use: a connection pool that waits for a free connection.

Why not redis-py's default: its pool holds at most 100 connections and fails the 101st
call at once (`MaxConnectionsError`), so a deployment serving a few hundred requests at
once answered half of them 503 while Redis was healthy, and a turn's commit or lock
renewal could fail the same way. This pool holds `REDIS_MAX_CONNECTIONS` and makes a
call wait up to `REDIS_POOL_WAIT_S` for one; only then is it an outage (`is_pool_exhausted`).
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError

# Connections one process may hold: above what one replica runs at once (256 requests, each
# with at most one call in flight, plus a turn's lock renewal), far below Redis' 10,000 clients.
REDIS_MAX_CONNECTIONS = 1024
# How long a call waits for a connection when all are in use before it fails as an outage.
REDIS_POOL_WAIT_S = 10.0
# What redis-py's waiting pool raises when no connection freed up in time.
_NO_CONNECTION_TEXT = "No connection available"


def pooled_client(
    url: str,
    *,
    reply_timeout_s: float,
    connect_timeout_s: float,
    max_connections: int = REDIS_MAX_CONNECTIONS,
    pool_wait_s: float = REDIS_POOL_WAIT_S,
) -> aioredis.Redis:
    """A client for `url` (decoded replies) whose calls wait for a pooled connection; raises ValueError on a bad URL."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=pool_wait_s,
        decode_responses=True,
        socket_timeout=reply_timeout_s,
        socket_connect_timeout=connect_timeout_s,
    )
    return aioredis.Redis.from_pool(pool)


def is_pool_exhausted(err: BaseException) -> bool:
    """Whether `err` says every pooled connection was in use (this process is busy), not that Redis dropped one."""
    return isinstance(err, MaxConnectionsError) or (
        isinstance(err, RedisConnectionError) and str(err).startswith(_NO_CONNECTION_TEXT)
    )
