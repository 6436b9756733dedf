"""What Redis refusing or dropping a call means, shared by the API-key store and the session store.

Why a module of its own: both stores answer 503 for an outage, and Redis refusing a
command for a state of its own (full, read-only replica, failed snapshot, missing
database, a long script running, too few replicas, a cluster slot moving or down) is
an outage too, not a bug: each store names the state the same way, and
both retry a call once when its pooled connection died with a Redis restart.
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable, Optional, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MasterDownError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)

from cluster.redis_pool import is_pool_exhausted

T = TypeVar("T")
logger = logging.getLogger(__name__)

# Refusals Redis answers for a state of the server, by redis-py class or by the start of the error text.
_REFUSALS: tuple[tuple[type[ResponseError] | str, str], ...] = (
    (OutOfMemoryError, "Redis is out of memory (used memory > maxmemory) and refuses writes"),
    (ReadOnlyError, "Redis is a read-only replica and refuses writes; the URL must name the primary"),
    ("MISCONF", "Redis refuses writes because saving its snapshot to disk failed (MISCONF; see the Redis log)"),
    ("DB index is out of range", "the Redis URL names a database number this Redis does not have"),
    (NoPermissionError, "the Redis user lacks an ACL permission this service needs"),
    ("BUSY ", "Redis is busy running a script or function (BUSY) and answers nothing else until it ends"),
    ("NOREPLICAS", "Redis refuses writes: fewer replicas are connected than its min-replicas-to-write"),
    (TryAgainError, "Redis asks to try again (TRYAGAIN: a cluster slot is being moved)"),
    (MasterDownError, "the Redis replica lost its link to the primary (MASTERDOWN); the URL should name the primary"),
    (ClusterDownError, "the Redis cluster is down (CLUSTERDOWN)"),
    (AskError, "Redis sent the key to another node (MOVED/ASK): the URL names a node of a Redis Cluster, which "
               "warmpath does not support; it needs a standalone Redis"),
)

# What redis-py puts before the error of a command in a pipeline.
_PIPELINE_ERROR = "of pipeline caused error: "


def redis_refusal(err: ResponseError) -> Optional[str]:
    """What a refusal caused by Redis' own state means, in one line; None for any other error (a bug of ours)."""
    text = str(err).rpartition(_PIPELINE_ERROR)[2]  # a MULTI's error names the command first
    for kind, meaning in _REFUSALS:
        is_match = text.startswith(kind) if isinstance(kind, str) else isinstance(err, kind)
        if is_match:
            return meaning
    return None


async def retry_on_dead_connection(client: aioredis.Redis, call: Callable[[], Awaitable[T]]) -> T:
    """Runs `call()`, and once more if its pooled connection was dead (Redis restarted, a proxy dropped it).

    Only for calls that may run twice (reads, compare-and-set, deletes): a
    ConnectionError does not say whether Redis ran the command. The idle pooled
    connections are dropped before the retry, since the restart killed them all.
    A Redis that is down fails the retry as fast as the first try; timeouts are
    not retried (a hung Redis would only double the wait).
    """
    try:
        return await call()
    except RedisConnectionError as err:
        if is_pool_exhausted(err):  # every connection busy, none dead: dropping the idle ones would not help
            raise
        logger.info("Redis connection failed (%s); retrying once on a new connection", err)
        await client.connection_pool.disconnect(inuse_connections=False)
        return await call()
