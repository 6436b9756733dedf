"""The Redis client both stores use: a connection pool that waits for a free connection.

Why not redis-py's default: its pool holds at most 100 connections and fails the 101st
call at once (`MaxConnectionsError`), so a deployment serving a few hundred requests at
once answered half of them 503 while Redis was healthy, and a turn's commit or lock
renewal could fail the same way. This pool holds `REDIS_MAX_CONNECTIONS` and makes a
call wait up to `REDIS_POOL_WAIT_S` for one; only then is it an outage (`is_pool_exhausted`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError

from cluster.config import check_redis_url, without_password

# Connections one process may hold: above what one replica runs at once (256 requests, each
# with at most one call in flight, plus a turn's lock renewal), far below Redis' 10,000 clients.
REDIS_MAX_CONNECTIONS = 1024
# How long a call waits for a connection when all are in use before it fails as an outage.
REDIS_POOL_WAIT_S = 10.0
# What redis-py's waiting pool raises when no connection freed up in time.
_NO_CONNECTION_TEXT = "No connection available"


def serving_redis_url(configured: str | None, needed_by: str, environ: Mapping[str, str] = os.environ) -> str:
    """The Redis a deployment opens: the config's `redis_url`, else its environment's `REDIS_URL` (a pod's, built
    from a Secret), checked as the config's is.

    Why checked here: the config's URL was checked where it was loaded, the environment's never; a password
    holding `/`, `#` or `?` unencoded made redis-py's error quote part of it, and that error became the
    deployment's status message (`warmpath status`, a RayService's status).

    Raises:
        ValueError: neither is set, or the URL is unusable (its password masked).
    """
    url = configured or environ.get("REDIS_URL")
    if not url:
        raise ValueError(f"{needed_by} needs redis_url in the cluster config or REDIS_URL in its environment")
    if not configured:
        try:
            check_redis_url(url)
        except ValueError as err:
            raise ValueError(f"REDIS_URL {err}") from None
    return url


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


def refuse_unsuitable_redis(url: str, timeout_s: float = 2.0) -> None:
    """Raises ValueError when `url` names a Redis warmpath cannot keep its state in: a node of a Redis Cluster,
    or one that evicts keys (a memory limit under a policy other than `noeviction`); a Redis that does not
    answer, or does not answer INFO, passes.

    Why: both stores speak to one Redis with a plain client, so against a cluster every key hashed to
    another node's slots fails (`MOVED`): two sessions in three would fail, at random. An evicting Redis
    drops what was least used: a session's transcript while its record, read more recently, stays (the
    session then showed no messages and its next turn ran on none), a turn's idempotency record (a retry
    ran again), an API key's record. Every session key has a TTL, so `volatile-*` policies evict them too.
    Refused where a deployment starts, it fails once with the reason rather than per request. An outage
    is left to the stores, which answer it 503 and recover when Redis is back.
    """
    import redis

    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        try:
            is_cluster = str(client.info("cluster").get("cluster_enabled", 0)) == "1"
        except redis.exceptions.RedisError:
            return
        if is_cluster:
            raise ValueError(
                f"the Redis at {without_password(url)} is a node of a Redis Cluster, which warmpath does not "
                "support: point redis_url (or REDIS_URL) at a standalone Redis, the primary where it has replicas"
            )
        try:
            memory = client.info("memory")
        except redis.exceptions.RedisError:  # a variant without the section: its eviction is unknown here
            return
    finally:
        client.close()
    policy = str(memory.get("maxmemory_policy", "noeviction"))
    limit = memory.get("maxmemory", 0)
    if isinstance(limit, int) and limit > 0 and policy != "noeviction":
        raise ValueError(
            f"the Redis at {without_password(url)} evicts keys when full (maxmemory {memory['maxmemory']}, "
            f"maxmemory-policy {policy}): it would drop sessions' messages and API keys' records; set "
            "maxmemory-policy noeviction (a full Redis then refuses writes, which warmpath answers 503)"
        )
